/* Eight-lane fp32 helpers shared by our kernels: GCC/Clang vector extensions, no intrinsics, so
 * the same source builds for any -march (AVX2: one ymm register per v8). Every reduction is
 * written out in a fixed order; without -ffast-math the compiler may not reassociate it, so a
 * row's bits depend only on its own inputs. */
#ifndef ADAFLASH_VEC8_H
#define ADAFLASH_VEC8_H
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8 v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

static inline v8 select8(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* exp(x), ~2 ulp: Cody-Waite range reduction and Cephes' degree-6 polynomial. Inputs are clamped
 * to [-87, 88]; below -87 the result is exactly 0 (softmax pads rely on it). */
static inline v8 exp8(v8 x) {
  const v8 lo = (v8){0} - 87.0f, hi = (v8){0} + 88.0f;
  v8i under = x < lo;
  x = select8(x > hi, hi, select8(under, lo, x));
  const v8 shifter = (v8){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  v8 n = (x * 1.44269504088896341f + shifter) - shifter;
  v8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v8 p = (v8){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  /* 2^n in two halves: n reaches 127 at x = 88, one past the largest finite exponent field */
  v8i half = __builtin_convertvector(n, v8i) >> 1;
  v8 y = p * (v8)((half + 127) << 23) * (v8)((__builtin_convertvector(n, v8i) - half + 127) << 23);
  return select8(under, (v8){0}, y);
}

/* y[r] = x[r] * w / sqrt(mean(x[r]^2) + eps), over H features (H % 8 == 0) */
static inline void norm_row(const float *x, const float *w, float eps, float *y, long H) {
  v8 acc = {0};
  for (long i = 0; i < H; i += 8) {
    v8 v = load8(x + i);
    acc += v * v;
  }
  float rstd = 1.0f / __builtin_sqrtf(hsum8(acc) / (float)H + eps);
  for (long i = 0; i < H; i += 8) store8(y + i, load8(x + i) * rstd * load8(w + i));
}

#endif
