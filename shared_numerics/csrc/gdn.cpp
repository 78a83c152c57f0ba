// The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) over one sequence's new tokens, the arithmetic of
// shared_numerics.gated_deltanet.gated_delta_rule's torch ops in their order, so the same bits. Built by
// shared_numerics/cpu_kernels.py (-ffp-contract=off, no fast-math: a product and a sum are two roundings, as torch's).
//
// zk_gated_delta_rule: per value head, with its state S [dk x dv] float32, for each token t:
//   S[i][j] = S[i][j] * decay[t]                                    (decay = exp(g), computed by the caller)
//   u[j] = sum_i S[i][j] * k[t][i]                                  (the fixed tree of shared_numerics.reduce.tree_sum:
//                                                                     rows zero-padded to the next power of two p,
//                                                                     then a[i] = a[i] + a[i + p/2] until one row)
//   S[i][j] = S[i][j] + k[t][i] * ((v[t][j] - u[j]) * beta[t])
//   o[t][j] = sum_i S[i][j] * q[t][i]                               (the same tree)
// Every column j of S is its own recurrence (the sums run over i only), so the kernel runs one block of 16 columns at
// a time through all of a sequence's tokens, the block [dk x 16] held in a local buffer (L1) and each sum evaluated
// with a stack of partial sums while its products are made: leaves in bit-reversed order of i, merging as a binary
// counter carries, which adds exactly the pairs the halving tree adds, left operand first. A decode step (at most two
// tokens per sequence, d_v a multiple of 128) takes whole rows of 128 columns instead: the state streams from memory
// row by row. One thread computes one (sequence, head, column block): neither the thread count, the split nor the
// block width changes a bit.
//
// zk_gated_delta_rule_bwd: the gradients of zk_gated_delta_rule (float32; deterministic: one thread per (sequence,
// head), every sum in a fixed order; not a definition other code must match). States are kept at every CHUNK-th token
// in a forward pass, each chunk's states recomputed from its checkpoint, then per token t, last first, with dS the
// gradient of S_t, P = decay S_{t-1}, u = P^T k, d = (v - u) beta:
//   dS += q do^T; dq = S_t do; dk = dS d + P du; dd = dS^T k; dv = dd beta; du = -dd beta; dbeta = (v - u) . dd;
//   dP = dS + k du^T; ddecay = <dP, S_{t-1}>; dS_{t-1} = decay dP.
//
// zk_l2_normalize: per row of d: sq = x * x; the fixed tree of shared_numerics.reduce.tree_sum (zero-pad to the next
// power of two, then a[i] = a[i] + a[i + p/2] until one element); r = 1 / sqrtf(sum + eps) (torch.rsqrt's correctly
// rounded square root and division); y = (x * r) / divisor, float32 (shared_numerics.gated_deltanet.l2_normalize and
// true_divide: the same operations, so the same bits; dividing by 1 changes nothing).
//
// zk_causal_conv1d_silu: the causal depthwise conv1d with SiLU of shared_numerics.gated_deltanet.causal_conv1d, per
// token and channel: acc = x[t-K+1] * w[0]; acc = acc + x[t-K+1+j] * w[j] (j = 1 .. K-1, float32, inputs before the
// sequence's first new token from its conv state), y = acc * sigmoid(acc) (zk::sigmoid, the SiLU of zk_silu_mul),
// rounded once to the activations' dtype; then each sequence's state becomes its last K - 1 inputs.
// Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (ICLR 2025); HF torch_recurrent_gated_delta_rule,
// causal_conv1d_fn.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "zk_simd.h"

namespace {

using zk::v16f;

// NB blocks of 16 columns side by side: one row of a local state block, NB vectors
template <int NB>
struct Row {
  v16f x[NB];
};

// Tree-sum of leaves produced in bit-reversed order (leaf m of the walk is row bitrev(m)): each push merges as a
// binary counter carries, left operand (the earlier subtree) first.
template <int NB>
struct TreeStack {
  Row<NB> level[24];
  int64_t m = 0;
  inline void push(Row<NB> x) {
    int64_t lvl = 0;
    while ((m >> lvl) & 1) {
      for (int c = 0; c < NB; ++c) x.x[c] = level[lvl].x[c] + x.x[c];
      ++lvl;
    }
    level[lvl] = x;
    ++m;
  }
};

// One (sequence, head, group of NB column blocks from column j0, w columns in all) through the sequence's tokens.
// `order`: the walk (row bitrev(m), or >= dk for a zero leaf); fast: dk a power of two >= 8 (eight leaves of the walk
// at a time, their 3-level subtree in registers).
template <int NB>
void run_item(int64_t lo, int64_t hi, int64_t h, int64_t head, int64_t dk, int64_t dv, int64_t j0, int64_t w,
              int64_t p, int64_t depth, const int64_t* order, bool fast, const float* q, const float* k, const float* v,
              const float* decay, const float* beta, float* s, float* out, Row<NB>* sb) {
  const bool full = w == 16 * NB;  // whole vectors: loads and stores of 16 lanes
  for (int64_t i = 0; i < dk; ++i) {
    Row<NB> x = {};
    if (full)
      for (int c = 0; c < NB; ++c) x.x[c] = zk::loadv(s + i * dv + 16 * c);
    else
      for (int64_t l = 0; l < w; ++l) x.x[l / 16][l % 16] = s[i * dv + l];
    sb[i] = x;
  }
  for (int64_t step = lo; step < hi; ++step) {
    const int64_t row = step * h + head;
    const v16f g = zk::splat(decay[row]), b = zk::splat(beta[row]);
    const float* kt = k + row * dk;
    const float* qt = q + row * dk;
    Row<NB> vt = {};
    if (full)
      for (int c = 0; c < NB; ++c) vt.x[c] = zk::loadv(v + row * dv + j0 + 16 * c);
    else
      for (int64_t l = 0; l < w; ++l) vt.x[l / 16][l % 16] = v[row * dv + j0 + l];
    Row<NB> u, o, d;
    if (fast) {
      TreeStack<NB> tu;
      for (int64_t m = 0; m < p; m += 8) {
        const int64_t* r = order + m;
        Row<NB> acc;
        for (int c = 0; c < NB; ++c) {
          v16f l[8];
          for (int e = 0; e < 8; ++e) {
            const v16f si = sb[r[e]].x[c] * g;
            sb[r[e]].x[c] = si;
            l[e] = si * kt[r[e]];
          }
          acc.x[c] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        }
        tu.push(acc);
      }
      u = tu.level[depth - 3];
      for (int c = 0; c < NB; ++c) d.x[c] = (vt.x[c] - u.x[c]) * b;
      TreeStack<NB> to;
      for (int64_t m = 0; m < p; m += 8) {
        const int64_t* r = order + m;
        Row<NB> acc;
        for (int c = 0; c < NB; ++c) {
          v16f l[8];
          for (int e = 0; e < 8; ++e) {
            const v16f si = sb[r[e]].x[c] + kt[r[e]] * d.x[c];
            sb[r[e]].x[c] = si;
            l[e] = si * qt[r[e]];
          }
          acc.x[c] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        }
        to.push(acc);
      }
      o = to.level[depth - 3];
    } else {
      TreeStack<NB> tu;
      for (int64_t m = 0; m < p; ++m) {
        const int64_t i = order[m];
        Row<NB> leaf = {};
        if (i < dk)
          for (int c = 0; c < NB; ++c) {
            const v16f si = sb[i].x[c] * g;
            sb[i].x[c] = si;
            leaf.x[c] = si * kt[i];
          }
        tu.push(leaf);
      }
      u = tu.level[depth];
      for (int c = 0; c < NB; ++c) d.x[c] = (vt.x[c] - u.x[c]) * b;
      TreeStack<NB> to;
      for (int64_t m = 0; m < p; ++m) {
        const int64_t i = order[m];
        Row<NB> leaf = {};
        if (i < dk)
          for (int c = 0; c < NB; ++c) {
            const v16f si = sb[i].x[c] + kt[i] * d.x[c];
            sb[i].x[c] = si;
            leaf.x[c] = si * qt[i];
          }
        to.push(leaf);
      }
      o = to.level[depth];
    }
    if (full)
      for (int c = 0; c < NB; ++c) zk::storev(out + row * dv + j0 + 16 * c, o.x[c]);
    else
      for (int64_t l = 0; l < w; ++l) out[row * dv + j0 + l] = o.x[l / 16][l % 16];
  }
  for (int64_t i = 0; i < dk; ++i)
    if (full)
      for (int c = 0; c < NB; ++c) zk::storev(s + i * dv + 16 * c, sb[i].x[c]);
    else
      for (int64_t l = 0; l < w; ++l) s[i * dv + l] = sb[i].x[l / 16][l % 16];
}

template <int NB>
void run_items(int64_t nseq, const int64_t* cu, int64_t h, int64_t dk, int64_t dv, int64_t p, int64_t depth,
               const int64_t* order, bool fast, const float* q, const float* k, const float* v, const float* decay,
               const float* beta, float* state, float* out, int threads) {
  const int64_t width = 16 * NB;
  const int64_t groups = (dv + width - 1) / width;
  const int64_t items = nseq * h * groups;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
  {
    std::vector<Row<NB>> sbuf(dk);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t pair = item / groups, grp = item % groups;
      const int64_t seq = pair / h, head = pair % h;
      const int64_t j0 = grp * width, w = dv - j0 < width ? dv - j0 : width;
      run_item<NB>(cu[seq], cu[seq + 1], h, head, dk, dv, j0, w, p, depth, order, fast, q, k, v, decay, beta,
                   state + pair * dk * dv + j0, out, sbuf.data());
    }
  }
}

// sum over j < n of a[j] * b[j] in 16 lane partial sums (lane j % 16), then the lanes in order: a fixed order
inline float hsum(v16f x) {
  float r = 0.0f;
  for (int l = 0; l < 16; ++l) r += x[l];
  return r;
}
inline float dot_lanes(const float* a, const float* b, int64_t n) {
  v16f acc = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc = acc + zk::loadv(a + j) * zk::loadv(b + j);
  for (; j < n; ++j) acc[j % 16] += a[j] * b[j];
  return hsum(acc);
}

}  // namespace

extern "C" {

// nseq sequences, sequence n's tokens rows cu[n] .. cu[n+1]-1 of q, k: [rows, h, dk]; v, out: [rows, h, dv];
// decay, beta: [rows, h]; state: [nseq, h, dk, dv], each sequence's updated in place. All float32, contiguous; cu:
// nseq + 1 nondecreasing int64.
void zk_gated_delta_rule(int64_t nseq, const int64_t* cu, int64_t h, int64_t dk, int64_t dv, const float* q,
                         const float* k, const float* v, const float* decay, const float* beta, float* state,
                         float* out, int threads) {
  int64_t p = 1, depth = 0;
  while (p < dk) p *= 2, ++depth;
  std::vector<int64_t> order(p);
  for (int64_t m = 0; m < p; ++m) {
    int64_t r = 0;
    for (int64_t b = 0; b < depth; ++b) r |= ((m >> b) & 1) << (depth - 1 - b);
    order[m] = r;
  }
  const bool fast = p == dk && dk >= 8;
  // A prefill keeps a block of 16 columns in L1 through its tokens; a decode step (a token or two per sequence)
  // streams whole rows of 128 columns from a state that comes from memory. The lanes are independent: the same bits.
  if (cu[nseq] <= 2 * nseq && dv % 128 == 0)
    run_items<8>(nseq, cu, h, dk, dv, p, depth, order.data(), fast, q, k, v, decay, beta, state, out, threads);
  else
    run_items<1>(nseq, cu, h, dk, dv, p, depth, order.data(), fast, q, k, v, decay, beta, state, out, threads);
}


// nseq sequences, sequence n's tokens rows cu[n] .. cu[n+1]-1 of x, y: [rows, c] of `dtype` (0 float32, 1 bfloat16);
// w: [c, kw] float32; state: [nseq, kw - 1, c] of `dtype`, oldest input first, each sequence's updated in place.
void zk_causal_conv1d_silu(int dtype, int64_t nseq, const int64_t* cu, int64_t c, int64_t kw, const void* x,
                           const float* w, void* state, void* y, int threads) {
  const int64_t rows = cu[nseq], cblocks = (c + 15) / 16, ks = kw - 1;
  auto at = [&](const void* base, int64_t i) -> float {
    return dtype == 0 ? static_cast<const float*>(base)[i] : zk::bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  };
  std::vector<float> wt(kw * (cblocks * 16), 0.0f);  // [kw, c] zero-padded: tap j of 16 channels in one load
  for (int64_t ch = 0; ch < c; ++ch)
    for (int64_t j = 0; j < kw; ++j) wt[j * cblocks * 16 + ch] = w[ch * kw + j];
  std::vector<int64_t> seq_of(rows);
  for (int64_t n = 0; n < nseq; ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) seq_of[t] = n;
  const int64_t items = rows * cblocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && items >= 64)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t t = item / cblocks, c0 = (item % cblocks) * 16, m = c - c0 < 16 ? c - c0 : 16;
    const int64_t n = seq_of[t], lo = cu[n];
    v16f acc = {};
    if (m == 16 && t - ks >= lo) {  // every tap inside the new tokens, whole vectors: straight loads
      const float* wj = wt.data() + c0;
      if (dtype == 1) {
        const uint16_t* xp = static_cast<const uint16_t*>(x) + (t - ks) * c + c0;
        acc = zk::load_bf16(xp) * zk::loadv(wj);
        for (int64_t j = 1; j < kw; ++j) acc = acc + zk::load_bf16(xp + j * c) * zk::loadv(wj + j * cblocks * 16);
      } else {
        const float* xp = static_cast<const float*>(x) + (t - ks) * c + c0;
        acc = zk::loadv(xp) * zk::loadv(wj);
        for (int64_t j = 1; j < kw; ++j) acc = acc + zk::loadv(xp + j * c) * zk::loadv(wj + j * cblocks * 16);
      }
    } else {
      for (int64_t j = 0; j < kw; ++j) {
        const int64_t pos = t - ks + j;
        v16f xv = {}, wv;
        if (pos >= lo) {
          if (m == 16 && dtype == 1)
            xv = zk::load_bf16(static_cast<const uint16_t*>(x) + pos * c + c0);
          else if (m == 16)
            xv = zk::loadv(static_cast<const float*>(x) + pos * c + c0);
          else
            for (int64_t l = 0; l < m; ++l) xv[l] = at(x, pos * c + c0 + l);
        } else {
          const int64_t base = (n * ks + pos - lo + ks) * c + c0;
          for (int64_t l = 0; l < m; ++l) xv[l] = at(state, base + l);
        }
        wv = zk::loadv(wt.data() + j * cblocks * 16 + c0);
        acc = j == 0 ? xv * wv : acc + xv * wv;
      }
    }
    const v16f out = acc * zk::sigmoid(acc);
    if (dtype == 0) {
      for (int64_t l = 0; l < m; ++l) static_cast<float*>(y)[t * c + c0 + l] = out[l];
    } else if (m == 16) {
      zk::store_bf16(static_cast<uint16_t*>(y) + t * c + c0, out);
    } else {
      for (int64_t l = 0; l < m; ++l) static_cast<uint16_t*>(y)[t * c + c0 + l] = zk::float_to_bf16(out[l]);
    }
  }
  // the new states: each sequence's last ks inputs, rows written in ascending order (row r reads its old row r + T)
  const size_t es = dtype == 0 ? 4 : 2;
  for (int64_t n = 0; n < nseq; ++n) {
    const int64_t lo = cu[n], hi = cu[n + 1];
    char* st = static_cast<char*>(state) + n * ks * c * es;
    for (int64_t r = 0; r < ks; ++r) {
      const int64_t pos = hi - ks + r;
      const char* src = pos >= lo ? static_cast<const char*>(x) + pos * c * es : st + (pos - lo + ks) * c * es;
      if (src != st + r * c * es) std::memmove(st + r * c * es, src, c * es);
    }
  }
}


// Inputs as zk_gated_delta_rule's (state: the states before the first token, not modified) and dout [rows, h, dv],
// dfinal [nseq, h, dk, dv] (the gradient of the final states); outputs dq, dk [rows, h, dk], dv [rows, h, dv],
// ddecay, dbeta [rows, h], dstate [nseq, h, dk, dv]. All float32, contiguous.
void zk_gated_delta_rule_bwd(int64_t nseq, const int64_t* cu, int64_t h, int64_t dk, int64_t dv, const float* q,
                             const float* k, const float* v, const float* decay, const float* beta,
                             const float* state, const float* dout, const float* dfinal, float* dq, float* dkk,
                             float* dvv, float* ddecay, float* dbeta, float* dstate, int threads) {
  constexpr int64_t CHUNK = 32;
  const int64_t pairs = nseq * h, sz = dk * dv;
#pragma omp parallel num_threads(threads) if (threads > 1 && pairs > 1)
  {
    // us, dsv: u and d of each token of the chunk being recomputed, kept for its backward
    std::vector<float> ckpt, chunk((CHUNK + 1) * sz), ds(sz), p(sz), us(CHUNK * dv), dsv(CHUNK * dv), prow(dv),
        dd(dv), du(dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t seq = pair / h, head = pair % h, lo = cu[seq], hi = cu[seq + 1], len = hi - lo;
      const int64_t nchunks = (len + CHUNK - 1) / CHUNK;
      // one forward step from s (S_{t-1}) to out (S_t); keeps u and d in token t's slot of the chunk
      auto step = [&](int64_t t, const float* s, float* out) {
        const int64_t row = t * h + head;
        float* u = us.data() + ((t - lo) % CHUNK) * dv;
        float* d = dsv.data() + ((t - lo) % CHUNK) * dv;
        const float g = decay[row], b = beta[row];
        const float* kt = k + row * dk;
        const float* vt = v + row * dv;
        for (int64_t i = 0; i < sz; ++i) p[i] = s[i] * g;
        for (int64_t j = 0; j < dv; ++j) u[j] = 0.0f;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) u[j] += p[i * dv + j] * kt[i];
        for (int64_t j = 0; j < dv; ++j) d[j] = (vt[j] - u[j]) * b;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) out[i * dv + j] = p[i * dv + j] + kt[i] * d[j];
      };
      ckpt.assign((nchunks + 1) * sz, 0.0f);
      const float* s0 = state + pair * sz;
      std::copy(s0, s0 + sz, ckpt.begin());
      for (int64_t c = 0; c < nchunks; ++c) {
        std::copy(ckpt.begin() + c * sz, ckpt.begin() + (c + 1) * sz, chunk.begin());
        const int64_t a = lo + c * CHUNK, e = std::min(hi, a + CHUNK);
        for (int64_t t = a; t < e; ++t) step(t, chunk.data() + (t - a) * sz, chunk.data() + (t - a + 1) * sz);
        std::copy(chunk.begin() + (e - a) * sz, chunk.begin() + (e - a + 1) * sz, ckpt.begin() + (c + 1) * sz);
      }
      const float* df = dfinal + pair * sz;
      std::copy(df, df + sz, ds.begin());
      for (int64_t c = nchunks - 1; c >= 0; --c) {
        const int64_t a = lo + c * CHUNK, e = std::min(hi, a + CHUNK);
        std::copy(ckpt.begin() + c * sz, ckpt.begin() + (c + 1) * sz, chunk.begin());
        for (int64_t t = a; t < e; ++t) step(t, chunk.data() + (t - a) * sz, chunk.data() + (t - a + 1) * sz);
        for (int64_t t = e - 1; t >= a; --t) {
          const int64_t row = t * h + head;
          const float* prev = chunk.data() + (t - a) * sz;
          const float* cur = chunk.data() + (t - a + 1) * sz;
          const float* u = us.data() + (t - a) * dv;
          const float* d = dsv.data() + (t - a) * dv;
          const float g = decay[row], b = beta[row];
          const float* kt = k + row * dk;
          const float* qt = q + row * dk;
          const float* vt = v + row * dv;
          const float* dot = dout + row * dv;
          for (int64_t i = 0; i < dk; ++i)
            for (int64_t j = 0; j < dv; ++j) ds[i * dv + j] += qt[i] * dot[j];
          for (int64_t i = 0; i < dk; ++i) dq[row * dk + i] = dot_lanes(cur + i * dv, dot, dv);
          for (int64_t j = 0; j < dv; ++j) dd[j] = 0.0f;
          for (int64_t i = 0; i < dk; ++i)
            for (int64_t j = 0; j < dv; ++j) dd[j] += ds[i * dv + j] * kt[i];
          float db = 0.0f;
          for (int64_t j = 0; j < dv; ++j) {
            dvv[row * dv + j] = dd[j] * b;
            du[j] = -dd[j] * b;
            db += (vt[j] - u[j]) * dd[j];
          }
          dbeta[row] = db;
          v16f dg = {};
          for (int64_t i = 0; i < dk; ++i) {
            float* dsi = ds.data() + i * dv;
            const float* prv = prev + i * dv;
            for (int64_t j = 0; j < dv; ++j) prow[j] = prv[j] * g;  // row i of P = decay S_{t-1}, as step made it
            dkk[row * dk + i] = dot_lanes(dsi, d, dv) + dot_lanes(prow.data(), du.data(), dv);
            int64_t j = 0;
            for (; j + 16 <= dv; j += 16) {
              const v16f dpij = zk::loadv(dsi + j) + kt[i] * zk::loadv(du.data() + j);
              dg = dg + dpij * zk::loadv(prv + j);
              zk::storev(dsi + j, g * dpij);
            }
            for (; j < dv; ++j) {
              const float dpij = dsi[j] + kt[i] * du[j];
              dg[j % 16] += dpij * prv[j];
              dsi[j] = g * dpij;
            }
          }
          ddecay[row] = hsum(dg);
        }
      }
      std::copy(ds.begin(), ds.end(), dstate + pair * sz);
    }
  }
}


// x: t tokens of `heads` rows of d elements of `dtype` (0 float32, 1 bfloat16), row (token, head) at
// token * stride + head * d; y: [t, heads, d] float32, contiguous.
void zk_l2_normalize(int dtype, const void* x, int64_t t, int64_t heads, int64_t d, int64_t stride, float eps,
                     float divisor, float* y, int threads) {
  int64_t p = 1;
  while (p < d) p *= 2;
  const int64_t rows = t * heads;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows >= 256)
  {
    std::vector<float> a(p), xs(d);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t base = (r / heads) * stride + (r % heads) * d;
      for (int64_t i = 0; i < d; ++i)
        xs[i] = dtype == 0 ? static_cast<const float*>(x)[base + i]
                           : zk::bf16_to_float(static_cast<const uint16_t*>(x)[base + i]);
      for (int64_t i = 0; i < d; ++i) a[i] = xs[i] * xs[i];
      for (int64_t i = d; i < p; ++i) a[i] = 0.0f;
      for (int64_t half = p / 2; half >= 1; half /= 2)
        for (int64_t i = 0; i < half; ++i) a[i] = a[i] + a[i + half];
      const float inv = 1.0f / std::sqrt(a[0] + eps);
      float* out = y + r * d;
      for (int64_t i = 0; i < d; ++i) out[i] = (xs[i] * inv) / divisor;
    }
  }
}

}  // extern "C"
