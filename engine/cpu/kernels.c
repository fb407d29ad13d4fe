/* Fused fp32 CPU kernels; loaded by engine/cpu/kernels.py.
 *
 * The small ones replace several PyTorch ops whose fixed dispatch cost (microseconds each)
 * dominates at the row counts of decode steps; they run on
 * the calling thread, their work being microseconds. Attention is real work (prefills
 * always, decodes from DECODE_PARALLEL_MIN context tokens) and shares it among OpenMP
 * threads (torch's own pool: see OPENMP_FLAG in cpu_kernels.py).
 * All tensors are row-major fp32 (int32/int64 indices); rows may be strided, elements
 * within a row are contiguous.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Context tokens in a decode step from which decode attention is shared among threads; below,
 * waking them costs about what they save. */
#define DECODE_PARALLEL_MIN 1024

#include "vec.h"

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (RMSNorm, Zhang and Sennrich 2019).
 * With delta, x[r] += delta[r] first, in place (the residual add before the norm). Rows
 * are shared among `threads` OpenMP threads. */
void add_rms_norm(float *x, int64_t x_stride, const float *delta, int64_t delta_stride,
                  const float *w, float *out, int64_t rows, int64_t h, float eps,
                  int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; r++) {
    float *xr = x + r * x_stride;
    float *o = out + r * h;
    if (delta) {
      const float *dr = delta + r * delta_stride;
      for (int64_t i = 0; i < h; i++) xr[i] += dr[i];
    }
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) ss += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) o[i] = xr[i] * inv * w[i];
  }
}

/* out[r] = silu(gate) * up, where gu[r] = [gate (n) | up (n)]: one pass over gu, where
 * PyTorch's silu and mul take two and a temporary. silu(g) = g e / (1 + e) for g < 0, else
 * g / (1 + e), with e = exp(-|g|) (vexp: n a multiple of VL). Rows are shared among
 * `threads` OpenMP threads (prefill steps: thousands of rows). */
void silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gu + r * 2 * n, *u = g + n;
    float *o = out + r * n;
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
      const vf x = vload(g + i);
      const vi neg = x < x - x;
      const vf e = vexp((vf)((vi)x | INT32_MIN)), d = e + 1.0f; /* exp(-|x|) */
      const vf num = (vf)(((vi)(x * e) & neg) | ((vi)x & ~neg));
      const vf y = num / d * vload(u + i);
      memcpy(o + i, &y, sizeof y);
    }
    for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}

/* Rotary embedding in place, halves rotated as transformers' rotate_half (GPT-NeoX
 * layout): with x = [x1 | x2] per head, x1' = x1 cos1 - x2 sin1, x2' = x2 cos2 + x1 sin2.
 * x: [rows, heads, d] with row stride x_stride; cos, sin: [rows, d]. */
void rope(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d,
          const float *cos, const float *sin, int64_t threads) {
  const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; r++) {
    const float *c = cos + r * d, *s = sin + r * d;
    for (int64_t hd = 0; hd < heads; hd++) {
      float *x1 = x + r * x_stride + hd * d, *x2 = x1 + half;
      for (int64_t i = 0; i < half; i++) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

/* cache[slots[r]] = src[r] for K and V: caches [num_slots, width] of element type kv_type
 * (vec.h), sources fp32 and row-strided. */
void cache_write(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                 const int64_t *slots, int64_t rows, int64_t width, void *k_cache,
                 void *v_cache, int64_t threads, int64_t kv_type) {
  const int t = (int)kv_type;
  const int64_t es = kv_size(t);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; r++) {
    f32_to_kv(k + r * k_stride, (char *)k_cache + slots[r] * width * es, t, width);
    f32_to_kv(v + r * v_stride, (char *)v_cache + slots[r] * width * es, t, width);
  }
}

/* Row `slot` of a cache of element type t (vec.h) as fp32: in place for fp32, else
 * converted into buf (`row` floats). */
static inline const float *kv_row(const void *cache, int t, int64_t slot, int64_t row,
                                  float *buf) {
  if (t == KV_F32) return (const float *)cache + slot * row;
  kv_to_f32((const char *)cache + slot * row * 2, t, buf, row);
  return buf;
}

/* Decode attention of one sequence: query q ([H, D]) against its L context tokens, read
 * through its block table; scores: [H, L] scratch, buf: KVH * D floats (a 16-bit cache's
 * row, converted). */
static void decode_one(const float *q, const void *k_cache, const void *v_cache, int t,
                       const int32_t *table, int64_t L, int64_t H, int64_t KVH, int64_t D,
                       int64_t bs, float scale, float *scores, float *buf, float *o) {
  const int64_t G = H / KVH, row = KVH * D;
  for (int64_t j = 0; j < L; j++) {
    const float *k = kv_row(k_cache, t, (int64_t)table[j / bs] * bs + j % bs, row, buf);
    for (int64_t h = 0; h < H; h++) {
      const float *qh = q + h * D, *kh = k + (h / G) * D;
      float dot = 0.f;
      for (int64_t i = 0; i < D; i++) dot += qh[i] * kh[i];
      scores[h * L + j] = dot * scale;
    }
  }
  for (int64_t h = 0; h < H; h++) {
    float *sc = scores + h * L, m = -FLT_MAX, z = 0.f;
    for (int64_t j = 0; j < L; j++) m = sc[j] > m ? sc[j] : m;
    for (int64_t j = 0; j < L; j++) {
      sc[j] = expf(sc[j] - m);
      z += sc[j];
    }
    const float inv = 1.0f / z;
    for (int64_t j = 0; j < L; j++) sc[j] *= inv;
  }
  memset(o, 0, sizeof(float) * H * D);
  for (int64_t j = 0; j < L; j++) {
    const float *v = kv_row(v_cache, t, (int64_t)table[j / bs] * bs + j % bs, row, buf);
    for (int64_t h = 0; h < H; h++) {
      const float p = scores[h * L + j], *vh = v + (h / G) * D;
      float *oh = o + h * D;
      for (int64_t i = 0; i < D; i++) oh[i] += p * vh[i];
    }
  }
}

/* One query token per sequence against its paged context (softmax(q K^T * scale) V).
 * q: [n, H, D], row stride q_stride; caches: [num_blocks * bs, KVH, D]; tables: [n,
 * table_stride] block ids; lens: [n] context tokens (>= 1); out: [n, H, D], row stride
 * out_stride; kv_type: the caches' element type (vec.h). Query head h reads KV head h / (H / KVH) (grouped-query attention). Each
 * token's K and V rows (all KV heads, contiguous, and a block's tokens contiguous) are
 * read once, in cache order, for every head: the cache streams from memory at long
 * contexts, so its order of access sets the speed. Sequences are shared among `threads`
 * OpenMP threads once the step holds DECODE_PARALLEL_MIN context tokens. Returns 0, or -1
 * without memory. */
int decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                     const void *v_cache, const int32_t *tables, int64_t table_stride,
                     const int32_t *lens, int64_t n, int64_t H, int64_t KVH, int64_t D,
                     int64_t bs, float scale, float *out, int64_t out_stride, int64_t threads,
                     int64_t kv_type) {

  int64_t max_len = 1, total = 0;
  int err = 0;
  for (int64_t s = 0; s < n; s++) {
    max_len = lens[s] > max_len ? lens[s] : max_len;
    total += lens[s];
  }
#pragma omp parallel num_threads(total >= DECODE_PARALLEL_MIN ? threads : 1)
  {
    float *scores = malloc(sizeof(float) * (H * max_len + KVH * D));
    if (!scores) __atomic_store_n(&err, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, 1)
    for (int64_t s = 0; s < n; s++)
      if (scores)
        decode_one(q + s * q_stride, k_cache, v_cache, (int)kv_type, tables + s * table_stride,
                   lens[s], H, KVH, D, bs, scale, scores, scores + H * max_len,
                   out + s * out_stride);
    free(scores);
  }
  return err ? -1 : 0;
}
