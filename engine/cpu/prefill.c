/* Causal prefill attention on the paged KV cache, across OpenMP threads; loaded with
 * engine/cpu/kernels.c (see the conventions there). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* ---- Prefill attention: causal, on the paged cache in place, across threads. ----
 * Scores are kept transposed, St[key][row], so that a unit's query rows (TILE_Q tokens x
 * the G heads of one KV head) fill the vector lanes: each K row is read in place from the
 * cache, its elements broadcast, and the softmax runs across rows in the lanes. */
#define TILE_Q 16 /* query tokens per work unit: G * TILE_Q rows share each K/V row read */
#define KEYS_QK 8 /* keys per score tile (with up to RV_QK row vectors: 24 accumulators) */
#define RV_QK 3
#define ROWS_PV 6 /* output rows per register tile (6 x 64 floats = 24 accumulators) */
#define MASKED (-1e30f) /* a finite -inf: -ffast-math assumes no infinities */

struct prefill_job {
  const float *q;
  const void *k_cache, *v_cache; /* element type kv_type (vec.h) */
  const int32_t *tables, *qsl, *lens;
  float *out;
  int64_t q_stride, table_stride, out_stride, H, KVH, D, bs, s0, n_units;
  int64_t max_keys; /* longest context of any sequence, rounded up to KEYS_QK */
  float scale;
  int64_t next; /* next work unit, taken atomically */
  int err;
  int kv_type;
};

/* St[kk][r] = K_kk . Qt[:, r] for KEYS_QK keys (rows kp[kk], each D floats) and the rv row
 * vectors from r0 (rv <= RV_QK; a constant where inlined, so the tile stays in registers).
 * qt: [D][rp] (query rows transposed), st: [KEYS_QK][rp]. */
static inline __attribute__((always_inline)) void qk_tile(const float *qt, int64_t rp,
                                                          int64_t r0, int rv,
                                                          const float *const *kp, int64_t D,
                                                          float *st) {
  vf acc[KEYS_QK][RV_QK];
  memset(acc, 0, sizeof acc);
  for (int64_t d = 0; d < D; d++) {
    vf qv[RV_QK];
    for (int v = 0; v < rv; v++) qv[v] = vload(qt + d * rp + r0 + v * VL);
    for (int kk = 0; kk < KEYS_QK; kk++) {
      const float kd = kp[kk][d];
      for (int v = 0; v < rv; v++) acc[kk][v] += kd * qv[v];
    }
  }
  for (int kk = 0; kk < KEYS_QK; kk++)
    for (int v = 0; v < rv; v++) memcpy(st + kk * rp + r0 + v * VL, &acc[kk][v], sizeof(vf));
}

/* Scores St[j][r] for keys [0, nk) and rows [0, rp) (rp a multiple of VL); keys past nk up
 * to KEYS_QK read `zeros`. */
static void qk_scores(const struct prefill_job *j, const float *qt, int64_t rp,
                      const int64_t *slots, int64_t nk, int64_t g, const float *zeros,
                      float *st) {
  const int64_t D = j->D, row = j->KVH * D;
  for (int64_t kb = 0; kb < nk; kb += KEYS_QK) {
    const float *kp[KEYS_QK];
    for (int kk = 0; kk < KEYS_QK; kk++)
      kp[kk] = kb + kk < nk ? (const float *)j->k_cache + slots[kb + kk] * row + g * D : zeros;
    float *st_b = st + kb * rp;
    int64_t r0 = 0;
    for (; r0 + RV_QK * VL <= rp; r0 += RV_QK * VL) qk_tile(qt, rp, r0, RV_QK, kp, D, st_b);
    if (rp - r0 == 2 * VL) qk_tile(qt, rp, r0, 2, kp, D, st_b);
    if (rp - r0 == VL) qk_tile(qt, rp, r0, 1, kp, D, st_b);
  }
}

/* Softmax over keys of each row r (a column of St), in place: keys at or past valid[r] are
 * masked (only the last `diag` keys can be); writes 1 / sum into inv[r]. rp: a multiple
 * of VL. */
static void softmax_cols(float *st, int64_t nk, int64_t rp, const int64_t *valid,
                         int64_t diag, float *inv) {
  for (int64_t k = nk - diag; k < nk; k++)
    for (int64_t r = 0; r < rp; r++)
      if (k >= valid[r]) st[k * rp + r] = MASKED;
  for (int64_t r0 = 0; r0 < rp; r0 += VL) {
    vf m = vload(st + r0), z = m - m;
    for (int64_t k = 1; k < nk; k++) {
      const vf x = vload(st + k * rp + r0);
      const vi gt = x > m;
      m = (vf)(((vi)x & gt) | ((vi)m & ~gt));
    }
    for (int64_t k = 0; k < nk; k++) {
      const vf e = vexp(vload(st + k * rp + r0) - m);
      memcpy(st + k * rp + r0, &e, sizeof e);
      z += e;
    }
    const vf one = z - z + 1.0f, iz = one / z;
    memcpy(inv + r0, &iz, sizeof iz);
  }
}

/* O[r] = inv[r] * sum_k P[k][r] V[k] for nr rows from r0 (nr <= ROWS_PV; a constant where
 * inlined, so the tile stays in registers); row r goes to dst[r] (none where NULL).
 * p: [nk][rp]. D is a multiple of 4 * VL. */
static inline __attribute__((always_inline)) void pv_tile(
    const struct prefill_job *j, const float *p, int64_t rp, int64_t r0, int nr, int64_t nk,
    const int64_t *slots, int64_t g, const float *inv, float *const *dst) {
  const int64_t D = j->D, row = j->KVH * D;
  for (int64_t dc = 0; dc < D; dc += 4 * VL) {
    vf acc[ROWS_PV][4];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < nk; k++) {
      const float *v = (const float *)j->v_cache + slots[k] * row + g * D + dc;
      const vf v0 = vload(v), v1 = vload(v + VL), v2 = vload(v + 2 * VL), v3 = vload(v + 3 * VL);
      for (int r = 0; r < nr; r++) {
        const float pr = p[k * rp + r0 + r];
        acc[r][0] += pr * v0;
        acc[r][1] += pr * v1;
        acc[r][2] += pr * v2;
        acc[r][3] += pr * v3;
      }
    }
    for (int r = 0; r < nr; r++) {
      if (!dst[r0 + r]) continue;
      for (int c = 0; c < 4; c++) {
        const vf o = acc[r][c] * inv[r0 + r];
        memcpy(dst[r0 + r] + dc + c * VL, &o, sizeof o);
      }
    }
  }
}

/* pv_tile over rows [0, rp), rp a multiple of VL. */
static void pv_rows(const struct prefill_job *j, const float *p, int64_t rp, int64_t nk,
                    const int64_t *slots, int64_t g, const float *inv, float *const *dst) {
  int64_t r0 = 0;
  for (; r0 + ROWS_PV <= rp; r0 += ROWS_PV) pv_tile(j, p, rp, r0, ROWS_PV, nk, slots, g, inv, dst);
  for (; r0 < rp; r0 += 2) pv_tile(j, p, rp, r0, 2, nk, slots, g, inv, dst);
}

struct prefill_scratch {
  float *qt, *zeros, *st, *inv;
  int64_t *slots, *valid;
  float **dst;
  float *k32, *v32; /* a 16-bit cache's K and V rows of one unit, as fp32 [keys][D] */
  int64_t *ident;   /* 0, 1, 2, ...: the slots of those rows */
};

/* One work unit: TILE_Q query tokens of sequence s, the G query heads of KV head g. */
static void prefill_unit(const struct prefill_job *j, struct prefill_scratch *w, int64_t s,
                         int64_t g, int64_t t0) {
  const int64_t D = j->D, G = j->H / j->KVH, q0 = j->qsl[s];
  const int64_t lq = j->qsl[s + 1] - q0, ctx0 = j->lens[s] - lq;
  const int64_t nt = lq - t0 < TILE_Q ? lq - t0 : TILE_Q, rows = nt * G;
  const int64_t rp = (rows + VL - 1) / VL * VL, nk = ctx0 + t0 + nt;
  const int32_t *table = j->tables + s * j->table_stride;
  for (int64_t k0 = 0; k0 < nk; k0 += j->bs) {
    const int64_t base = (int64_t)table[k0 / j->bs] * j->bs;
    for (int64_t i = 0; i < j->bs && k0 + i < nk; i++) w->slots[k0 + i] = base + i;
  }
  for (int64_t r = 0; r < rp; r++) {
    w->valid[r] = nk;
    w->dst[r] = NULL;
    if (r >= rows) {
      for (int64_t d = 0; d < D; d++) w->qt[d * rp + r] = 0.f;
      continue;
    }
    const int64_t t = q0 + t0 + r / G, h = g * G + r % G;
    const float *src = j->q + t * j->q_stride + h * D;
    for (int64_t d = 0; d < D; d++) w->qt[d * rp + r] = src[d] * j->scale;
    w->valid[r] = ctx0 + t0 + r / G + 1;
    w->dst[r] = j->out + t * j->out_stride + h * D;
  }
  if (j->kv_type != KV_F32) {
    /* The unit's K and V rows of KV head g, converted once: the scores and the output
     * then run the fp32 loops on them, as one KV head of D-wide rows. The conversion is
     * one pass over rows that G * TILE_Q query rows read. */
    const int64_t es = kv_size(j->kv_type), row = j->KVH * D;
    for (int64_t k = 0; k < nk; k++) {
      const int64_t off = (w->slots[k] * row + g * D) * es;
      kv_to_f32((const char *)j->k_cache + off, j->kv_type, w->k32 + k * D, D);
      kv_to_f32((const char *)j->v_cache + off, j->kv_type, w->v32 + k * D, D);
    }
    struct prefill_job one = *j;
    one.k_cache = w->k32, one.v_cache = w->v32, one.KVH = 1;
    qk_scores(&one, w->qt, rp, w->ident, nk, 0, w->zeros, w->st);
    softmax_cols(w->st, nk, rp, w->valid, nt, w->inv);
    pv_rows(&one, w->st, rp, nk, w->ident, 0, w->inv, w->dst);
    return;
  }
  qk_scores(j, w->qt, rp, w->slots, nk, g, w->zeros, w->st);
  softmax_cols(w->st, nk, rp, w->valid, nt, w->inv);
  pv_rows(j, w->st, rp, nk, w->slots, g, w->inv, w->dst);
}

/* One thread's share: work units taken one at a time until none is left. */
static void prefill_worker(struct prefill_job *j) {
  const int64_t G = j->H / j->KVH, D = j->D;
  const int64_t rmax = (TILE_Q * G + VL - 1) / VL * VL;
  const int wide = j->kv_type != KV_F32;
  struct prefill_scratch w = {
      malloc(sizeof(float) * rmax * D), calloc(D, sizeof(float)),
      malloc(sizeof(float) * rmax * j->max_keys), malloc(sizeof(float) * rmax),
      malloc(sizeof(int64_t) * j->max_keys),
      malloc(sizeof(int64_t) * rmax), malloc(sizeof(float *) * rmax),
      wide ? malloc(sizeof(float) * j->max_keys * D) : NULL,
      wide ? malloc(sizeof(float) * j->max_keys * D) : NULL,
      wide ? malloc(sizeof(int64_t) * j->max_keys) : NULL};
  int64_t u;
  if (wide && w.ident)
    for (int64_t k = 0; k < j->max_keys; k++) w.ident[k] = k;
  if (!(w.qt && w.zeros && w.st && w.inv && w.slots && w.valid && w.dst) ||
      (wide && !(w.k32 && w.v32 && w.ident))) {
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
  free(w.qt), free(w.zeros), free(w.st), free(w.inv);
  free(w.slots), free(w.valid), free(w.dst);
  free(w.k32), free(w.v32), free(w.ident);
}

/* Causal attention of sequences [s0, s0 + n_seqs) of a step, each query token against its
 * sequence's paged context up to its own position (its chunk's K/V already in the cache).
 * q, out: [T, H, D] (row strides q_stride, out_stride); caches: [num_blocks * bs, KVH, D];
 * tables: [B, table_stride] block ids; qsl: [B + 1] query row offsets; lens: [B] context
 * tokens after the step. Query token t of sequence s sits at position
 * lens[s] - (qsl[s+1] - qsl[s]) + t. D must be a multiple of 64. Exact softmax per row
 * (scores in memory, not online), so no rescaling. Work units (16 query tokens x one KV
 * head) are shared among `threads` OpenMP threads. kv_type: the caches' element type
 * (vec.h).
 * Returns 0, -1 without memory, -2 for an unsupported D. */
int prefill_attention(const float *q, int64_t q_stride, const void *k_cache,
                      const void *v_cache, const int32_t *tables, int64_t table_stride,
                      const int32_t *qsl, const int32_t *lens, int64_t s0, int64_t n_seqs,
                      int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *out,
                      int64_t out_stride, int64_t threads, int64_t kv_type) {
  if (D % (4 * VL) != 0) return -2;
  struct prefill_job j = {q,   k_cache, v_cache, tables, qsl,   lens, out, q_stride,
                          table_stride, out_stride, H, KVH,   D,     bs,   s0,  0,
                          0,   scale,   0,       0,      (int)kv_type};
  for (int64_t s = s0; s < s0 + n_seqs; s++) {
    j.n_units += (qsl[s + 1] - qsl[s] + TILE_Q - 1) / TILE_Q * KVH;
    j.max_keys = lens[s] > j.max_keys ? lens[s] : j.max_keys;
  }
  j.max_keys = (j.max_keys + KEYS_QK - 1) / KEYS_QK * KEYS_QK;
#pragma omp parallel num_threads(threads)
  prefill_worker(&j);
  return j.err ? -1 : 0;
}
