/* y[M, N] = x[M, K] @ W[N, K]^T in fp32, batch-invariant by construction (adaflash/models/rowwise.py).
 *
 * Every output element is one sequential fused multiply-add chain over k = 0 .. K-1, started at 0,
 * whatever M is and wherever its row falls in a tile: a row's bits never depend on the other rows
 * in the call. Verifying k rows and decoding one therefore give the same logits, which is what
 * token-identical speculation needs. (oneDNN's 1-row and k-row kernels reduce in different
 * orders, so it cannot promise that and runs at about half this speed at one row.)
 *
 * Layout: W is prepacked into column blocks of NBW outputs, each stored k-major ([K][NBW]), so a
 * block streams through memory once per call while the rows reuse it from cache: at one row the
 * kernel reads weights at the machine's streaming bandwidth. The K loop is cut into chunks of KB
 * so a chunk of the block stays in L1 across a tile of RT rows; partial sums go through y, which
 * keeps the chain's order. Build: cc -O3 -march=native -fopenmp -shared (ffp-contract stays on:
 * the same fma in every tile).
 */
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

#define CV 4          /* vectors of 8 outputs per column block */
#define NBW (CV * 8)  /* outputs per column block: the packing's width, read by rowwise.py */
#define RT 3          /* rows per register tile: 3 x 4 accumulators + 4 weights fit 16 registers */
#define KB 192        /* k per chunk: 192 x 32 x 4 B = 24 KiB of the block, inside L1 */

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

#define TILE(R)                                                                                  \
  static void tile##R(const float *x, long K, long k0, long k1, const float *wb, float *y,       \
                      long ldy) {                                                                \
    v8 acc[R][CV];                                                                               \
    for (int r = 0; r < R; r++)                                                                  \
      for (int c = 0; c < CV; c++) acc[r][c] = k0 ? load8(y + r * ldy + 8 * c) : (v8){0};        \
    for (long k = k0; k < k1; k++) {                                                             \
      const float *w = wb + k * NBW;                                                             \
      for (int r = 0; r < R; r++) {                                                              \
        v8 xv = (v8){0} + x[r * K + k];                                                          \
        for (int c = 0; c < CV; c++) acc[r][c] += xv * load8(w + 8 * c);                         \
      }                                                                                          \
    }                                                                                            \
    for (int r = 0; r < R; r++)                                                                  \
      for (int c = 0; c < CV; c++) store8(y + r * ldy + 8 * c, acc[r][c]);                       \
  }
TILE(1)
TILE(2)
TILE(3)

typedef void (*tile_fn)(const float *, long, long, long, const float *, float *, long);
static const tile_fn TILES[RT + 1] = {0, tile1, tile2, tile3};

int rowwise_block_width(void) { return NBW; }

/* wp: W packed as [ceil(N / NBW)][K][NBW], zero-padded past N. */
void rowwise_matmul(const float *x, const float *wp, float *y, long M, long N, long K, int threads) {
  long blocks = (N + NBW - 1) / NBW;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long b = 0; b < blocks; b++) {
    const float *wb = wp + b * K * NBW;
    long width = N - b * NBW < NBW ? N - b * NBW : NBW;
    float edge[RT * NBW]; /* the last, partial block computes here, then copies its columns */
    for (long k0 = 0; k0 < K; k0 += KB) {
      long k1 = k0 + KB < K ? k0 + KB : K;
      for (long m = 0; m < M; m += RT) {
        long rows = M - m < RT ? M - m : RT;
        float *out = y + m * N + b * NBW;
        if (width == NBW) {
          TILES[rows](x + m * K, K, k0, k1, wb, out, N);
          continue;
        }
        if (k0)
          for (long r = 0; r < rows; r++) memcpy(edge + r * NBW, out + r * N, width * sizeof(float));
        TILES[rows](x + m * K, K, k0, k1, wb, edge, NBW);
        for (long r = 0; r < rows; r++) memcpy(out + r * N, edge + r * NBW, width * sizeof(float));
      }
    }
  }
}
