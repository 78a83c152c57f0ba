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
// Speed without touching that arithmetic: the forward runs up to 4 chunks (and up to 4 rows) side by side — their
// scores, maxima, exps, sums and p . v are independent, only the folding into (m, l, acc) is sequential, chunk after
// chunk — so a decode row's 32-step sums are not latency-bound; keys reach the transposed [d][32] layout through
// 16 x 16 in-register transposes of whole 64-byte row pieces on AVX-512 (element by element elsewhere); on AVX-512
// a unit of up to 4 rows (a decode step's) reads float32 / bf16 values in place in the cache, 16 lanes at a time in
// the p . v loop (ValueSource; a copy into a float buffer took ~14% of a long-context decode); the next step's cache
// lines are prefetched into L2 while this step computes, spread over its score and p . v loops. Data movement only:
// the same floats meet the same operations.
// Two faster forms of the same bits: with bf16 / fp16 operands every q_i k_ci is exact in float32 (16- / 22-bit
// significands), so the score's multiply-then-add is one fused multiply-add (half the instructions; prefill -10-15%);
// the chunk's max is a vector tree of the scan's comparisons (equal scores have equal bits: a score is never -0).
// tests/test_numerics.py::test_attention_kernel_is_the_documented_arithmetic checks the bits against this header's
// arithmetic written out in torch ops.
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZK_ATT_VECTOR 1
#endif

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

  // bf16 / fp16 operands: every q_i k_ci is exact in float32, so a score's multiply-then-add may be fused (add_product)
  inline bool exact_products() const { return dtype != 0; }

  // key/value of sequence row `seq_row`, absolute position `pos`, kv head `h`: element offset
  inline int64_t kv_offset(int64_t seq_row, int64_t pos, int h) const {
    int64_t col = pos / bs;
    int64_t block = block_table[seq_row * bt_cols + col];
    return block * kv_sb + h * kv_sh + (pos % bs) * kv_sp;
  }

  // kv_offset of positions first .. first + n - 1 into off[0 .. n - 1], one division for the run
  inline void chunk_offsets(int64_t seq_row, int64_t first, int n, int h, int64_t* off) const {
    int64_t col = first / bs, slot = first % bs;
    int64_t row = block_table[seq_row * bt_cols + col] * kv_sb + h * kv_sh;
    for (int c = 0; c < n; ++c) {
      off[c] = row + slot * kv_sp;
      if (++slot == bs && c + 1 < n) {
        slot = 0;
        row = block_table[seq_row * bt_cols + ++col] * kv_sb + h * kv_sh;
      }
    }
  }
};

// the backward's per-unit buffers
struct Scratch {
  std::vector<float> qr, kc, kt, vc, vt, s, p;
  void size(int rows, int dp) {
    qr.assign(static_cast<size_t>(rows) * dp, 0.0f);
    kc.assign(static_cast<size_t>(CHUNK) * dp, 0.0f);
    kt.assign(static_cast<size_t>(CHUNK) * dp, 0.0f);
    vt.assign(static_cast<size_t>(CHUNK) * dp, 0.0f);
    vc.assign(static_cast<size_t>(CHUNK) * dp, 0.0f);
    s.assign(static_cast<size_t>(CHUNK) * rows, 0.0f);
    p.assign(static_cast<size_t>(CHUNK) * rows, 0.0f);
  }
};

// load the rows' queries (row r = query q0 + r / g, head h * g + r % g), zero-padded to dp
void load_queries(const Layout& L, int64_t q0, int nq, int h, int g, float* qr) {
  const int dp = L.dp;
  for (int r = 0; r < nq * g; ++r) {
    int64_t qi = q0 + r / g;
    int head = h * g + r % g;
    float* dst = qr + static_cast<size_t>(r) * dp;
    std::memset(dst, 0, sizeof(float) * dp);
    load_row(L.q, (qi * L.hq + head) * L.d, L.dtype, L.d, dst);
  }
}

// s + q k, one term of a score's d-order sum: with exact products (EXACT, Layout::exact_products) one fused
// multiply-add, bit for bit the multiply-then-add
template <bool EXACT>
inline v16f add_product(v16f s, float q, v16f k) {
  if constexpr (EXACT) return zk::fma_exact(zk::splat(q), k, s);
  return s + q * k;
}

// scores of rows r0..r0+R-1 against the chunk's transposed keys S.kt: s = (q_0 k_0 + ... + q_{d-1} k_{d-1}) * scale,
// summed in d order, then -inf past the row's position. R rows side by side only so that their independent sums
// overlap in the pipeline; each row's operations are the same as alone.
template <int R, bool EXACT>
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
      s0[rr] = add_product<EXACT>(s0[rr], qr[rr][i], k0);
      s1[rr] = add_product<EXACT>(s1[rr], qr[rr][i], k1);
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

#ifdef ZK_ATT_VECTOR
// The chunk's keys and values moved with AVX-512 instead of element by element: the same floats land in the same
// places (bf16 -> float is exact, a move is a move), so nothing downstream changes. Keys c < n_valid of the chunk sit
// at element offsets off[c]; keys past `last` read as zeros (masked loads never touch them).
//   * transposed [d][CHUNK] (kt; vt when asked): transpose_keys;
//   * row-major [CHUNK][dp] (vc; kc when asked): load_rows, masked 16-lane loads, zero-padded to dp.

// 16 keys (rows at element offsets off[0..15] of base; keys k >= n_valid read as zeros) transposed into
// dst[i * CHUNK + k], i < d: each row's 64-byte pieces loaded whole (masked at the row's end), transposed as dwords
// in registers — a bf16 dword holds dimensions i (low half) and i + 1 (high half) — and widened to float exactly.
void transpose_keys(const void* base, int dtype, int d, const int64_t* off, int n_valid, float* dst) {
  const int per = dtype == 0 ? 16 : 32;  // elements per 64-byte piece
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int e0 = 0; e0 < d; e0 += per) {
    const int n = d - e0 < per ? d - e0 : per;
    __m512i r[16];
    for (int k = 0; k < 16; ++k) {
      if (k >= n_valid) {
        r[k] = _mm512_setzero_si512();
      } else if (dtype == 0) {
        r[k] = _mm512_castps_si512(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u),
                                                         static_cast<const float*>(base) + off[k] + e0));
      } else {
        const __mmask32 m = n == 32 ? 0xFFFFFFFFu : (1u << n) - 1u;
        r[k] = _mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + off[k] + e0);
      }
    }
    zk::transpose16_regs(r);
    if (dtype == 0) {
      for (int p = 0; p < n; ++p) _mm512_storeu_si512(dst + static_cast<size_t>(e0 + p) * CHUNK, r[p]);
    } else {
      for (int p = 0; 2 * p < n; ++p) {
        _mm512_storeu_si512(dst + static_cast<size_t>(e0 + 2 * p) * CHUNK, _mm512_slli_epi32(r[p], 16));
        if (2 * p + 1 < n)
          _mm512_storeu_si512(dst + static_cast<size_t>(e0 + 2 * p + 1) * CHUNK, _mm512_and_si512(r[p], hi_mask));
      }
    }
  }
}

// rows of CHUNK keys (element offsets off[c] of base; keys c >= n_valid read as zeros) into dst[c * dp + i], widened
// to float, zero-padded to dp
void load_rows(const void* base, int dtype, int d, int dp, const int64_t* off, int n_valid, float* dst) {
  for (int c = 0; c < CHUNK; ++c) {
    float* row = dst + static_cast<size_t>(c) * dp;
    for (int i0 = 0; i0 < dp; i0 += LANES) {
      const int n = d - i0 < LANES ? (d - i0 > 0 ? d - i0 : 0) : LANES;
      const __mmask16 m = c < n_valid ? static_cast<__mmask16>((1u << n) - 1u) : 0;
      __m512 x;
      if (dtype == 0) {
        x = _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + (c < n_valid ? off[c] : 0) + i0);
      } else {
        const uint16_t* src = static_cast<const uint16_t*>(base) + (c < n_valid ? off[c] : 0) + i0;
        const __m256i b = _mm256_maskz_loadu_epi16(m, src);
        x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      }
      _mm512_storeu_ps(row + i0, x);
    }
  }
}

// chunk j's keys transposed into kt (and its values into vt when non-null); the element offsets of its keys into
// off[CHUNK]; returns how many of them lie at positions <= last
int transpose_chunk(const Layout& L, int h, int64_t seq_row, int64_t j, int64_t last, float* kt, float* vt,
                    int64_t* off) {
  const int64_t first = j * CHUNK;
  const int n_valid = last - first + 1 < CHUNK ? static_cast<int>(last - first + 1) : CHUNK;
  L.chunk_offsets(seq_row, first, n_valid, h, off);
  for (int half = 0; half < 2; ++half) {  // kt / vt columns 0..15, then 16..31
    const int nv = n_valid - 16 * half;
    transpose_keys(L.k, L.dtype, L.d, off + 16 * half, nv, kt + 16 * half);
    if (vt != nullptr) transpose_keys(L.v, L.dtype, L.d, off + 16 * half, nv, vt + 16 * half);
  }
  return n_valid;
}

// the AVX-512 path of move_chunk
void vector_chunk(const Layout& L, int h, int64_t seq_row, int64_t j, int64_t last, float* kt, float* vc, float* kc,
                  float* vt) {
  int64_t off[CHUNK];
  const int n_valid = transpose_chunk(L, h, seq_row, j, last, kt, vt, off);
  load_rows(L.v, L.dtype, L.d, L.dp, off, n_valid, vc);
  if (kc != nullptr) load_rows(L.k, L.dtype, L.d, L.dp, off, n_valid, kc);
}

// the forward's chunk (float32 / bf16 caches): keys transposed into kt as vector_chunk does, values left in place —
// vrow[c] the cache row of key c, or `zeros` (dp floats) past `last`
void vector_chunk_in_place(const Layout& L, int h, int64_t seq_row, int64_t j, int64_t last, float* kt,
                           const void** vrow, const float* zeros) {
  int64_t off[CHUNK];
  const int n_valid = transpose_chunk(L, h, seq_row, j, last, kt, nullptr, off);
  const int64_t esz = L.dtype == 0 ? 4 : 2;
  for (int c = 0; c < CHUNK; ++c)
    vrow[c] = c < n_valid ? static_cast<const void*>(static_cast<const char*>(L.v) + off[c] * esz) : zeros;
}
#endif

// keys/values of chunk j into float buffers: positions <= last only, the rest zero; transposed keys kt [d][CHUNK],
// row-major values vc [CHUNK][dp] (zero-padded); when non-null also row-major keys kc and transposed values vt (the
// backward's dq and dO . v). Moves only: the same floats whichever path (AVX-512 row pieces and register
// transposes, or element by element).
void move_chunk(const Layout& L, int h, int64_t seq_row, int64_t j, int64_t last, float* kt, float* vc, float* kc,
                float* vt) {
#ifdef ZK_ATT_VECTOR
  if (L.dtype != 2) {
    vector_chunk(L, h, seq_row, j, last, kt, vc, kc, vt);
    return;
  }
#endif
  const int dp = L.dp, d = L.d;
  thread_local std::vector<float> kbuf;
  kbuf.resize(dp);
  for (int c = 0; c < CHUNK; ++c) {
    int64_t pos = j * CHUNK + c;
    float* kd = kc != nullptr ? kc + static_cast<size_t>(c) * dp : kbuf.data();
    float* vd = vc + static_cast<size_t>(c) * dp;
    std::memset(kd, 0, sizeof(float) * dp);
    std::memset(vd, 0, sizeof(float) * dp);
    if (pos <= last) {
      int64_t off = L.kv_offset(seq_row, pos, h);
      load_row(L.k, off, L.dtype, d, kd);
      load_row(L.v, off, L.dtype, d, vd);
    }
    for (int i = 0; i < d; ++i) kt[static_cast<size_t>(i) * CHUNK + c] = kd[i];
    if (vt != nullptr)
      for (int i = 0; i < d; ++i) vt[static_cast<size_t>(i) * CHUNK + c] = vd[i];
  }
}

// the scores of every row against chunk j (score_rows, 4 rows at a time)
template <bool EXACT>
void score_all_rows(const Layout& L, int64_t q0, int rows, int g, int64_t j, Scratch& S) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) score_rows<4, EXACT>(L, q0, g, j, L.d, r, S);
  for (; r < rows; ++r) score_rows<1, EXACT>(L, q0, g, j, L.d, r, S);
}

// the backward's chunk: keys and values of chunk j (move_chunk, all four layouts) and the scores of every row
// (masked: -inf), s[r * CHUNK + c]
void chunk_scores(const Layout& L, int64_t q0, int nq, int h, int g, int64_t seq_row, int64_t j, int64_t last,
                  Scratch& S) {
  move_chunk(L, h, seq_row, j, last, S.kt.data(), S.vc.data(), S.kc.data(), S.vt.data());
  if (L.exact_products())
    score_all_rows<true>(L, q0, nq * g, g, j, S);
  else
    score_all_rows<false>(L, q0, nq * g, g, j, S);
}

// The forward's online softmax over NC chunks at a time (see the file comment for a row's arithmetic, which is
// unchanged): the NC chunks' scores, their maxima, exps, sums and p . v are independent computations, so running them
// side by side gives the pipeline NC independent dependency chains where one chunk gave it one (a decode row's
// chains — 32-step sums over d and over keys — were latency-bound). Only the folding into (m, l, acc) is sequential,
// chunk after chunk, exactly as before. The running max: the old scan started from m, mx = (s_c > mx) ? s_c : mx over
// c in order; here each chunk's scan starts from -inf and mx = (cmax > m) ? cmax : m — the same element wins (the
// first maximal one; NaN never; m when nothing beats it), so the same bits.
constexpr int NC = 4;

// the cache lines of the keys and values of positions first .. first + count - 1 (<= last, count <= NC * CHUNK) into
// pf; returns their count. The next step's: the first forward_step of a step asks for them into L2, a few per
// iteration of its d loop and of its p . v loop, so they arrive while the step computes (a unit's keys lie block
// after block, which the hardware prefetchers follow poorly; asked all at once, or into L1, they stalled the step
// instead: 2.6-2.9 ms -> 2.0 ms a call with the cache cold; only the d loop's iterations: ~5% slower than both loops'
// at a long-context decode; none, or every other line: 2.3 / 1.8 ms instead of 1.36-1.40). A hint only: no arithmetic
// depends on it.
int next_step_lines(const Layout& L, int h, int64_t seq_row, int64_t first, int64_t count, int64_t last,
                    const char** pf) {
  const int64_t n = last - first + 1 < count ? last - first + 1 : count;
  if (n <= 0) return 0;
  int64_t off[NC * CHUNK];
  L.chunk_offsets(seq_row, first, static_cast<int>(n), h, off);
  const int64_t esz = L.dtype == 0 ? 4 : 2, row_bytes = L.d * esz;
  int np = 0;
  for (int64_t c = 0; c < n; ++c) {
    const char* kp = static_cast<const char*>(L.k) + off[c] * esz;
    const char* vp = static_cast<const char*>(L.v) + off[c] * esz;
    for (int64_t b = 0; b < row_bytes; b += 64) {
      pf[np++] = kp + b;
      pf[np++] = vp + b;
    }
  }
  return np;
}

// Where the forward's p . v reads a chunk's values (FwdScratch::vrow, one row pointer per key): kPadded, float rows of
// dp in FwdScratch::vc (move_chunk's copy: fp16, or no AVX-512); kF32 / kBF16 (units of up to 4 rows, e.g. a decode
// step's: one forward_step reads each value), the cache's own float32 / bf16 rows, read in place 16 lanes at a time
// (masked at d; bf16 widened exactly, as move_chunk did), a key past the unit's last position pointing at a zero row.
// The same floats either way.
enum ValueSource { kPadded, kF32, kBF16 };

struct FwdScratch {
  std::vector<float> qr, kt, vc, acc, m, l, zeros;
  std::vector<const void*> vrow;  // [NC * CHUNK] the step's value rows (ValueSource)
  std::vector<const char*> pf;    // the next step's cache lines (next_step_lines)
  void size(int rows, int d, int dp) {
    zeros.assign(dp, 0.0f);
    vrow.resize(static_cast<size_t>(NC) * CHUNK);
    qr.assign(static_cast<size_t>(rows) * dp, 0.0f);
    kt.resize(static_cast<size_t>(NC) * d * CHUNK);
    vc.resize(static_cast<size_t>(NC) * CHUNK * dp);
    acc.assign(static_cast<size_t>(rows) * dp, 0.0f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    pf.resize(static_cast<size_t>(NC) * CHUNK * 2 * ((d * 4 + 63) / 64));
  }
};

// lanes i0 .. i0 + 15 of a value row (ValueSource VS; lanes past d read as zeros: mask vm)
template <int VS>
inline v16f value_lanes(const void* row, int i0, uint32_t vm) {
  if constexpr (VS == kPadded) {
    (void)vm;
    return loadv(static_cast<const float*>(row) + i0);
  }
#ifdef ZK_ATT_VECTOR
  if constexpr (VS == kF32)
    return __builtin_bit_cast(v16f,
                              _mm512_maskz_loadu_ps(static_cast<__mmask16>(vm), static_cast<const float*>(row) + i0));
  if constexpr (VS == kBF16) {
    const __m256i b = _mm256_maskz_loadu_epi16(static_cast<__mmask16>(vm), static_cast<const uint16_t*>(row) + i0);
    return __builtin_bit_cast(v16f, _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
#endif
  return (v16f){};
}

// rows r0 .. r0 + R - 1 (queries qpos[]), one step over chunks j0 .. j0 + N - 1 whose keys/values are in F.kt / F.vrow
// slots t0 .. t0 + N - 1; R rows and N chunks side by side only for the pipeline: each (row, chunk)'s operations are
// the same as alone, and a row folds its chunks in order. Asks for the np cache lines pf[] into L2 on the way, spread
// over the d loop and the p . v loop (next_step_lines).
template <int R, int N, bool EXACT, int VS>
inline void forward_step(const Layout& L, FwdScratch& F, int r0, const float* qpos, int64_t j0, int t0,
                         const char* const* pf, int np) {
  const int d = L.d, dp = L.dp;
  const size_t kt_stride = static_cast<size_t>(d) * CHUNK;
  const float* kt_base = F.kt.data() + t0 * kt_stride;
  const void* const* vrow = F.vrow.data() + static_cast<size_t>(t0) * CHUNK;
  const float ninf = -std::numeric_limits<float>::infinity();
  const float* q[R];
  for (int rr = 0; rr < R; ++rr) q[rr] = &F.qr[static_cast<size_t>(r0 + rr) * dp];
  // scores: s = (q_0 k_0 + ... + q_{d-1} k_{d-1}) * scale, d order; -inf past the row
  v16f s0[R][N], s1[R][N];
  for (int rr = 0; rr < R; ++rr)
    for (int t = 0; t < N; ++t) s0[rr][t] = s1[rr][t] = (v16f){};
  // the prefetches spread over the d loop's d iterations and the p . v loop's (dp / LANES) * CHUNK
  const int slots = d + (dp / LANES) * CHUNK, per = (np + slots - 1) / slots;
  int next_pf = 0;
  auto prefetch_some = [&]() {  // the next `per` of pf[] into L2
    for (const int end = next_pf + per < np ? next_pf + per : np; next_pf < end; ++next_pf)
      __builtin_prefetch(pf[next_pf], 0, 2);
  };
  for (int i = 0; i < d; ++i) {
    prefetch_some();
    for (int t = 0; t < N; ++t) {
      const float* kt = kt_base + t * kt_stride + static_cast<size_t>(i) * CHUNK;
      const v16f k0 = loadv(kt), k1 = loadv(kt + 16);
      for (int rr = 0; rr < R; ++rr) {
        s0[rr][t] = add_product<EXACT>(s0[rr][t], q[rr][i], k0);
        s1[rr][t] = add_product<EXACT>(s1[rr][t], q[rr][i], k1);
      }
    }
  }
  v16f pos0, pos1;
  for (int c = 0; c < 16; ++c) {
    pos0[c] = static_cast<float>(c);
    pos1[c] = static_cast<float>(c + 16);
  }
  const v16f ninfv = (v16f){} + ninf;
  alignas(64) float sc[R][N][CHUNK];
  for (int rr = 0; rr < R; ++rr)
    for (int t = 0; t < N; ++t) {
      const float qp = qpos[rr] - static_cast<float>((j0 + t) * CHUNK);  // key c masked when c > qp
      storev(sc[rr][t], pos0 > qp ? ninfv : s0[rr][t] * L.scale);
      storev(sc[rr][t] + 16, pos1 > qp ? ninfv : s1[rr][t] * L.scale);
    }
  // each chunk's max, then the running max chunk after chunk. The scan from -inf (c in order, x > m ? x : m) finds
  // the largest score, never a NaN; equal scores have equal bits (a score is never -0: its sum starts at +0 and the
  // scale is positive; masked scores are -inf), so a tree of the same comparisons over the 32 lanes finds the same
  // bits in 6 vector steps instead of 32 scalar ones.
  float cmax[R][N];
  for (int rr = 0; rr < R; ++rr)
    for (int t = 0; t < N; ++t) {
      v16f a = loadv(sc[rr][t]);
      const v16f b = loadv(sc[rr][t] + 16);
      a = a > ninfv ? a : ninfv;  // NaN -> -inf
      cmax[rr][t] = zk::hmax(b > a ? b : a);
    }
  float mprev[R][N], mx[R][N];
  v16f alpha_in = {};
  for (int rr = 0; rr < R; ++rr) {
    float m = F.m[r0 + rr];
    for (int t = 0; t < N; ++t) {
      mprev[rr][t] = m;
      mx[rr][t] = cmax[rr][t] > m ? cmax[rr][t] : m;
      alpha_in[rr * N + t] = m - mx[rr][t];
      m = mx[rr][t];
    }
    F.m[r0 + rr] = m;
  }
  const v16f alpha_v = exp_nonpos(alpha_in);  // lane rr * N + t: (row rr, chunk t)'s exp (lanes are independent)
  alignas(64) float pr[R][N][CHUNK];
  for (int rr = 0; rr < R; ++rr)
    for (int t = 0; t < N; ++t)
      for (int c0 = 0; c0 < CHUNK; c0 += 16) {
        const v16f sv = loadv(sc[rr][t] + c0);
        storev(pr[rr][t] + c0, sv == ninf ? (v16f){} : exp_nonpos(sv - mx[rr][t]));
      }
  float lsum[R][N];
  for (int rr = 0; rr < R; ++rr)
    for (int t = 0; t < N; ++t) lsum[rr][t] = 0.0f;
  for (int c = 0; c < CHUNK; ++c)
    for (int rr = 0; rr < R; ++rr)
      for (int t = 0; t < N; ++t) lsum[rr][t] = lsum[rr][t] + pr[rr][t][c];
  float alpha[R][N];
  for (int rr = 0; rr < R; ++rr) {
    float l = F.l[r0 + rr];
    for (int t = 0; t < N; ++t) {
      alpha[rr][t] = mprev[rr][t] == ninf ? 0.0f : alpha_v[rr * N + t];
      l = l * alpha[rr][t] + lsum[rr][t];
    }
    F.l[r0 + rr] = l;
  }
  // pv_d = sum_c p_c v_cd (c in order) per chunk; acc = acc * alpha + pv, chunk after chunk
  for (int i0 = 0; i0 < dp; i0 += LANES) {
    const uint32_t vm = d - i0 >= LANES ? 0xFFFFu : (1u << (d - i0)) - 1u;
    v16f pv[R][N];
    for (int rr = 0; rr < R; ++rr)
      for (int t = 0; t < N; ++t) pv[rr][t] = (v16f){};
    for (int c = 0; c < CHUNK; ++c) {
      prefetch_some();
      for (int t = 0; t < N; ++t) {
        const v16f vv = value_lanes<VS>(vrow[t * CHUNK + c], i0, vm);
        for (int rr = 0; rr < R; ++rr) pv[rr][t] = pv[rr][t] + pr[rr][t][c] * vv;
      }
    }
    for (int rr = 0; rr < R; ++rr) {
      float* acc = &F.acc[static_cast<size_t>(r0 + rr) * dp + i0];
      v16f a = loadv(acc);
      for (int t = 0; t < N; ++t) a = a * alpha[rr][t] + pv[rr][t];
      storev(acc, a);
    }
  }
}

// the step's nc chunks over every row: groups of 4 rows take the chunks 2 at a time (16 score chains), the rows left
// over (pairs, then one) all nc at once. The step's first call asks for the next step's np cache lines pf[].
template <int N, bool EXACT, int VS>
inline void forward_rows(const Layout& L, FwdScratch& F, int rows, const float* qpos, int64_t j0,
                         const char* const* pf, int np) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    int t = 0;
    for (; t + 2 <= N; t += 2, np = 0) forward_step<4, 2, EXACT, VS>(L, F, r, qpos + r, j0 + t, t, pf, np);
    if (t < N) forward_step<4, 1, EXACT, VS>(L, F, r, qpos + r, j0 + t, t, pf, np);
    np = 0;
  }
  for (; r + 2 <= rows; r += 2, np = 0) forward_step<2, N, EXACT, VS>(L, F, r, qpos + r, j0, 0, pf, np);
  for (; r < rows; ++r, np = 0) forward_step<1, N, EXACT, VS>(L, F, r, qpos + r, j0, 0, pf, np);
}

// forward_rows for the step's nc (1 .. NC) chunks
template <bool EXACT, int VS>
void forward_chunks(const Layout& L, FwdScratch& F, int rows, const float* qpos, int64_t j0, int nc,
                    const char* const* pf, int np) {
  switch (nc) {
    case 4: forward_rows<4, EXACT, VS>(L, F, rows, qpos, j0, pf, np); break;
    case 3: forward_rows<3, EXACT, VS>(L, F, rows, qpos, j0, pf, np); break;
    case 2: forward_rows<2, EXACT, VS>(L, F, rows, qpos, j0, pf, np); break;
    default: forward_rows<1, EXACT, VS>(L, F, rows, qpos, j0, pf, np); break;
  }
}

void forward_unit(const Layout& L, int64_t q0, int nq, int h, float* out, float* m_out, float* l_out,
                  FwdScratch& F) {
  const int g = L.hq / L.hkv, dp = L.dp, rows = nq * g;
  F.size(rows, L.d, dp);
  load_queries(L, q0, nq, h, g, F.qr.data());
  const int64_t seq_row = L.q_row[q0];
  int64_t last = 0;
  for (int i = 0; i < nq; ++i) last = L.q_pos[q0 + i] > last ? L.q_pos[q0 + i] : last;
  const int64_t n_chunks = last / CHUNK + 1;
  thread_local std::vector<float> qpos;
  qpos.resize(rows);
  for (int r = 0; r < rows; ++r) qpos[r] = static_cast<float>(L.q_pos[q0 + r / g]);
  const int step = L.d <= 32 ? NC : L.d <= 64 ? 2 : 1;  // the steps' keys and values stay in L1
#ifdef ZK_ATT_VECTOR
  // values in place only for a unit of one row group (a decode step's): more groups would each widen them again
  const int vs = rows > 4 ? kPadded : L.dtype == 0 ? kF32 : L.dtype == 1 ? kBF16 : kPadded;
#else
  const int vs = kPadded;
#endif
  for (int64_t j0 = 0; j0 < n_chunks; j0 += step) {
    const int nc = n_chunks - j0 < step ? static_cast<int>(n_chunks - j0) : step;
    for (int t = 0; t < nc; ++t) {
      float* kt = F.kt.data() + static_cast<size_t>(t) * L.d * CHUNK;
      const void** vrow = F.vrow.data() + static_cast<size_t>(t) * CHUNK;
#ifdef ZK_ATT_VECTOR
      if (vs != kPadded) {
        vector_chunk_in_place(L, h, seq_row, j0 + t, last, kt, vrow, F.zeros.data());
        continue;
      }
#endif
      float* vc = F.vc.data() + static_cast<size_t>(t) * CHUNK * dp;
      move_chunk(L, h, seq_row, j0 + t, last, kt, vc, nullptr, nullptr);
      for (int c = 0; c < CHUNK; ++c) vrow[c] = vc + static_cast<size_t>(c) * dp;
    }
    const int np = j0 + step < n_chunks
                       ? next_step_lines(L, h, seq_row, (j0 + step) * CHUNK, step * CHUNK, last, F.pf.data())
                       : 0;
    const char* const* pf = F.pf.data();
    if (vs == kBF16)
      forward_chunks<true, kBF16>(L, F, rows, qpos.data(), j0, nc, pf, np);
    else if (vs == kF32)
      forward_chunks<false, kF32>(L, F, rows, qpos.data(), j0, nc, pf, np);
    else if (L.exact_products())
      forward_chunks<true, kPadded>(L, F, rows, qpos.data(), j0, nc, pf, np);
    else
      forward_chunks<false, kPadded>(L, F, rows, qpos.data(), j0, nc, pf, np);
  }
  for (int r = 0; r < rows; ++r) {
    int64_t qi = q0 + r / g;
    int head = h * g + r % g;
    float* o = out + (qi * L.hq + head) * L.d;
    const float* acc = &F.acc[static_cast<size_t>(r) * dp];
    for (int i = 0; i < L.d; ++i) o[i] = acc[i] / F.l[r];
    if (m_out) {  // (the backward's; inference passes none)
      m_out[qi * L.hq + head] = F.m[r];
      l_out[qi * L.hq + head] = F.l[r];
    }
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
// out [Nq, Hq, D], m_out / l_out [Nq, Hq] (or both null), float32.
int zk_attention_fwd(int dtype, int hq, int hkv, int d, const void* q, const void* k, const void* v, int64_t kv_sb,
                     int64_t kv_sh, int64_t kv_sp, int bs, const int64_t* block_table, int64_t bt_cols,
                     const int64_t* q_row, const int64_t* q_pos, int64_t n_blocks, const int64_t* block_q0,
                     const int64_t* block_nq, float scale, float* out, float* m_out, float* l_out, int threads) {
  if (hkv <= 0 || hq % hkv != 0 || d <= 0 || bs <= 0) return 1;
  Layout L{dtype, hq, hkv, d, (d + LANES - 1) / LANES * LANES, bs, q, k, v, kv_sb, kv_sh, kv_sp, block_table,
           bt_cols, q_row, q_pos, scale};
  run_parallel(n_blocks * hkv, threads, [&](int64_t u) {
    thread_local FwdScratch F;
    forward_unit(L, block_q0[u / hkv], static_cast<int>(block_nq[u / hkv]), static_cast<int>(u % hkv), out, m_out,
                 l_out, F);
  });
  return 0;
}

// Forward over vLLM's batch metadata, read as it lies (int32 when idx_i32, else int64): query_start_loc [n_seqs + 1]
// (0 .. Nq), seq_lens [n_seqs], block_table rows bt_stride apart (bt_cols used). Sequence i's queries are
// query_start_loc[i] .. query_start_loc[i + 1] - 1 at positions seq_lens[i] - (their count) + 0, 1, ...; each
// sequence's queries are cut into blocks of q_tile — the q_row, q_pos and blocks shared_numerics.attention_cpu built
// with torch ops before (a few dozen calls a layer, ~0.13 ms at decode): the same units, the same bits. Returns 2 for
// metadata that does not describe Nq queries in order, 3 for a position past the block table, else as above.
int zk_attention_paged_fwd(int dtype, int hq, int hkv, int d, const void* q, int64_t n_q, const void* k, const void* v,
                           int64_t kv_sb, int64_t kv_sh, int64_t kv_sp, int bs, const void* block_table,
                           int64_t bt_stride, int64_t bt_cols, const void* query_start_loc, const void* seq_lens,
                           int64_t n_seqs, int idx_i32, int q_tile, float scale, float* out, float* m_out,
                           float* l_out, int threads) {
  if (hkv <= 0 || hq % hkv != 0 || d <= 0 || bs <= 0 || q_tile <= 0 || n_seqs < 0) return 1;
  auto at = [idx_i32](const void* p, int64_t i) -> int64_t {
    return idx_i32 ? static_cast<const int32_t*>(p)[i] : static_cast<const int64_t*>(p)[i];
  };
  thread_local std::vector<int64_t> bt, q_row, q_pos, block_q0, block_nq;
  bt.resize(static_cast<size_t>(n_seqs * bt_cols));
  for (int64_t i = 0; i < n_seqs; ++i)
    for (int64_t c = 0; c < bt_cols; ++c) bt[i * bt_cols + c] = at(block_table, i * bt_stride + c);
  q_row.resize(n_q);
  q_pos.resize(n_q);
  block_q0.clear();
  block_nq.clear();
  if (n_seqs == 0 ? n_q != 0 : (at(query_start_loc, 0) != 0 || at(query_start_loc, n_seqs) != n_q)) return 2;
  for (int64_t i = 0; i < n_seqs; ++i) {
    const int64_t a = at(query_start_loc, i), b = at(query_start_loc, i + 1), first = at(seq_lens, i) - (b - a);
    if (b < a || b > n_q || first < 0) return 2;  // (checked before q_row / q_pos are written)
    if (b > a && at(seq_lens, i) > bt_cols * bs) return 3;
    for (int64_t j = a; j < b; ++j) {
      q_row[j] = i;
      q_pos[j] = first + (j - a);
    }
    for (int64_t j = a; j < b; j += q_tile) {
      block_q0.push_back(j);
      block_nq.push_back(b - j < q_tile ? b - j : q_tile);
    }
  }
  return zk_attention_fwd(dtype, hq, hkv, d, q, k, v, kv_sb, kv_sh, kv_sp, bs, bt.data(), bt_cols, q_row.data(),
                          q_pos.data(), static_cast<int64_t>(block_q0.size()), block_q0.data(), block_nq.data(), scale,
                          out, m_out, l_out, threads);
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
      load_queries(L, q0, nq, h, g, S.qr.data());
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
        chunk_scores(L, q0, nq, h, g, seq_row, j, last, S);
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
