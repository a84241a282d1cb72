/* Causal attention of packed query rows against a slot KV cache, fp32, row-invariant by
 * construction (adaflash/models/slot_attention.py).
 *
 * Row n (a token of some request) reads its request's slot: keys and values at positions
 * 0 .. pos[n] of cache[slot[n]]. Each (row, kv head) is one task that attends its G = H / KVH
 * query heads to those keys in a fixed order: scores, their max, exp and sum, then the weighted
 * sum of values, each a sequential loop over positions. Nothing in a row's arithmetic depends on
 * the other rows in the call (a prefill of 300 rows, a verify of k̂, a decode of 1, other
 * requests' rows), so a token's output is the same bits in every one of them: what
 * token-identical speculation needs, with no masks, padding or per-request Python.
 *
 * Layouts: out [N][H][D]; cache_k and cache_v [slots][KVH][cap][D].
 * Build: cc -O3 -march=native -fopenmp -shared (with rowwise_matmul.c, one library).
 */
#include <stdlib.h>

#include "vec8.h"

/* K/V rows ahead to request while scoring this one: a task reads its slot from DRAM once. */
#define PREFETCH 8

/* One task: G query heads (qn, [G][D]) of one row against the L keys and values of one kv head
 * of its slot (kb, vb: [cap][D]); s is scratch for G x stride scores; o receives [G][D]. */
static void attend(const float *qn, const float *kb, const float *vb, long L, long G, long D, float scale,
                   float *s, long stride, float *o) {
  /* scores: one fma chain over D per (position, head), its 8 lanes summed in a fixed tree */
  for (long j = 0; j < L; j++) {
    const float *kj = kb + j * D;
    __builtin_prefetch(kj + PREFETCH * D);
    __builtin_prefetch(vb + j * D + 16); /* the values, for the pass after this one */
    for (long g = 0; g < G; g++) {
      const float *qg = qn + g * D;
      v8 acc = {0};
      for (long d = 0; d < D; d += 8) acc += load8(qg + d) * load8(kj + d);
      s[g * stride + j] = hsum8(acc) * scale;
    }
  }
  for (long g = 0; g < G; g++) {
    float *sg = s + g * stride;
    float m = sg[0];
    for (long j = 1; j < L; j++) m = sg[j] > m ? sg[j] : m;
    v8 sum = {0};
    long j = 0;
    for (; j + 8 <= L; j += 8) {
      v8 p = exp8(load8(sg + j) - m);
      store8(sg + j, p);
      sum += p;
    }
    if (j < L) { /* the tail: pad lanes past L contribute exactly 0 */
      float tail[8] = {0};
      memcpy(tail, sg + j, sizeof(float) * (L - j));
      v8 p = exp8(load8(tail) - m);
      for (long l = L - j; l < 8; l++) p[l] = 0.0f;
      memcpy(sg + j, &p, sizeof(float) * (L - j));
      sum += p;
    }
    float inv = 1.0f / hsum8(sum);
    /* values: per lane of D, one sequential fma chain over positions */
    for (long d0 = 0; d0 < D; d0 += 64) {
      long w = D - d0 < 64 ? D - d0 : 64;
      v8 acc[8] = {{0}};
      for (long jj = 0; jj < L; jj++) {
        v8 p = (v8){0} + sg[jj];
        const float *vj = vb + jj * D + d0;
        for (long c = 0; c < w / 8; c++) acc[c] += p * load8(vj + 8 * c);
      }
      for (long c = 0; c < w / 8; c++) store8(o + g * D + d0 + 8 * c, acc[c] * inv);
    }
  }
}

static int check(const long *slot, const long *pos, long N, long slots, long cap, long *span) {
  *span = 0;
  for (long n = 0; n < N; n++) {
    if (slot[n] < 0 || slot[n] >= slots || pos[n] < 0 || pos[n] >= cap) return -1;
    *span = pos[n] + 1 > *span ? pos[n] + 1 : *span;
  }
  return 0;
}

/* Attention of every row's G-head groups (q may be out itself: each task copies its q first). */
static void attend_all(const float *q, const float *cache_k, const float *cache_v, const long *slot,
                       const long *pos, float *out, long N, long H, long KVH, long cap, long D, float scale,
                       long span, int threads) {
  long G = H / KVH;
  long stride = (span + 7) & ~7L; /* scores of one head, padded to whole vectors */
#pragma omp parallel num_threads(threads)
  {
    float *s = malloc(sizeof(float) * (G * stride + G * D));
    float *qn = s + G * stride;
#pragma omp for schedule(dynamic, 1)
    for (long t = 0; t < N * KVH; t++) {
      long n = t / KVH, kvh = t % KVH;
      long base = (slot[n] * KVH + kvh) * cap * D;
      memcpy(qn, q + (n * H + kvh * G) * D, sizeof(float) * G * D); /* q may alias out */
      attend(qn, cache_k + base, cache_v + base, pos[n] + 1, G, D, scale, s, stride,
             out + (n * H + kvh * G) * D);
    }
    free(s);
  }
}

/* x·cos + rotate_half(x)·sin, with rotate_half's sign carried by sin (models/layers.rope_tables) */
static void rope(const float *x, const float *c, const float *s, float *y, long D) {
  long h = D / 2;
  for (long d = 0; d < h; d += 8) {
    v8 a = load8(x + d), b = load8(x + h + d);
    store8(y + d, a * load8(c + d) + b * load8(s + d));
    store8(y + h + d, b * load8(c + h + d) + a * load8(s + h + d));
  }
}

/* The whole attention of a layer from its fused projection qkv [N][(H + 2 KVH) D]: Qwen3's
 * per-head RMSNorm of q and k where q_norm / k_norm are given, RoPE on q and k (cos, sin [N][D]),
 * k and v written into the cache at (slot, pos), then attention into out [N][H][D]. D % 16 == 0.
 * Every row's K/V are written before any row attends: a verify's rows see each other's keys.
 * Returns 0, or -1 (nothing computed) if a row's slot or position is outside the cache. */
int slot_attention(const float *qkv, const float *cos, const float *sin, const float *q_norm,
                   const float *k_norm, float eps, const long *slot, const long *pos, float *cache_k,
                   float *cache_v, float *out, long N, long H, long KVH, long slots, long cap, long D,
                   float scale, int threads) {
  long span, width = (H + 2 * KVH) * D;
  if (check(slot, pos, N, slots, cap, &span)) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (N > 1)
  for (long n = 0; n < N; n++) {
    const float *row = qkv + n * width, *c = cos + n * D, *s = sin + n * D;
    float normed[D];
    for (long h = 0; h < H; h++) {
      const float *x = row + h * D;
      if (q_norm) norm_row(x, q_norm, eps, normed, D), x = normed;
      rope(x, c, s, out + (n * H + h) * D, D);
    }
    for (long kvh = 0; kvh < KVH; kvh++) {
      long at = ((slot[n] * KVH + kvh) * cap + pos[n]) * D;
      const float *x = row + (H + kvh) * D;
      if (k_norm) norm_row(x, k_norm, eps, normed, D), x = normed;
      rope(x, c, s, cache_k + at, D);
      memcpy(cache_v + at, row + (H + KVH + kvh) * D, sizeof(float) * D);
    }
  }
  attend_all(out, cache_k, cache_v, slot, pos, out, N, H, KVH, cap, D, scale, span, threads);
  return 0;
}
