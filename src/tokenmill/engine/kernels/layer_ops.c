/* The small per-layer operations of a decoder step, each one pass in one call: RMSNorm, and
 * rotary embedding of q and k with the step's K/V stored at their cache slots. Built at first use
 * by kernels/__init__.py and called through ctypes.
 *
 * Why: at decode batch sizes these operations move a few kilobytes, and in PyTorch each is a
 * chain of 5-10 operator calls (~20-40 us per layer on this class of CPU), a tenth of a small
 * model's step. Results equal PyTorch's expressions they replace (models/layers.py), rounding
 * included: fp32 operations in the same order, and for bf16 each product and sum rounded to bf16
 * where PyTorch rounds it; only RMSNorm's sum of squares is added in another order.
 *
 *   tm_rms_norm_{f32,bf16}(x [R, N], w [N], out [R, N], R, N, eps, threads)
 *       out[r] = w * bf(x[r] * rsqrt(mean(x[r]^2) + eps))      (bf: round to the dtype)
 *   tm_rope_store_{f32,bf16}(q, q_row, k, k_row, v, v_row, cos [T, D], sin [T, D], slots [T] i64,
 *                            k_cache, v_cache [S, KVH, D], S, T, H, KVH, D, threads)
 *       q[t, h] and k[t, h] rotated in place: x*cos + rotate_half(x)*sin; then k[t], v[t] copied
 *       to cache row slots[t]. q_row etc. are row strides in elements (heads are contiguous).
 * Both return 0; tm_rope_store -2, having changed nothing, when a slot lies outside [0, S).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "vector_math.h"

/* A row's sum of squares goes in 8 lanes, each in index order, then the lanes in order: the same
 * bits whatever builds it (AVX2 or AVX-512) and whatever rows lie beside it, which reassociation
 * (allowed by the build's flags) would not keep. */
#pragma GCC optimize("no-associative-math")
#define LANES 8

/* fp32 -> nearest bf16, ties to even (as PyTorch rounds); NaN stays NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline void store_f32(float *p, float f) { *p = f; }
static inline void store_bf16(uint16_t *p, float f) { *p = f32_to_bf16(f); }
static inline float keep_f32(float f) { return f; }

/* Rows per task: a task moves at least MIN_BYTES_PER_THREAD, so small calls stay on one thread. */
static int tasks_for(int64_t rows, int64_t row_bytes, int threads, int64_t *per_task) {
    int64_t n = rows * row_bytes / MIN_BYTES_PER_THREAD;
    if (n > threads) n = threads;
    if (n < 1) n = 1;
    *per_task = (rows + n - 1) / n;
    return (int)n;
}

struct norm_job { const void *x, *w; void *out; int64_t rows, per_task; int n; float eps; };

#define DEFINE_NORM(SUFFIX, T, LOAD, STORE, ROUND)                                             \
static void norm_task_##SUFFIX(void *ctx, int task) {                                         \
    const struct norm_job *jb = ctx;                                                          \
    const T *w = jb->w;                                                                       \
    const int n = jb->n;                                                                      \
    const int64_t end = (task + 1) * jb->per_task < jb->rows ? (task + 1) * jb->per_task : jb->rows; \
    for (int64_t r = task * jb->per_task; r < end; r++) {                                     \
        const T *x = (const T *)jb->x + r * n;                                                \
        T *out = (T *)jb->out + r * n;                                                        \
        float lanes[LANES] = {0.f}, sum = 0.f;                                                \
        for (int i = 0; i < n; i++) { const float v = LOAD(x + i); lanes[i % LANES] += v * v; } \
        for (int l = 0; l < LANES; l++) sum += lanes[l];                                      \
        const float inv = 1.f / sqrtf(sum / n + jb->eps);                                     \
        for (int i = 0; i < n; i++) STORE(out + i, LOAD(w + i) * ROUND(LOAD(x + i) * inv));   \
    }                                                                                         \
}                                                                                             \
int tm_rms_norm_##SUFFIX(const T *x, const T *w, T *out, int64_t rows, int n, float eps, int threads) { \
    struct norm_job jb = {.x = x, .w = w, .out = out, .rows = rows, .n = n, .eps = eps};     \
    const int tasks = tasks_for(rows, (int64_t)n * sizeof(T), threads, &jb.per_task);         \
    parallel_for(norm_task_##SUFFIX, &jb, tasks, tasks);                                      \
    return 0;                                                                                 \
}
DEFINE_NORM(f32, float, load_f32, store_f32, keep_f32)
DEFINE_NORM(bf16, uint16_t, load_bf16, store_bf16, round_bf16)

struct rope_job {
    void *q, *k;
    const void *v, *cos, *sin;
    const int64_t *slots;
    void *k_cache, *v_cache;
    int64_t q_row, k_row, v_row, tokens, per_task;
    int H, KVH, D;
};

/* x*cos + rotate_half(x)*sin for one head in place; rotate_half(x) = [-x[half:], x[:half]] */
#define DEFINE_ROTATE(SUFFIX, T, LOAD, STORE, ROUND)                                           \
static void rotate_##SUFFIX(T *x, const T *c, const T *s, int D) {                            \
    const int half = D / 2;                                                                   \
    float in[512];                                                                            \
    for (int i = 0; i < D; i++) in[i] = LOAD(x + i);                                          \
    for (int i = 0; i < half; i++)                                                            \
        STORE(x + i, ROUND(in[i] * LOAD(c + i)) + ROUND(-in[i + half] * LOAD(s + i)));        \
    for (int i = half; i < D; i++)                                                            \
        STORE(x + i, ROUND(in[i] * LOAD(c + i)) + ROUND(in[i - half] * LOAD(s + i)));         \
}                                                                                             \
static void rope_task_##SUFFIX(void *ctx, int task) {                                         \
    const struct rope_job *jb = ctx;                                                          \
    const int D = jb->D, KVH = jb->KVH;                                                       \
    const int64_t end = (task + 1) * jb->per_task < jb->tokens ? (task + 1) * jb->per_task : jb->tokens; \
    for (int64_t t = task * jb->per_task; t < end; t++) {                                     \
        const T *c = (const T *)jb->cos + t * D, *s = (const T *)jb->sin + t * D;            \
        T *q = (T *)jb->q + t * jb->q_row, *k = (T *)jb->k + t * jb->k_row;                   \
        for (int h = 0; h < jb->H; h++) rotate_##SUFFIX(q + h * D, c, s, D);                  \
        for (int h = 0; h < KVH; h++) rotate_##SUFFIX(k + h * D, c, s, D);                    \
        const int64_t slot = jb->slots[t] * KVH * D;                                          \
        memcpy((T *)jb->k_cache + slot, k, sizeof(T) * KVH * D);                              \
        memcpy((T *)jb->v_cache + slot, (const T *)jb->v + t * jb->v_row, sizeof(T) * KVH * D); \
    }                                                                                         \
}                                                                                             \
int tm_rope_store_##SUFFIX(T *q, int64_t q_row, T *k, int64_t k_row, const T *v, int64_t v_row, \
                           const T *cos, const T *sin, const int64_t *slots, T *k_cache, T *v_cache, \
                           int64_t cache_rows, int64_t tokens, int H, int KVH, int D, int threads) { \
    for (int64_t t = 0; t < tokens; t++)                                                      \
        if (slots[t] < 0 || slots[t] >= cache_rows) return -2;                                \
    struct rope_job jb = {.q = q, .k = k, .v = v, .cos = cos, .sin = sin, .slots = slots,     \
                          .k_cache = k_cache, .v_cache = v_cache, .q_row = q_row, .k_row = k_row, \
                          .v_row = v_row, .tokens = tokens, .H = H, .KVH = KVH, .D = D};      \
    const int tasks = tasks_for(tokens, (int64_t)(H + 3 * KVH) * D * sizeof(T), threads, &jb.per_task); \
    parallel_for(rope_task_##SUFFIX, &jb, tasks, tasks);                                      \
    return 0;                                                                                 \
}
DEFINE_ROTATE(f32, float, load_f32, store_f32, keep_f32)
DEFINE_ROTATE(bf16, uint16_t, load_bf16, store_bf16, round_bf16)
