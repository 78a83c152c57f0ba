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
// zk_rope: per (token, head), for i < D/2 with x1 = x[i], x2 = x[i + D/2] (HF rotate-half): y1 = x1 * c - x2 * s,
// y2 = x2 * c + x1 * s in float32, every product and the difference / sum rounded on its own (the torch ops of
// shared_numerics.rope._rotate in their order: the same bits), written in the input's dtype (bf16: round to nearest
// even, NaN -> 0x7FC0, as .to(torch.bfloat16)). Source: Su et al., "RoFormer" (2021); HF apply_rotary_pos_emb.
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
    const v16f sv = zk::sigmoid(gv);
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

// x: [n, heads, d] of `dtype` (0 float32, 1 bfloat16), element strides sn (token) and sh (head), d contiguous, d even;
// cos, sin: [n, d / 2] float32 contiguous; y: [n, heads, d] of `dtype`, contiguous
void zk_rope(int dtype, const void* x, int64_t n, int64_t heads, int64_t d, int64_t sn, int64_t sh, const float* cos,
             const float* sin, void* y, int threads) {
  const int64_t half = d / 2, rows = n * heads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * d >= 32768)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row / heads, h = row % heads, src = t * sn + h * sh, dst = row * d;
    const float* c = cos + t * half;
    const float* sn_ = sin + t * half;
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
      v16f x1, x2;
      if (dtype == 1) {
        x1 = zk::load_bf16(static_cast<const uint16_t*>(x) + src + i);
        x2 = zk::load_bf16(static_cast<const uint16_t*>(x) + src + half + i);
      } else {
        x1 = zk::loadv(static_cast<const float*>(x) + src + i);
        x2 = zk::loadv(static_cast<const float*>(x) + src + half + i);
      }
      const v16f cv = zk::loadv(c + i), sv = zk::loadv(sn_ + i);
      const v16f y1 = x1 * cv - x2 * sv, y2 = x2 * cv + x1 * sv;
      if (dtype == 1) {
        zk::store_bf16(static_cast<uint16_t*>(y) + dst + i, y1);
        zk::store_bf16(static_cast<uint16_t*>(y) + dst + half + i, y2);
      } else {
        zk::storev(static_cast<float*>(y) + dst + i, y1);
        zk::storev(static_cast<float*>(y) + dst + half + i, y2);
      }
    }
    for (; i < half; ++i) {  // the same operations, one element at a time
      const float x1 = load(x, src + i, dtype), x2 = load(x, src + half + i, dtype);
      const float y1 = x1 * c[i] - x2 * sn_[i], y2 = x2 * c[i] + x1 * sn_[i];
      if (dtype == 1) {
        static_cast<uint16_t*>(y)[dst + i] = zk::float_to_bf16(y1);
        static_cast<uint16_t*>(y)[dst + half + i] = zk::float_to_bf16(y2);
      } else {
        static_cast<float*>(y)[dst + i] = y1;
        static_cast<float*>(y)[dst + half + i] = y2;
      }
    }
  }
}

// x: rows x h of `dtype`, row stride `stride` elements; w: h float32; y: rows x h of out_dtype (0 float32, 1 bf16:
// the float32 value rounded to nearest even, NaN -> 0x7FC0, as .to(torch.bfloat16)), contiguous; r: rows float32 (each
// row's 1 / sqrt(ms + eps), for the backward) or null
void zk_rms_norm(int dtype, const void* x, int64_t rows, int64_t h, int64_t stride, const float* w, float eps,
                 void* y, int out_dtype, float* r_out, int threads) {
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
      if (out_dtype == 1) {
        uint16_t* out = static_cast<uint16_t*>(y) + r * h;
        for (int64_t i = 0; i < h; ++i) out[i] = zk::float_to_bf16(load(x, base + i, dtype) * inv * w[i]);
      } else {
        float* out = static_cast<float*>(y) + r * h;
        for (int64_t i = 0; i < h; ++i) out[i] = load(x, base + i, dtype) * inv * w[i];
      }
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
