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
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define ZK_F32_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ZK_F32_AVX2 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define ZK_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__)
namespace {

// 16x16 transpose of 32-bit words: dst[c][r] = src[r][c]; rows of src `ss` words apart, of dst `ds` words apart
inline void transpose16(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ss);
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
  for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + c * ds, r[c]);  // r[c] = column c
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

struct Out {
  void* ptr;
  int dtype;  // 0 float32, 1 bf16
  int transpose;
  int64_t ldo;
  const float* bias;
  int64_t i_rows, j_rows;
};

// one 16x16 float32 tile c[ii][jj] = C[i0 + ii][j0 + jj] -> the output (bias, rounding, layout, bounds)
inline void write_tile(const float* c, int64_t i0, int64_t j0, const Out& o) {
  const int64_t ni = o.i_rows - i0 < 16 ? o.i_rows - i0 : 16;
  const int64_t nj = o.j_rows - j0 < 16 ? o.j_rows - j0 : 16;
  if (ni <= 0 || nj <= 0) return;
  alignas(64) float t[256];
  const float* rows = c;
  int64_t nr = ni, nc = nj, r0 = i0, c0 = j0;
  if (o.transpose) {  // rows of the output are j, its columns i
    transpose16(reinterpret_cast<const uint32_t*>(c), 16, reinterpret_cast<uint32_t*>(t), 16);
    rows = t;
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

// C rows i0..i0+31 (a: 32 rows, stride lda; kp = padded K) x B blocks jb0..jb1 (pairs, a lone last block alone).
// K in blocks of KC: the A strip's block (32 x KC bf16) stays in L1 while every B pair of the chunk passes over it;
// the float32 accumulators wait in c between K blocks (a tile store and load move bits unchanged). A finished pair's
// output is written while the next pair's first products run (vector work beside the tile unit).
void strip(const uint16_t* a, int64_t lda, int64_t kp, const uint32_t* bp, int64_t jb0, int64_t jb1, int64_t i0,
           const Out& o, float* c) {
  const int64_t kp2 = kp / 2;
  int64_t pending = -1;  // a finished pair (its first B block) whose output is not written yet
  auto flush = [&]() {
    if (pending < 0) return;
    const float* cc = c + (pending - jb0) * 2 * 256;
    write_tile(cc, i0, pending * 16, o);
    write_tile(cc + 256, i0 + 16, pending * 16, o);
    if (pending + 1 < jb1) {
      write_tile(cc + 512, i0, pending * 16 + 16, o);
      write_tile(cc + 768, i0 + 16, pending * 16 + 16, o);
    }
    pending = -1;
  };
  for (int64_t kb = 0; kb < kp; kb += KC) {
    const int64_t ke = kb + KC < kp ? kb + KC : kp;
    for (int64_t jb = jb0; jb < jb1; jb += 2) {
      const bool two = jb + 1 < jb1;
      float* cc = c + (jb - jb0) * 2 * 256;  // 4 tiles of this pair: [i 0-15, j 0-15], [i 16-31, j 0-15], then j 16-31
      const uint32_t* b0 = bp + jb * kp2 * 16;
      const uint32_t* b1 = b0 + kp2 * 16;
      if (kb == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
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
          if (k == kb) flush();
        }
      } else {
        for (int64_t k = kb; k < ke; k += 32) {
          _tile_loadd(4, a + k, lda * 2);
          _tile_loadd(5, a + 16 * lda + k, lda * 2);
          _tile_loadd(6, b0 + k * 8, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          if (k == kb) flush();
        }
      }
      _tile_stored(0, cc, 64);
      _tile_stored(1, cc + 256, 64);
      _tile_stored(2, cc + 512, 64);
      _tile_stored(3, cc + 768, 64);
      if (ke == kp) pending = jb;
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
// (out_dtype 0) or bf16 (1). The layouts change only where operands are read from, never the arithmetic. Returns 0,
// or -1 when this build has no AMX.
int zk_gemm_abt_bf16(const uint16_t* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const uint16_t* b,
                     int64_t j_rows, int64_t ldb, int b_kmajor, const float* bias, void* out, int out_dtype,
                     int transpose, int64_t ldo, int threads) {
#ifdef ZK_HAVE_AMX
  if (!zk_gemm_has_amx()) return -1;
  const int64_t kp = (k + 31) / 32 * 32;
  const int64_t jblocks = (j_rows + 15) / 16;
  // packed operands live in per-calling-thread buffers kept between calls (a fresh allocation's page faults and
  // zero fill cost as much as the packing); the packers write every word of them
  thread_local std::vector<uint32_t> bp;
  const size_t words = static_cast<size_t>(jblocks) * (kp / 2) * 16;
  if (bp.size() < words) bp.resize(words);
  uint32_t* const bpp = bp.data();  // (inside the parallel region `bp` would name each OpenMP thread's own buffer)
  if (b_kmajor)
    pack_b_kmajor(b, j_rows, k, ldb, kp / 2, jblocks, bpp, threads);
  else
    pack_b(b, j_rows, k, ldb, kp / 2, jblocks, bpp, threads);
  // A straight from memory when its 32-row strips and K steps are whole; else a zero-padded copy of what is not
  const int64_t istrips = (i_rows + 31) / 32;
  thread_local std::vector<uint16_t> a_buf;
  const int64_t lda_pad = kp;
  const int64_t first_padded = (!a_kmajor && k == kp) ? i_rows / 32 : 0;  // strips from here on read a_pad
  uint16_t* a_pad = nullptr;
  if (first_padded < istrips) {
    const int64_t rows = (istrips - first_padded) * 32;
    if (a_buf.size() < static_cast<size_t>(rows * kp)) a_buf.resize(static_cast<size_t>(rows * kp));
    a_pad = a_buf.data();
    if (a_kmajor) {
      pack_a_kmajor(a, i_rows, k, lda, kp, rows / 16, a_pad, threads);
    } else {
      std::memset(a_pad, 0, static_cast<size_t>(rows * kp) * 2);
      for (int64_t r = 0; r < rows && first_padded * 32 + r < i_rows; ++r)
        std::memcpy(a_pad + r * kp, a + (first_padded * 32 + r) * lda, k * 2);
    }
  }
  const Out o{out, out_dtype, transpose, ldo, bias, i_rows, j_rows};
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
      (void)bias, (void)out, (void)out_dtype, (void)transpose, (void)ldo, (void)threads;
  return -1;
#endif
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// float32: C = A · Bᵀ, A [I, K], B [J, K] float32 (K contiguous), on FMA units. One element (i, j): 16 lane sums,
// lane l = fma chain over t = 0, 1, ... of a[i][16t + l] * b[j][16t + l] (K's tail read as zeros), then the fixed
// tree l += l + 8, l += l + 4, l += l + 2, l += l + 1; + bias[i]. Every element is computed whole by one thread, so its
// bits depend only on row i of A, row j of B and bias[i]: not on I, J, the tile or the thread count — nor on the
// vector width: AVX-512 holds the 16 lanes in one register, AVX2 in two, each lane the same fused multiply-adds and
// the tree the same adds. Work unit = (a chunk of up to F32_CHUNK_J rows of B kept in L2, 64 rows of A); register
// tile F32_RI rows of A x F32_RJ rows of B (4 x 6 on AVX-512's 32 registers, 2 x 2 on AVX2's 16).
#if defined(ZK_F32_AVX512) || defined(ZK_F32_AVX2)
namespace {

constexpr int64_t F32_CHUNK_J = 240;
constexpr int64_t F32_GROUP_I = 64;

#if defined(ZK_F32_AVX512)
constexpr int F32_RI = 4, F32_RJ = 6;
struct V16 {
  __m512 v;
};
inline V16 v_zero() { return {_mm512_setzero_ps()}; }
inline V16 v_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 v_load_n(const float* p, int64_t n) {
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)};
}
inline V16 v_fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline __m256 v_fold(V16 x) {  // lane l + lane l + 8
  return _mm256_add_ps(_mm512_castps512_ps256(x.v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1)));
}
#else
constexpr int F32_RI = 2, F32_RJ = 2;
struct V16 {
  __m256 lo, hi;
};
inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v_load_n(const float* p, int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n) - 8), idx);
  return {_mm256_maskload_ps(p, lo), _mm256_maskload_ps(p + 8, hi)};
}
inline V16 v_fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline __m256 v_fold(V16 x) { return _mm256_add_ps(x.lo, x.hi); }  // lane l + lane l + 8
#endif

inline float hsum16(V16 v) {
  const __m256 a = v_fold(v);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  const __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));
  return _mm_cvtss_f32(d);
}

// x [rows, cols] 32-bit words (row stride ld) -> xt [cols, rows] (row stride ldt): 16x16 blocks (AVX-512), scalar
// tails (and scalar everywhere on AVX2)
void transpose_words(const uint32_t* x, int64_t rows, int64_t cols, int64_t ld, uint32_t* xt, int64_t ldt,
                     int threads) {
#if !defined(ZK_F32_AVX512)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && cols > 16)
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) xt[c * ldt + r] = x[r * ld + c];
#else
  const int64_t cb = (cols + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && cb > 1)
  for (int64_t c = 0; c < cb; ++c) {
    const int64_t c0 = c * 16;
    int64_t r0 = 0;
    if (c0 + 16 <= cols)
      for (; r0 + 16 <= rows; r0 += 16) transpose16(x + r0 * ld + c0, ld, xt + c0 * ldt + r0, ldt);
    for (int64_t cc = c0; cc < c0 + 16 && cc < cols; ++cc)
      for (int64_t r = (c0 + 16 <= cols ? r0 : 0); r < rows; ++r) xt[cc * ldt + r] = x[r * ld + cc];
  }
#endif
}

template <int RI, int RJ>
inline void tile_f32(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k, float (*c)[6]) {
  V16 acc[RI][RJ];
  for (int r = 0; r < RI; ++r)
    for (int q = 0; q < RJ; ++q) acc[r][q] = v_zero();
  int64_t t = 0;
  for (; t + 16 <= k; t += 16) {
    V16 bv[RJ];
    for (int q = 0; q < RJ; ++q) bv[q] = v_load(b + q * ldb + t);
    for (int r = 0; r < RI; ++r) {
      const V16 av = v_load(a + r * lda + t);
      for (int q = 0; q < RJ; ++q) acc[r][q] = v_fma(av, bv[q], acc[r][q]);
    }
  }
  if (t < k) {
    V16 bv[RJ];
    for (int q = 0; q < RJ; ++q) bv[q] = v_load_n(b + q * ldb + t, k - t);
    for (int r = 0; r < RI; ++r) {
      const V16 av = v_load_n(a + r * lda + t, k - t);
      for (int q = 0; q < RJ; ++q) acc[r][q] = v_fma(av, bv[q], acc[r][q]);
    }
  }
  for (int r = 0; r < RI; ++r)
    for (int q = 0; q < RJ; ++q) c[r][q] = hsum16(acc[r][q]);
}

template <int RI>
inline void row_tiles_f32(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k, int64_t i0,
                          int64_t j0, int64_t j1, const float* bias, float* out, int transpose, int64_t ldo) {
  float c[4][6];
  for (int64_t j = j0; j < j1; j += F32_RJ) {
    const int64_t nj = j1 - j < F32_RJ ? j1 - j : F32_RJ;
    const float* bj = b + j * ldb;
    switch (nj) {
      case 6: tile_f32<RI, 6>(a, lda, bj, ldb, k, c); break;
      case 5: tile_f32<RI, 5>(a, lda, bj, ldb, k, c); break;
      case 4: tile_f32<RI, 4>(a, lda, bj, ldb, k, c); break;
      case 3: tile_f32<RI, 3>(a, lda, bj, ldb, k, c); break;
      case 2: tile_f32<RI, 2>(a, lda, bj, ldb, k, c); break;
      default: tile_f32<RI, 1>(a, lda, bj, ldb, k, c); break;
    }
    for (int r = 0; r < RI; ++r)
      for (int64_t q = 0; q < nj; ++q) {
        const float v = bias ? c[r][q] + bias[i0 + r] : c[r][q];
        out[transpose ? (j + q) * ldo + i0 + r : (i0 + r) * ldo + j + q] = v;
      }
  }
}

}  // namespace
#endif

extern "C" {

int zk_gemm_has_f32() {
#if defined(ZK_F32_AVX512) || defined(ZK_F32_AVX2)
  return 1;
#else
  return 0;
#endif
}

// C = A · Bᵀ in float32 (see above). a: [i_rows, k], row stride lda; b: [j_rows, k], row stride ldb; bias: i_rows or
// null; out: [i_rows, j_rows] (transpose = 0) or [j_rows, i_rows] (1), row stride ldo. Returns 0, or -1 without
// AVX-512 or AVX2 + FMA in this build.
int zk_gemm_abt_f32(const float* a, int64_t i_rows, int64_t k, int64_t lda, int a_kmajor, const float* b,
                    int64_t j_rows, int64_t ldb, int b_kmajor, const float* bias, float* out, int transpose,
                    int64_t ldo, int threads) {
#if defined(ZK_F32_AVX512) || defined(ZK_F32_AVX2)
  // a k-major operand ([k, rows], rows contiguous) is transposed first into a per-calling-thread buffer
  thread_local std::vector<float> a_buf, b_buf;
  if (a_kmajor) {
    if (a_buf.size() < static_cast<size_t>(i_rows * k)) a_buf.resize(static_cast<size_t>(i_rows * k));
    transpose_words(reinterpret_cast<const uint32_t*>(a), k, i_rows, lda, reinterpret_cast<uint32_t*>(a_buf.data()),
                    k, threads);
    a = a_buf.data(), lda = k;
  }
  if (b_kmajor) {
    if (b_buf.size() < static_cast<size_t>(j_rows * k)) b_buf.resize(static_cast<size_t>(j_rows * k));
    transpose_words(reinterpret_cast<const uint32_t*>(b), k, j_rows, ldb, reinterpret_cast<uint32_t*>(b_buf.data()),
                    k, threads);
    b = b_buf.data(), ldb = k;
  }
  // chunks of B of near-equal size (a multiple of the 6-row tile), so that threads get near-equal work
  const int64_t chunks = (j_rows + F32_CHUNK_J - 1) / F32_CHUNK_J;
  const int64_t chunk_j = ((j_rows + chunks - 1) / chunks + 5) / 6 * 6;
  const int64_t groups = (i_rows + F32_GROUP_I - 1) / F32_GROUP_I;
  const int64_t units = chunks * groups;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && units > 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t ch = u / groups, gi = u % groups;
    const int64_t j0 = ch * chunk_j, j1 = j0 + chunk_j < j_rows ? j0 + chunk_j : j_rows;
    if (j0 >= j1) continue;
    const int64_t i_end = (gi + 1) * F32_GROUP_I < i_rows ? (gi + 1) * F32_GROUP_I : i_rows;
    for (int64_t i = gi * F32_GROUP_I; i < i_end; i += F32_RI) {
      const float* ai = a + i * lda;
      switch (i_end - i < F32_RI ? i_end - i : F32_RI) {
        case 4: row_tiles_f32<4>(ai, lda, b, ldb, k, i, j0, j1, bias, out, transpose, ldo); break;
        case 3: row_tiles_f32<3>(ai, lda, b, ldb, k, i, j0, j1, bias, out, transpose, ldo); break;
        case 2: row_tiles_f32<2>(ai, lda, b, ldb, k, i, j0, j1, bias, out, transpose, ldo); break;
        default: row_tiles_f32<1>(ai, lda, b, ldb, k, i, j0, j1, bias, out, transpose, ldo); break;
      }
    }
  }
  return 0;
#else
  (void)a, (void)i_rows, (void)k, (void)lda, (void)a_kmajor, (void)b, (void)j_rows, (void)ldb, (void)b_kmajor,
      (void)bias, (void)out, (void)transpose, (void)ldo, (void)threads;
  return -1;
#endif
}

}  // extern "C"
