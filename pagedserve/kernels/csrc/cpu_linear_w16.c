/* A linear layer whose weight is stored in 16 bits (bf16 or fp16) and multiplied in fp32.
 *
 * Contract: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), x and y fp32, W's values those of the
 * 16-bit weight exactly (a bf16 or fp16 value widens to fp32 without rounding): the result of
 * torch's F.linear(x, W.float(), bias) up to fp32 rounding (each sum runs over k in order).
 *
 * Layout (pagedserve/kernels/cpu_linear_w16.py packs it): W as [ceil(N / 32)][K][32], a
 * block of 32 output columns, each k's 32 weights contiguous; the last block's missing
 * columns are zeros. So a block is one sequential stream of K * 64 bytes.
 *
 * Loop order: for a chunk of MC rows, for a chunk of KC inputs, for each column block (shared
 * over threads), the rows in tiles of MR; each tile keeps MR x 32 sums in registers over the
 * KC inputs (starting from y's partial sums after the first chunk: each sum still runs over
 * k in order, and the bias is added after the last), converting each k's 32 weights to fp32
 * once for MR rows. The weights come from memory once a row chunk: a decode step streams
 * them once, half the bytes of an fp32 weight.
 *
 * With AVX-512 the tile is intrinsics (bf16: zero-extend and shift; fp16: vcvtph2ps); the
 * portable path below computes the same sums in the same order and is exported, so that it
 * is tested on any machine.
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NB 32                 /* output columns a block */
#define MR 12                 /* rows a register tile (12 x 2 vectors of sums, 2 of weights) */
#define MC 192                /* rows a chunk: its x (MC x KC fp32, 192 KiB) stays in L2 */
#define KC 256                /* k a chunk: a block's slice of weights (16 KiB) stays in L1 */
#define PAR_MIN_FLOPS 4000000 /* below this, the calling thread does the whole call */

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        const float f = (float)man * 5.9604644775390625e-8f; /* zero or subnormal: man x 2^-24 */
        return sign ? -f : f;
    }
    if (exp == 31) u = sign | 0x7f800000u | (man << 13);
    else u = sign | ((exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void tile_portable(const float *x, int64_t ldx, const uint16_t *w, int64_t K, float *y,
                          int64_t ldy, int rows, int cols, const float *bias, int fp16,
                          int accumulate) {
    float acc[MR][NB];
    memset(acc, 0, sizeof acc);
    if (accumulate)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < cols; j++) acc[r][j] = y[r * ldy + j];
    for (int64_t k = 0; k < K; k++) {
        float wk[NB];
        const uint16_t *wr = w + k * NB;
        for (int j = 0; j < NB; j++) wk[j] = fp16 ? f16_to_f32(wr[j]) : bf16_to_f32(wr[j]);
        for (int r = 0; r < rows; r++) {
            const float xr = x[r * ldx + k];
            for (int j = 0; j < NB; j++) acc[r][j] += xr * wk[j];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.0f);
}

/* A tile's sums over one column block's kc inputs (see tile_portable): the rows of a chunk
 * in tiles of MR. */
static void block_portable(const float *x, int64_t ldx, const uint16_t *w, int64_t kc,
                           float *y, int64_t ldy, int64_t mc, int cols, const float *bias,
                           int fp16, int accumulate) {
    for (int64_t r = 0; r < mc; r += MR)
        tile_portable(x + r * ldx, ldx, w, kc, y + r * ldy, ldy, mc - r < MR ? (int)(mc - r) : MR,
                      cols, bias, fp16, accumulate);
}

#ifdef __AVX512F__
enum { BF16 = 0, FP16 = 1 };

static inline __attribute__((always_inline)) __m512 widen(const uint16_t *w, int64_t i,
                                                          const int fmt) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)(w + i));
    if (fmt == FP16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* rows and fmt are constants at each call site below: the compiler unrolls the row loops
 * and keeps the sums in registers. */
static inline __attribute__((always_inline)) void tile_avx512(const float *x, int64_t ldx,
                                                              const uint16_t *w, int64_t K,
                                                              float *y, int64_t ldy,
                                                              const int rows, int cols,
                                                              const float *bias, const int fmt,
                                                              int accumulate) {
    const __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1u);
    const __mmask16 m1 = cols >= 32 ? 0xffff
                         : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1u)
                                     : (__mmask16)0;
    __m512 a0[MR], a1[MR];
    if (accumulate) {
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            a0[r] = _mm512_maskz_loadu_ps(m0, y + r * ldy);
            a1[r] = _mm512_maskz_loadu_ps(m1, y + r * ldy + 16);
        }
    } else {
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = widen(w, k * NB, fmt), w1 = widen(w, k * NB + 16, fmt);
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
            a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
            a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
        }
    }
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_add_ps(a0[r], b0));
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_add_ps(a1[r], b1));
    }
}

#define TILE_CASE(R)                                                                       \
    case R:                                                                                \
        if (fmt == FP16) tile_avx512(x, ldx, w, K, y, ldy, R, cols, bias, FP16, accumulate); \
        else tile_avx512(x, ldx, w, K, y, ldy, R, cols, bias, BF16, accumulate);             \
        break;

static void tile(const float *x, int64_t ldx, const uint16_t *w, int64_t K, float *y, int64_t ldy,
                 int rows, int cols, const float *bias, int fmt, int accumulate) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
    default: break;
    }
}

static void block_avx512(const float *x, int64_t ldx, const uint16_t *w, int64_t kc, float *y,
                         int64_t ldy, int64_t mc, int cols, const float *bias, int fp16,
                         int accumulate) {
    for (int64_t r = 0; r < mc; r += MR)
        tile(x + r * ldx, ldx, w, kc, y + r * ldy, ldy, mc - r < MR ? (int)(mc - r) : MR, cols,
             bias, fp16 ? FP16 : BF16, accumulate);
}
#define block block_avx512
#else
#define block block_portable
#endif

typedef void (*block_fn)(const float *, int64_t, const uint16_t *, int64_t, float *, int64_t,
                         int64_t, int, const float *, int, int);

static int run(block_fn fn, const float *x, int64_t ldx, const uint16_t *w, const float *bias,
               float *y, int64_t M, int64_t N, int64_t K, int fp16, int threads) {
    if (M < 0 || N <= 0 || K <= 0 || ldx < K) return -1;
    const int64_t blocks = (N + NB - 1) / NB;
    const int nt = (double)M * (double)N * (double)K * 2.0 >= PAR_MIN_FLOPS && threads > 1
                       ? threads
                       : 1;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = M - m0 < MC ? M - m0 : MC;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            const int last = k0 + kc == K; /* the bias goes on after the whole sum */
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int cols = N - b * NB < NB ? (int)(N - b * NB) : NB;
                fn(x + m0 * ldx + k0, ldx, w + b * K * NB + k0 * NB, kc, y + m0 * N + b * NB, N,
                   mc, cols, bias && last ? bias + b * NB : NULL, fp16, k0 > 0);
            }
        }
    }
    return 0;
}

/* y (M x N, contiguous) = x (M x K, rows ldx apart) @ W^T + bias (may be NULL); W packed as
 * above, fp16 != 0 for fp16 weights, else bf16. Returns 0, or -1 for impossible sizes
 * (nothing written). */
int pagedserve_linear_w16(const float *x, int64_t ldx, const uint16_t *w, const float *bias,
                          float *y, int64_t M, int64_t N, int64_t K, int fp16, int threads) {
    return run(block, x, ldx, w, bias, y, M, N, K, fp16, threads);
}

/* The same on the portable path (the one a CPU without AVX-512 runs), for tests. */
int pagedserve_linear_w16_portable(const float *x, int64_t ldx, const uint16_t *w,
                                   const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                                   int fp16, int threads) {
    return run(block_portable, x, ldx, w, bias, y, M, N, K, fp16, threads);
}
