/* Row-wise element ops of a decoder layer, fp32 (adaflash/models/row_ops.py): RMSNorm with the
 * residual add fused in, and SiLU(gate) * up. Each row is computed alone, in a fixed order, so its
 * bits do not depend on the rows beside it (a verify of k̂ rows, a decode of 1). */
#include "vec8.h"

/* With a != NULL: s = x + a is written to sum and normed into y; else y = norm(x). */
void add_rms_norm(const float *x, const float *a, const float *w, float eps, float *sum, float *y, long N,
                  long H, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (N > 1)
  for (long r = 0; r < N; r++) {
    const float *xr = x + r * H;
    if (a) {
      for (long i = 0; i < H; i += 8) store8(sum + r * H + i, load8(xr + i) + load8(a + r * H + i));
      xr = sum + r * H;
    }
    norm_row(xr, w, eps, y + r * H, H);
  }
}

/* gu [N][2I] = [gate | up] -> y [N][I] = gate / (1 + exp(-gate)) * up (I % 8 == 0) */
void silu_mul(const float *gu, float *y, long N, long I, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (N * I >= 4096)
  for (long r = 0; r < N; r++) {
    const float *g = gu + r * 2 * I, *u = g + I;
    for (long i = 0; i < I; i += 8) {
      v8 gv = load8(g + i);
      store8(y + r * I + i, gv / (1.0f + exp8(-gv)) * load8(u + i));
    }
  }
}
