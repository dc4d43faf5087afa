/* Paged decode attention for CPUs: one query token per sequence, K/V read in place
 * from the block-structured cache (no gather copy). Built at first use by
 * kernels/__init__.py and called through ctypes.
 *
 * Layouts (row-major):
 *   q            [B, H, D]              (H = query heads)
 *   k, v         [num_blocks, BS, KVH, D]   one layer's K or V
 *   block_tables [B, max_blocks] int64, context_lens [B] int64
 *   out          [B, H, D] float32
 * Each K/V row is read once per sequence; scores are kept in fp32.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Blocks of one sequence are scattered through the pool, so the hardware prefetcher
 * loses the stream at every block boundary: ask for the next block explicitly. */
static inline void prefetch_block(const void *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 0);
}

#define DEFINE_KERNEL(NAME, T, LOAD)                                                          \
int NAME(const T *q, const T *k, const T *v, const int64_t *block_tables,                     \
         const int64_t *context_lens, float *out, int B, int H, int KVH, int D, int BS,       \
         int max_blocks, float scale) {                                                      \
    const int group = H / KVH;                                                                \
    float *qf = malloc(sizeof(float) * H * D);                                                \
    if (!qf) return -1;                                                                       \
    for (int b = 0; b < B; b++) {                                                             \
        const int64_t len = context_lens[b];                                                  \
        const int64_t *table = block_tables + (int64_t)b * max_blocks;                        \
        float *scores = malloc(sizeof(float) * H * (len > 0 ? len : 1));                      \
        if (!scores) { free(qf); return -1; }                                                 \
        for (int i = 0; i < H * D; i++) qf[i] = LOAD(q[(int64_t)b * H * D + i]) * scale;      \
        for (int64_t t = 0; t < len; t++) {                                                   \
            const T *krow = k + (table[t / BS] * BS + t % BS) * (int64_t)KVH * D;             \
            if (t % BS == 0 && t + BS < len)                                                  \
                prefetch_block(k + table[t / BS + 1] * BS * (int64_t)KVH * D,                 \
                               BS * KVH * D * sizeof(T));                                     \
            for (int kh = 0; kh < KVH; kh++) {                                                \
                float kf[256];                                                                \
                for (int d = 0; d < D; d++) kf[d] = LOAD(krow[kh * D + d]);                   \
                for (int g = 0; g < group; g++) {                                             \
                    const int h = kh * group + g;                                             \
                    const float *qh = qf + h * D;                                             \
                    float s = 0.f;                                                            \
                    for (int d = 0; d < D; d++) s += qh[d] * kf[d];                           \
                    scores[h * len + t] = s;                                                  \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < H; h++) {                                                         \
            float *sh = scores + h * len, m = -FLT_MAX, sum = 0.f;                            \
            for (int64_t t = 0; t < len; t++) m = sh[t] > m ? sh[t] : m;                      \
            for (int64_t t = 0; t < len; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }      \
            for (int64_t t = 0; t < len; t++) sh[t] /= sum;                                   \
        }                                                                                     \
        float *ob = out + (int64_t)b * H * D;                                                 \
        memset(ob, 0, sizeof(float) * H * D);                                                 \
        for (int64_t t = 0; t < len; t++) {                                                   \
            const T *vrow = v + (table[t / BS] * BS + t % BS) * (int64_t)KVH * D;             \
            if (t % BS == 0 && t + BS < len)                                                  \
                prefetch_block(v + table[t / BS + 1] * BS * (int64_t)KVH * D,                 \
                               BS * KVH * D * sizeof(T));                                     \
            for (int kh = 0; kh < KVH; kh++) {                                                \
                float vf[256];                                                    \
                for (int d = 0; d < D; d++) vf[d] = LOAD(vrow[kh * D + d]);                   \
                for (int g = 0; g < group; g++) {                                             \
                    const int h = kh * group + g;                                             \
                    const float p = scores[h * len + t];                                      \
                    float *oh = ob + h * D;                                                   \
                    for (int d = 0; d < D; d++) oh[d] += p * vf[d];                           \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        free(scores);                                                                         \
    }                                                                                         \
    free(qf);                                                                                 \
    return 0;                                                                                 \
}

#define LOAD_F32(x) (x)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, bf16_to_f32)
DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32)
