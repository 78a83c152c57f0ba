// Batch-invariant causal attention on CPU: one fixed arithmetic per (query, head), whatever else is in the call.
//
// Built by shared_numerics/cpu_kernels.py (g++ -O3 -march=native -ffp-contract=off, no fast-math: the compiler may
// vectorise only across independent lanes, never reorder a reduction; -fopenmp). Called through ctypes on raw pointers.
//
// Work unit: (query block, kv head), a block being up to Q_TILE consecutive queries of one sequence; its rows are the
// (query, query head) pairs of that kv head. Every unit runs on one thread, units are spread over `threads` OpenMP threads;
// a row's arithmetic never depends on the other rows of its unit, on the unit count or on the thread count:
//   * keys in chunks of 32 absolute positions, chunk 0 first; a key past the row's position: score -inf, p exactly 0
//   * score s_c = (q_0 k_c0 + q_1 k_c1 + ... + q_{D-1} k_c,D-1) * scale, summed in d order (vectorised across the
//     32 keys of the chunk, never across d)
//   * online softmax per chunk: mx = max(m, max_c s); alpha = (m == -inf) ? 0 : exp_nonpos(m - mx);
//     p_c = exp_nonpos(s_c - mx); l = l * alpha + (p_0 + p_1 + ... + p_31) (in order); pv_d = sum_c p_c v_cd
//     (c in order); acc_d = acc_d * alpha + pv_d; m = mx. A chunk whose keys all lie past the row is an exact no-op.
//     exp_nonpos is Cephes' expf (range reduction by ln 2, degree-6 polynomial; < 2 ulp) written as plain
//     arithmetic on 16-lane vectors (lanes are independent: a key's bits never depend on its lane); arguments <= 0.
//   * out = acc / l, float32; m and l are returned for the backward.
// Backward (dense layout; unit = (sequence, kv head), which owns its keys' gradients): p = exp_nonpos(s - m) / l,
// Dd = dO . out, dp_c = dO . v_c (both in d order), ds = p (dp - Dd); dq += ds k, dk += ds q, dv += p dO,
// accumulated in query-block, chunk, key, row order; dq and dk times scale at the end.
//
// Source: Dao et al., "FlashAttention" (2022) online softmax and FlashAttention-2 backward; fixed split sizes as in
// SGLang's deterministic mode and vLLM's batch-invariant attention; PagedAttention's block table addressing.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "zk_simd.h"

namespace {

using zk::bf16_to_float;
using zk::exp_nonpos;
using zk::loadv;
using zk::storev;
using zk::v16f;
using zk::v16i;

constexpr int CHUNK = 32;
constexpr int LANES = 16;  // head dims are zero-padded to a multiple of this (vector width)

// dtype codes: 0 float32, 1 bfloat16, 2 float16
inline void load_row(const void* base, int64_t offset, int dtype, int d, float* dst) {
  if (dtype == 0) {
    const float* p = static_cast<const float*>(base) + offset;
    for (int i = 0; i < d; ++i) dst[i] = p[i];
  } else if (dtype == 1) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int i = 0; i < d; ++i) dst[i] = bf16_to_float(p[i]);
  } else {
    const _Float16* p = static_cast<const _Float16*>(base) + offset;
    for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(p[i]);
  }
}

// a . b over d, summed in d order
inline float dot_seq(const float* a, const float* b, int d) {
  float acc = 0.0f;
  for (int i = 0; i < d; ++i) acc = acc + a[i] * b[i];
  return acc;
}

struct Layout {
  int dtype, hq, hkv, d, dp, bs;
  const void* q;  // [Nq, Hq, D] contiguous
  const void* k;
  const void* v;
  int64_t kv_sb, kv_sh, kv_sp;  // strides (elements) of the block, head and slot dims of k and v
  const int64_t* block_table;   // [rows, bt_cols]
  int64_t bt_cols;
  const int64_t* q_row;  // [Nq] block-table row of each query's sequence
  const int64_t* q_pos;  // [Nq]
  float scale;

  // key/value of sequence row `seq_row`, absolute position `pos`, kv head `h`: element offset
  inline int64_t kv_offset(int64_t seq_row, int64_t pos, int h) const {
    int64_t col = pos / bs;
    int64_t block = block_table[seq_row * bt_cols + col];
    return block * kv_sb + h * kv_sh + (pos % bs) * kv_sp;
  }
};

struct Scratch {
  std::vector<float> qr, kc, kt, vc, vt, s, p, m, l, acc, pv;
  void size(int rows, int dp) {
    qr.assign(static_cast<size_t>(rows) * dp, 0.0f);
    kc.assign(static_cast<size_t>(CHUNK) * dp, 0.0f);
    kt.assign(static_cast<size_t>(CHUNK) * dp, 0.0f);
    vt.assign(static_cast<size_t>(CHUNK) * dp, 0.0f);
    vc.assign(static_cast<size_t>(CHUNK) * dp, 0.0f);
    s.assign(static_cast<size_t>(CHUNK) * rows, 0.0f);
    p.assign(static_cast<size_t>(CHUNK) * rows, 0.0f);
    m.assign(rows, 0.0f);
    l.assign(rows, 0.0f);
    acc.assign(static_cast<size_t>(rows) * dp, 0.0f);
    pv.assign(static_cast<size_t>(rows) * dp, 0.0f);
  }
};

// load the rows' queries (row r = query q0 + r / g, head h * g + r % g), zero-padded to dp
void load_queries(const Layout& L, int64_t q0, int nq, int h, int g, Scratch& S) {
  const int dp = L.dp;
  for (int r = 0; r < nq * g; ++r) {
    int64_t qi = q0 + r / g;
    int head = h * g + r % g;
    float* dst = &S.qr[static_cast<size_t>(r) * dp];
    std::memset(dst, 0, sizeof(float) * dp);
    load_row(L.q, (qi * L.hq + head) * L.d, L.dtype, L.d, dst);
  }
}

// scores of rows r0..r0+R-1 against the chunk's transposed keys S.kt: s = (q_0 k_0 + ... + q_{d-1} k_{d-1}) * scale,
// summed in d order, then -inf past the row's position. R rows side by side only so that their independent sums
// overlap in the pipeline; each row's operations are the same as alone.
template <int R>
inline void score_rows(const Layout& L, int64_t q0, int g, int64_t j, int d, int r0, Scratch& S) {
  const int dp = L.dp;
  v16f s0[R], s1[R];
  const float* qr[R];
  for (int rr = 0; rr < R; ++rr) {
    s0[rr] = (v16f){};
    s1[rr] = (v16f){};
    qr[rr] = &S.qr[static_cast<size_t>(r0 + rr) * dp];
  }
  for (int i = 0; i < d; ++i) {
    const float* kt = &S.kt[static_cast<size_t>(i) * CHUNK];
    const v16f k0 = loadv(kt), k1 = loadv(kt + 16);
    for (int rr = 0; rr < R; ++rr) {
      s0[rr] = s0[rr] + qr[rr][i] * k0;
      s1[rr] = s1[rr] + qr[rr][i] * k1;
    }
  }
  const v16f ninf = (v16f){} - std::numeric_limits<float>::infinity();
  v16f pos0, pos1;
  for (int c = 0; c < 16; ++c) {
    pos0[c] = static_cast<float>(c);
    pos1[c] = static_cast<float>(c + 16);
  }
  for (int rr = 0; rr < R; ++rr) {
    const float qp = static_cast<float>(L.q_pos[q0 + (r0 + rr) / g] - j * CHUNK);  // key c masked when c > qp
    float* sr = &S.s[static_cast<size_t>(r0 + rr) * CHUNK];
    storev(sr, pos0 > qp ? ninf : s0[rr] * L.scale);
    storev(sr + 16, pos1 > qp ? ninf : s1[rr] * L.scale);
  }
}

// online-softmax step of rows r0..r0+R-1 over the chunk's scores S.s and values S.vc (see the file comment); R rows
// side by side only for the pipeline, each row's operations the same as alone
template <int R>
inline void softmax_pv_rows(int dp, int r0, Scratch& S) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float* sr[R];
  float mx[R], lsum[R];
  alignas(64) float pr[R][CHUNK];
  v16f alpha_in = {};
  for (int rr = 0; rr < R; ++rr) {
    sr[rr] = &S.s[static_cast<size_t>(r0 + rr) * CHUNK];
    mx[rr] = S.m[r0 + rr];
  }
  for (int c = 0; c < CHUNK; ++c)
    for (int rr = 0; rr < R; ++rr) mx[rr] = sr[rr][c] > mx[rr] ? sr[rr][c] : mx[rr];
  for (int rr = 0; rr < R; ++rr) alpha_in[rr] = S.m[r0 + rr] - mx[rr];
  const v16f alpha_v = exp_nonpos(alpha_in);  // lane rr: row r0 + rr's exp (lanes are independent)
  for (int rr = 0; rr < R; ++rr)
    for (int c0 = 0; c0 < CHUNK; c0 += 16) {
      const v16f sv = loadv(sr[rr] + c0);
      storev(pr[rr] + c0, sv == ninf ? (v16f){} : exp_nonpos(sv - mx[rr]));
    }
  for (int rr = 0; rr < R; ++rr) lsum[rr] = 0.0f;
  for (int c = 0; c < CHUNK; ++c)
    for (int rr = 0; rr < R; ++rr) lsum[rr] = lsum[rr] + pr[rr][c];
  for (int rr = 0; rr < R; ++rr) {
    const float alpha = S.m[r0 + rr] == ninf ? 0.0f : alpha_v[rr];
    S.l[r0 + rr] = S.l[r0 + rr] * alpha + lsum[rr];
    S.m[r0 + rr] = mx[rr];
    alpha_in[rr] = alpha;
  }
  for (int i0 = 0; i0 < dp; i0 += LANES) {  // pv_d = sum_c p_c v_cd, c in order; acc = acc * alpha + pv
    v16f t[R];
    for (int rr = 0; rr < R; ++rr) t[rr] = (v16f){};
    for (int c = 0; c < CHUNK; ++c) {
      const v16f vv = loadv(&S.vc[static_cast<size_t>(c) * dp + i0]);
      for (int rr = 0; rr < R; ++rr) t[rr] = t[rr] + pr[rr][c] * vv;
    }
    for (int rr = 0; rr < R; ++rr) {
      float* acc = &S.acc[static_cast<size_t>(r0 + rr) * dp + i0];
      storev(acc, loadv(acc) * alpha_in[rr] + t[rr]);
    }
  }
}

// keys/values of chunk j (positions <= last only; the rest zero; row-major kc/vc, transposed kt [d][c], and the
// transposed vt only when `values_transposed`: the backward's dO . v) and the scores of every row (masked: -inf),
// s[r * CHUNK + c]
void chunk_scores(const Layout& L, int64_t q0, int nq, int h, int g, int64_t seq_row, int64_t j, int64_t last,
                  Scratch& S, bool values_transposed) {
  const int dp = L.dp, rows = nq * g, d = L.d;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int c = 0; c < CHUNK; ++c) {
    int64_t pos = j * CHUNK + c;
    float* kd = &S.kc[static_cast<size_t>(c) * dp];
    float* vd = &S.vc[static_cast<size_t>(c) * dp];
    if (pos > last) {
      std::memset(kd, 0, sizeof(float) * dp);
      std::memset(vd, 0, sizeof(float) * dp);
    } else {
      int64_t off = L.kv_offset(seq_row, pos, h);
      load_row(L.k, off, L.dtype, d, kd);
      load_row(L.v, off, L.dtype, d, vd);
    }
    for (int i = 0; i < d; ++i) S.kt[static_cast<size_t>(i) * CHUNK + c] = kd[i];
    if (values_transposed)
      for (int i = 0; i < d; ++i) S.vt[static_cast<size_t>(i) * CHUNK + c] = vd[i];
  }
  int r = 0;
  for (; r + 4 <= rows; r += 4) score_rows<4>(L, q0, g, j, d, r, S);
  for (; r < rows; ++r) score_rows<1>(L, q0, g, j, d, r, S);
  (void)ninf;
}

void forward_unit(const Layout& L, int64_t q0, int nq, int h, float* out, float* m_out, float* l_out, Scratch& S) {
  const int g = L.hq / L.hkv, dp = L.dp, rows = nq * g;
  const float ninf = -std::numeric_limits<float>::infinity();
  S.size(rows, dp);
  load_queries(L, q0, nq, h, g, S);
  int64_t seq_row = L.q_row[q0];
  int64_t last = 0;
  for (int i = 0; i < nq; ++i) last = L.q_pos[q0 + i] > last ? L.q_pos[q0 + i] : last;
  for (int r = 0; r < rows; ++r) {
    S.m[r] = ninf;
    S.l[r] = 0.0f;
  }
  for (int64_t j = 0; j * CHUNK <= last; ++j) {
    chunk_scores(L, q0, nq, h, g, seq_row, j, last, S, false);
    int r = 0;
    for (; r + 4 <= rows; r += 4) softmax_pv_rows<4>(dp, r, S);
    for (; r < rows; ++r) softmax_pv_rows<1>(dp, r, S);
  }
  for (int r = 0; r < rows; ++r) {
    int64_t qi = q0 + r / g;
    int head = h * g + r % g;
    float* o = out + (qi * L.hq + head) * L.d;
    const float* acc = &S.acc[static_cast<size_t>(r) * dp];
    for (int i = 0; i < L.d; ++i) o[i] = acc[i] / S.l[r];
    m_out[qi * L.hq + head] = S.m[r];
    l_out[qi * L.hq + head] = S.l[r];
  }
}

// backward state of one (query block, kv head) unit for one key chunk (see zk_attention_bwd)
struct BwdRows {
  const Layout& L;
  Scratch& S;
  int64_t q0;
  int h, g, d, dp, hq;
  const float* m;
  const float* l;
  const float* dO;  // [rows, dp]
  const float* Dd;  // [rows]
  float* ds;        // [rows, CHUNK]
  float* dqa;       // [rows, dp]
};

// rows r0..r0+R-1: dp_c = dO . v_c (d order), p = exp_nonpos(s - m) / l, ds = p (dp - Dd), then dq += sum_c ds_c k_c
// (c in order). R rows side by side only for the pipeline; each row's operations are the same as alone.
template <int R>
inline void bwd_rows(const BwdRows& B, int r0) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int dp = B.dp;
  v16f d0[R], d1[R];
  for (int rr = 0; rr < R; ++rr) d0[rr] = d1[rr] = (v16f){};
  for (int i = 0; i < B.d; ++i) {
    const float* vt = &B.S.vt[static_cast<size_t>(i) * CHUNK];
    const v16f v0 = loadv(vt), v1 = loadv(vt + 16);
    for (int rr = 0; rr < R; ++rr) {
      const float di = B.dO[static_cast<size_t>(r0 + rr) * dp + i];
      d0[rr] = d0[rr] + di * v0;
      d1[rr] = d1[rr] + di * v1;
    }
  }
  for (int rr = 0; rr < R; ++rr) {
    const int r = r0 + rr;
    const int64_t idx = (B.q0 + r / B.g) * B.hq + B.h * B.g + r % B.g;
    const float mr = B.m[idx], lr = B.l[idx];
    const float* sr = &B.S.s[static_cast<size_t>(r) * CHUNK];
    float* pr = &B.S.p[static_cast<size_t>(r) * CHUNK];
    float* dsr = &B.ds[static_cast<size_t>(r) * CHUNK];
    const v16f dd = (v16f){} + B.Dd[r];
    for (int c0 = 0; c0 < CHUNK; c0 += 16) {
      const v16f sv = loadv(sr + c0);
      const v16f pv = sv == ninf ? (v16f){} : exp_nonpos(sv - mr) / lr;
      storev(pr + c0, pv);
      storev(dsr + c0, pv * ((c0 == 0 ? d0[rr] : d1[rr]) - dd));
    }
  }
  for (int i0 = 0; i0 < dp; i0 += LANES) {
    v16f t[R];
    for (int rr = 0; rr < R; ++rr) t[rr] = loadv(&B.dqa[static_cast<size_t>(r0 + rr) * dp + i0]);
    for (int c = 0; c < CHUNK; ++c) {
      const v16f kv = loadv(&B.S.kc[static_cast<size_t>(c) * dp + i0]);
      for (int rr = 0; rr < R; ++rr) t[rr] = t[rr] + B.ds[static_cast<size_t>(r0 + rr) * CHUNK + c] * kv;
    }
    for (int rr = 0; rr < R; ++rr) storev(&B.dqa[static_cast<size_t>(r0 + rr) * dp + i0], t[rr]);
  }
}

// keys c0..c0+NK-1 of chunk j: dk += sum_r ds_rc q_r, dv += sum_r p_rc dO_r (rows in order, 16 d's in registers; the
// padded tail of d is never stored). NK keys side by side only for the pipeline; each key's operations are the same.
template <int NK>
inline void key_grads(const BwdRows& B, int rows, int64_t seq_row, int64_t j, int c0, float* dk, float* dv) {
  const int dp = B.dp, d = B.d;
  float* dkp[NK];
  float* dvp[NK];
  for (int kk = 0; kk < NK; ++kk) {
    const int64_t off = B.L.kv_offset(seq_row, j * CHUNK + c0 + kk, B.h);
    dkp[kk] = dk + off;
    dvp[kk] = dv + off;
  }
  for (int i0 = 0; i0 < dp; i0 += LANES) {
    const int n = d - i0 < LANES ? d - i0 : LANES;
    alignas(64) float bk[NK][LANES], bv[NK][LANES];
    v16f tk[NK], tv[NK];
    for (int kk = 0; kk < NK; ++kk) {
      std::memset(bk[kk], 0, sizeof(bk[kk]));
      std::memset(bv[kk], 0, sizeof(bv[kk]));
      std::memcpy(bk[kk], dkp[kk] + i0, sizeof(float) * n);
      std::memcpy(bv[kk], dvp[kk] + i0, sizeof(float) * n);
      tk[kk] = loadv(bk[kk]);
      tv[kk] = loadv(bv[kk]);
    }
    for (int r = 0; r < rows; ++r) {
      const v16f qv = loadv(&B.S.qr[static_cast<size_t>(r) * dp + i0]);
      const v16f ov = loadv(&B.dO[static_cast<size_t>(r) * dp + i0]);
      for (int kk = 0; kk < NK; ++kk) {
        tk[kk] = tk[kk] + B.ds[static_cast<size_t>(r) * CHUNK + c0 + kk] * qv;
        tv[kk] = tv[kk] + B.S.p[static_cast<size_t>(r) * CHUNK + c0 + kk] * ov;
      }
    }
    for (int kk = 0; kk < NK; ++kk) {
      storev(bk[kk], tk[kk]);
      storev(bv[kk], tv[kk]);
      std::memcpy(dkp[kk] + i0, bk[kk], sizeof(float) * n);
      std::memcpy(dvp[kk] + i0, bv[kk], sizeof(float) * n);
    }
  }
}

// units spread over `threads` OpenMP threads (torch's own runtime: the library is loaded into a process that has
// torch's libgomp, whose soname it links against, so the kernel shares torch's thread team instead of competing
// with its spinning threads); a unit never splits
template <typename F>
void run_parallel(int64_t n_units, int threads, F fn) {
  if (threads <= 1 || n_units <= 1) {
    for (int64_t u = 0; u < n_units; ++u) fn(u);
    return;
  }
#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int64_t u = 0; u < n_units; ++u) fn(u);
}

}  // namespace

extern "C" {

// Forward. Units: n_blocks query blocks (block_q0[i] .. block_q0[i] + block_nq[i] - 1) x hkv heads.
// out [Nq, Hq, D], m_out / l_out [Nq, Hq], float32.
int zk_attention_fwd(int dtype, int hq, int hkv, int d, const void* q, const void* k, const void* v, int64_t kv_sb,
                     int64_t kv_sh, int64_t kv_sp, int bs, const int64_t* block_table, int64_t bt_cols,
                     const int64_t* q_row, const int64_t* q_pos, int64_t n_blocks, const int64_t* block_q0,
                     const int64_t* block_nq, float scale, float* out, float* m_out, float* l_out, int threads) {
  if (hkv <= 0 || hq % hkv != 0 || d <= 0 || bs <= 0) return 1;
  Layout L{dtype, hq, hkv, d, (d + LANES - 1) / LANES * LANES, bs, q, k, v, kv_sb, kv_sh, kv_sp, block_table,
           bt_cols, q_row, q_pos, scale};
  run_parallel(n_blocks * hkv, threads, [&](int64_t u) {
    thread_local Scratch S;
    forward_unit(L, block_q0[u / hkv], static_cast<int>(block_nq[u / hkv]), static_cast<int>(u % hkv), out, m_out,
                 l_out, S);
  });
  return 0;
}

// Backward over dense sequences. Units: n_seqs sequences (their query blocks seq_b0[i] .. seq_b1[i] - 1) x hkv heads.
// out, dout [Nq, Hq, D] float32; m, l [Nq, Hq]; dq [Nq, Hq, D] float32 (zeroed); dk, dv float32 with the strides of
// k and v (zeroed). Keys of a sequence: positions 0 .. its last query.
int zk_attention_bwd(int dtype, int hq, int hkv, int d, const void* q, const void* k, const void* v, int64_t kv_sb,
                     int64_t kv_sh, int64_t kv_sp, int bs, const int64_t* block_table, int64_t bt_cols,
                     const int64_t* q_row, const int64_t* q_pos, const int64_t* block_q0, const int64_t* block_nq,
                     int64_t n_seqs, const int64_t* seq_b0, const int64_t* seq_b1, float scale, const float* out,
                     const float* dout, const float* m, const float* l, float* dq, float* dk, float* dv, int threads) {
  if (hkv <= 0 || hq % hkv != 0 || d <= 0 || bs <= 0) return 1;
  Layout L{dtype, hq, hkv, d, (d + LANES - 1) / LANES * LANES, bs, q, k, v, kv_sb, kv_sh, kv_sp, block_table,
           bt_cols, q_row, q_pos, scale};
  const int g = hq / hkv, dp = L.dp;
  run_parallel(n_seqs * hkv, threads, [&](int64_t u) {
    thread_local Scratch S;
    thread_local std::vector<float> dO, O, Dd, dqa, ds;
    const int h = static_cast<int>(u % hkv);
    const int64_t sq = u / hkv;
    for (int64_t b = seq_b0[sq]; b < seq_b1[sq]; ++b) {
      const int64_t q0 = block_q0[b];
      const int nq = static_cast<int>(block_nq[b]), rows = nq * g;
      S.size(rows, dp);
      dO.assign(static_cast<size_t>(rows) * dp, 0.0f);
      O.assign(static_cast<size_t>(rows) * dp, 0.0f);
      Dd.assign(rows, 0.0f);
      dqa.assign(static_cast<size_t>(rows) * dp, 0.0f);
      ds.assign(static_cast<size_t>(CHUNK) * rows, 0.0f);
      load_queries(L, q0, nq, h, g, S);
      for (int r = 0; r < rows; ++r) {
        int64_t idx = (q0 + r / g) * hq + h * g + r % g;
        for (int i = 0; i < d; ++i) {
          dO[static_cast<size_t>(r) * dp + i] = dout[idx * d + i];
          O[static_cast<size_t>(r) * dp + i] = out[idx * d + i];
        }
        Dd[r] = dot_seq(&dO[static_cast<size_t>(r) * dp], &O[static_cast<size_t>(r) * dp], d);
      }
      const int64_t seq_row = L.q_row[q0];
      int64_t last = 0;
      for (int i = 0; i < nq; ++i) last = L.q_pos[q0 + i] > last ? L.q_pos[q0 + i] : last;
      for (int64_t j = 0; j * CHUNK <= last; ++j) {
        chunk_scores(L, q0, nq, h, g, seq_row, j, last, S, true);
        BwdRows B{L, S, q0, h, g, d, dp, hq, m, l, dO.data(), Dd.data(), ds.data(), dqa.data()};
        int r = 0;
        for (; r + 4 <= rows; r += 4) bwd_rows<4>(B, r);
        for (; r < rows; ++r) bwd_rows<1>(B, r);
        int c = 0;
        const int n_keys = last - j * CHUNK + 1 < CHUNK ? static_cast<int>(last - j * CHUNK + 1) : CHUNK;
        for (; c + 4 <= n_keys; c += 4) key_grads<4>(B, rows, seq_row, j, c, dk, dv);
        for (; c < n_keys; ++c) key_grads<1>(B, rows, seq_row, j, c, dk, dv);
      }
      for (int r = 0; r < rows; ++r) {
        int64_t idx = (q0 + r / g) * hq + h * g + r % g;
        for (int i = 0; i < d; ++i) dq[idx * d + i] = dqa[static_cast<size_t>(r) * dp + i] * scale;
      }
    }
    // dk times scale, once, for this sequence's keys of head h
    const int64_t q_first = block_q0[seq_b0[sq]];
    const int64_t seq_row = L.q_row[q_first];
    int64_t last = 0;
    for (int64_t b = seq_b0[sq]; b < seq_b1[sq]; ++b)
      for (int64_t i = 0; i < block_nq[b]; ++i) last = L.q_pos[block_q0[b] + i] > last ? L.q_pos[block_q0[b] + i] : last;
    for (int64_t pos = 0; pos <= last; ++pos) {
      float* dkp = dk + L.kv_offset(seq_row, pos, h);
      for (int i = 0; i < d; ++i) dkp[i] = dkp[i] * scale;
    }
  });
  return 0;
}

}  // extern "C"
