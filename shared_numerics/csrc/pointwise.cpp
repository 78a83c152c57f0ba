// Batch-invariant elementwise kernels on CPU: one formula per element, so an element's bits never depend on its
// position in the tensor or on the thread split (ATen's float exp takes SIMD Sleef in a tensor's body and scalar libm in
// its tail). Built by shared_numerics/cpu_kernels.py (-ffp-contract=off, no fast-math: vector lanes compute exactly
// the scalar formula; a tail of fewer than 16 elements runs the same 16-lane code on a zero-padded copy).
//
// zk_silu_mul: a = |g|; e = exp_nonpos(-a) (zk_simd.h: Cephes expf as plain arithmetic, never overflows);
// d = 1 + e; s = (g >= 0) ? 1 / d : e / d (= 1 / (1 + exp(-g))); y = (g * s) * u, float32, written in the output dtype
// (bf16: round to nearest even, as torch; float16: by the caller). s is returned for the backward
// (dy/dg = u (s + g s (1 - s)), dy/du = g s). Source: Shazeer, "GLU Variants Improve Transformer" (2020); vLLM
// SiluAndMul.forward_native.
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

#include "zk_simd.h"

namespace {

using zk::bf16_to_float;
using zk::v16f;

inline float load(const void* base, int64_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(base)[i];
  if (dtype == 1) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  return static_cast<float>(static_cast<const _Float16*>(base)[i]);
}

}  // namespace

extern "C" {

// g, u: n elements of `dtype` (0 float32, 1 bfloat16, 2 float16), contiguous; y: n elements of `out_dtype` (0 float32,
// 1 bfloat16); s: n float32 or null
void zk_silu_mul(int dtype, const void* g, const void* u, int64_t n, void* y, int out_dtype, float* s, int threads) {
  const int64_t blocks = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 32768)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i0 = blk * 16, m = n - i0 < 16 ? n - i0 : 16;
    v16f gv = {}, uv = {};
    if (m == 16 && dtype == 1) {
      gv = zk::load_bf16(static_cast<const uint16_t*>(g) + i0);
      uv = zk::load_bf16(static_cast<const uint16_t*>(u) + i0);
    } else if (m == 16 && dtype == 0) {
      gv = zk::loadv(static_cast<const float*>(g) + i0);
      uv = zk::loadv(static_cast<const float*>(u) + i0);
    } else {
      for (int64_t j = 0; j < m; ++j) {
        gv[j] = load(g, i0 + j, dtype);
        uv[j] = load(u, i0 + j, dtype);
      }
    }
    const v16f a = gv < 0.0f ? -gv : gv;
    const v16f e = zk::exp_nonpos(-a);
    const v16f d = 1.0f + e;
    const v16f sv = (gv >= 0.0f ? (v16f){} + 1.0f : e) / d;  // one division: 1 / d or e / d
    const v16f yv = (gv * sv) * uv;
    if (m == 16) {
      if (out_dtype == 0)
        zk::storev(static_cast<float*>(y) + i0, yv);
      else
        zk::store_bf16(static_cast<uint16_t*>(y) + i0, yv);
      if (s) zk::storev(s + i0, sv);
    } else {
      for (int64_t j = 0; j < m; ++j) {
        if (out_dtype == 0)
          static_cast<float*>(y)[i0 + j] = yv[j];
        else
          static_cast<uint16_t*>(y)[i0 + j] = zk::float_to_bf16(yv[j]);
        if (s) s[i0 + j] = sv[j];
      }
    }
  }
}

// Backward of zk_silu_mul on its saved s, the torch expressions' operations in their order: dg = (dy * u) * (s +
// (g * s) * (1 - s)), du = dy * (g * s), float32, written in the output dtype (0 float32, 1 bf16 rounded to nearest
// even). g, u, dy: n elements of `dtype`; s: n float32; dg, du: n elements of out_dtype.
void zk_silu_mul_bwd(int dtype, const void* g, const void* u, const float* s, const void* dy, int64_t n, void* dg,
                     void* du, int out_dtype, int threads) {
  const int64_t blocks = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 32768)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i0 = blk * 16, m = n - i0 < 16 ? n - i0 : 16;
    v16f gv = {}, uv = {}, sv = {}, dv = {};
    if (m == 16 && dtype == 1) {
      gv = zk::load_bf16(static_cast<const uint16_t*>(g) + i0);
      uv = zk::load_bf16(static_cast<const uint16_t*>(u) + i0);
      dv = zk::load_bf16(static_cast<const uint16_t*>(dy) + i0);
      sv = zk::loadv(s + i0);
    } else if (m == 16 && dtype == 0) {
      gv = zk::loadv(static_cast<const float*>(g) + i0);
      uv = zk::loadv(static_cast<const float*>(u) + i0);
      dv = zk::loadv(static_cast<const float*>(dy) + i0);
      sv = zk::loadv(s + i0);
    } else {
      for (int64_t j = 0; j < m; ++j) {
        gv[j] = load(g, i0 + j, dtype);
        uv[j] = load(u, i0 + j, dtype);
        dv[j] = load(dy, i0 + j, dtype);
        sv[j] = s[i0 + j];
      }
    }
    const v16f gs = gv * sv;
    const v16f dgv = (dv * uv) * (sv + gs * (1.0f - sv));
    const v16f duv = dv * gs;
    if (m == 16) {
      if (out_dtype == 0) {
        zk::storev(static_cast<float*>(dg) + i0, dgv);
        zk::storev(static_cast<float*>(du) + i0, duv);
      } else {
        zk::store_bf16(static_cast<uint16_t*>(dg) + i0, dgv);
        zk::store_bf16(static_cast<uint16_t*>(du) + i0, duv);
      }
    } else {
      for (int64_t j = 0; j < m; ++j) {
        if (out_dtype == 0) {
          static_cast<float*>(dg)[i0 + j] = dgv[j];
          static_cast<float*>(du)[i0 + j] = duv[j];
        } else {
          static_cast<uint16_t*>(dg)[i0 + j] = zk::float_to_bf16(dgv[j]);
          static_cast<uint16_t*>(du)[i0 + j] = zk::float_to_bf16(duv[j]);
        }
      }
    }
  }
}

// x: rows x h of `dtype`, row stride `stride` elements; w: h float32; y: rows x h float32 (contiguous); r: rows
// float32 (each row's 1 / sqrt(ms + eps), for the backward) or null
void zk_rms_norm(int dtype, const void* x, int64_t rows, int64_t h, int64_t stride, const float* w, float eps,
                 float* y, float* r_out, int threads) {
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
      if (r_out) r_out[r] = inv;
      float* out = y + r * h;
      for (int64_t i = 0; i < h; ++i) out[i] = load(x, base + i, dtype) * inv * w[i];
    }
  }
}

// Backward of zk_rms_norm (training; x̂ = x * r, y = x̂ * w): per row, g = dy * w, dot = the fixed tree (as the
// forward's) of g * x̂, dx = r * (g - x̂ * (dot / h)), float32, written in out_dtype (0 float32, 1 bf16 rounded to
// nearest even); a row's dx depends only on that row. Then the gain's gradient in row order: dw[c] = dw[c] + dy * x̂
// for row = 0, 1, ... (the products rounded to float32), continuing whatever dw holds (zeros, or an exact-accumulation
// chain: shared_numerics.grad_chain). x, dy: rows x h of `dtype`, contiguous; w: h float32; r: rows float32 from the
// forward; dx: rows x h of out_dtype; dw: h float32 or null.
void zk_rms_norm_bwd(int dtype, const void* x, const void* dy, int64_t rows, int64_t h, const float* w,
                     const float* r, void* dx, int out_dtype, float* dw, int threads) {
  int64_t p = 1;
  while (p < h) p *= 2;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * h >= 32768)
  {
    std::vector<float> buf(p), g(h), xh(h);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t base = row * h;
      const float inv = r[row];
      for (int64_t i = 0; i < h; ++i) {
        xh[i] = load(x, base + i, dtype) * inv;
        g[i] = load(dy, base + i, dtype) * w[i];
        buf[i] = g[i] * xh[i];
      }
      for (int64_t i = h; i < p; ++i) buf[i] = 0.0f;
      for (int64_t half = p / 2; half >= 1; half /= 2)
        for (int64_t i = 0; i < half; ++i) buf[i] = buf[i] + buf[i + half];
      const float mean = buf[0] / static_cast<float>(h);
      for (int64_t i = 0; i < h; ++i) {
        const float v = inv * (g[i] - xh[i] * mean);
        if (out_dtype == 0)
          static_cast<float*>(dx)[base + i] = v;
        else
          static_cast<uint16_t*>(dx)[base + i] = zk::float_to_bf16(v);
      }
    }
  }
  if (!dw) return;
  const int64_t cblocks = (h + 63) / 64;  // columns in blocks of 64, each walked over the rows in order
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && cblocks > 1 && rows * h >= 32768)
  for (int64_t cb = 0; cb < cblocks; ++cb) {
    const int64_t c0 = cb * 64, c1 = c0 + 64 < h ? c0 + 64 : h;
    for (int64_t row = 0; row < rows; ++row) {
      const float inv = r[row];
      for (int64_t c = c0; c < c1; ++c) dw[c] = dw[c] + load(dy, row * h + c, dtype) * (load(x, row * h + c, dtype) * inv);
    }
  }
}

}  // extern "C"
