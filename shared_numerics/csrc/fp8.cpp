// FP8 (e4m3fn) activation quantization and code widening on CPU: shared_numerics/fp8.py's definition in one pass.
// Built by shared_numerics/cpu_kernels.py (-ffp-contract=off, no fast-math); called by shared_numerics/fp8.py.
//
// zk_fp8_quantize: per row of x and per group of `group` consecutive elements (group = K: one scale per token;
// 128: per 1x128 block; the last group of a row may be shorter), every step float32, in this order:
//   amax = max |x| over the group (exact); non-finite anywhere -> return -1, nothing to trust in the outputs;
//   s = amax / 448 (IEEE division); s = s < 1/(448*512) ? 1/(448*512) : s  (torch.clamp(min=) with the float32 floor);
//   v = x / s (IEEE division); v = clamp(v, -448, 448); code = e4m3fn(v), round to nearest even.
// The e4m3fn conversion is c10's fp8e4m3fn_from_fp32_value (PyTorch c10/util/Float8_e4m3fn.h) for |v| <= 448, where
// it does not saturate: normals by adding 0x7FFFF + the kept mantissa's lowest bit and cutting 20 bits, subnormals
// (|v| < 2^-6) by the float add of 2^-9 * 2^23 that rounds to the 2^-9 grid. The codes are written as fp8 bytes
// and/or as their values in bf16 (every e4m3fn value is a bf16 value: 4 significant bits, exponents 2^-9..2^8), what
// the AMX GEMM multiplies. Rows are independent; threads split rows.
//
// zk_fp8_to_bf16: the value of each e4m3fn byte as bf16 bits (a 256-entry table built from the format's definition:
// sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 subnormal; 0x7F / 0xFF NaN -> 0x7FC0 / 0xFFC0).
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ZK_FP8_AVX512 1
#endif

#include "zk_simd.h"

namespace {

using zk::bf16_to_float;

inline uint32_t bits(float f) { return __builtin_bit_cast(uint32_t, f); }
inline float from_bits(uint32_t u) { return __builtin_bit_cast(float, u); }

// c10::detail::fp8e4m3fn_from_fp32_value for |f| <= 448 (no saturation or NaN branch needed)
inline uint8_t e4m3_from_float(float f) {
  constexpr uint32_t denorm_mask = UINT32_C(141) << 23;
  uint32_t f_bits = bits(f);
  const uint32_t sign = f_bits & UINT32_C(0x80000000);
  f_bits ^= sign;
  uint8_t result;
  if (f_bits < (UINT32_C(121) << 23)) {
    f_bits = bits(from_bits(f_bits) + from_bits(denorm_mask));
    result = static_cast<uint8_t>(f_bits - denorm_mask);
  } else {
    const uint32_t mant_odd = (f_bits >> 20) & 1;
    f_bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 20);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

// bf16 bits of the e4m3fn value of byte c
inline uint16_t e4m3_to_bf16(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 8;
  const uint32_t e = (c >> 3) & 0xF, m = c & 0x7;
  if (e == 0xF && m == 0x7) return static_cast<uint16_t>(sign | 0x7FC0);  // NaN, sign kept
  if (e == 0) {  // subnormal: m * 2^-9, exact in bf16
    if (m == 0) return static_cast<uint16_t>(sign);
    const float v = static_cast<float>(m) * 0.001953125f;  // 2^-9
    return static_cast<uint16_t>(sign | (bits(v) >> 16));
  }
  return static_cast<uint16_t>(sign | ((e + 120) << 7) | (m << 4));
}

struct Table {
  uint16_t v[256];
  Table() {
    for (int c = 0; c < 256; ++c) v[c] = e4m3_to_bf16(static_cast<uint8_t>(c));
  }
};
const Table kTable;

inline float load(const void* base, int64_t i, int dtype) {
  return dtype == 0 ? static_cast<const float*>(base)[i] : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

#ifdef ZK_FP8_AVX512
// 16 elements of x (bf16 or float32) at p, `n` of them (tail: masked, zeros beyond)
inline __m512 load16(const void* p, int dtype, int64_t n) {
  const __mmask16 m = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  if (dtype == 0) return _mm512_maskz_loadu_ps(m, p);
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// one group [lo, hi) of a row, the scalar formulas lane by lane: amax (max is exact, in any order), then codes and
// their bf16 values for |v| <= 448 (the two branches of e4m3_from_float computed for every lane and selected)
inline int group16(const void* x, int dtype, int64_t base, int64_t lo, int64_t hi, float min_scale, uint8_t* codes,
                   uint16_t* values, float* scale) {
  const int64_t esize = dtype == 0 ? 4 : 2;
  const char* row = static_cast<const char*>(x) + base * esize;
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t i = lo; i < hi; i += 16) {
    const __m512 a = _mm512_and_ps(load16(row + i * esize, dtype, hi - i), absmask);
    bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.4028234663852886e38f), _CMP_NLE_UQ);  // inf or NaN
    vmax = _mm512_max_ps(vmax, a);
  }
  if (bad) return -1;
  const float amax = _mm512_reduce_max_ps(vmax);
  float s = amax / 448.0f;
  s = s < min_scale ? min_scale : s;
  *scale = s;
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i denorm = _mm512_set1_epi32(141 << 23);
  for (int64_t i = lo; i < hi; i += 16) {
    const int64_t n = hi - i;
    const __mmask16 m = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    __m512 v = _mm512_div_ps(load16(row + i * esize, dtype, n), vs);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const __m512i f = _mm512_xor_si512(u, sign);
    const __mmask16 sub = _mm512_cmplt_epu32_mask(f, _mm512_set1_epi32(121 << 23));
    // normals: round to 3 mantissa bits, nearest even
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(f, 20), _mm512_set1_epi32(1));
    const __m512i fr = _mm512_add_epi32(_mm512_add_epi32(f, _mm512_set1_epi32(0x7FFFF)), odd);
    const __m512i code_n = _mm512_srli_epi32(_mm512_add_epi32(fr, _mm512_set1_epi32(static_cast<int>(0xC4000000u))), 20);
    const __m512i val_n = _mm512_and_si512(fr, _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
    // subnormals: the float add onto the 2^-9 grid
    const __m512i sb = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(f), _mm512_castsi512_ps(denorm)));
    const __m512i code_s = _mm512_sub_epi32(sb, denorm);
    const __m512i val_s = _mm512_castps_si512(_mm512_sub_ps(_mm512_castsi512_ps(sb), _mm512_castsi512_ps(denorm)));
    const __m512i code = _mm512_or_si512(_mm512_and_si512(_mm512_mask_mov_epi32(code_n, sub, code_s),
                                                          _mm512_set1_epi32(0xFF)),
                                         _mm512_srli_epi32(sign, 24));
    const __m512i val = _mm512_or_si512(_mm512_srli_epi32(_mm512_mask_mov_epi32(val_n, sub, val_s), 16),
                                        _mm512_srli_epi32(sign, 16));
    if (codes) _mm_mask_storeu_epi8(codes + i, m, _mm512_cvtepi32_epi8(code));
    if (values) _mm256_mask_storeu_epi16(values + i, m, _mm512_cvtepi32_epi16(val));
  }
  return 0;
}
#endif

}  // namespace

extern "C" {

// x: [rows, k] of `dtype` (0 float32, 1 bfloat16), row stride ldx; codes: [rows, k] bytes or null; values: [rows, k]
// bf16 bits or null (both row stride k); scales: [rows, ceil(k / group)] float32. Returns 0, or -1 when x holds a
// non-finite value.
int zk_fp8_quantize(int dtype, const void* x, int64_t rows, int64_t k, int64_t ldx, int64_t group, uint8_t* codes,
                    uint16_t* values, float* scales, int threads) {
  const int64_t groups = (k + group - 1) / group;
  const float min_scale = static_cast<float>(1.0 / (448.0 * 512.0));
  int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1) reduction(| : bad)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * ldx;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t lo = g * group, hi = lo + group < k ? lo + group : k;
#ifdef ZK_FP8_AVX512
      if (group16(x, dtype, base, lo, hi, min_scale, codes ? codes + r * k : nullptr,
                  values ? values + r * k : nullptr, scales + r * groups + g) != 0)
        bad = 1;
#else
      float amax = 0.0f;
      for (int64_t i = lo; i < hi; ++i) {
        const float a = std::fabs(load(x, base + i, dtype));
        if (!(a <= 3.4028234663852886e38f)) bad = 1;  // inf or NaN
        amax = a > amax ? a : amax;
      }
      float s = amax / 448.0f;
      s = s < min_scale ? min_scale : s;
      scales[r * groups + g] = s;
      for (int64_t i = lo; i < hi; ++i) {
        float v = load(x, base + i, dtype) / s;
        v = v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v);
        const uint8_t c = e4m3_from_float(v);
        if (codes) codes[r * k + i] = c;
        if (values) values[r * k + i] = kTable.v[c];
      }
#endif
    }
  }
  return bad ? -1 : 0;
}

// values: [rows, k] bf16 code values (row stride k), scales: [rows, ceil(k / group)] -> out: [rows, k] bf16 bits of
// value * scale (float32 product, rounded to nearest even: torch's (q.float() * s).to(torch.bfloat16))
void zk_fp8_dequantize_bf16(const uint16_t* values, const float* scales, int64_t rows, int64_t k, int64_t group,
                            uint16_t* out, int threads) {
  const int64_t groups = (k + group - 1) / group;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[r * groups + g];
      const int64_t lo = g * group, hi = lo + group < k ? lo + group : k;
      for (int64_t i = lo; i < hi; ++i) out[r * k + i] = zk::float_to_bf16(bf16_to_float(values[r * k + i]) * s);
    }
}

// codes: n e4m3fn bytes -> out: n bf16 bits (their values)
void zk_fp8_to_bf16(const uint8_t* codes, int64_t n, uint16_t* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) out[i] = kTable.v[codes[i]];
}

}  // extern "C"
