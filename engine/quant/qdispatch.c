/* The entry points of the packed-weight kernels (engine/quant/kernels.c): pick the
 * variant compiled for the best instruction set this CPU has, once, and share a product's
 * output rows among OpenMP threads (torch's pool: see OPENMP_FLAG in engine/cpu/kernels.py).
 * Compiled for the baseline of the target, so that it runs everywhere. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define VARIANT_API(v)                                                                        \
  int q_rows_##v(int, const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *,     \
                 int64_t, int64_t, float *, int64_t, const float *);                          \
  int q_expand_##v(int, const uint8_t *, int64_t, int64_t, const int64_t *, int64_t, float *, \
                   int64_t);                                                                  \
  void q_pack_##v(const float *, int64_t, int64_t, int64_t, float *, int64_t, int64_t);       \
  int64_t q_panel_rows_##v(void);                                                             \
  int64_t q_gemm_min_rows_##v(void);

VARIANT_API(generic)
#if defined(__x86_64__) && !defined(Q_GENERIC_ONLY)
VARIANT_API(v3)
VARIANT_API(v4)
#endif

struct variant {
  int (*rows)(int, const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *, int64_t,
              int64_t, float *, int64_t, const float *);
  int (*expand)(int, const uint8_t *, int64_t, int64_t, const int64_t *, int64_t, float *,
                int64_t);
  void (*pack)(const float *, int64_t, int64_t, int64_t, float *, int64_t, int64_t);
  int64_t (*panel_rows)(void);
  int64_t (*gemm_min_rows)(void);
};

#define VARIANT(v) {q_rows_##v, q_expand_##v, q_pack_##v, q_panel_rows_##v, q_gemm_min_rows_##v}
static const struct variant GENERIC = VARIANT(generic);
#if defined(__x86_64__) && !defined(Q_GENERIC_ONLY)
static const struct variant V3 = VARIANT(v3), V4 = VARIANT(v4);
#endif

/* 0: generic, 3: x86-64-v3 (AVX2, FMA, F16C), 4: x86-64-v4 (AVX-512 F, BW, CD, DQ, VL). */
static int level = -1;
static const struct variant *use = &GENERIC;

/* The best level this CPU runs. */
int q_cpu_level(void) {
#if defined(__x86_64__) && !defined(Q_GENERIC_ONLY)
  __builtin_cpu_init();
  const int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
  if (v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512cd"))
    return 4;
  if (v3) return 3;
#endif
  return 0;
}

/* Use the variant of `want` (a level of q_cpu_level; -1: the best this CPU runs). Returns
 * the level in use, or -1 where this CPU cannot run `want` (nothing changes then). */
int q_set_level(int want) {
  const int best = q_cpu_level();
  if (want < 0) want = best;
  if (want > best || (want != 0 && want != 3 && want != 4)) return -1;
  level = want;
  use = &GENERIC;
#if defined(__x86_64__) && !defined(Q_GENERIC_ONLY)
  if (want == 4) use = &V4;
  if (want == 3) use = &V3;
#endif
  return level;
}

/* The instruction-set level in use (see q_set_level). */
int q_level(void) {
  if (level < 0) q_set_level(-1);
  return level;
}

/* Multiply-adds from which a product shares its rows among the threads: below, waking
 * them costs about what they save. */
#define PARALLEL_MIN_MACS (1 << 16)

static int64_t thread_id(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

static int64_t thread_count(void) {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

/* [lo, hi) of `total` items for thread t of nt, in multiples of `unit`. */
static void share(int64_t total, int64_t unit, int64_t t, int64_t nt, int64_t *lo, int64_t *hi) {
  const int64_t per = ((total + nt - 1) / nt + unit - 1) / unit * unit;
  *lo = t * per < total ? t * per : total;
  *hi = *lo + per < total ? *lo + per : total;
}

/* y[i][n] = sum_k x[i][k] W[n][k] (+ bias[n]) for i < m, n < nrows: W's rows packed as
 * `type` (row n at w + n rb), x and y row-major with strides xs, ys (floats). From the
 * variant's gemm_min_rows rows of x on, x is first packed into panels (shared by the
 * threads) for the register-tiled product. Returns 0, -1 for an unknown type, -2 out of
 * memory. */
int q_matmul(int type, const uint8_t *w, int64_t rb, int64_t nrows, int64_t k, const float *x,
             int64_t xs, int64_t m, float *y, int64_t ys, const float *bias, int64_t threads) {
  const struct variant *v = (q_level(), use);
  if (nrows * k * m < PARALLEL_MIN_MACS) threads = 1;
  float *xp = NULL;
  const int64_t gp = v->panel_rows(), np = (m + gp - 1) / gp;
  if (m >= v->gemm_min_rows()) {
    xp = malloc(sizeof(float) * (size_t)(np * gp * k));
    if (!xp) return -2;
  }
  int err = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(min : err)
  {
    const int64_t t = thread_id(), nt = thread_count();
    int64_t lo, hi;
    if (xp) {
      share(np, 1, t, nt, &lo, &hi);
      v->pack(x, xs, m, k, xp, lo, hi);
#pragma omp barrier
    }
    /* Multiples of 12 rows: the register tiles of every path divide it. */
    share(nrows, 12, t, nt, &lo, &hi);
    if (hi > lo) {
      const int rc = v->rows(type, w, rb, lo, hi, k, x, xs, m, y, ys, xp);
      if (rc < err) err = rc;
      if (bias)
        for (int64_t i = 0; i < m; i++)
          for (int64_t n = lo; n < hi; n++) y[i * ys + n] += bias[n];
    }
  }
  free(xp);
  return err;
}

/* Rows ids[i] (i where ids is NULL) of W de-quantized into out + i os (k floats each), for
 * i < n. Returns 0, or -1 for an unknown type. */
int q_expand(int type, const uint8_t *w, int64_t rb, int64_t k, const int64_t *ids, int64_t n,
             float *out, int64_t os, int64_t threads) {
  const struct variant *v = (q_level(), use);
  if (n * k < PARALLEL_MIN_MACS) threads = 1;
  int err = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(min : err)
  {
    int64_t lo, hi;
    share(n, 1, thread_id(), thread_count(), &lo, &hi);
    if (hi > lo) {
      const int rc = v->expand(type, ids ? w : w + lo * rb, rb, k, ids ? ids + lo : NULL, hi - lo,
                               out + lo * os, os);
      if (rc < err) err = rc;
    }
  }
  return err;
}
