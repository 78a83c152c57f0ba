// Batch-invariant elementwise kernels on CPU: one scalar formula per element (glibc's expf, IEEE +, *, /), so an
// element's bits never depend on its position in the tensor or on the thread split (ATen's float exp takes SIMD
// Sleef in a tensor's body and scalar libm in its tail). Built by shared_numerics/cpu_kernels.py (-ffp-contract=off,
// no fast-math: vector lanes compute exactly the scalar formula).
//
// zk_silu_mul: e = expf(-g); s = 1 / (1 + e); y = g / (1 + e) * u   (float32 in and out; y is rounded to the
// activation dtype by the caller). s is returned for the backward (dy/dg = u (s + g s (1 - s)), dy/du = g s).
// Source: Shazeer, "GLU Variants Improve Transformer" (2020); vLLM SiluAndMul.forward_native.
//
// zk_rms_norm: per row of H: sq = x * x; the fixed tree of shared_numerics.reduce.tree_sum (zero-pad to the next
// power of two p, then a[i] = a[i] + a[i + p/2] until one element); ms = sum / H; r = 1 / sqrtf(ms + eps);
// y = (x * r) * w. The same IEEE operations in the same order as shared_numerics.norm.rms_norm's torch ops, so the
// same bits (the kernel is that function's forward in one pass). Source: Zhang & Sennrich, "Root Mean Square Layer
// Normalization" (2019); HF Qwen3RMSNorm.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float load(const void* base, int64_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(base)[i];
  if (dtype == 1) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  return static_cast<float>(static_cast<const _Float16*>(base)[i]);
}

}  // namespace

extern "C" {

// g, u: n elements of `dtype` (0 float32, 1 bfloat16, 2 float16), contiguous; y: n float32; s: n float32 or null
void zk_silu_mul(int dtype, const void* g, const void* u, int64_t n, float* y, float* s, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 32768)
  for (int64_t i = 0; i < n; ++i) {
    float gf = load(g, i, dtype);
    float e = expf(-gf);
    float d = 1.0f + e;
    y[i] = gf / d * load(u, i, dtype);
    if (s) s[i] = 1.0f / d;
  }
}

// x: rows x h of `dtype`, row stride `stride` elements; w: h float32; y: rows x h float32 (contiguous)
void zk_rms_norm(int dtype, const void* x, int64_t rows, int64_t h, int64_t stride, const float* w, float eps,
                 float* y, int threads) {
  int64_t p = 1;
  while (p < h) p *= 2;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * h >= 32768)
  {
    std::vector<float> buf(p);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t base = r * stride;
      for (int64_t i = 0; i < h; ++i) {
        float v = load(x, base + i, dtype);
        buf[i] = v * v;
      }
      for (int64_t i = h; i < p; ++i) buf[i] = 0.0f;
      for (int64_t half = p / 2; half >= 1; half /= 2)
        for (int64_t i = 0; i < half; ++i) buf[i] = buf[i] + buf[i + half];
      const float ms = buf[0] / static_cast<float>(h);
      const float inv = 1.0f / sqrtf(ms + eps);
      float* out = y + r * h;
      for (int64_t i = 0; i < h; ++i) out[i] = load(x, base + i, dtype) * inv * w[i];
    }
  }
}

}  // extern "C"
