/* Matrix products on weights kept packed as a GGUF file stores them; loaded by
 * engine/quant/kernels.py.
 *
 * y[m][n] = sum_k x[m][k] * W[n][k] for fp32 activations x and a weight W whose rows are
 * packed blocks (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and I8R, an int8
 * row with one fp32 scale). Each group of 32 weights is expanded to fp32 in registers with
 * the same operations as the formats' reference de-quantization (ggml's
 * dequantize_row_*, as gguf-py's numpy port computes it: the scale times the integer,
 * plus the minimum), so every expanded weight equals the fp32 weight of the de-quantized
 * model bit for bit and only the order of the sums differs from an fp32 matrix product.
 *
 * This file is compiled once per instruction set (see VARIANT below and
 * engine/quant/kernels.py): x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA, F16C) and the
 * baseline of the target; qdispatch.c picks one at run time. The vector type vf is 16
 * floats in every variant: one AVX-512 register, two AVX2 ones or four SSE ones.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef VARIANT
#define VARIANT generic
#endif
#define CAT2(a, b) a##_##b
#define CAT(a, b) CAT2(a, b)
#define EXPORT(name) CAT(name, VARIANT)

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
#define VL 16

/* Type ids: ggml's for the GGUF formats; I8R is the project's own. */
enum {
  T_Q4_0 = 2,
  T_Q4_1 = 3,
  T_Q5_0 = 6,
  T_Q5_1 = 7,
  T_Q8_0 = 8,
  T_Q4_K = 12,
  T_Q5_K = 13,
  T_Q6_K = 14,
  T_I8R = 1024,
};

#define INLINE static inline __attribute__((always_inline))

INLINE vf vload(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

INLINE void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

INLINE float h2f(const uint8_t *p) {
  _Float16 h;
  memcpy(&h, p, 2);
  return (float)h;
}

INLINE vb bload(const uint8_t *p) {
  vb v;
  memcpy(&v, p, sizeof v);
  return v;
}

INLINE vf u8f(vb q) { return __builtin_convertvector(__builtin_convertvector(q, vi), vf); }

/* int8 to float. Written as (q + 128) - 128 through unsigned bytes: GCC 12 turns a direct
 * signed conversion of a byte vector into scalar code. Exact: every step is an integer
 * below 2^24. */
INLINE vf s8f(const uint8_t *p) { return u8f(bload(p) ^ 0x80) - 128.0f; }

INLINE float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VL; i++) s += v[i];
  return s;
}

/* ---- One group of 32 weights, expanded: lo = weights 0..15, hi = 16..31 of group g of
 * the super-block at p (a super-block is one block for the 32-weight formats). ---- */

/* Q4_0: fp16 d, 16 bytes; byte j: weight j (low nibble), j + 16 (high). w = (q - 8) d. */
#define Q4_0_QK 32
#define Q4_0_BYTES 18
static const vf IOTAF __attribute__((unused)) = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

#ifdef __AVX512F__
#include <immintrin.h>
/* lo = table[low nibbles of the 16 bytes at q], hi = table[high nibbles]: the expansion of
 * the 4-bit formats in two permutes (written with intrinsics: GCC 12 turns the same code in
 * vector extensions into scalar byte moves). */
INLINE void nibble_lookup(const uint8_t *q, vf table, vf *lo, vf *hi) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
  const __m512 t = (__m512)table;
  *lo = (vf)_mm512_permutexvar_ps(idx, t);
  *hi = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), t);
}

/* 16 bytes at q as 16 int32 lanes. */
INLINE __m512i u8x16(const uint8_t *q) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
}

/* The 5-bit formats: table[q | h << 4] for 16 lanes of 4-bit q (idx: nothing above bit 3)
 * and the 16 fifth bits in `bits` (bit l: lane l), t0 = values 0..15, t1 = 16..31
 * (vpermt2ps reads the low 5 bits of each index). */
INLINE vf lookup32(__m512i idx, __mmask16 bits, vf t0, vf t1) {
  const __m512i i5 = _mm512_mask_or_epi32(idx, bits, idx, _mm512_set1_epi32(16));
  return (vf)_mm512_permutex2var_ps((__m512)t0, i5, (__m512)t1);
}
#endif
INLINE void ex_Q4_0(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)row, (void)g;
  const float d = h2f(p);
  const vb q = bload(p + 2);
#ifdef __AVX512F__
  (void)q;
  nibble_lookup(p + 2, (IOTAF - 8.0f) * d, lo, hi);
#else
  *lo = (u8f(q & 15) - 8.0f) * d;
  *hi = (u8f(q >> 4) - 8.0f) * d;
#endif
}

/* Q4_1: fp16 d, fp16 m, 16 bytes as Q4_0. w = q d + m. */
#define Q4_1_QK 32
#define Q4_1_BYTES 20
INLINE void ex_Q4_1(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)row, (void)g;
  const float d = h2f(p), m = h2f(p + 2);
  const vb q = bload(p + 4);
#ifdef __AVX512F__
  /* The 16 values a nibble can stand for, then one permute per 16 weights (vpermps reads
   * the low 4 bits of each index). */
  (void)q;
  nibble_lookup(p + 4, IOTAF * d + m, lo, hi);
#else
  *lo = u8f(q & 15) * d + m;
  *hi = u8f(q >> 4) * d + m;
#endif
}

static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* The fifth bits of Q5_0/Q5_1: bit j of the 32-bit qh is weight j's, as 0 or 16. */
INLINE void fifth_bits(const uint8_t *qhp, vf *lo, vf *hi) {
  uint32_t qh;
  memcpy(&qh, qhp, 4);
  const vi h = (vi){0} + (int32_t)qh;
  *lo = __builtin_convertvector(((h >> IOTA) & 1) << 4, vf);
  *hi = __builtin_convertvector(((h >> (IOTA + 16)) & 1) << 4, vf);
}

/* Q5_0: fp16 d, 4 bytes qh, 16 bytes ql. w = ((ql | h << 4) - 16) d. */
#define Q5_0_QK 32
#define Q5_0_BYTES 22
INLINE void ex_Q5_0(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)row, (void)g;
  const float d = h2f(p);
#ifdef __AVX512F__
  uint32_t qh;
  memcpy(&qh, p + 2, 4);
  const __m512i q = u8x16(p + 6);
  const vf t0 = (IOTAF - 16.0f) * d, t1 = IOTAF * d;
  *lo = lookup32(_mm512_and_si512(q, _mm512_set1_epi32(15)), (__mmask16)qh, t0, t1);
  *hi = lookup32(_mm512_srli_epi32(q, 4), (__mmask16)(qh >> 16), t0, t1);
#else
  vf hl, hh;
  fifth_bits(p + 2, &hl, &hh);
  const vb q = bload(p + 6);
  *lo = (u8f(q & 15) + hl - 16.0f) * d;
  *hi = (u8f(q >> 4) + hh - 16.0f) * d;
#endif
}

/* Q5_1: fp16 d, fp16 m, 4 bytes qh, 16 bytes ql. w = (ql | h << 4) d + m. */
#define Q5_1_QK 32
#define Q5_1_BYTES 24
INLINE void ex_Q5_1(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)row, (void)g;
  const float d = h2f(p), m = h2f(p + 2);
#ifdef __AVX512F__
  uint32_t qh;
  memcpy(&qh, p + 4, 4);
  const __m512i q = u8x16(p + 8);
  const vf t0 = IOTAF * d + m, t1 = (IOTAF + 16.0f) * d + m;
  *lo = lookup32(_mm512_and_si512(q, _mm512_set1_epi32(15)), (__mmask16)qh, t0, t1);
  *hi = lookup32(_mm512_srli_epi32(q, 4), (__mmask16)(qh >> 16), t0, t1);
#else
  vf hl, hh;
  fifth_bits(p + 4, &hl, &hh);
  const vb q = bload(p + 8);
  *lo = (u8f(q & 15) + hl) * d + m;
  *hi = (u8f(q >> 4) + hh) * d + m;
#endif
}

/* Q8_0: fp16 d, 32 int8. w = q d. */
#define Q8_0_QK 32
#define Q8_0_BYTES 34
INLINE void ex_Q8_0(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)row, (void)g;
  const float d = h2f(p);
  *lo = s8f(p + 2) * d;
  *hi = s8f(p + 18) * d;
}

/* The 6-bit scale and minimum of sub-block j of a Q4_K/Q5_K super-block (ggml's
 * get_scale_min_k4). */
INLINE void scale_min_k4(int j, const uint8_t *q, float *sc, float *mn) {
  if (j < 4) {
    *sc = (float)(q[j] & 63);
    *mn = (float)(q[j + 4] & 63);
  } else {
    *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/* Q4_K: 256 weights in 8 groups of 32. fp16 d, fp16 dmin, 12 bytes of 6-bit scales and
 * minimums, 128 bytes: bytes 32c..32c+31 hold group 2c (low nibbles) and 2c+1 (high).
 * w = (d sc) q - dmin mn. */
#define Q4_K_QK 256
#define Q4_K_BYTES 144
INLINE void ex_Q4_K(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)row;
  float sc, mn;
  scale_min_k4(g, p + 4, &sc, &mn);
  const float d = h2f(p) * sc, m = h2f(p + 2) * mn;
  const uint8_t *q = p + 16 + 32 * (g >> 1);
  const int shift = 4 * (g & 1);
#ifdef __AVX512F__
  /* The 16 values of the group's nibbles, one permute per 16 weights (vpermps reads the
   * low 4 bits of each index). */
  const vf table = IOTAF * d - m;
  const __m128i n = _mm_cvtsi32_si128(shift);
  *lo = (vf)_mm512_permutexvar_ps(_mm512_srl_epi32(u8x16(q), n), (__m512)table);
  *hi = (vf)_mm512_permutexvar_ps(_mm512_srl_epi32(u8x16(q + 16), n), (__m512)table);
#else
  *lo = u8f((bload(q) >> shift) & 15) * d - m;
  *hi = u8f((bload(q + 16) >> shift) & 15) * d - m;
#endif
}

/* Q5_K: Q4_K with a fifth bit per weight: d, dmin, 12 scale bytes, 32 bytes qh (bit g of
 * qh[l] is weight l of group g), 128 bytes as Q4_K. w = (d sc) (q + 16 h) - dmin mn. */
#define Q5_K_QK 256
#define Q5_K_BYTES 176
INLINE void ex_Q5_K(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)row;
  float sc, mn;
  scale_min_k4(g, p + 4, &sc, &mn);
  const float d = h2f(p) * sc, m = h2f(p + 2) * mn;
  const uint8_t *qh = p + 16, *q = p + 48 + 32 * (g >> 1);
  const int shift = 4 * (g & 1);
#ifdef __AVX512F__
  const vf t0 = IOTAF * d - m, t1 = (IOTAF + 16.0f) * d - m;
  const __m128i n = _mm_cvtsi32_si128(shift);
  const __m512i bit = _mm512_set1_epi32(1 << g);
  const __mmask16 bl = _mm512_test_epi32_mask(u8x16(qh), bit);
  const __mmask16 bh = _mm512_test_epi32_mask(u8x16(qh + 16), bit);
  const __m512i f = _mm512_set1_epi32(15);
  *lo = lookup32(_mm512_and_si512(_mm512_srl_epi32(u8x16(q), n), f), bl, t0, t1);
  *hi = lookup32(_mm512_and_si512(_mm512_srl_epi32(u8x16(q + 16), n), f), bh, t0, t1);
#else
  const vb hl = ((bload(qh) >> g) & 1) << 4, hh = ((bload(qh + 16) >> g) & 1) << 4;
  *lo = u8f(((bload(q) >> shift) & 15) | hl) * d - m;
  *hi = u8f(((bload(q + 16) >> shift) & 15) | hh) * d - m;
#endif
}

/* Q6_K: 256 weights. 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
 * scales (one per 16 weights), fp16 d. Group g = 4 half + r: ql[64 half + 32 (r & 1) + l]
 * nibble r >> 1, qh[32 half + l] bits 2r, scale 8 half + 2r (+1 for l >= 16).
 * w = d sc (q - 32). */
#define Q6_K_QK 256
#define Q6_K_BYTES 210
INLINE void ex_Q6_K(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)row;
  const int half = g >> 2, r = g & 3;
  const uint8_t *ql = p + 64 * half + 32 * (r & 1), *qh = p + 128 + 32 * half;
  const int8_t *sc = (const int8_t *)(p + 192) + 8 * half + 2 * r;
  const float d = h2f(p + 208);
  const int nib = 4 * (r >> 1), hs = 2 * r;
#ifdef __AVX512F__
  /* In 32-bit lanes (shifts by a count in a register), then converted: q - 32 in [-32, 31]. */
  const __m128i n = _mm_cvtsi32_si128(nib), h = _mm_cvtsi32_si128(hs);
  const __m512i f = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3);
  const __m512i a = _mm512_or_si512(
      _mm512_and_si512(_mm512_srl_epi32(u8x16(ql), n), f),
      _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(u8x16(qh), h), three), 4));
  const __m512i b = _mm512_or_si512(
      _mm512_and_si512(_mm512_srl_epi32(u8x16(ql + 16), n), f),
      _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(u8x16(qh + 16), h), three), 4));
  *lo = ((vf)_mm512_cvtepi32_ps(a) - 32.0f) * (d * (float)sc[0]);
  *hi = ((vf)_mm512_cvtepi32_ps(b) - 32.0f) * (d * (float)sc[1]);
#else
  const vb a = ((bload(ql) >> nib) & 15) | (((bload(qh) >> hs) & 3) << 4);
  const vb b = ((bload(ql + 16) >> nib) & 15) | (((bload(qh + 16) >> hs) & 3) << 4);
  *lo = (u8f(a) - 32.0f) * (d * (float)sc[0]);
  *hi = (u8f(b) - 32.0f) * (d * (float)sc[1]);
#endif
}

/* I8R: fp32 scale s, then the row's k int8; p points 4 bytes before its block (so that
 * block sb is at row + 32 sb + 4). w = q s. Written by engine/quant/quantize.py (quantization: int8). */
INLINE void ex_I8R(const uint8_t *row, const uint8_t *p, int g, vf *lo, vf *hi) {
  (void)g;
  float s;
  memcpy(&s, row, 4);
  *lo = s8f(p + 4) * s;
  *hi = s8f(p + 20) * s;
}

/* ---- Kernels, one set per type ----
 *
 * rows_T(w, rb, n0, n1, k, x, xs, m, y, ys): y[i][n] for rows n0 <= n < n1 of W (row n at
 * w + n rb) and the m rows of x (stride xs), into y (stride ys); 0, or -2 out of memory.
 * Below GEMM_MIN_M rows of x, register tiles of R weight rows x MB activation rows: each
 * group of 32 weights is expanded in registers once per tile and multiplied with MB rows
 * of x. (R, MB) = (4, 1) for one row of x (a decode step: the product is bound by reading
 * the weights, which are prefetched PREFETCH bytes ahead), (2, 4) otherwise. From
 * GEMM_MIN_M rows on, gemm_T (below).
 *
 * expand_T(w, rb, n, k, out): row n de-quantized into out (k floats).
 */
#ifndef PREFETCH
#define PREFETCH 4096
#endif

#define TILE(T, R, MB)                                                                        \
  static void tile_##T##_##R##_##MB(const uint8_t *w, int64_t rb, int64_t n, int rc,         \
                                    int64_t k, const float *x, int64_t xs, int mc, float *y, \
                                    int64_t ys) {                                             \
    const uint8_t *wr[R];                                                                     \
    const float *xr[MB];                                                                      \
    for (int r = 0; r < R; r++) wr[r] = w + (n + (r < rc ? r : rc - 1)) * rb;                \
    for (int i = 0; i < MB; i++) xr[i] = x + (i < mc ? i : mc - 1) * xs;                     \
    vf acc[R][MB];                                                                            \
    memset(acc, 0, sizeof acc);                                                               \
    for (int64_t sb = 0; sb < k / T##_QK; sb++) {                                             \
      for (int r = 0; r < R; r++) __builtin_prefetch(wr[r] + sb * T##_BYTES + PREFETCH);     \
      for (int g = 0; g < T##_QK / 32; g++) {                                                 \
        const int64_t off = sb * T##_QK + 32 * g;                                             \
        vf lo[R], hi[R];                                                                      \
        for (int r = 0; r < R; r++) ex_##T(wr[r], wr[r] + sb * T##_BYTES, g, &lo[r], &hi[r]); \
        for (int i = 0; i < MB; i++) {                                                        \
          const vf xl = vload(xr[i] + off), xh = vload(xr[i] + off + 16);                     \
          for (int r = 0; r < R; r++) {                                                      \
            acc[r][i] += lo[r] * xl; /* two FMAs, not a multiply, an FMA and an add */       \
            acc[r][i] += hi[r] * xh;                                                          \
          }                                                                                   \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
    for (int r = 0; r < rc; r++)                                                              \
      for (int i = 0; i < mc; i++) y[i * ys + n + r] = hsum(acc[r][i]);                       \
  }

#define EXPAND(T)                                                                             \
  static void expand_##T(const uint8_t *w, int64_t rb, int64_t n, int64_t k, float *out) {   \
    const uint8_t *row = w + n * rb;                                                          \
    for (int64_t sb = 0; sb < k / T##_QK; sb++)                                               \
      for (int g = 0; g < T##_QK / 32; g++) {                                                 \
        vf lo, hi;                                                                            \
        ex_##T(row, row + sb * T##_BYTES, g, &lo, &hi);                                       \
        vstore(out + sb * T##_QK + 32 * g, lo);                                               \
        vstore(out + sb * T##_QK + 32 * g + 16, hi);                                          \
      }                                                                                       \
  }

/* ---- Many activation rows: a register-tiled product on expanded weights ----
 *
 * From GEMM_MIN_M rows on, expanding each weight once per register tile of activation rows
 * costs more than the multiply-adds it feeds. The product then runs in the BLIS layout
 * (Van Zee and van de Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS
 * Functionality", ACM TOMS 2015) with the weights as the broadcast operand: GM weight rows
 * are expanded once into an fp32 scratch (row-major, k floats each), the activations are
 * packed once into panels of GP rows, transposed (xp[k][GP]), and a GM x GP register tile
 * accumulates w[r][kk] * xp[kk][0..GP) over all of k. Each weight is then expanded once per
 * call and each multiply-add is one FMA with a broadcast. */
#ifdef __AVX512F__
#define GM 12 /* weight rows per register tile: 12 x 2 accumulators of the 32 registers */
#define GV 2
#else
#define GM 6 /* 6 x 1 vectors: 12 of AVX2's 16 registers */
#define GV 1
#endif
#define GP (GV * VL) /* activation rows per panel */
#ifndef GEMM_MIN_M
#define GEMM_MIN_M 20
#endif

/* In place: t[i][j] <- t[j][i] for 16 vectors of 16 floats; four rounds of two-source
 * shuffles (one vpermt2ps each on AVX-512), each swapping the off-diagonal s x s blocks of
 * the vector pairs (i, i + s). */
INLINE void transpose16(vf t[16]) {
#define T1(s, hi, j)                                                                          \
  ((hi) ? (((j) & (s)) ? 16 + (j) : (j) + (s)) : (((j) & (s)) ? 16 + (j) - (s) : (j)))
#define TMASK(s, hi)                                                                          \
  (vi) {                                                                                      \
    T1(s, hi, 0), T1(s, hi, 1), T1(s, hi, 2), T1(s, hi, 3), T1(s, hi, 4), T1(s, hi, 5),       \
        T1(s, hi, 6), T1(s, hi, 7), T1(s, hi, 8), T1(s, hi, 9), T1(s, hi, 10),                \
        T1(s, hi, 11), T1(s, hi, 12), T1(s, hi, 13), T1(s, hi, 14), T1(s, hi, 15)             \
  }
#define ROUND(s)                                                                              \
  for (int i = 0; i < 16; i++)                                                                \
    if (!(i & (s))) {                                                                         \
      const vf a = t[i], b = t[i + (s)];                                                      \
      t[i] = __builtin_shuffle(a, b, TMASK(s, 0));                                            \
      t[i + (s)] = __builtin_shuffle(a, b, TMASK(s, 1));                                      \
    }
  ROUND(1) ROUND(2) ROUND(4) ROUND(8)
#undef ROUND
#undef TMASK
#undef T1
}

/* Panels p0..p1 of GP rows of x, transposed: xp[p][kk][j] = x[p GP + j][kk] (0 past row m),
 * 16 rows by 16 columns at a time through transpose16 (k is a multiple of 32). */
static void pack_x(const float *x, int64_t xs, int64_t m, int64_t k, float *xp, int64_t p0,
                   int64_t p1) {
  for (int64_t p = p0; p < p1; p++)
    for (int h = 0; h < GV; h++)
      for (int64_t k0 = 0; k0 < k; k0 += VL) {
        vf t[16];
        for (int j = 0; j < 16; j++) {
          const int64_t i = p * GP + h * VL + j;
          t[j] = i < m ? vload(x + i * xs + k0) : (vf){0};
        }
        transpose16(t);
        for (int kk = 0; kk < 16; kk++) vstore(xp + p * k * GP + (k0 + kk) * GP + h * VL, t[kk]);
      }
}

/* y[i][n + r] for r < rc, i < mc, from we (GM rows of k expanded weights) and one panel. */
static void gemm_tile(const float *we, int rc, const float *xp, int mc, int64_t k, float *y,
                      int64_t ys, int64_t n) {
  vf acc[GM][GV];
  for (int r = 0; r < GM; r++)
    for (int v = 0; v < GV; v++) acc[r][v] = (vf){0};
  for (int64_t kk = 0; kk < k; kk++) {
    vf b[GV];
    for (int v = 0; v < GV; v++) b[v] = vload(xp + kk * GP + v * VL);
    for (int r = 0; r < GM; r++) {
      const vf a = (vf){0} + we[r * k + kk];
      for (int v = 0; v < GV; v++) acc[r][v] += a * b[v];
    }
  }
  /* Lanes are activation rows, registers weight rows: transposed 16 x 16 at a time, each
   * activation row's rc outputs are then one contiguous copy. */
  for (int v = 0; v < GV && v * VL < mc; v++) {
    vf t[16];
    for (int r = 0; r < 16; r++) t[r] = r < GM ? acc[r][v] : (vf){0};
    transpose16(t);
    for (int l = 0; l < VL && v * VL + l < mc; l++)
      memcpy(y + (v * VL + l) * ys + n, &t[l], sizeof(float) * (size_t)rc);
  }
}

/* Panels that a group shares while each weight tile is expanded once per group: as many
 * as fit in GEMM_L2_BYTES, so that the group's panels stay in the core's cache. */
#ifndef GEMM_L2_BYTES
#define GEMM_L2_BYTES (512 * 1024)
#endif

#define GEMM(T)                                                                               \
  static int gemm_##T(const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t k,       \
                      const float *xp, int64_t m, float *y, int64_t ys) {                     \
    const int64_t np = (m + GP - 1) / GP;                                                     \
    int64_t group = GEMM_L2_BYTES / (k * GP * (int64_t)sizeof(float));                        \
    if (group < 1) group = 1;                                                                 \
    float *we = malloc(sizeof(float) * (size_t)(GM * k));                                     \
    if (!we) return -2;                                                                       \
    for (int64_t p0 = 0; p0 < np; p0 += group) {                                              \
      const int64_t p1 = p0 + group < np ? p0 + group : np;                                   \
      for (int64_t n = n0; n < n1; n += GM) {                                                 \
        const int rc = n1 - n < GM ? (int)(n1 - n) : GM;                                      \
        for (int r = 0; r < GM; r++)                                                          \
          expand_##T(w, rb, n + (r < rc ? r : rc - 1), k, we + r * k);                        \
        for (int64_t p = p0; p < p1; p++)                                                     \
          gemm_tile(we, rc, xp + p * k * GP, m - p * GP < GP ? (int)(m - p * GP) : GP, k,     \
                    y + p * GP * ys, ys, n);                                                  \
      }                                                                                       \
    }                                                                                         \
    free(we);                                                                                 \
    return 0;                                                                                 \
  }

#define ROWS(T)                                                                               \
  static int rows_##T(const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t k,       \
                      const float *x, int64_t xs, int64_t m, float *y, int64_t ys,            \
                      const float *xp) {                                                      \
    if (xp) return gemm_##T(w, rb, n0, n1, k, xp, m, y, ys);                                  \
    if (m == 1) {                                                                             \
      for (int64_t n = n0; n < n1; n += 4)                                                    \
        tile_##T##_4_1(w, rb, n, n1 - n < 4 ? (int)(n1 - n) : 4, k, x, xs, 1, y, ys);         \
      return 0;                                                                               \
    }                                                                                         \
    for (int64_t n = n0; n < n1; n += 2) {                                                    \
      const int rc = n1 - n < 2 ? (int)(n1 - n) : 2;                                          \
      int64_t i = 0;                                                                          \
      for (; m - i > 4; i += 8)                                                               \
        tile_##T##_2_8(w, rb, n, rc, k, x + i * xs, xs, m - i < 8 ? (int)(m - i) : 8,         \
                       y + i * ys, ys);                                                       \
      if (i < m) tile_##T##_2_4(w, rb, n, rc, k, x + i * xs, xs, (int)(m - i), y + i * ys, ys); \
    }                                                                                         \
    return 0;                                                                                 \
  }

#define KERNELS(T) TILE(T, 4, 1) TILE(T, 2, 4) TILE(T, 2, 8) EXPAND(T) GEMM(T) ROWS(T)

#define I8R_QK 32 /* the row's scale, then k / 32 blocks of 32 int8 (after the scale) */
#define I8R_BYTES 32
KERNELS(Q4_0)
KERNELS(Q4_1)
KERNELS(Q5_0)
KERNELS(Q5_1)
KERNELS(Q8_0)
KERNELS(Q4_K)
KERNELS(Q5_K)
KERNELS(Q6_K)
KERNELS(I8R)

#define DISPATCH(type, CALL)                                                                  \
  switch (type) {                                                                             \
  case T_Q4_0: CALL(Q4_0); break;                                                             \
  case T_Q4_1: CALL(Q4_1); break;                                                             \
  case T_Q5_0: CALL(Q5_0); break;                                                             \
  case T_Q5_1: CALL(Q5_1); break;                                                             \
  case T_Q8_0: CALL(Q8_0); break;                                                             \
  case T_Q4_K: CALL(Q4_K); break;                                                             \
  case T_Q5_K: CALL(Q5_K); break;                                                             \
  case T_Q6_K: CALL(Q6_K); break;                                                             \
  case T_I8R: CALL(I8R); break;                                                               \
  default: return -1;                                                                         \
  }

/* y rows n0..n1 of x W^T; see rows_T. With xp (panels packed by q_pack), the register-tiled
 * product on expanded weights. Returns 0, -1 for an unknown type, -2 out of memory. */
int EXPORT(q_rows)(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t k,
                   const float *x, int64_t xs, int64_t m, float *y, int64_t ys,
                   const float *xp) {
  int rc = 0;
#define CALL_ROWS(T) rc = rows_##T(w, rb, n0, n1, k, x, xs, m, y, ys, xp)
  DISPATCH(type, CALL_ROWS)
  return rc;
}

/* Panels p0..p1 of x for q_rows (see pack_x). */
void EXPORT(q_pack)(const float *x, int64_t xs, int64_t m, int64_t k, float *xp, int64_t p0,
                    int64_t p1) {
  pack_x(x, xs, m, k, xp, p0, p1);
}

/* Activation rows per packed panel, and the rows from which q_rows should get panels. */
int64_t EXPORT(q_panel_rows)(void) { return GP; }
int64_t EXPORT(q_gemm_min_rows)(void) { return GEMM_MIN_M; }

/* Row ids[i] of W (i when ids is NULL) de-quantized into out + i os, for i < n. */
int EXPORT(q_expand)(int type, const uint8_t *w, int64_t rb, int64_t k, const int64_t *ids,
                     int64_t n, float *out, int64_t os) {
#define CALL_EXPAND(T)                                                                        \
  for (int64_t i = 0; i < n; i++) expand_##T(w, rb, ids ? ids[i] : i, k, out + i * os)
  DISPATCH(type, CALL_EXPAND)
  return 0;
}
