/* Fused fp32 CPU kernels; loaded by engine/cpu_kernels.py.
 *
 * The small ones replace several PyTorch ops whose fixed dispatch cost (3-10 us each on the
 * 2-core host this was written on) dominates at the row counts of decode steps; they run on
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
 * PyTorch's silu and mul take two and a temporary. Rows are shared among `threads` OpenMP
 * threads (prefill steps: thousands of rows). */
void silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gu + r * 2 * n, *u = g + n;
    float *o = out + r * n;
    for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}

/* Rotary embedding in place, halves rotated as transformers' rotate_half (GPT-NeoX
 * layout): with x = [x1 | x2] per head, x1' = x1 cos1 - x2 sin1, x2' = x2 cos2 + x1 sin2.
 * x: [rows, heads, d] with row stride x_stride; cos, sin: [rows, d]. */
void rope(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d,
          const float *cos, const float *sin) {
  const int64_t half = d / 2;
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

/* cache[slots[r]] = src[r] for K and V: caches [num_slots, width], sources row-strided. */
void cache_write(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                 const int64_t *slots, int64_t rows, int64_t width, float *k_cache,
                 float *v_cache) {
  for (int64_t r = 0; r < rows; r++) {
    memcpy(k_cache + slots[r] * width, k + r * k_stride, width * sizeof(float));
    memcpy(v_cache + slots[r] * width, v + r * v_stride, width * sizeof(float));
  }
}

/* Decode attention of one sequence: query q ([H, D]) against its L context tokens, read
 * through its block table; scores: [H, L] scratch. */
static void decode_one(const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *table, int64_t L, int64_t H, int64_t KVH, int64_t D,
                       int64_t bs, float scale, float *scores, float *o) {
  const int64_t G = H / KVH, row = KVH * D;
  for (int64_t j = 0; j < L; j++) {
    const float *k = k_cache + ((int64_t)table[j / bs] * bs + j % bs) * row;
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
    const float *v = v_cache + ((int64_t)table[j / bs] * bs + j % bs) * row;
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
 * out_stride. Query head h reads KV head h / (H / KVH) (grouped-query attention). Each
 * token's K and V rows (all KV heads, contiguous, and a block's tokens contiguous) are
 * read once, in cache order, for every head: the cache streams from memory at long
 * contexts, so its order of access sets the speed. Sequences are shared among `threads`
 * OpenMP threads once the step holds DECODE_PARALLEL_MIN context tokens. Returns 0, or -1
 * without memory. */
int decode_attention(const float *q, int64_t q_stride, const float *k_cache,
                     const float *v_cache, const int32_t *tables, int64_t table_stride,
                     const int32_t *lens, int64_t n, int64_t H, int64_t KVH, int64_t D,
                     int64_t bs, float scale, float *out, int64_t out_stride,
                     int64_t threads) {
  int64_t max_len = 1, total = 0;
  int err = 0;
  for (int64_t s = 0; s < n; s++) {
    max_len = lens[s] > max_len ? lens[s] : max_len;
    total += lens[s];
  }
#pragma omp parallel num_threads(total >= DECODE_PARALLEL_MIN ? threads : 1)
  {
    float *scores = malloc(sizeof(float) * H * max_len);
    if (!scores) __atomic_store_n(&err, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, 1)
    for (int64_t s = 0; s < n; s++)
      if (scores)
        decode_one(q + s * q_stride, k_cache, v_cache, tables + s * table_stride, lens[s], H,
                   KVH, D, bs, scale, scores, out + s * out_stride);
    free(scores);
  }
  return err ? -1 : 0;
}

/* ---- Prefill attention: causal, on the paged cache in place, across threads. ---- */

/* 16 floats: one AVX-512 register, two AVX2 or four NEON ones; unaligned loads via memcpy. */
typedef float vf __attribute__((vector_size(64)));
#define VL 16
#define TILE_Q 16 /* query tokens per work unit: G * TILE_Q rows share each K/V row read */
#define ROWS_QK 8 /* score rows per register tile */
#define ROWS_PV 4 /* output rows per register tile (4 x 64 floats = 16 accumulators) */

static inline vf vload(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

struct prefill_job {
  const float *q, *k_cache, *v_cache;
  const int32_t *tables, *qsl, *lens;
  float *out;
  int64_t q_stride, table_stride, out_stride, H, KVH, D, bs, s0, n_units;
  int64_t max_keys; /* longest context of any sequence, rounded up to VL */
  float scale;
  int64_t next; /* next work unit, taken atomically */
  int err;
};

/* Scores S[r][j] = Qt[r] . K[j] for rows [0, rows) (a multiple of ROWS_QK) and keys
 * [0, nk), nk_pad = nk rounded up to VL. K rows are gathered 16 at a time into kt (D x VL,
 * transposed) so that each is read once for all rows. */
static void qk_scores(const struct prefill_job *j, const float *qt, int64_t rows,
                      const int64_t *slots, int64_t nk, int64_t g, float *kt, float *s,
                      int64_t nk_pad) {
  const int64_t D = j->D, row = j->KVH * D;
  for (int64_t kb = 0; kb < nk; kb += VL) {
    for (int64_t jj = 0; jj < VL; jj++) {
      const float *k = kb + jj < nk ? j->k_cache + slots[kb + jj] * row + g * D : NULL;
      for (int64_t d = 0; d < D; d++) kt[d * VL + jj] = k ? k[d] : 0.f;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS_QK) {
      vf acc[ROWS_QK] = {0};
      for (int64_t d = 0; d < D; d++) {
        const vf kv = vload(kt + d * VL);
        for (int r = 0; r < ROWS_QK; r++) acc[r] += qt[(r0 + r) * D + d] * kv;
      }
      for (int r = 0; r < ROWS_QK; r++) memcpy(s + (r0 + r) * nk_pad + kb, &acc[r], sizeof(vf));
    }
  }
}

/* Row r's softmax over its keys [0, valid[r]) in place, zero beyond up to nk_pad;
 * returns nothing, writes 1 / sum into inv[r] (applied at the output). */
static void softmax_rows(float *s, int64_t rows, const int64_t *valid, int64_t nk_pad,
                         float *inv) {
  for (int64_t r = 0; r < rows; r++) {
    float *sr = s + r * nk_pad, m = -FLT_MAX, z = 0.f;
    const int64_t n = valid[r];
    for (int64_t i = 0; i < n; i++) m = sr[i] > m ? sr[i] : m;
    for (int64_t i = 0; i < n; i++) {
      sr[i] = expf(sr[i] - m);
      z += sr[i];
    }
    for (int64_t i = n; i < nk_pad; i++) sr[i] = 0.f;
    inv[r] = n > 0 ? 1.0f / z : 0.f;
  }
}

/* O[r] = inv[r] * sum_j P[r][j] V[j] for rows [0, rows) (a multiple of ROWS_PV); row r goes
 * to dst[r]. D is a multiple of 4 * VL. */
static void pv_rows(const struct prefill_job *j, const float *p, int64_t rows, int64_t nk,
                    int64_t nk_pad, const int64_t *slots, int64_t g, const float *inv,
                    float *const *dst) {
  const int64_t D = j->D, row = j->KVH * D;
  for (int64_t r0 = 0; r0 < rows; r0 += ROWS_PV) {
    for (int64_t dc = 0; dc < D; dc += 4 * VL) {
      vf acc[ROWS_PV][4];
      memset(acc, 0, sizeof acc);
      for (int64_t k = 0; k < nk; k++) {
        const float *v = j->v_cache + slots[k] * row + g * D + dc;
        const vf v0 = vload(v), v1 = vload(v + VL), v2 = vload(v + 2 * VL),
                 v3 = vload(v + 3 * VL);
        for (int r = 0; r < ROWS_PV; r++) {
          const float pr = p[(r0 + r) * nk_pad + k];
          acc[r][0] += pr * v0;
          acc[r][1] += pr * v1;
          acc[r][2] += pr * v2;
          acc[r][3] += pr * v3;
        }
      }
      for (int r = 0; r < ROWS_PV; r++) {
        if (!dst[r0 + r]) continue;
        for (int c = 0; c < 4; c++) {
          const vf o = acc[r][c] * inv[r0 + r];
          memcpy(dst[r0 + r] + dc + c * VL, &o, sizeof o);
        }
      }
    }
  }
}

struct prefill_scratch {
  float *qt, *kt, *s, *inv;
  int64_t *slots, *valid;
  float **dst;
};

/* One work unit: TILE_Q query tokens of sequence s, the G query heads of KV head g. */
static void prefill_unit(const struct prefill_job *j, struct prefill_scratch *w, int64_t s,
                         int64_t g, int64_t t0) {
  const int64_t D = j->D, G = j->H / j->KVH, q0 = j->qsl[s];
  const int64_t lq = j->qsl[s + 1] - q0, ctx0 = j->lens[s] - lq;
  const int64_t nt = lq - t0 < TILE_Q ? lq - t0 : TILE_Q, rows = nt * G;
  const int64_t rows_pad = (rows + ROWS_QK - 1) / ROWS_QK * ROWS_QK;
  const int64_t nk = ctx0 + t0 + nt, nk_pad = (nk + VL - 1) / VL * VL;
  const int32_t *table = j->tables + s * j->table_stride;
  for (int64_t k = 0; k < nk; k++) w->slots[k] = (int64_t)table[k / j->bs] * j->bs + k % j->bs;
  for (int64_t r = 0; r < rows_pad; r++) {
    float *qt = w->qt + r * D;
    if (r >= rows) {
      memset(qt, 0, sizeof(float) * D);
      w->valid[r] = 0;
      w->dst[r] = NULL;
      continue;
    }
    const int64_t t = q0 + t0 + r / G, h = g * G + r % G;
    const float *src = j->q + t * j->q_stride + h * D;
    for (int64_t d = 0; d < D; d++) qt[d] = src[d] * j->scale;
    w->valid[r] = ctx0 + t0 + r / G + 1;
    w->dst[r] = j->out + t * j->out_stride + h * D;
  }
  qk_scores(j, w->qt, rows_pad, w->slots, nk, g, w->kt, w->s, nk_pad);
  softmax_rows(w->s, rows_pad, w->valid, nk_pad, w->inv);
  pv_rows(j, w->s, rows_pad, nk, nk_pad, w->slots, g, w->inv, w->dst);
}

/* One thread's share: work units taken one at a time until none is left. */
static void prefill_worker(struct prefill_job *j) {
  const int64_t G = j->H / j->KVH;
  const int64_t rmax = (TILE_Q * G + ROWS_QK - 1) / ROWS_QK * ROWS_QK;
  struct prefill_scratch w = {
      malloc(sizeof(float) * rmax * j->D), malloc(sizeof(float) * j->D * VL),
      malloc(sizeof(float) * rmax * j->max_keys), malloc(sizeof(float) * rmax),
      malloc(sizeof(int64_t) * j->max_keys), malloc(sizeof(int64_t) * rmax),
      malloc(sizeof(float *) * rmax)};
  int64_t u;
  if (!(w.qt && w.kt && w.s && w.inv && w.slots && w.valid && w.dst)) {
    __atomic_store_n(&j->err, 1, __ATOMIC_RELAXED);
  } else {
    while ((u = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->n_units) {
      /* Units run sequence by sequence, each sequence's last (longest) tiles first. */
      int64_t s = j->s0;
      for (;; s++) {
        const int64_t lq = j->qsl[s + 1] - j->qsl[s];
        const int64_t n = (lq + TILE_Q - 1) / TILE_Q * j->KVH;
        if (u < n) break;
        u -= n;
      }
      const int64_t lq = j->qsl[s + 1] - j->qsl[s], tiles = (lq + TILE_Q - 1) / TILE_Q;
      prefill_unit(j, &w, s, u % j->KVH, (tiles - 1 - u / j->KVH) * TILE_Q);
    }
  }
  free(w.qt), free(w.kt), free(w.s), free(w.inv), free(w.slots), free(w.valid), free(w.dst);
}

/* Causal attention of sequences [s0, s0 + n_seqs) of a step, each query token against its
 * sequence's paged context up to its own position (its chunk's K/V already in the cache).
 * q, out: [T, H, D] (row strides q_stride, out_stride); caches: [num_blocks * bs, KVH, D];
 * tables: [B, table_stride] block ids; qsl: [B + 1] query row offsets; lens: [B] context
 * tokens after the step. Query token t of sequence s sits at position
 * lens[s] - (qsl[s+1] - qsl[s]) + t. D must be a multiple of 64. Exact softmax per row
 * (scores in memory, not online), so no rescaling. Work units (16 query tokens x one KV
 * head) are shared among `threads` OpenMP threads.
 * Returns 0, -1 without memory, -2 for an unsupported D. */
int prefill_attention(const float *q, int64_t q_stride, const float *k_cache,
                      const float *v_cache, const int32_t *tables, int64_t table_stride,
                      const int32_t *qsl, const int32_t *lens, int64_t s0, int64_t n_seqs,
                      int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *out,
                      int64_t out_stride, int64_t threads) {
  if (D % (4 * VL) != 0) return -2;
  struct prefill_job j = {q, k_cache, v_cache, tables, qsl, lens, out, q_stride, table_stride,
                          out_stride, H, KVH, D, bs, s0, 0, 0, scale, 0, 0};
  for (int64_t s = s0; s < s0 + n_seqs; s++) {
    j.n_units += (qsl[s + 1] - qsl[s] + TILE_Q - 1) / TILE_Q * KVH;
    j.max_keys = lens[s] > j.max_keys ? lens[s] : j.max_keys;
  }
  j.max_keys = (j.max_keys + VL - 1) / VL * VL;
#pragma omp parallel num_threads(threads)
  prefill_worker(&j);
  return j.err ? -1 : 0;
}
