// Shared helpers of zerokld's CPU kernels (included by the csrc/*.cpp files; shared_numerics/cpu_kernels.py hashes
// every header into each library's cache key). Plain IEEE arithmetic on GCC vector types: under -ffp-contract=off and
// without fast-math each lane computes exactly the scalar formula, so a value's bits never depend on its lane or on
// the vector width the machine has (AVX-512 registers, or two AVX2 ones).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace zk {

// 16 floats / int32s
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v16f_unaligned __attribute__((vector_size(64), aligned(4), may_alias));

inline v16f loadv(const float* p) { return *reinterpret_cast<const v16f_unaligned*>(p); }
inline void storev(float* p, v16f v) { *reinterpret_cast<v16f_unaligned*>(p) = v; }

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's round_to_nearest_even)
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint16_t v16h_unaligned __attribute__((vector_size(32), aligned(2), may_alias));

// 16 bf16 (bits) -> 16 floats, exactly
inline v16f load_bf16(const uint16_t* p) {
  const v16u u = __builtin_convertvector(*reinterpret_cast<const v16h_unaligned*>(p), v16u) << 16;
  return __builtin_bit_cast(v16f, u);
}

// 16 floats -> 16 bf16, lane by lane float_to_bf16 (round to nearest even, NaN -> 0x7FC0)
inline void store_bf16(uint16_t* p, v16f v) {
  const v16u u = __builtin_bit_cast(v16u, v);
  v16u r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  r = v != v ? (v16u){} + 0x7FC0u : r;
  *reinterpret_cast<v16h_unaligned*>(p) = __builtin_convertvector(r, v16h);
}

// c + a * b in one rounding: a fused multiply-add per lane. Where every product a * b is exact in float32 (bf16 x
// bf16 or fp16 x fp16 values: 16- or 22-bit significands, products in float32's normal range) this is bit for bit
// the multiply-then-add c + a * b, in half the instructions; callers use it only there.
inline v16f fma_exact(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
  return __builtin_bit_cast(v16f, _mm512_fmadd_ps(__builtin_bit_cast(__m512, a), __builtin_bit_cast(__m512, b),
                                                  __builtin_bit_cast(__m512, c)));
#else
  v16f r;
  for (int l = 0; l < 16; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
#endif
}
// x in every lane
inline v16f splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
// the largest of 16 lanes by a tree of (y > x ? y : x); lanes must hold no NaN
inline float hmax(v16f x) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int w = 8; w >= 1; w /= 2) {
    const v16f y = __builtin_shuffle(x, lane ^ w);
    x = y > x ? y : x;
  }
  return x[0];
}
// exp(x) for x <= 0 (-inf included), 16 lanes: Cephes expf (range reduction by ln 2, n = x log2(e) rounded to
// nearest even by the 1.5 * 2^23 trick, degree-6 polynomial, < 2 ulp) as plain arithmetic; 0 below -87.
inline v16f exp_nonpos(v16f x) {
  const v16f xc = x < -87.0f ? (v16f){} - 87.0f : x;
  const v16f fn = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  v16f r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  const v16f z = r * r;
  v16f y = (v16f){} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const v16i bits = (__builtin_convertvector(fn, v16i) + 127) << 23;
  const v16f res = y * __builtin_bit_cast(v16f, bits);
  return x < -87.0f ? (v16f){} : res;
}

// sigmoid(g) = 1 / (1 + exp(-g)), 16 lanes, never overflowing: a = |g|; e = exp_nonpos(-a); d = 1 + e;
// (g >= 0 ? 1 : e) / d, one division (zk_silu_mul's s; the Gated DeltaNet conv's SiLU)
inline v16f sigmoid(v16f g) {
  const v16f a = g < 0.0f ? -g : g;
  const v16f e = exp_nonpos(-a);
  const v16f d = 1.0f + e;
  return (g >= 0.0f ? (v16f){} + 1.0f : e) / d;
}

#if defined(__AVX512F__)
// 16 x 16 transpose of 32-bit words in registers: on return r[c] holds what was column c (word c of every r[i]).
// Unpacks of 32- and 64-bit words, then two rounds of 128-bit lane shuffles; moves only.
inline void transpose16_regs(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + s]: 128-bit lane l holds rows 4q..4q+3 of column 4l + s; two lane shuffles gather each column
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}
#endif

}  // namespace zk
