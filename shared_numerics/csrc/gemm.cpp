// Batch-invariant GEMM on CPU matrix units: C = A · Bᵀ with A [I, K] and B [J, K] (K contiguous in both), bf16
// operands, float32 accumulation, one rounding of (C + bias) to the output dtype. Built by
// shared_numerics/cpu_kernels.py; called by shared_numerics/gemm_cpu.py.
//
// The arithmetic of one output element (i, j) is fixed by the source: K is zero-padded to a multiple of 32 and walked
// in 32-element steps, step 0 first, each step one AMX TDPBF16PS into the element's float32 accumulator (the
// instruction's own fixed pair-wise products and sums; the element depends only on row i of A and row j of B). Every
// element is computed whole by one thread from a zeroed accumulator — no split of K, no reduction across threads — so
// its bits do not depend on I, J, on which 16x16 tile it falls in, or on the thread count. With A = a weight [N, K]
// and B = activations [M, K], a token's outputs are the same bits alone (decode, M = 1) or among 2048 (prefill).
//
// Layout: B is packed per call into AMX's VNNI form (for each block of 16 rows of B, pairs of K as 32-bit words,
// [K/2][16]) by 16x16 32-bit transposes; A's 16-row tiles load straight from A (a weight is never repacked). Work unit =
// (32 rows of A, a chunk of up to 256 rows of B): 2x2 C tiles, 2 A tiles, 2 B tiles (AMX's 8 tile registers); the
// chunk keeps a B slice in L2 while a thread walks the rows of A. Output: C [I, J] or its transpose [J, I] (what a
// linear layer wants: out[m][n] = sum_k x[m][k] w[n][k]), float32 or bf16 (round to nearest even, NaN -> 0x7FC0:
// c10::BFloat16's rounding), bias[i] added in float32 before the rounding.
// Source: Intel AMX (Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 2, TDPBF16PS; the VNNI
// layout of oneDNN's AMX kernels).
#include <cstdint>
#include <array>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define ZK_F32_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ZK_F32_AVX2 1
#endif
#include "zk_simd.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define ZK_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// A float buffer kept by its thread between calls (a fresh allocation's page faults cost as much as the work),
// 2 MiB-aligned with transparent huge pages requested: the packed operands and accumulators are walked in slices
// spread over megabytes, and with 4 KiB pages the TLB misses cost ~15% of the float32 kernel (2-core Xeon, 2026-11-26)
struct HugeBuffer {
  float* p = nullptr;
  size_t n = 0;
  HugeBuffer() = default;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  ~HugeBuffer() { std::free(p); }
  float* get(size_t want) {  // at least `want` floats; contents unspecified
    if (want <= n) return p;
    std::free(p);
    const size_t huge = size_t(1) << 21, bytes = (want * sizeof(float) + huge - 1) / huge * huge;
    p = static_cast<float*>(std::aligned_alloc(huge, bytes));
    if (!p) throw std::bad_alloc();
    madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP the pages are 4 KiB
    n = bytes / sizeof(float);
    return p;
  }
};

}  // namespace

#if defined(__AVX512F__)
namespace {

// 16x16 transpose of 32-bit words: dst[c][r] = src[r][c]; rows of src `ss` words apart, of dst `ds` words apart
inline void transpose16(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ss);
  zk::transpose16_regs(r);
  for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + c * ds, r[c]);  // r[c] = column c
}
inline void transpose16(const float* src, int64_t ss, uint32_t* dst, int64_t ds) {
  transpose16(reinterpret_cast<const uint32_t*>(src), ss, dst, ds);
}
// 16 bf16 -> their exact float32 values' bits
inline __m512i widen_bf16(__m256i h) { return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16); }
// the same of a bf16 array (rows `ss` elements apart), each element widened exactly to a float's 32 bits
inline void transpose16(const uint16_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * ss)));
  zk::transpose16_regs(r);
  for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + c * ds, r[c]);
}

}  // namespace
#endif

extern "C" int zk_gemm_has_amx() {
#ifdef ZK_HAVE_AMX
  // ask the kernel for AMX tile state once (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); 0 = granted
  static const int ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return 0;
#endif
}

#ifdef ZK_HAVE_AMX
namespace {

constexpr int64_t CHUNK_J = 128;  // rows of B per work unit (a 256 KiB slice at K = 1024 stays in L2)
constexpr int64_t KC = 256;  // K per block (an A strip's block, 16 KiB, stays in L1)

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void tile_config() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

inline uint32_t pair_at(const uint16_t* row, int64_t k, int64_t kmax) {
  uint32_t lo = k < kmax ? row[k] : 0, hi = k + 1 < kmax ? row[k + 1] : 0;
  return lo | (hi << 16);
}

// B [J, K] (row stride ldb) -> bp [jblocks][kp2][16] words, zero beyond J and K (kp2 = Kp / 2)
void pack_b(const uint16_t* b, int64_t j_rows, int64_t k, int64_t ldb, int64_t kp2, int64_t jblocks, uint32_t* bp,
            int threads) {
  const bool words = (k % 2 == 0) && (ldb % 2 == 0) && ((reinterpret_cast<uintptr_t>(b) & 3) == 0);
  const int64_t kfull = words ? (k / 32) * 16 : 0;  // pairs handled by full 16x16 transposes
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && jblocks > 1)
  for (int64_t jb = 0; jb < jblocks; ++jb) {
    uint32_t* dst = bp + jb * kp2 * 16;
    const int64_t j0 = jb * 16;
    const bool full_rows = j0 + 16 <= j_rows;
    if (full_rows) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(b + j0 * ldb);
      for (int64_t p = 0; p < kfull; p += 16) transpose16(src + p, ldb / 2, dst + p * 16, 16);
    }
    for (int64_t p = full_rows ? kfull : 0; p < kp2; ++p)
      for (int jj = 0; jj < 16; ++jj)
        dst[p * 16 + jj] = j0 + jj < j_rows ? pair_at(b + (j0 + jj) * ldb, 2 * p, k) : 0;
  }
}

// 16 bf16 of row `r` (columns c0..c0+15, fewer at the tail) of a [rows, cols] array, zero beyond it, widened to words
inline __m512i row16(const uint16_t* x, int64_t ld, int64_t r, int64_t rows, int64_t c0, int64_t cols) {
  if (r >= rows || c0 >= cols) return _mm512_setzero_si512();
  const int64_t n = cols - c0 < 16 ? cols - c0 : 16;
  return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), x + r * ld + c0));
}

// pairs of K as words from a k-major array x [k, cols] (cols contiguous, row stride ld): word (p, c) =
// x[2p][c] | x[2p + 1][c] << 16, for p in p0..p0+15 and c in c0..c0+15 -> w[p - p0][c - c0]
inline void kmajor_words(const uint16_t* x, int64_t ld, int64_t k, int64_t cols, int64_t p0, int64_t c0,
                         __m512i* w) {
  for (int p = 0; p < 16; ++p) {
    const __m512i lo = row16(x, ld, 2 * (p0 + p), k, c0, cols), hi = row16(x, ld, 2 * (p0 + p) + 1, k, c0, cols);
    w[p] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
}

// B given k-major (b [k, j_rows], j contiguous) -> bp as pack_b makes it
void pack_b_kmajor(const uint16_t* b, int64_t j_rows, int64_t k, int64_t ldb, int64_t kp2, int64_t jblocks,
                   uint32_t* bp, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && jblocks > 1)
  for (int64_t jb = 0; jb < jblocks; ++jb) {
    __m512i w[16];
    for (int64_t p0 = 0; p0 < kp2; p0 += 16) {
      kmajor_words(b, ldb, k, j_rows, p0, jb * 16, w);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(bp + (jb * kp2 + p0 + p) * 16, w[p]);
    }
  }
}

// A given k-major (a [k, i_rows], i contiguous) -> ap [istrips * 32, kp] (k contiguous, zero-padded)
void pack_a_kmajor(const uint16_t* a, int64_t i_rows, int64_t k, int64_t lda, int64_t kp, int64_t iblocks,
                   uint16_t* ap, int threads) {
  const int64_t kp2 = kp / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && iblocks > 1)
  for (int64_t ib = 0; ib < iblocks; ++ib) {
    alignas(64) uint32_t w[256];
    for (int64_t p0 = 0; p0 < kp2; p0 += 16) {
      kmajor_words(a, lda, k, i_rows, p0, ib * 16, reinterpret_cast<__m512i*>(w));
      transpose16(w, 16, reinterpret_cast<uint32_t*>(ap + ib * 16 * kp) + p0, kp2);
    }
  }
}

inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// 16 floats rounded as to_bf16 does, the bf16 bits left in the upper half of each 32-bit lane
inline __m512i bf16_hi(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

struct Out {
  void* ptr;
  int dtype;  // 0 float32, 1 bf16
  int transpose;
  int64_t ldo;
  const float* bias;
  int64_t i_rows, j_rows;
  int accumulate;  // start each element's chain from the float32 output's value instead of zero
};

// the inverse of write_tile_prepare + write_tile_rows for a float32 output: c[ii][jj] = C[i0 + ii][j0 + jj], zero outside the output
inline void read_tile(float* c, int64_t i0, int64_t j0, const Out& o) {
  const int64_t ni = o.i_rows - i0 < 16 ? o.i_rows - i0 : 16;
  const int64_t nj = o.j_rows - j0 < 16 ? o.j_rows - j0 : 16;
  const float* src = static_cast<const float*>(o.ptr);
  for (int64_t ii = 0; ii < 16; ++ii)
    for (int64_t jj = 0; jj < 16; ++jj)
      c[ii * 16 + jj] = ii < ni && jj < nj
                            ? src[o.transpose ? (j0 + jj) * o.ldo + i0 + ii : (i0 + ii) * o.ldo + j0 + jj]
                            : 0.0f;
}

// one 16x16 float32 tile c[ii][jj] = C[i0 + ii][j0 + jj] -> the output (bias, rounding, layout, bounds), in two
// halves that the strip interleaves with the next pair's tile products: write_tile_prepare (a [J, I] output: the
// tile transposed into t; else nothing) then write_tile_rows (bias, rounding, stores)
inline const float* write_tile_prepare(const float* c, const Out& o, float* t) {
  if (!o.transpose) return c;
  transpose16(reinterpret_cast<const uint32_t*>(c), 16, reinterpret_cast<uint32_t*>(t), 16);
  return t;
}

inline void write_tile_rows(const float* rows, int64_t i0, int64_t j0, const Out& o) {
  const int64_t ni = o.i_rows - i0 < 16 ? o.i_rows - i0 : 16;
  const int64_t nj = o.j_rows - j0 < 16 ? o.j_rows - j0 : 16;
  if (ni <= 0 || nj <= 0) return;
  int64_t nr = ni, nc = nj, r0 = i0, c0 = j0;
  if (o.transpose) {  // rows of the output are j, its columns i
    nr = nj, nc = ni, r0 = j0, c0 = i0;
  }
  const __mmask16 m = static_cast<__mmask16>((1u << nc) - 1);
  for (int64_t r = 0; r < nr; ++r) {
    __m512 v = _mm512_loadu_ps(rows + r * 16);
    if (o.bias) {
      const __m512 bv = o.transpose ? _mm512_maskz_loadu_ps(m, o.bias + i0) : _mm512_set1_ps(o.bias[i0 + r]);
      v = _mm512_add_ps(v, bv);
    }
    const int64_t off = (r0 + r) * o.ldo + c0;
    if (o.dtype == 0)
      _mm512_mask_storeu_ps(static_cast<float*>(o.ptr) + off, m, v);
    else
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.ptr) + off, m, to_bf16(v));
  }
}

// a [J, I] bf16 output's rows j0 + rlo .. j0 + rhi - 1 at columns i0 .. i0 + 31 from two transposed tiles (t0: columns
// i0 .. i0 + 15, t1: the next 16): per row both halves rounded (to_bf16's bits), joined and stored as one 64-byte row
inline void write_pair_rows_bf16(const float* t0, const float* t1, int64_t i0, int64_t j0, const Out& o, int rlo,
                                 int rhi) {
  const int64_t ni = o.i_rows - i0 < 32 ? o.i_rows - i0 : 32, nj = o.j_rows - j0 < rhi ? o.j_rows - j0 : rhi;
  if (ni <= 0) return;
  const __mmask32 m = ni >= 32 ? 0xffffffffu : static_cast<__mmask32>((1u << ni) - 1);
  const __mmask16 m0 = static_cast<__mmask16>(ni >= 16 ? 0xffff : (1u << ni) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(ni >= 32 ? 0xffff : (ni <= 16 ? 0 : (1u << (ni - 16)) - 1));
  const __m512 b0 = o.bias ? _mm512_maskz_loadu_ps(m0, o.bias + i0) : _mm512_setzero_ps();
  const __m512 b1 = o.bias ? _mm512_maskz_loadu_ps(m1, o.bias + i0 + 16) : _mm512_setzero_ps();
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23,
                                       21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);  // the upper halves of both
  uint16_t* out = static_cast<uint16_t*>(o.ptr);
  for (int64_t r = rlo; r < nj; ++r) {
    __m512 v0 = _mm512_loadu_ps(t0 + r * 16), v1 = _mm512_loadu_ps(t1 + r * 16);
    if (o.bias) {
      v0 = _mm512_add_ps(v0, b0);
      v1 = _mm512_add_ps(v1, b1);
    }
    const __m512i w = _mm512_permutex2var_epi16(bf16_hi(v0), odd, bf16_hi(v1));
    _mm512_mask_storeu_epi16(out + (j0 + r) * o.ldo + i0, m, w);
  }
}

// an [I, J] bf16 output's rows row0 + rlo .. row0 + rhi - 1 at columns col0 .. col0 + 31 from two tiles (p0: columns
// col0 .. col0 + 15, p1: the next 16; row r of each is output row row0 + r): per row both halves rounded (to_bf16's
// bits), joined and stored as one 64-byte row
inline void write_rows_joined_bf16(const float* p0, const float* p1, int64_t row0, int64_t col0, const Out& o,
                                   int rlo, int rhi) {
  const int64_t nc = o.j_rows - col0 < 32 ? o.j_rows - col0 : 32, nr = o.i_rows - row0 < rhi ? o.i_rows - row0 : rhi;
  if (nc <= 0) return;
  const __mmask32 m = nc >= 32 ? 0xffffffffu : static_cast<__mmask32>((1u << nc) - 1);
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23,
                                       21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  uint16_t* out = static_cast<uint16_t*>(o.ptr);
  for (int64_t r = rlo; r < nr; ++r) {
    __m512 v0 = _mm512_loadu_ps(p0 + r * 16), v1 = _mm512_loadu_ps(p1 + r * 16);
    if (o.bias) {
      const __m512 b = _mm512_set1_ps(o.bias[row0 + r]);
      v0 = _mm512_add_ps(v0, b);
      v1 = _mm512_add_ps(v1, b);
    }
    const __m512i w = _mm512_permutex2var_epi16(bf16_hi(v0), odd, bf16_hi(v1));
    _mm512_mask_storeu_epi16(out + (row0 + r) * o.ldo + col0, m, w);
  }
}

// C rows i0..i0+31 (a: 32 rows, stride lda; kp = padded K) x B blocks jb0..jb1 (pairs, a lone last block alone).
// K in blocks of KC: the A strip's block (32 x KC bf16) stays in L1 while every B pair of the chunk passes over it;
// the float32 accumulators wait in c between K blocks (a tile store and load move bits unchanged). A finished pair's
// output is written in 8 stages (per tile: its transpose, then its rows; a bf16 [J, I] output: per j tile, the two
// transposes, then its rows in two halves, each row 64 bytes at once), one per K step of the next pair's products,
// so that the vector work runs beside the tile unit instead of stalling it (2-core Xeon: writing the pair in one burst
// left the tile unit idle, ~30% of a prefill-sized bf16 GEMM).
void strip(const uint16_t* a, int64_t lda, int64_t kp, const uint32_t* bp, int64_t jb0, int64_t jb1, int64_t i0,
           const Out& o, float* c) {
  const int64_t kp2 = kp / 2;
  int64_t pending = -1;  // a finished pair (its first B block) whose output is not written yet
  int stage = 0;         // of the pending pair's write: tile stage / 2, transpose (even) or rows (odd)
  alignas(64) float t[256], t1[256];
  const float* rows = nullptr;
  const bool joined = o.transpose && o.dtype == 1;  // a linear layer's bf16 [J, I]: both i tiles' rows at once
  auto flush_stage = [&]() {
    if (pending < 0) return;
    if (joined) {  // per j tile: transpose i tile 0, transpose i tile 1, rows 0-7, rows 8-15
      const int jt = stage / 4, part = stage % 4;
      const float* cc = c + (pending - jb0) * 2 * 256 + jt * 512;
      if (part < 2) {
        if (part == 0) {  // the j tile's 16 output lines on their way (for ownership) while the transposes run
          const int64_t jj0 = pending * 16 + jt * 16;
          const uint16_t* ob = static_cast<const uint16_t*>(o.ptr) + i0;
          for (int64_t r = 0; r < 16 && jj0 + r < o.j_rows; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(ob + (jj0 + r) * o.ldo), _MM_HINT_ET0);
        }
        write_tile_prepare(cc + part * 256, o, part ? t1 : t);
      } else
        write_pair_rows_bf16(t, t1, i0, pending * 16 + jt * 16, o, part == 2 ? 0 : 8, part == 2 ? 8 : 16);
      ++stage;
      if (stage == 8 || (stage == 4 && pending + 1 >= jb1)) pending = -1;  // (a lone last block: 1 j tile)
      return;
    }
    if (!o.transpose && o.dtype == 1 && pending + 1 < jb1) {  // bf16 [I, J] (dX, dW): per i tile, rows 0-7, 8-15
      const int it = stage / 2, part = stage % 2;
      const float* cc = c + (pending - jb0) * 2 * 256 + it * 256;  // (i tile, j 0-15); + 512: (i tile, j 16-31)
      const int64_t r0 = i0 + it * 16;
      if (part == 0) {  // the tile's 16 output lines on their way (for ownership)
        const uint16_t* ob = static_cast<const uint16_t*>(o.ptr) + pending * 16;
        for (int64_t r = 0; r < 16 && r0 + r < o.i_rows; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(ob + (r0 + r) * o.ldo), _MM_HINT_ET0);
      }
      write_rows_joined_bf16(cc, cc + 512, r0, pending * 16, o, part ? 8 : 0, part ? 16 : 8);
      if (++stage == 4) pending = -1;
      return;
    }
    const int tile = stage / 2;
    const float* cc = c + (pending - jb0) * 2 * 256 + tile * 256;
    const int64_t ti = i0 + (tile % 2) * 16, tj = pending * 16 + (tile / 2) * 16;
    if (stage % 2 == 0)
      rows = write_tile_prepare(cc, o, t);
    else
      write_tile_rows(rows, ti, tj, o);
    ++stage;
    if (stage == 8 || (stage == 4 && pending + 1 >= jb1)) pending = -1;  // (a lone last block: 2 tiles)
  };
  auto flush = [&]() {
    while (pending >= 0) flush_stage();
  };
  for (int64_t kb = 0; kb < kp; kb += KC) {
    const int64_t ke = kb + KC < kp ? kb + KC : kp;
    for (int64_t jb = jb0; jb < jb1; jb += 2) {
      const bool two = jb + 1 < jb1;
      float* cc = c + (jb - jb0) * 2 * 256;  // 4 tiles of this pair: [i 0-15, j 0-15], [i 16-31, j 0-15], then j 16-31
      const uint32_t* b0 = bp + jb * kp2 * 16;
      const uint32_t* b1 = b0 + kp2 * 16;
      if (kb == 0 && !o.accumulate) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        if (kb == 0) {  // accumulate: the chains go on from the output's float32 values
          read_tile(cc, i0, jb * 16, o);
          read_tile(cc + 256, i0 + 16, jb * 16, o);
          read_tile(cc + 512, i0, jb * 16 + 16, o);
          read_tile(cc + 768, i0 + 16, jb * 16 + 16, o);
        }
        _tile_loadd(0, cc, 64);
        _tile_loadd(1, cc + 256, 64);
        _tile_loadd(2, cc + 512, 64);
        _tile_loadd(3, cc + 768, 64);
      }
      if (two) {
        for (int64_t k = kb; k < ke; k += 32) {  // loads interleaved with the products that need them
          _tile_loadd(4, a + k, lda * 2);
          _tile_loadd(6, b0 + k * 8, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, b1 + k * 8, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, a + 16 * lda + k, lda * 2);
          _tile_dpbf16ps(1, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
          flush_stage();
        }
      } else {
        for (int64_t k = kb; k < ke; k += 32) {
          _tile_loadd(4, a + k, lda * 2);
          _tile_loadd(5, a + 16 * lda + k, lda * 2);
          _tile_loadd(6, b0 + k * 8, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          flush_stage();
        }
      }
      flush();  // (a K block of fewer than 8 steps)
      _tile_stored(0, cc, 64);
      _tile_stored(1, cc + 256, 64);
      _tile_stored(2, cc + 512, 64);
      _tile_stored(3, cc + 768, 64);
      if (ke == kp) pending = jb, stage = 0;
    }
  }
  flush();
}

}  // namespace
#endif

extern "C" {

// C = A · Bᵀ (see the file comment). a: [i_rows, k] bf16, row stride lda (a_kmajor = 0), or given k-major as
// [k, i_rows] with row stride lda (a_kmajor = 1); b likewise ([j_rows, k] or, b_kmajor = 1, [k, j_rows]); bias: i_rows
// float32 or null; out: [i_rows, j_rows] (transpose = 0) or [j_rows, i_rows] (transpose = 1), row stride ldo, float32
// (out_dtype 0) or bf16 (1). The layouts change only where operands are read from, never the arithmetic. accumulate
// (float32 output, no bias): out += A · Bᵀ as the continuation of each element's chain — its accumulator starts from
// out's value instead of zero, so calls on consecutive K ranges, each a multiple of 32, leave the bits of one call on
// their concatenation. Returns 0, or -1 when this build has no AMX.
int zk_gemm_abt_bf16(const uint16_t* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const uint16_t* b,
                     int64_t j_rows, int64_t ldb, int b_kmajor, const float* bias, void* out, int out_dtype,
                     int transpose, int64_t ldo, int threads, int accumulate) {
#ifdef ZK_HAVE_AMX
  if (!zk_gemm_has_amx()) return -1;
  const int64_t kp = (k + 31) / 32 * 32;
  const int64_t jblocks = (j_rows + 15) / 16;
  // packed operands live in per-calling-thread buffers kept between calls (a fresh allocation's page faults and
  // zero fill cost as much as the packing); the packers write every word of them
  thread_local HugeBuffer bp;
  const size_t words = static_cast<size_t>(jblocks) * (kp / 2) * 16;
  // (inside the parallel region `bp` would name each OpenMP thread's own buffer)
  uint32_t* const bpp = reinterpret_cast<uint32_t*>(bp.get(words));
  if (b_kmajor)
    pack_b_kmajor(b, j_rows, k, ldb, kp / 2, jblocks, bpp, threads);
  else
    pack_b(b, j_rows, k, ldb, kp / 2, jblocks, bpp, threads);
  // A straight from memory when its 32-row strips and K steps are whole; else a zero-padded copy of what is not
  const int64_t istrips = (i_rows + 31) / 32;
  thread_local HugeBuffer a_buf;
  const int64_t lda_pad = kp;
  const int64_t first_padded = (!a_kmajor && k == kp) ? i_rows / 32 : 0;  // strips from here on read a_pad
  uint16_t* a_pad = nullptr;
  if (first_padded < istrips) {
    const int64_t rows = (istrips - first_padded) * 32;
    a_pad = reinterpret_cast<uint16_t*>(a_buf.get(static_cast<size_t>(rows * kp + 1) / 2));
    if (a_kmajor) {
      pack_a_kmajor(a, i_rows, k, lda, kp, rows / 16, a_pad, threads);
    } else {
      std::memset(a_pad, 0, static_cast<size_t>(rows * kp) * 2);
      for (int64_t r = 0; r < rows && first_padded * 32 + r < i_rows; ++r)
        std::memcpy(a_pad + r * kp, a + (first_padded * 32 + r) * lda, k * 2);
    }
  }
  const Out o{out, out_dtype, transpose, ldo, bias, i_rows, j_rows, accumulate};
  // chunks of B of near-equal size (whole 16-row blocks), so that threads get near-equal work
  const int64_t chunks = (jblocks * 16 + CHUNK_J - 1) / CHUNK_J;
  const int64_t chunk_blocks = (jblocks + chunks - 1) / chunks;
  const int64_t units = chunks * istrips;
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
  {
    tile_config();
    alignas(64) float cbuf[CHUNK_J / 32 * 4 * 256];
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t ch = u / istrips, is = u % istrips;
      const uint16_t* ap = is < first_padded ? a + is * 32 * lda : a_pad + (is - first_padded) * 32 * lda_pad;
      const int64_t ld = is < first_padded ? lda : lda_pad;
      const int64_t jb0 = ch * chunk_blocks, jb1 = jb0 + chunk_blocks < jblocks ? jb0 + chunk_blocks : jblocks;
      if (jb0 < jb1) strip(ap, ld, kp, bpp, jb0, jb1, is * 32, o, cbuf);
    }
    _tile_release();
  }
  return 0;
#else
  (void)a, (void)i_rows, (void)k, (void)lda, (void)a_kmajor, (void)b, (void)j_rows, (void)ldb, (void)b_kmajor,
      (void)bias, (void)out, (void)out_dtype, (void)transpose, (void)ldo, (void)threads, (void)accumulate;
  return -1;
#endif
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// float32: C = A · Bᵀ, A [I, K], B [J, K] float32 (or bf16, each element widened exactly to float32 as it is read:
// the chains of the operands' float32 upcasts, zk_gemm_abt_f32_bf16), on FMA units. One element (i, j) is one fused
// multiply-add chain in K order from a zero accumulator: acc = fma(a[i][k], b[j][k], acc) for k = 0, 1, ..., K - 1, then + bias[i]. Every
// element is computed whole by one thread, so its bits depend only on row i of A, row j of B and bias[i]: not on I, J,
// the tile or the thread count — nor on the vector width (AVX-512 and AVX2 run the same chain per element) nor on the
// K blocking (a block's partial sums are stored and reloaded as float32, losslessly). The register tile is the
// BLIS/MKL micro-kernel's: F32_NA vectors of A rows (one k) times a broadcast element of each of F32_RJ rows of B, so
// the accumulators are outputs and nothing is reduced across lanes.
//
// Without a bias, A and B may trade places first (C^T = B · A^T; fma(a, b, c) = fma(b, a, c), so every chain is the
// same): a few rows of A then meet many of B as the few-rows paths below expect, and an [I, J] output becomes [J, I].
// Packed path: A and B are packed once per call by all threads (A in F32_P-row panels [k][F32_P], B per K block of
// F32_KC in F32_RJ-row blocks [nk][F32_RJ]; tails zero). Work unit = (a group of A panels, a chunk of B blocks), one
// thread, units near-equal and their count a multiple of the thread count where the shape allows. Per K block, each B
// block (in L1) runs against the group's panels; the unit's accumulators wait in a per-thread buffer between K blocks,
// and the last K block writes a [J, I] output in place (bias added), an [I, J] one through the buffer's transpose.
#if defined(ZK_F32_AVX512) || defined(ZK_F32_AVX2)
namespace {

#if defined(ZK_F32_AVX512)
constexpr int F32_W = 16, F32_NA = 3, F32_RJ = 8;  // 3 x 8 accumulators + 3 A vectors + 1 broadcast (of 32)
using VF = __m512;
inline VF vf_zero() { return _mm512_setzero_ps(); }
inline VF vf_load(const float* p) { return _mm512_loadu_ps(p); }
inline void vf_store(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF vf_set1(float x) { return _mm512_set1_ps(x); }
inline VF vf_fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vf_add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline __mmask16 vf_mask(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1); }
inline VF vf_load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(vf_mask(n), p); }  // lanes < n
inline void vf_store_n(float* p, VF v, int64_t n) { _mm512_mask_storeu_ps(p, vf_mask(n), v); }
#else
constexpr int F32_W = 8, F32_NA = 2, F32_RJ = 6;  // 2 x 6 accumulators + 2 A vectors + 1 broadcast (of 16)
using VF = __m256;
inline VF vf_zero() { return _mm256_setzero_ps(); }
inline VF vf_load(const float* p) { return _mm256_loadu_ps(p); }
inline void vf_store(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vf_set1(float x) { return _mm256_set1_ps(x); }
inline VF vf_fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vf_add(VF a, VF b) { return _mm256_add_ps(a, b); }
inline __m256i vf_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline VF vf_load_n(const float* p, int64_t n) { return _mm256_maskload_ps(p, vf_mask(n)); }  // lanes < n
inline void vf_store_n(float* p, VF v, int64_t n) { _mm256_maskstore_ps(p, vf_mask(n), v); }
#endif
constexpr int64_t F32_P = F32_NA * F32_W;  // rows of A per register tile
constexpr int64_t F32_IB = 10 * F32_P;     // rows of A per work unit
constexpr int64_t F32_JB = 60 * F32_RJ;    // at most this many rows of B per work unit
constexpr int64_t F32_KC = 192;            // K block
constexpr size_t F32_KEEP = size_t(1) << 24;  // packed words (64 MiB) kept between calls by the calling thread

// Operand elements E: float, or bf16 (uint16_t bits) widened exactly to float as they are read (the value a bf16 ->
// float32 upcast gives), so a bf16 GEMM runs the float32 chains of its upcast operands without storing them
inline float elem(const float* p) { return *p; }
inline float elem(const uint16_t* p) { return zk::bf16_to_float(*p); }
inline VF vf_load(const uint16_t* p) {  // F32_W elements as floats
#if defined(ZK_F32_AVX512)
  return _mm512_castsi512_ps(widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#endif
}
// dst[0..n) = src[0..n) as floats
inline void copy_floats(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}
inline void copy_floats(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + F32_W <= n; i += F32_W) vf_store(dst + i, vf_load(src + i));
  for (; i < n; ++i) dst[i] = elem(src + i);
}

// A panel: dst[kk * F32_P + r] = A(r0 + r, k0 + kk), zero for r >= nr; A(r, k) = a[r * lda + k] (K contiguous) or
// a[k * lda + r] (k-major)
template <typename E>
void pack_a_f32(const E* a, int64_t lda, int kmajor, int64_t r0, int64_t nr, int64_t k0, int64_t nk, float* dst) {
  if (kmajor) {
    if (nr == F32_P) {
      for (int64_t kk = 0; kk < nk; ++kk) copy_floats(dst + kk * F32_P, a + (k0 + kk) * lda + r0, F32_P);
      return;
    }
    for (int64_t kk = 0; kk < nk; ++kk) {
      copy_floats(dst + kk * F32_P, a + (k0 + kk) * lda + r0, nr);
      std::memset(dst + kk * F32_P + nr, 0, static_cast<size_t>(F32_P - nr) * sizeof(float));
    }
    return;
  }
  int64_t r = 0;
#if defined(ZK_F32_AVX512)
  for (; r + 16 <= nr; r += 16) {
    const E* src = a + (r0 + r) * lda + k0;
    int64_t kk = 0;
    for (; kk + 16 <= nk; kk += 16) transpose16(src + kk, lda, reinterpret_cast<uint32_t*>(dst + kk * F32_P + r), F32_P);
    for (; kk < nk; ++kk)
      for (int64_t q = 0; q < 16; ++q) dst[kk * F32_P + r + q] = elem(src + q * lda + kk);
  }
#endif
  for (; r < nr; ++r) {
    const E* src = a + (r0 + r) * lda + k0;
    for (int64_t kk = 0; kk < nk; ++kk) dst[kk * F32_P + r] = elem(src + kk);
  }
  if (nr < F32_P)
    for (int64_t kk = 0; kk < nk; ++kk)
      std::memset(dst + kk * F32_P + nr, 0, static_cast<size_t>(F32_P - nr) * sizeof(float));
}

// B rows [r0, r0 + nr) in blocks of F32_RJ: block q at dst + q * nk * F32_RJ, [nk][F32_RJ], rows past nr zero
template <typename E>
void pack_b_f32(const E* b, int64_t ldb, int kmajor, int64_t r0, int64_t nr, int64_t k0, int64_t nk, float* dst) {
  const int64_t blk = nk * F32_RJ;
  int64_t r = 0;
#if defined(ZK_F32_AVX512)
  static_assert(F32_RJ == 8, "two 8-row blocks per 16x16 transpose");
  if (!kmajor) {
    alignas(64) uint32_t t[16 * 16];
    for (; r + 16 <= nr; r += 16) {
      const E* src = b + (r0 + r) * ldb + k0;
      float* d0 = dst + (r / F32_RJ) * blk;
      float* d1 = d0 + blk;
      int64_t kk = 0;
      for (; kk + 16 <= nk; kk += 16) {
        transpose16(src + kk, ldb, t, 16);
        for (int c = 0; c < 16; ++c) {
          const __m512 v = _mm512_load_ps(reinterpret_cast<const float*>(t + c * 16));
          _mm256_storeu_ps(d0 + (kk + c) * F32_RJ, _mm512_castps512_ps256(v));
          _mm256_storeu_ps(d1 + (kk + c) * F32_RJ,
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        }
      }
      for (; kk < nk; ++kk)
        for (int64_t q = 0; q < 16; ++q) (q < 8 ? d0 : d1)[kk * F32_RJ + q % 8] = elem(src + q * ldb + kk);
    }
  }
#endif
  if (kmajor)  // whole blocks: one row of F32_RJ floats per k, contiguous in both
    for (; r + F32_RJ <= nr; r += F32_RJ) {
      float* d = dst + (r / F32_RJ) * blk;
      const E* src = b + k0 * ldb + r0 + r;
      for (int64_t kk = 0; kk < nk; ++kk) copy_floats(d + kk * F32_RJ, src + kk * ldb, F32_RJ);
    }
  const int64_t nr_pad = (nr + F32_RJ - 1) / F32_RJ * F32_RJ;
  for (; r < nr_pad; ++r) {
    float* d = dst + (r / F32_RJ) * blk + r % F32_RJ;
    if (r >= nr)
      for (int64_t kk = 0; kk < nk; ++kk) d[kk * F32_RJ] = 0.0f;
    else if (kmajor)
      for (int64_t kk = 0; kk < nk; ++kk) d[kk * F32_RJ] = elem(b + (k0 + kk) * ldb + r0 + r);
    else
      for (int64_t kk = 0; kk < nk; ++kk) d[kk * F32_RJ] = elem(b + (r0 + r) * ldb + k0 + kk);
  }
}

// where a unit's last K block leaves its finished elements: straight in a [J, I] output (row stride ldo) at the
// tile's first element, bias (the tile's first i, or null) added, the first ni of the tile's F32_P columns only
struct FinalOut {
  float* out;
  int64_t ldo;
  const float* bias;
  int64_t ni;
};

// acc[q][0..F32_P) (row stride ldc) = (resume ? acc : 0) + the chain over nk steps of ap [nk][F32_P] x bp [nk][F32_RJ]
// for the block's first RJ rows of B; with fin, the results (+ bias) go to fin's output instead of acc
template <int RJ>
void micro_f32(const float* ap, int64_t lap, const float* bp, int64_t nk, float* acc, int64_t ldc, bool resume,
               const FinalOut* fin) {
  if (fin)  // the output's lines on their way while the chain runs
    for (int q = 0; q < RJ; ++q)
      for (int64_t i = 0; i < fin->ni && i < F32_P; i += 16)
        _mm_prefetch(reinterpret_cast<const char*>(fin->out + q * fin->ldo + i), _MM_HINT_ET0);
  VF c[RJ][F32_NA];
  for (int q = 0; q < RJ; ++q)
    for (int v = 0; v < F32_NA; ++v) c[q][v] = resume ? vf_load(acc + q * ldc + v * F32_W) : vf_zero();
  for (int64_t kk = 0; kk < nk; ++kk) {
    VF av[F32_NA];
    for (int v = 0; v < F32_NA; ++v) av[v] = vf_load(ap + kk * lap + v * F32_W);
    for (int q = 0; q < RJ; ++q) {
      const VF bq = vf_set1(bp[kk * F32_RJ + q]);
      for (int v = 0; v < F32_NA; ++v) c[q][v] = vf_fma(av[v], bq, c[q][v]);
    }
  }
  if (!fin) {
    for (int q = 0; q < RJ; ++q)
      for (int v = 0; v < F32_NA; ++v) vf_store(acc + q * ldc + v * F32_W, c[q][v]);
    return;
  }
  for (int v = 0; v < F32_NA; ++v) {
    const int64_t n = fin->ni - v * F32_W < F32_W ? fin->ni - v * F32_W : F32_W;
    if (n <= 0) break;
    const VF bv = fin->bias ? vf_load_n(fin->bias + v * F32_W, n) : vf_zero();
    for (int q = 0; q < RJ; ++q)  // acc + bias: one float32 add (none without a bias)
      vf_store_n(fin->out + q * fin->ldo + v * F32_W, fin->bias ? vf_add(c[q][v], bv) : c[q][v], n);
  }
}

using MicroF32 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, const FinalOut*);
template <int... R>
constexpr std::array<MicroF32, sizeof...(R)> micro_table(std::integer_sequence<int, R...>) {
  return {&micro_f32<R + 1>...};
}
constexpr auto MICRO_F32 = micro_table(std::make_integer_sequence<int, F32_RJ>{});  // [rj - 1]: rj rows of B

// Few rows of B (decode: B = a handful of tokens, A = a weight): the roles swap — the tokens are the vector operand
// (packed once, [k][F32_P], NA vectors used) and the weight's rows are broadcast straight from memory, each row
// streamed once, nothing transposed. fma(a, b, c) = fma(b, a, c), so an element's chain is the same.
// acc[q][0..NA*F32_W) = chain over nk of tok [nk][F32_P] x W row q; W element (q, kk) at w[q * ls + kk] (ROWS: W's
// own K-contiguous rows) or w[kk * ls + q] (k-major)
template <int RJ, int NA, bool ROWS>
void micro_few(const float* tok, const float* w, int64_t ls, int64_t nk, float* acc) {
  VF c[RJ][NA];
  for (int q = 0; q < RJ; ++q)
    for (int v = 0; v < NA; ++v) c[q][v] = vf_zero();
  const float* row[RJ];
  for (int q = 0; q < RJ; ++q) row[q] = w + q * ls;
  for (int64_t kk = 0; kk < nk; ++kk) {
    VF tv[NA];
    for (int v = 0; v < NA; ++v) tv[v] = vf_load(tok + kk * F32_P + v * F32_W);
    for (int q = 0; q < RJ; ++q) {
      const VF wq = vf_set1(ROWS ? row[q][kk] : w[kk * ls + q]);
      for (int v = 0; v < NA; ++v) c[q][v] = vf_fma(tv[v], wq, c[q][v]);
    }
  }
  for (int q = 0; q < RJ; ++q)
    for (int v = 0; v < NA; ++v) vf_store(acc + q * F32_P + v * F32_W, c[q][v]);
}

using MicroFew = void (*)(const float*, const float*, int64_t, int64_t, float*);
template <int NA, bool ROWS, int... R>
constexpr std::array<MicroFew, sizeof...(R)> few_table(std::integer_sequence<int, R...>) {
  return {&micro_few<R + 1, NA, ROWS>...};
}
template <int NA, bool ROWS>
constexpr auto FEW = few_table<NA, ROWS>(std::make_integer_sequence<int, F32_RJ>{});

MicroFew pick_few(int na, bool rows, int rj) {
  if (na == 1) return rows ? FEW<1, true>[rj - 1] : FEW<1, false>[rj - 1];
#if defined(ZK_F32_AVX512)
  if (na == 2) return rows ? FEW<2, true>[rj - 1] : FEW<2, false>[rj - 1];
  return rows ? FEW<3, true>[rj - 1] : FEW<3, false>[rj - 1];
#else
  return rows ? FEW<2, true>[rj - 1] : FEW<2, false>[rj - 1];
#endif
}

constexpr int64_t F32_FEW_ROWS = 8 * F32_RJ;  // rows of A per work unit on the few-rows path

// C = A · Bᵀ for F32_RJ < j_rows <= F32_P (see micro_few); same arguments as zk_gemm_abt_f32
template <typename E>
void gemm_f32_few(const E* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const E* b,
                  int64_t j_rows, int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose, int64_t ldo,
                  int threads) {
  thread_local std::vector<float> tok_buf;
  tok_buf.resize(static_cast<size_t>(k * F32_P));
  float* const tok = tok_buf.data();
  pack_a_f32(b, ldb, b_kmajor, 0, j_rows, 0, k, tok);  // the tokens, [k][F32_P], zero past j_rows
  const int na = static_cast<int>((j_rows + F32_W - 1) / F32_W);
  const int64_t units = (i_rows + F32_FEW_ROWS - 1) / F32_FEW_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && units > 1)
  for (int64_t u = 0; u < units; ++u) {
    alignas(64) float acc[F32_RJ * F32_P];
    const int64_t i_end = (u + 1) * F32_FEW_ROWS < i_rows ? (u + 1) * F32_FEW_ROWS : i_rows;
    for (int64_t i = u * F32_FEW_ROWS; i < i_end; i += F32_RJ) {
      const int rj = static_cast<int>(i_end - i < F32_RJ ? i_end - i : F32_RJ);
      if constexpr (std::is_same_v<E, float>) {
        pick_few(na, !a_kmajor, rj)(tok, a_kmajor ? a + i : a + i * lda, lda, k, acc);
      } else {  // bf16: the group's rows of A widened once, into L1 (the broadcasts then load floats)
        thread_local std::vector<float> wide;
        wide.resize(static_cast<size_t>(F32_RJ * k));
        float* const wf = wide.data();
        if (a_kmajor)
          for (int64_t kk = 0; kk < k; ++kk) copy_floats(wf + kk * F32_RJ, a + kk * lda + i, rj);
        else
          for (int q = 0; q < rj; ++q) copy_floats(wf + q * k, a + (i + q) * lda, k);
        pick_few(na, !a_kmajor, rj)(tok, wf, a_kmajor ? F32_RJ : k, k, acc);
      }
      for (int q = 0; q < rj; ++q)
        for (int64_t j = 0; j < j_rows; ++j) {
          const float v = bias ? acc[q * F32_P + j] + bias[i + q] : acc[q * F32_P + j];
          out[transpose ? j * ldo + i + q : (i + q) * ldo + j] = v;
        }
    }
  }
}

#if defined(ZK_F32_AVX512)
#ifndef ZK_ROWS_AHEAD
#define ZK_ROWS_AHEAD 128
#endif
// 16 elements as floats, lanes outside m zero (and not read)
inline __m512 ld16_mask(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 ld16_mask(__mmask16 m, const uint16_t* p) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
#else
  alignas(32) uint16_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = (m >> i) & 1 ? p[i] : 0;
  const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
#endif
  return _mm512_castsi512_ps(widen_bf16(h));
}
// Finished chains of rows r0 .. r0 + nr - 1 of A (lanes of v, nr <= 16, m their mask) for row t of B: + bias[r],
// then out[t][r] (transpose) or out[r][t]
inline void store_rows(__m512 v, const float* bias, int64_t r0, int64_t nr, __mmask16 m, int t, float* out,
                       int transpose, int64_t ldo) {
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + r0));
  if (transpose) {
    _mm512_mask_storeu_ps(out + t * ldo + r0, m, v);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int64_t r = 0; r < nr; ++r) out[(r0 + r) * ldo + t] = tmp[r];
  }
}
// At most F32_RJ rows of B (single-sequence decode, and its backward dX = dY W): A is streamed once, never packed.
// 16 rows of A at a time, one vector per k of the 16 rows' elements: a k-major A (W read as Wᵀ) holds them
// contiguously; a K-contiguous A (a weight) is read 16 k at a time and turned in registers (transpose16). So each lane
// carries one output element's chain: acc[t][r] = fma(a[i0 + r][k], b[t][k], acc[t][r]) for k = 0, 1, ...: the same
// chain as micro_f32's. T = rows of B (a template parameter, so the accumulators stay in registers).
template <int T, typename E>
void rows_block(const E* a, int64_t i0, int64_t ni, int64_t k, int64_t lda, int a_kmajor, const float* b,
                int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose, int64_t ldo) {
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) uint32_t w[256];
  alignas(64) float part[256];
  const int64_t k16 = k / 16 * 16;
  const __mmask16 m = static_cast<__mmask16>((1u << ni) - 1);
  (void)a_kmajor;  // K-contiguous A here; a k-major A: rows_block_kmajor
  for (int64_t k0 = 0; k0 < k; k0 += 16) {
    const int64_t nk = k0 < k16 ? 16 : k - k0;
    if (ni == 16 && nk == 16) {
      if (k0 + ZK_ROWS_AHEAD < k)  // 16 row streams: ahead of the hardware prefetcher
        for (int r = 0; r < 16; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(a + (i0 + r) * lda + k0 + ZK_ROWS_AHEAD), _MM_HINT_T0);
      transpose16(a + i0 * lda + k0, lda, w, 16);
    } else {  // a partial block, zero-padded (the padded k are never added: the loop below stops at nk)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t c = 0; c < 16; ++c) part[r * 16 + c] = r < ni && c < nk ? elem(a + (i0 + r) * lda + k0 + c) : 0.0f;
      transpose16(reinterpret_cast<const uint32_t*>(part), 16, w, 16);
    }
    if (nk == 16 && !b_kmajor) {
      for (int kk = 0; kk < 16; ++kk) {
        const __m512 col = _mm512_load_ps(reinterpret_cast<const float*>(w + kk * 16));
        for (int t = 0; t < T; ++t) acc[t] = _mm512_fmadd_ps(col, _mm512_set1_ps(b[t * ldb + k0 + kk]), acc[t]);
      }
    } else {
      for (int64_t kk = 0; kk < nk; ++kk) {
        const __m512 col = _mm512_load_ps(reinterpret_cast<const float*>(w + kk * 16));
        for (int t = 0; t < T; ++t) {
          const float x = b_kmajor ? b[(k0 + kk) * ldb + t] : b[t * ldb + k0 + kk];
          acc[t] = _mm512_fmadd_ps(col, _mm512_set1_ps(x), acc[t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) store_rows(acc[t], bias, i0, ni, m, t, out, transpose, ldo);
}

#ifndef ZK_KMAJOR_AHEAD
#define ZK_KMAJOR_AHEAD 8
#endif
// k-major A: V vectors (16 V rows of A) per block, each k's row segment loaded as it lies (16 V contiguous floats)
template <int T, int V, typename E>
void rows_block_kmajor(const E* a, int64_t i0, int64_t ni, int64_t k, int64_t lda, int, const float* b,
                       int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose, int64_t ldo) {
  __m512 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = _mm512_setzero_ps();
  __mmask16 m[V];
  for (int v = 0; v < V; ++v) {
    const int64_t n = ni - 16 * v;
    m[v] = static_cast<__mmask16>(n >= 16 ? 0xffff : (n <= 0 ? 0 : (1u << n) - 1));
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    if (kk + ZK_KMAJOR_AHEAD < k)  // the next rows' segments: each k's row lies in another 4 KiB page
      for (int v = 0; v < V; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(a + (kk + ZK_KMAJOR_AHEAD) * lda + i0 + 16 * v), _MM_HINT_T0);
    __m512 col[V];
    for (int v = 0; v < V; ++v) col[v] = ld16_mask(m[v], a + kk * lda + i0 + 16 * v);
    for (int t = 0; t < T; ++t) {
      const __m512 x = _mm512_set1_ps(b_kmajor ? b[kk * ldb + t] : b[t * ldb + kk]);
      for (int v = 0; v < V; ++v) acc[t][v] = _mm512_fmadd_ps(col[v], x, acc[t][v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t r0 = i0 + 16 * v, nr = ni - 16 * v;
    if (nr <= 0) break;
    for (int t = 0; t < T; ++t) store_rows(acc[t][v], bias, r0, nr < 16 ? nr : 16, m[v], t, out, transpose, ldo);
  }
}
#ifndef ZK_STREAM_AHEAD
#define ZK_STREAM_AHEAD 4
#endif
constexpr int F32_STREAM_T = 2;             // rows of B up to which a k-major A is streamed row by row
constexpr int64_t F32_STREAM_COLS = 512;   // rows of A (output columns) per unit of rows_stream_kmajor
// k-major A and T <= F32_STREAM_T rows of B (a decode token's dX = dY W): the unit's F32_STREAM_COLS outputs keep
// their accumulators in L1 (float32, stored and reloaded losslessly: the same chains, acc = fma(a, x, acc) in k
// order) while each k's segment of A is read as one contiguous 2 KiB run — A streamed row after row, instead of in
// the 128-column strips of rows_block_kmajor (~15% faster at K = N = 1024, M = 1 and 2 on the 2-core Xeon)
template <int T, typename E>
void rows_stream_kmajor(const E* a, int64_t i0, int64_t ni, int64_t k, int64_t lda, int, const float* b,
                        int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose, int64_t ldo) {
  alignas(64) float acc[T][F32_STREAM_COLS];
  const int64_t nv = (ni + 15) / 16;
  const __mmask16 tail = vf_mask(ni - 16 * (nv - 1));
  for (int t = 0; t < T; ++t)
    for (int64_t v = 0; v < nv; ++v) _mm512_store_ps(acc[t] + 16 * v, _mm512_setzero_ps());
  for (int64_t kk = 0; kk < k; ++kk) {
    const E* row = a + kk * lda + i0;
    const E* ahead = a + (kk + ZK_STREAM_AHEAD < k ? kk + ZK_STREAM_AHEAD : kk) * lda + i0;
    __m512 x[T];
    for (int t = 0; t < T; ++t) x[t] = _mm512_set1_ps(b_kmajor ? b[kk * ldb + t] : b[t * ldb + kk]);
    for (int64_t v = 0; v < nv; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * v), _MM_HINT_T0);
      const __m512 col = v + 1 < nv ? vf_load(row + 16 * v) : ld16_mask(tail, row + 16 * v);
      for (int t = 0; t < T; ++t)
        _mm512_store_ps(acc[t] + 16 * v, _mm512_fmadd_ps(col, x[t], _mm512_load_ps(acc[t] + 16 * v)));
    }
  }
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t r0 = i0 + 16 * v, nr = ni - 16 * v < 16 ? ni - 16 * v : 16;
    for (int t = 0; t < T; ++t)
      store_rows(_mm512_load_ps(acc[t] + 16 * v), bias, r0, nr, vf_mask(nr), t, out, transpose, ldo);
  }
}

// T x V accumulators <= 16, or 1 vector for 9..F32_KMAJOR_T rows of B
constexpr int kmajor_vectors(int t) { return t <= 2 ? 8 : (t <= 4 ? 4 : (t <= 8 ? 2 : 1)); }
constexpr int F32_KMAJOR_T = 24;  // rows of B per pass of a k-major A (24 accumulators, 1 load, 24 broadcasts)

template <typename E>
using RowsBlock = void (*)(const E*, int64_t, int64_t, int64_t, int64_t, int, const float*, int64_t, int,
                           const float*, float*, int, int64_t);
template <typename E, int... R>
constexpr std::array<RowsBlock<E>, sizeof...(R)> rows_table(std::integer_sequence<int, R...>) {
  return {&rows_block<R + 1, E>...};
}
template <typename E>  // [t - 1]: t rows of B
constexpr auto ROWS_BLOCK = rows_table<E>(std::make_integer_sequence<int, F32_RJ>{});
template <typename E, int... R>
constexpr std::array<RowsBlock<E>, sizeof...(R)> kmajor_table(std::integer_sequence<int, R...>) {
  return {&rows_block_kmajor<R + 1, kmajor_vectors(R + 1), E>...};
}
template <typename E>
constexpr auto ROWS_BLOCK_KMAJOR = kmajor_table<E>(std::make_integer_sequence<int, F32_KMAJOR_T>{});
template <typename E>
constexpr std::array<RowsBlock<E>, F32_STREAM_T> ROWS_STREAM_KMAJOR = {&rows_stream_kmajor<1, E>,
                                                                        &rows_stream_kmajor<2, E>};

template <typename E>
void gemm_f32_rows(const E* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const E* b,
                   int64_t j_rows, int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose, int64_t ldo,
                   int threads) {
  // a k-major A takes up to F32_P rows of B in near-equal passes of at most F32_KMAJOR_T (A read once per pass); a
  // pass of at most F32_STREAM_T rows (only j_rows <= F32_STREAM_T makes one) streams A row by row
  const int64_t passes = a_kmajor ? (j_rows + F32_KMAJOR_T - 1) / F32_KMAJOR_T : 1;
  const int64_t per_pass = (j_rows + passes - 1) / passes;
  // B (a few rows) as floats: bf16 rows widened once per call, K-contiguous, so that its broadcasts load floats
  const float* bf = nullptr;
  if constexpr (std::is_same_v<E, float>) {
    bf = b;
  } else {
    thread_local std::vector<float> wide;
    wide.resize(static_cast<size_t>(j_rows * k));
    for (int64_t j = 0; j < j_rows; ++j)
      if (b_kmajor)
        for (int64_t kk = 0; kk < k; ++kk) wide[j * k + kk] = elem(b + kk * ldb + j);
      else
        copy_floats(wide.data() + j * k, b + j * ldb, k);
    bf = wide.data(), ldb = k, b_kmajor = 0;
  }
  for (int64_t t0 = 0; t0 < j_rows; t0 += per_pass) {
    const int64_t nt = j_rows - t0 < per_pass ? j_rows - t0 : per_pass;
    const bool stream = a_kmajor && nt <= F32_STREAM_T;
    const int64_t rows = stream ? F32_STREAM_COLS : a_kmajor ? 16 * kmajor_vectors(static_cast<int>(nt)) : 16;  // of A
    const int64_t blocks = (i_rows + rows - 1) / rows;
    const RowsBlock<E> fn = stream     ? ROWS_STREAM_KMAJOR<E>[nt - 1]
                            : a_kmajor ? ROWS_BLOCK_KMAJOR<E>[nt - 1]
                                       : ROWS_BLOCK<E>[nt - 1];
    const float* bt = b_kmajor ? bf + t0 : bf + t0 * ldb;  // the pass's rows of B
    float* ot = transpose ? out + t0 * ldo : out + t0;   // and of the output
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t i0 = blk * rows, ni = i_rows - i0 < rows ? i_rows - i0 : rows;
      fn(a, i0, ni, k, lda, a_kmajor, bt, ldb, b_kmajor, bias, ot, transpose, ldo);
    }
  }
}
#endif

// The packed operands' buffer (at least `words` floats): the calling thread's, kept between calls, up to F32_KEEP
// words; beyond that `big` (the caller's, freed with the call)
float* f32_pack_buffer(size_t words, HugeBuffer& big) {
  thread_local HugeBuffer keep;
  return (words <= F32_KEEP ? keep : big).get(words);
}

// Inside a parallel region (orphaned worksharing): A into F32_P-row panels [ipanels][k][F32_P] at apa, B per kc-wide
// K block into F32_RJ-row blocks [kblock][jblocks][nk][F32_RJ] at bpa (a chunk's slice of a K block contiguous);
// tails zero. Each thread packs a share; the last loop's barrier ends with everything packed.
template <typename E>
void pack_f32_operands(const E* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const E* b,
                       int64_t j_rows, int64_t ldb, int b_kmajor, int64_t kc, float* apa, float* bpa) {
  const int64_t ipanels = (i_rows + F32_P - 1) / F32_P, jblocks = (j_rows + F32_RJ - 1) / F32_RJ;
  constexpr int64_t PACK_J = 48;  // rows of B per packing task: whole F32_RJ blocks, whole 16-row transposes
  const int64_t jtasks = (j_rows + PACK_J - 1) / PACK_J;
#pragma omp for schedule(static) nowait
  for (int64_t p = 0; p < ipanels; ++p) {
    const int64_t r0 = p * F32_P;
    pack_a_f32(a, lda, a_kmajor, r0, i_rows - r0 < F32_P ? i_rows - r0 : F32_P, 0, k, apa + r0 * k);
  }
#pragma omp for schedule(static)
  for (int64_t t = 0; t < jtasks; ++t) {
    const int64_t r0 = t * PACK_J, nr = j_rows - r0 < PACK_J ? j_rows - r0 : PACK_J;
    for (int64_t k0 = 0; k0 < k; k0 += kc) {
      const int64_t nk = k - k0 < kc ? k - k0 : kc;
      pack_b_f32(b, ldb, b_kmajor, r0, nr, k0, nk, bpa + k0 * jblocks * F32_RJ + r0 * nk);
    }
  }
}

// out [J, I] = the TP-aligned tree over K blocks of k_block columns (shared_numerics.tensor_parallel.block_tree_sum):
// block b's partial is each element's FMA chain from zero over its k_block columns (zk_gemm_abt_f32's element on that
// K range); with n = odd * 2^t blocks, each run of odd consecutive partials is added left to right, then adjacent
// pairs level by level (a binary counter: run r merges with the stacked left sibling while bit 0 of r is set). One
// register tile (F32_P rows of A x F32_RJ rows of B) at a time, its tree in a per-tile stack, so nothing of size
// blocks x J x I is stored; every element computed by one thread (the bits depend on neither the thread count nor
// the shape).
void gemm_f32_ktree(const float* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const float* b,
                    int64_t j_rows, int64_t ldb, int b_kmajor, float* out, int64_t ldo, int threads, int64_t k_block) {
  const int64_t blocks = k / k_block;
  int64_t odd = blocks, levels = 0;
  while (odd % 2 == 0) odd /= 2, ++levels;
  const int64_t ipanels = (i_rows + F32_P - 1) / F32_P, jblocks = (j_rows + F32_RJ - 1) / F32_RJ;
  const size_t a_words = static_cast<size_t>(ipanels * F32_P * k), b_words = static_cast<size_t>(jblocks * F32_RJ * k);
  HugeBuffer big;
  float* const apa = f32_pack_buffer(a_words + b_words, big);
  float* const bpa = apa + a_words;  // [block][jblocks][k_block][F32_RJ]
  const int64_t tiles = ipanels * jblocks;
  constexpr int64_t T = F32_RJ * F32_P;  // floats of one register tile, [F32_RJ][F32_P]
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    pack_f32_operands(a, i_rows, k, lda, a_kmajor, b, j_rows, ldb, b_kmajor, k_block, apa, bpa);
    std::vector<float> scratch(static_cast<size_t>(T * (levels + 3)) + 16);
    float* const part = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    float* const run = part + T;
    float* const stack = run + T;  // [levels + 1][T]
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t q = tile % jblocks, p = tile / jblocks;
      const int64_t rj = j_rows - q * F32_RJ < F32_RJ ? j_rows - q * F32_RJ : F32_RJ;
      const int64_t i0 = p * F32_P, ni = i_rows - i0 < F32_P ? i_rows - i0 : F32_P;
      int64_t runs = 0;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const float* ar = apa + p * F32_P * k + blk * k_block * F32_P;
        const float* bk = bpa + blk * k_block * jblocks * F32_RJ + q * k_block * F32_RJ;
        const bool first = blk % odd == 0;
        MICRO_F32[rj - 1](ar, F32_P, bk, k_block, first ? run : part, F32_P, false, nullptr);
        if (!first)  // the run, left to right: run = run + part
          for (int64_t e = 0; e < rj * F32_P; e += F32_W) vf_store(run + e, vf_add(vf_load(run + e), vf_load(part + e)));
        if (blk % odd != odd - 1) continue;
        int64_t level = 0;  // the run joins the tree: left sibling + right, while this run index closes a pair
        for (int64_t r = runs; r & 1; r >>= 1, ++level) {
          const float* left = stack + level * T;
          for (int64_t e = 0; e < rj * F32_P; e += F32_W) vf_store(run + e, vf_add(vf_load(left + e), vf_load(run + e)));
        }
        std::memcpy(stack + level * T, run, static_cast<size_t>(rj * F32_P) * sizeof(float));
        ++runs;
      }
      const float* root = stack + levels * T;  // [rj][F32_P]: out rows j, columns i
      for (int64_t jj = 0; jj < rj; ++jj)
        std::memcpy(out + (q * F32_RJ + jj) * ldo + i0, root + jj * F32_P, static_cast<size_t>(ni) * sizeof(float));
    }
  }  // omp parallel
}

// C = A · Bᵀ on the FMA units (see above; the arguments of zk_gemm_abt_f32), operands of element type E
template <typename E>
void gemm_f32(const E* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const E* b, int64_t j_rows,
              int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose, int64_t ldo, int threads,
              int accumulate) {
  // Without a bias, A and B may trade places (C^T = B · A^T: fma(a, b, c) = fma(b, a, c), the same chains): so that
  // few rows of A meet many of B as the decode paths' few rows of B, and otherwise so that the output is [J, I], which
  // the packed path writes in place
  const bool few_a = i_rows < j_rows && i_rows <= F32_P, few_b = j_rows < i_rows && j_rows <= F32_P;
  if (!bias && (few_a || (!transpose && !few_b))) {
    std::swap(a, b), std::swap(i_rows, j_rows), std::swap(lda, ldb), std::swap(a_kmajor, b_kmajor);
    transpose = !transpose;
  }
#if defined(ZK_F32_AVX512)
  if (!accumulate && (j_rows <= F32_RJ || (a_kmajor && j_rows <= F32_P)) && i_rows >= 16) {
    gemm_f32_rows(a, i_rows, k, lda, a_kmajor, b, j_rows, ldb, b_kmajor, bias, out, transpose, ldo, threads);
    return;
  }
#endif
  if (!accumulate && j_rows > F32_RJ && j_rows <= F32_P && i_rows >= F32_FEW_ROWS) {  // (fewer rows: the packed path is faster)
    gemm_f32_few(a, i_rows, k, lda, a_kmajor, b, j_rows, ldb, b_kmajor, bias, out, transpose, ldo, threads);
    return;
  }
  // A and B packed once per call, shared by the threads: A in F32_P-row panels [ipanels][k][F32_P]; B per K block
  // in F32_RJ-row blocks, [kblock][jblocks][nk][F32_RJ] (a chunk's slice of a K block is contiguous); tails zero
  const int64_t ipanels = (i_rows + F32_P - 1) / F32_P, jblocks = (j_rows + F32_RJ - 1) / F32_RJ;
  const size_t a_words = static_cast<size_t>(ipanels * F32_P * k), b_words = static_cast<size_t>(jblocks * F32_RJ * k);
  HugeBuffer big;
  float* const apa = f32_pack_buffer(a_words + b_words, big);
  float* const bpa = apa + a_words;
  // units = groups of A panels x chunks of B blocks, near-equal; their count a multiple of the threads where the
  // shape allows, so that threads get near-equal work (static schedule)
  int64_t groups = (ipanels + F32_IB / F32_P - 1) / (F32_IB / F32_P);
  int64_t chunks = (jblocks + F32_JB / F32_RJ - 1) / (F32_JB / F32_RJ);
  while (threads > 1 && (groups * chunks) % threads != 0) {
    if (groups < ipanels)
      ++groups;
    else if (chunks < jblocks)
      ++chunks;
    else
      break;
  }
  const int64_t panels_per = (ipanels + groups - 1) / groups, blocks_per = (jblocks + chunks - 1) / chunks;
  const int64_t units = chunks * groups;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    pack_f32_operands(a, i_rows, k, lda, a_kmajor, b, j_rows, ldb, b_kmajor, F32_KC, apa, bpa);
    // (the implicit barrier: every panel and block packed)
#pragma omp for schedule(static)
  for (int64_t u = 0; u < units; ++u) {
    thread_local HugeBuffer acc_buf;
    const int64_t ch = u / groups, gi = u % groups;
    const int64_t q0 = ch * blocks_per, q1 = q0 + blocks_per < jblocks ? q0 + blocks_per : jblocks;
    const int64_t p0 = gi * panels_per, p1 = p0 + panels_per < ipanels ? p0 + panels_per : ipanels;
    if (q0 >= q1 || p0 >= p1) continue;
    const int64_t j0 = q0 * F32_RJ, nj = (q1 * F32_RJ < j_rows ? q1 * F32_RJ : j_rows) - j0;
    const int64_t i0 = p0 * F32_P, ni = (p1 * F32_P < i_rows ? p1 * F32_P : i_rows) - i0;
    const int64_t nip = (p1 - p0) * F32_P, njp = (q1 - q0) * F32_RJ;
    float* const acc = acc_buf.get(static_cast<size_t>(njp * nip));  // acc[j][i], row stride nip
    if (accumulate) {  // the chains go on from out's values (padding: zero, never written back)
      std::memset(acc, 0, static_cast<size_t>(njp * nip) * sizeof(float));
      if (transpose) {
        for (int64_t j = 0; j < nj; ++j)
          std::memcpy(acc + j * nip, out + (j0 + j) * ldo + i0, static_cast<size_t>(ni) * sizeof(float));
      } else {
        int64_t i = 0;
#if defined(ZK_F32_AVX512)
        for (; i + 16 <= ni; i += 16) {
          int64_t j = 0;
          for (; j + 16 <= nj; j += 16)
            transpose16(reinterpret_cast<const uint32_t*>(out + (i0 + i) * ldo + j0 + j), ldo,
                        reinterpret_cast<uint32_t*>(acc + j * nip + i), nip);
          for (; j < nj; ++j)
            for (int64_t q = 0; q < 16; ++q) acc[j * nip + i + q] = out[(i0 + i + q) * ldo + j0 + j];
        }
#endif
        for (; i < ni; ++i)
          for (int64_t j = 0; j < nj; ++j) acc[j * nip + i] = out[(i0 + i) * ldo + j0 + j];
      }
    }
    for (int64_t k0 = 0; k0 < k; k0 += F32_KC) {
      const int64_t nk = k - k0 < F32_KC ? k - k0 : F32_KC;
      const float* bk = bpa + k0 * jblocks * F32_RJ;  // this K block's B blocks, [jblocks][nk][F32_RJ]
      for (int64_t q = q0; q < q1; ++q) {  // one B block at a time, kept in L1 over the group's A panels
        const int64_t rj = j_rows - q * F32_RJ < F32_RJ ? j_rows - q * F32_RJ : F32_RJ;
        for (int64_t p = p0; p < p1; ++p) {
          const float* ar = apa + p * F32_P * k + k0 * F32_P;
          const int64_t ic = p * F32_P;  // the panel's first row of A
          // a [J, I] output takes the last K block's results in place (no pass over acc afterwards)
          const FinalOut fin{out + q * F32_RJ * ldo + ic, ldo, bias ? bias + ic : nullptr, i_rows - ic};
          MICRO_F32[rj - 1](ar, F32_P, bk + q * nk * F32_RJ, nk, acc + (q - q0) * F32_RJ * nip + (p - p0) * F32_P,
                            nip, k0 > 0 || accumulate, transpose && k0 + nk == k ? &fin : nullptr);
        }
      }
    }
    // element (j, i) of the unit: acc + bias, one float32 add (none without a bias)
    const auto value = [&](int64_t j, int64_t i) { return bias ? acc[j * nip + i] + bias[i0 + i] : acc[j * nip + i]; };
    if (!transpose) {  // out [i_rows, j_rows]: acc's transpose, 16x16 blocks where whole (a [J, I] output: written
      // by the last K block)
      int64_t jb = 0;
#if defined(ZK_F32_AVX512)
      for (; jb + 16 <= nj; jb += 16) {
        int64_t i16 = 0;
        for (; i16 + 16 <= ni; i16 += 16) {
          float* o = out + (i0 + i16) * ldo + j0 + jb;
          transpose16(reinterpret_cast<const uint32_t*>(acc + jb * nip + i16), nip, reinterpret_cast<uint32_t*>(o),
                      ldo);
          if (bias)
            for (int64_t i = 0; i < 16; ++i)
              _mm512_storeu_ps(o + i * ldo,
                               _mm512_add_ps(_mm512_loadu_ps(o + i * ldo), _mm512_set1_ps(bias[i0 + i16 + i])));
        }
        for (int64_t i = i16; i < ni; ++i)
          for (int64_t j = jb; j < jb + 16; ++j) out[(i0 + i) * ldo + j0 + j] = value(j, i);
      }
#endif
      for (int64_t i = 0; i < ni; ++i)
        for (int64_t j = jb; j < nj; ++j) out[(i0 + i) * ldo + j0 + j] = value(j, i);
    }
  }
  }  // omp parallel
}

}  // namespace
#endif

namespace {
// the entry points' body: gemm_f32 where this build has the FMA kernel (0), else -1
template <typename E>
int gemm_f32_entry(const E* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const E* b, int64_t j_rows,
                   int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose, int64_t ldo, int threads,
                   int accumulate) {
#if defined(ZK_F32_AVX512) || defined(ZK_F32_AVX2)
  gemm_f32(a, i_rows, k, lda, a_kmajor, b, j_rows, ldb, b_kmajor, bias, out, transpose, ldo, threads, accumulate);
  return 0;
#else
  (void)a, (void)i_rows, (void)k, (void)lda, (void)a_kmajor, (void)b, (void)j_rows, (void)ldb, (void)b_kmajor,
      (void)bias, (void)out, (void)transpose, (void)ldo, (void)threads, (void)accumulate;
  return -1;
#endif
}
}  // namespace

extern "C" {

int zk_gemm_has_f32() {
#if defined(ZK_F32_AVX512) || defined(ZK_F32_AVX2)
  return 1;
#else
  return 0;
#endif
}

// out [J, I] (row stride ldo) = the TP-aligned tree over k_block-wide K blocks of B · Aᵀ's partials (gemm_f32_ktree;
// a, b as zk_gemm_abt_f32's). Returns 0, or -1 without the float32 kernel in this build or k_block not dividing k.
int zk_gemm_f32_ktree(const float* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const float* b,
                      int64_t j_rows, int64_t ldb, int b_kmajor, float* out, int64_t ldo, int threads,
                      int64_t k_block) {
#if defined(ZK_F32_AVX512) || defined(ZK_F32_AVX2)
  if (k_block <= 0 || k % k_block) return -1;
  gemm_f32_ktree(a, i_rows, k, lda, a_kmajor, b, j_rows, ldb, b_kmajor, out, ldo, threads, k_block);
  return 0;
#else
  (void)a, (void)i_rows, (void)k, (void)lda, (void)a_kmajor, (void)b, (void)j_rows, (void)ldb, (void)b_kmajor,
      (void)out, (void)ldo, (void)threads, (void)k_block;
  return -1;
#endif
}

// C = A · Bᵀ in float32 (see above). a: [i_rows, k], row stride lda (a_kmajor: [k, i_rows], row stride lda); b:
// [j_rows, k] likewise; bias: i_rows or null; out: [i_rows, j_rows] (transpose = 0) or [j_rows, i_rows] (1), row
// stride ldo. accumulate (no bias): out += A · Bᵀ as the continuation of each element's chain (its accumulator
// starts from out's value instead of zero), so calls on consecutive K ranges leave the bits of one call on their
// concatenation. Returns 0, or -1 without AVX-512 or AVX2 + FMA in this build.
int zk_gemm_abt_f32(const float* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const float* b,
                    int64_t j_rows, int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose,
                    int64_t ldo, int threads, int accumulate) {
  return gemm_f32_entry(a, i_rows, k, lda, a_kmajor, b, j_rows, ldb, b_kmajor, bias, out, transpose, ldo, threads,
                        accumulate);
}

// The same with bf16 operands (uint16_t bits; a, b as above): each element read is widened exactly to float32 and
// enters the float32 chain, so the result is bit for bit zk_gemm_abt_f32 on the operands' float32 upcasts. float32
// output. Returns 0, or -1 without AVX-512 or AVX2 + FMA in this build.
int zk_gemm_abt_f32_bf16(const uint16_t* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const uint16_t* b,
                         int64_t j_rows, int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose,
                         int64_t ldo, int threads, int accumulate) {
  return gemm_f32_entry(a, i_rows, k, lda, a_kmajor, b, j_rows, ldb, b_kmajor, bias, out, transpose, ldo, threads,
                        accumulate);
}

}  // extern "C"
