/* A decode step's decoder layers in one call (engine/quant/decode_stack.py).
 *
 * A step whose rows are all decodes runs, per layer, four products on packed weights and
 * seven small kernels (engine/cpu/kernels.c), the same calls in the same order as
 * engine/kernel_layers.KernelDecoderLayer makes them from Python; here they are made from
 * C, so that the step pays no Python dispatch between them (tens of microseconds a layer
 * at one row). The results are the same bit for bit.
 *
 * The small kernels are those of the other library, reached through the function
 * pointers in `struct dstep` (their signatures are engine/cpu/kernels.c's). Compiled for
 * the target's baseline: it only orchestrates.
 */
#include <stdint.h>
#include <stdlib.h>

int q_matmul(int type, const uint8_t *w, int64_t rb, int64_t nrows, int64_t k, const float *x,
             int64_t xs, int64_t m, float *y, int64_t ys, const float *bias, int64_t threads);

/* A row block of a packed weight [rows, k] (engine/quant/formats.py). */
struct qpart {
  int64_t type;
  const uint8_t *w;
  int64_t row_bytes, rows, k;
};

/* A projection: up to QLIN_PARTS row blocks stacked (a fused q/k/v whose parts differ in
 * format), each writing its own columns of the output. */
#define QLIN_PARTS 3
struct qlin {
  int64_t nparts, rows; /* rows: all the parts' */
  struct qpart parts[QLIN_PARTS];
  const float *bias; /* [rows] or NULL */
};

struct dlayer {
  struct qlin qkv, o, gate_up, down;
  const float *norm1, *norm2; /* [hidden] */
  float eps1, eps2;
  void *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim], kv_type */
};

typedef void (*rms_fn)(float *, int64_t, const float *, int64_t, const float *, float *, int64_t,
                       int64_t, float, int64_t);
typedef void (*silu_fn)(const float *, float *, int64_t, int64_t, int64_t);
typedef void (*rope_fn)(float *, int64_t, int64_t, int64_t, int64_t, const float *,
                        const float *, int64_t);
typedef void (*cache_fn)(const float *, int64_t, const float *, int64_t, const int64_t *, int64_t,
                         int64_t, void *, void *, int64_t, int64_t);
typedef int (*attn_fn)(const float *, int64_t, const void *, const void *, const int32_t *,
                       int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                       float, float *, int64_t, int64_t, int64_t);

struct dstep {
  int64_t rows;                  /* decodes in the step, one row each */
  const float *cos, *sin;        /* [rows, head_dim] */
  const int64_t *slots;          /* [rows] */
  const int32_t *tables;         /* [rows, table_stride] */
  int64_t table_stride;
  const int32_t *lens;           /* [rows] */
  int64_t hidden, heads, kv_heads, head_dim, block_size, intermediate;
  float scale;
  int64_t threads;               /* for the products and the attention */
  int64_t kv_type;               /* the caches' element type (engine/cpu/vec.h) */
  rms_fn rms_norm;
  silu_fn silu_mul;
  rope_fn rope;
  cache_fn cache_write;
  attn_fn decode_attention;
};

static int product(const struct qlin *l, const float *x, int64_t xs, int64_t m, float *y,
                   int64_t threads) {
  int64_t col = 0;
  for (int64_t i = 0; i < l->nparts; i++) {
    const struct qpart *p = &l->parts[i];
    const int rc = q_matmul((int)p->type, p->w, p->row_bytes, p->rows, p->k, x, xs, m, y + col,
                            l->rows, l->bias ? l->bias + col : NULL, threads);
    if (rc) return rc;
    col += p->rows;
  }
  return 0;
}

/* Run layers[0..n) on the residual stream h ([rows, hidden], updated in place). scratch
 * holds rows x (hidden + qkv width + q width + 2 intermediate + hidden) floats. Returns
 * 0, or the first nonzero code of a kernel (-1 unknown format, -2 out of memory, or the
 * attention's). */
int q_decode_layers(const struct dlayer *layers, int64_t n, const struct dstep *st, float *h,
                    float *scratch) {
  const int64_t t = st->rows, hid = st->hidden, d = st->head_dim;
  const int64_t q_size = st->heads * d, kv_size = st->kv_heads * d;
  const int64_t qkv_w = q_size + 2 * kv_size, inter = st->intermediate;
  float *x = scratch, *qkv = x + t * hid, *att = qkv + t * qkv_w, *gu = att + t * q_size;
  float *a = gu + t * 2 * inter, *y = a + t * inter;
  for (int64_t i = 0; i < n; i++) {
    const struct dlayer *L = &layers[i];
    int rc;
    st->rms_norm(h, hid, NULL, 0, L->norm1, x, t, hid, L->eps1, 1);
    if ((rc = product(&L->qkv, x, hid, t, qkv, st->threads))) return rc;
    st->rope(qkv, qkv_w, t, st->heads, d, st->cos, st->sin, 1);
    st->rope(qkv + q_size, qkv_w, t, st->kv_heads, d, st->cos, st->sin, 1);
    st->cache_write(qkv + q_size, qkv_w, qkv + q_size + kv_size, qkv_w, st->slots, t, kv_size,
                    L->k_cache, L->v_cache, 1, st->kv_type);
    rc = st->decode_attention(qkv, qkv_w, L->k_cache, L->v_cache, st->tables, st->table_stride,
                              st->lens, t, st->heads, st->kv_heads, d, st->block_size, st->scale,
                              att, q_size, st->threads, st->kv_type);
    if (rc) return rc;
    if ((rc = product(&L->o, att, q_size, t, y, st->threads))) return rc;
    st->rms_norm(h, hid, y, hid, L->norm2, x, t, hid, L->eps2, 1);
    if ((rc = product(&L->gate_up, x, hid, t, gu, st->threads))) return rc;
    st->silu_mul(gu, a, t, inter, 1);
    if ((rc = product(&L->down, a, inter, t, y, st->threads))) return rc;
    for (int64_t j = 0; j < t * hid; j++) h[j] += y[j];
  }
  return 0;
}
