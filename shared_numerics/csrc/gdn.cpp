// The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) over one sequence's new tokens, the arithmetic of
// shared_numerics.gated_deltanet.gated_delta_rule's torch ops in their order, so the same bits. Built by
// shared_numerics/cpu_kernels.py (-ffp-contract=off, no fast-math: a product and a sum are two roundings, as torch's).
//
// zk_gated_delta_rule: per value head (one thread computes a head whole: the thread count never changes a bit), with
// its state S [dk x dv] float32, for each token t:
//   S[i][j] = S[i][j] * decay[t]                                    (decay = exp(g), computed by the caller)
//   u[j] = sum_i S[i][j] * k[t][i]                                  (the fixed tree of shared_numerics.reduce.tree_sum:
//                                                                     rows zero-padded to the next power of two p,
//                                                                     then a[i] = a[i] + a[i + p/2] until one row)
//   S[i][j] = S[i][j] + k[t][i] * ((v[t][j] - u[j]) * beta[t])
//   o[t][j] = sum_i S[i][j] * q[t][i]                               (the same tree)
// Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (ICLR 2025); HF torch_recurrent_gated_delta_rule.
#include <cstdint>
#include <vector>

namespace {

// out[j] = tree-sum over i < dk of s[i][j] * x[i]; buf holds p * dv floats
inline void tree_dot(const float* s, const float* x, int64_t dk, int64_t dv, int64_t p, float* buf, float* out) {
  for (int64_t i = 0; i < dk; ++i) {
    const float xi = x[i];
    const float* si = s + i * dv;
    float* bi = buf + i * dv;
    for (int64_t j = 0; j < dv; ++j) bi[j] = si[j] * xi;
  }
  for (int64_t i = dk; i < p; ++i)
    for (int64_t j = 0; j < dv; ++j) buf[i * dv + j] = 0.0f;
  for (int64_t half = p / 2; half >= 1; half /= 2)
    for (int64_t i = 0; i < half; ++i) {
      float* a = buf + i * dv;
      const float* b = buf + (i + half) * dv;
      for (int64_t j = 0; j < dv; ++j) a[j] = a[j] + b[j];
    }
  for (int64_t j = 0; j < dv; ++j) out[j] = buf[j];
}

}  // namespace

extern "C" {

// nseq sequences, sequence n's tokens rows cu[n] .. cu[n+1]-1 of q, k: [rows, h, dk]; v, out: [rows, h, dv];
// decay, beta: [rows, h]; state: [nseq, h, dk, dv], each sequence's updated in place. All float32, contiguous; cu:
// nseq + 1 nondecreasing int64. One thread computes one (sequence, head) whole.
void zk_gated_delta_rule(int64_t nseq, const int64_t* cu, int64_t h, int64_t dk, int64_t dv, const float* q,
                         const float* k, const float* v, const float* decay, const float* beta, float* state,
                         float* out, int threads) {
  int64_t p = 1;
  while (p < dk) p *= 2;
  const int64_t pairs = nseq * h;
#pragma omp parallel num_threads(threads) if (threads > 1 && pairs > 1)
  {
    std::vector<float> buf(p * dv), u(dv), d(dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t seq = pair / h, head = pair % h;
      float* s = state + pair * dk * dv;
      for (int64_t step = cu[seq]; step < cu[seq + 1]; ++step) {
        const int64_t row = step * h + head;
        const float g = decay[row], b = beta[row];
        const float* kt = k + row * dk;
        const float* qt = q + row * dk;
        const float* vt = v + row * dv;
        for (int64_t i = 0; i < dk * dv; ++i) s[i] = s[i] * g;
        tree_dot(s, kt, dk, dv, p, buf.data(), u.data());
        for (int64_t j = 0; j < dv; ++j) d[j] = (vt[j] - u[j]) * b;
        for (int64_t i = 0; i < dk; ++i) {
          const float ki = kt[i];
          float* si = s + i * dv;
          for (int64_t j = 0; j < dv; ++j) si[j] = si[j] + ki * d[j];
        }
        tree_dot(s, qt, dk, dv, p, buf.data(), out + row * dv);
      }
    }
  }
}

}  // extern "C"
