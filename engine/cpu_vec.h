/* Vector helpers shared by engine/cpu_kernels.c and engine/cpu_prefill.c (GCC's vector
 * extensions: one AVX-512 register, two AVX2 or four NEON ones per vector). */
#ifndef ITERSERVE_CPU_VEC_H
#define ITERSERVE_CPU_VEC_H
#include <stdint.h>
#include <string.h>

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

#endif
