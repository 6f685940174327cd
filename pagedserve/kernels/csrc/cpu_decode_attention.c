/* Paged decode attention for the CPU: one query token per sequence, K/V read in place.
 *
 * Contract: that of pagedserve.kernels.reference.paged_attention for decode rows. For row b
 * and query head qh (KV head h = qh / group), the keys at positions [first, len) of
 * sequence b, where len = seq_lens[b] and first = max(0, len - window) with a window (0: none),
 * position p living in block block_tables[b][p / block_size] at offset p % block_size:
 *
 *   out[b][qh] = sum_p softmax_p(cap(scale * q[b][qh] . K[p][h])) V[p][h]
 *
 * cap(s) = soft_cap * tanh(s / soft_cap) when soft_cap > 0. Only visible positions are read,
 * so unwritten slots (NaN included) are never touched. The cache holds fp32, bf16 or fp16;
 * every product and sum is in fp32. The softmax is online, one tile of TILE positions at a
 * time: the tile's scores, then its maximum, then the running sums rescaled once.
 *
 * One task per (sequence, KV head), shared over OpenMP threads (the process's own runtime:
 * torch's libgomp when loaded beside torch). Each task scores its whole query-head group
 * against a K row read once, and adds a V row read once to the group's accumulators. A task
 * whose visible blocks include an id outside the cache reads nothing and is counted.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#define MAX_GROUP 16   /* query heads per pass over the K/V (a larger group takes passes) */
#define MAX_HEAD_DIM 256
#define TILE 32
/* The vector expf (glibc's libmvec) takes a scalar path per lane for arguments below about
 * -87, where exp underflows: a peaked softmax has many, and they made the kernel twice as
 * slow on a real decode step. Clamped here, such a weight is exp(-87) = 1.6e-38 instead of 0
 * or a subnormal, against the row's largest weight of 1. */
#define EXP_FLOOR (-87.0f)

typedef uint16_t u16;

/* A peaked softmax makes exp(s - max) and the rescaled sums subnormal, and x86 computes on
 * subnormals at a hundredth of its speed (a 2.2x slower kernel on a real decode step). Each
 * thread flushes them to zero while it works here (MXCSR FTZ and DAZ: a change below 1.2e-38
 * against terms of at least 1) and restores its own mode after, so nothing else in the
 * process sees it. */
#if defined(__SSE__)
static inline unsigned int flush_subnormals(void) {
    const unsigned int mode = _mm_getcsr();
    _mm_setcsr(mode | 0x8040u); /* FTZ | DAZ */
    return mode;
}
static inline void restore_float_mode(unsigned int mode) { _mm_setcsr(mode); }
#else
static inline unsigned int flush_subnormals(void) { return 0; }
static inline void restore_float_mode(unsigned int mode) { (void)mode; }
#endif

static inline const float *row_f32(const float *src, float *dst, int64_t d) {
    (void)dst;
    (void)d;
    return src; /* read in place */
}

static inline const float *row_bf16(const u16 *src, float *dst, int64_t d) {
    uint32_t *out = (uint32_t *)dst;
#pragma omp simd
    for (int64_t i = 0; i < d; i++) out[i] = (uint32_t)src[i] << 16;
    return dst;
}

static inline const float *row_f16(const _Float16 *src, float *dst, int64_t d) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#elif defined(__F16C__)
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < d; i++) dst[i] = (float)src[i];
    return dst;
}

#define DEFINE_DECODE(SUFFIX, T, ROW)                                                          \
    /* One (sequence, KV head) task; inlined with head_dim a constant where it is common. */   \
    static inline __attribute__((always_inline)) int task_##SUFFIX(                           \
        const float *q, const T *key_cache, const T *value_cache, const int32_t *tables,       \
        int64_t table_stride, const int32_t *seq_lens, int64_t num_q_heads,                    \
        int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, float scale,             \
        int64_t window, float soft_cap, float *out, int64_t b, int64_t h, const int64_t d) {   \
        const int64_t group = num_q_heads / num_kv_heads;                                      \
        const int64_t token_stride = num_kv_heads * d;                                         \
        const int64_t block_stride = block_size * token_stride;                                \
        const int64_t len = seq_lens[b];                                                       \
        const int64_t first = (window > 0 && len > window) ? len - window : 0;                 \
        const int32_t *table = tables + b * table_stride;                                      \
        for (int64_t c = first / block_size; c <= (len - 1) / block_size; c++)                \
            if (len > 0 && (table[c] < 0 || table[c] >= num_blocks)) return 0;                 \
        for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {                                    \
            const int64_t ng = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP;                \
            float qs[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                   \
            float s[MAX_GROUP][TILE], m[MAX_GROUP], l[MAX_GROUP];                              \
            float kr[MAX_HEAD_DIM], vr[MAX_HEAD_DIM];                                          \
            const float *qb = q + (b * num_q_heads + h * group + g0) * d;                      \
            for (int64_t g = 0; g < ng; g++) {                                                 \
                _Pragma("omp simd")                                                            \
                for (int64_t i = 0; i < d; i++) {                                              \
                    qs[g][i] = qb[g * d + i] * scale;                                          \
                    acc[g][i] = 0.0f;                                                          \
                }                                                                              \
                m[g] = -FLT_MAX;                                                               \
                l[g] = 0.0f;                                                                   \
            }                                                                                  \
            int64_t column = first / block_size, slot = first % block_size;                   \
            for (int64_t t0 = first; t0 < len; t0 += TILE) {                                   \
                const int64_t nt = len - t0 < TILE ? len - t0 : TILE;                          \
                int64_t off[TILE]; /* each position's row, for K and then V */                \
                /* The tile's rows first, their K and V lines asked for before any is read \
                 * (a block's slot and column kept as running counts: no division). */        \
                for (int64_t j = 0; j < nt; j++) {                                             \
                    off[j] = (int64_t)table[column] * block_stride + slot * token_stride       \
                             + h * d;                                                          \
                    if (++slot == block_size) {                                                \
                        slot = 0;                                                              \
                        column++;                                                              \
                    }                                                                          \
                    for (int64_t i = 0; i < d; i += 64 / (int64_t)sizeof(T)) {                 \
                        __builtin_prefetch(key_cache + off[j] + i);                            \
                        __builtin_prefetch(value_cache + off[j] + i);                          \
                    }                                                                          \
                }                                                                              \
                for (int64_t j = 0; j < nt; j++) {                                             \
                    const float *k = ROW(key_cache + off[j], kr, d);                           \
                    for (int64_t g = 0; g < ng; g++) {                                         \
                        float dot = 0.0f;                                                      \
                        _Pragma("omp simd reduction(+ : dot)")                                 \
                        for (int64_t i = 0; i < d; i++) dot += qs[g][i] * k[i];                \
                        s[g][j] = dot;                                                         \
                    }                                                                          \
                }                                                                              \
                for (int64_t g = 0; g < ng; g++) {                                             \
                    if (soft_cap > 0.0f) {                                                     \
                        _Pragma("omp simd")                                                    \
                        for (int64_t j = 0; j < nt; j++)                                       \
                            s[g][j] = soft_cap * tanhf(s[g][j] / soft_cap);                    \
                    }                                                                          \
                    float top = m[g];                                                          \
                    for (int64_t j = 0; j < nt; j++) top = s[g][j] > top ? s[g][j] : top;      \
                    /* the first tile has no running sums to rescale */                        \
                    const float corr = l[g] == 0.0f ? 0.0f : expf(m[g] - top);                 \
                    float sum = 0.0f;                                                          \
                    _Pragma("omp simd reduction(+ : sum)")                                     \
                    for (int64_t j = 0; j < nt; j++) {                                         \
                        s[g][j] = expf(fmaxf(s[g][j] - top, EXP_FLOOR));                       \
                        sum += s[g][j];                                                        \
                    }                                                                          \
                    l[g] = l[g] * corr + sum;                                                  \
                    m[g] = top;                                                                \
                    _Pragma("omp simd")                                                        \
                    for (int64_t i = 0; i < d; i++) acc[g][i] *= corr;                         \
                }                                                                              \
                for (int64_t j = 0; j < nt; j++) {                                             \
                    const float *v = ROW(value_cache + off[j], vr, d);                         \
                    for (int64_t g = 0; g < ng; g++) {                                         \
                        const float w = s[g][j];                                               \
                        _Pragma("omp simd")                                                    \
                        for (int64_t i = 0; i < d; i++) acc[g][i] += w * v[i];                 \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            float *ob = out + (b * num_q_heads + h * group + g0) * d;                          \
            for (int64_t g = 0; g < ng; g++) {                                                 \
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* no key: 0 */            \
                _Pragma("omp simd")                                                            \
                for (int64_t i = 0; i < d; i++) ob[g * d + i] = acc[g][i] * inv;               \
            }                                                                                  \
        }                                                                                      \
        return 1;                                                                              \
    }                                                                                          \
    /* Returns how many (sequence, KV head) tasks met a block id outside [0, num_blocks) in \
     * their visible blocks (those tasks write nothing): 0 when the tables are valid. */      \
    int pagedserve_decode_attention_##SUFFIX(                                                  \
        const float *q, const T *key_cache, const T *value_cache, const int32_t *tables,       \
        int64_t table_stride, const int32_t *seq_lens, int64_t n, int64_t num_q_heads,         \
        int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,        \
        float scale, int64_t window, float soft_cap, float *out, int num_threads) {            \
        int bad = 0;                                                                           \
        _Pragma("omp parallel num_threads(num_threads) reduction(+ : bad)")                    \
        {                                                                                      \
        const unsigned int mode = flush_subnormals();                                          \
        _Pragma("omp for collapse(2) schedule(dynamic, 1)")                                    \
        for (int64_t b = 0; b < n; b++) {                                                      \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                       \
                switch (head_dim) {                                                            \
                case 64:                                                                       \
                    bad += !task_##SUFFIX(q, key_cache, value_cache, tables, table_stride,     \
                                  seq_lens, num_q_heads, num_kv_heads, num_blocks, block_size, \
                                  scale, window, soft_cap, out, b, h, 64);                     \
                    break;                                                                     \
                case 128:                                                                      \
                    bad += !task_##SUFFIX(q, key_cache, value_cache, tables, table_stride,     \
                                  seq_lens, num_q_heads, num_kv_heads, num_blocks, block_size, \
                                  scale, window, soft_cap, out, b, h, 128);                    \
                    break;                                                                     \
                default:                                                                       \
                    bad += !task_##SUFFIX(q, key_cache, value_cache, tables, table_stride,     \
                                  seq_lens, num_q_heads, num_kv_heads, num_blocks, block_size, \
                                  scale, window, soft_cap, out, b, h, head_dim);               \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        restore_float_mode(mode);                                                              \
        }                                                                                      \
        return bad;                                                                            \
    }

DEFINE_DECODE(f32, float, row_f32)
DEFINE_DECODE(bf16, u16, row_bf16)
DEFINE_DECODE(f16, _Float16, row_f16)

int pagedserve_max_head_dim(void) { return MAX_HEAD_DIM; }
