/* Vector helpers shared by engine/cpu/kernels.c and engine/cpu/prefill.c (GCC's vector
 * extensions: one AVX-512 register, two AVX2 or four NEON ones per vector). */
#ifndef ITERSERVE_CPU_VEC_H
#define ITERSERVE_CPU_VEC_H
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

/* 16 floats; unaligned loads via memcpy. */
typedef float vf __attribute__((vector_size(64)));
#define VL 16

static inline vf vload(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

typedef int32_t vi __attribute__((vector_size(64)));

/* exp(x) on 16 lanes for x <= 0 (softmax scores minus their row's maximum; SiLU's -|g|),
 * relative error at most 4.5e-7 on [-87, 0] (against double exp at 8.7 million points):
 * x = n ln2 + f with |f| <= ln2 / 2 (Cody and Waite's two-part ln2), e^f by its degree-6
 * Taylor polynomial, 2^n added to the exponent bits. Lanes below
 * -87 give e^-87 (1.6e-38), not 0: nothing a sum of at least 1 notices. It replaces the
 * compiler's vectorized expf (glibc's libmvec, 8 lanes), which is slower on 16 lanes. */
static inline vf vexp(vf x) {
  const vf lo = x - x - 87.0f;
  const vi below = x < lo;
  x = (vf)(((vi)x & ~below) | ((vi)lo & below));
  const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi); /* round, x <= 0 */
  const vf nf = __builtin_convertvector(n, vf);
  const vf f = x - nf * 0.693145752f - nf * 1.42860677e-6f;
  vf p = f * (1.0f / 720) + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  return (vf)((vi)p + (n << 23));
}

/* KV cache element types (EngineConfig.kv_cache_dtype): 0 fp32, 1 fp16, 2 bf16. A cache
 * row is read as fp32 (fp16 by the F16C conversion where the target has it; bf16 by
 * shifting its bits into the high half of an fp32) and written by rounding to nearest
 * even. */
#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2

static inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even (finite inputs) */
  return (uint16_t)(u >> 16);
}

static inline int64_t kv_size(int t) { return t == KV_F32 ? 4 : 2; }

/* n elements of type t at src (element offset) into fp32 dst. */
static inline void kv_to_f32(const void *src, int t, float *dst, int64_t n) {
  if (t == KV_F32) {
    memcpy(dst, src, sizeof(float) * n);
  } else if (t == KV_F16) {
    const _Float16 *s = src;
    int64_t i = 0;
#ifdef __F16C__
    /* GCC 12 converts _Float16 one element at a time: eight at once with F16C. */
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < n; i++) dst[i] = (float)s[i];
  } else {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  }
}

/* n fp32 at src into type t at dst. */
static inline void f32_to_kv(const float *src, void *dst, int t, int64_t n) {
  if (t == KV_F32) {
    memcpy(dst, src, sizeof(float) * n);
  } else if (t == KV_F16) {
    _Float16 *d = dst;
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128((__m128i *)(d + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) d[i] = (_Float16)src[i];
  } else {
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
  }
}

#endif
