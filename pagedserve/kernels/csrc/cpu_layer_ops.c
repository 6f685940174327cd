/* A decoder layer's small steps on the CPU, each one pass over its rows in fp32.
 *
 * Contracts: those of pagedserve.kernels.reference (fused_add_rms_norm, rotary_embedding,
 * silu_and_mul, reshape_and_cache) for fp32 activations, equal to them up to fp32 rounding
 * (sums in another order, glibc's vector expf). In torch each is five to fifteen ops, each a
 * dispatch and a pass over memory; at decode sizes (a few hundred KiB) the dispatches are the
 * cost. Rows are shared over OpenMP threads only where there is work for them (PAR_MIN
 * elements); a decode step's rows run on the calling thread.
 *
 * Strides are in elements (bytes for write_kv) and name each row's start: a row's own
 * features are contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PAR_MIN 65536 /* elements below which one thread does the whole call */

static inline int threads_for(int64_t elements, int threads) {
    return elements >= PAR_MIN && threads > 1 ? threads : 1;
}

/* residual += x (when residual is given), then out = weight * (r / sqrt(mean(r^2) + eps)),
 * or (r / sqrt(mean(r^2) + eps)) * (1 + weight) with unit_offset (Gemma). */
void pagedserve_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual,
                                 const float *weight, float *out, int64_t rows, int64_t width,
                                 float eps, int unit_offset, int threads) {
    const int nt = threads_for(rows * width, threads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * width;
        const float *r = xr;
        if (residual != NULL) {
            float *rr = residual + t * width;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) rr[i] += xr[i];
            r = rr;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; i++) squares += r[i] * r[i];
        const float inv = 1.0f / sqrtf(squares / (float)width + eps);
        if (unit_offset) {
#pragma omp simd
            for (int64_t i = 0; i < width; i++) o[i] = (r[i] * inv) * (1.0f + weight[i]);
        } else {
#pragma omp simd
            for (int64_t i = 0; i < width; i++) o[i] = weight[i] * (r[i] * inv);
        }
    }
}

static inline void rotate_heads(float *x, int64_t heads, int64_t head_stride, const float *c,
                                const float *s, int64_t half) {
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * head_stride, *x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

/* NeoX rotation of each token's query and key heads by its position, in place: the first
 * 2 * half features of each head. Returns how many positions fall outside [0, max_len)
 * (then nothing is written). */
int64_t pagedserve_rotary_f32(const int64_t *positions, float *q, int64_t q_stride,
                              int64_t q_head_stride, int64_t q_heads, float *k, int64_t k_stride,
                              int64_t k_head_stride, int64_t k_heads, const float *cos,
                              const float *sin, int64_t max_len, int64_t half, int64_t rows,
                              int threads) {
    int64_t bad = 0;
    for (int64_t t = 0; t < rows; t++) bad += positions[t] < 0 || positions[t] >= max_len;
    if (bad) return bad;
    const int nt = threads_for(rows * (q_heads + k_heads) * half * 2, threads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        rotate_heads(q + t * q_stride, q_heads, q_head_stride, c, s, half);
        rotate_heads(k + t * k_stride, k_heads, k_head_stride, c, s, half);
    }
    return 0;
}

/* out = silu(gate) * up over x = [gate | up], each half `width` wide. A gate below -80 gives
 * 0 (silu is then above -1.5e-33), and exp's argument stays below 80: past 88 it overflows,
 * and libmvec's vector expf takes a scalar path per lane out of its range. */
void pagedserve_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows,
                                 int64_t width, int threads) {
    const int nt = threads_for(rows * width, threads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = x + t * x_stride, *up = gate + width;
        float *o = out + t * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++)
            o[i] = (gate[i] < -80.0f ? 0.0f : gate[i] / (1.0f + expf(fminf(-gate[i], 80.0f))))
                   * up[i];
    }
}

/* Each token's K and V row (row_bytes each, of any dtype the cache holds as is) into its
 * cache slot; a negative slot is padding, skipped. Returns how many slots are at or past
 * num_slots (then nothing is written). */
int64_t pagedserve_write_kv(const char *key, int64_t key_stride, const char *value,
                            int64_t value_stride, char *key_cache, char *value_cache,
                            const int64_t *slots, int64_t rows, int64_t row_bytes,
                            int64_t num_slots) {
    int64_t bad = 0;
    for (int64_t t = 0; t < rows; t++) bad += slots[t] >= num_slots;
    if (bad) return bad;
    for (int64_t t = 0; t < rows; t++) {
        if (slots[t] < 0) continue;
        memcpy(key_cache + slots[t] * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slots[t] * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
