/* Paged decode attention for CPUs: a sequence's last query token (a decode), or its last Q
 * (a decode and the drafts it verifies), K/V read in place from the block-structured cache (no
 * gather copy). Built at first use by kernels/__init__.py and called through ctypes.
 *
 * Layouts (row-major):
 *   q            [N, H, D]              (H = query heads; N = the sum of queries)
 *   k, v         [num_blocks, BS, KVH, D]   one layer's K or V
 *   block_tables [B, max_blocks] int64, context_lens [B] int64 (the context of the last query)
 *   queries      [B] int64 summing to N, or NULL for one each (N = B): sequence b's rows follow b-1's, and
 *                its query i (of Q) sees the first context_len - (Q - 1 - i) keys
 *   out          [N, H, D] float32
 * Each K/V row is read once per sequence, whatever Q; scores are kept in fp32. A query's result
 * is the same bits as when it is computed alone: the rows past its own context get weight 0.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "vector_math.h"

/* Blocks of one sequence are scattered through the pool, so the hardware prefetcher loses the
 * stream at every block boundary: the kernels ask for the next block explicitly. This fetches
 * slice `part` of `parts` of the `bytes` at p (NULL: nothing to fetch); a whole block is slice
 * 0 of 1. */
static inline void prefetch_slice(const void *p, int64_t bytes, int part, int parts) {
    if (p == NULL) return;
    for (int64_t off = part * bytes / parts; off < (part + 1) * bytes / parts; off += 64)
        __builtin_prefetch((const char *)p + off, 0, 3);
}

/* One sequence: qf [H, D] (scaled, fp32), its block table, `scores` [H, len] scratch, out [H, D]. */
#define SEQ_ARGS(T) const float *qf, const T *k, const T *v, const int64_t *table, int64_t len, \
                    float *scores, float *ob, int H, int KVH, int D, int BS, int Q

/* Heads are ordered (KV head, query, head in group); query i of Q sees len - (Q - 1 - i) keys. */
static inline int64_t head_len(int h, int H, int KVH, int Q, int64_t len) {
    const int per_kv = H / KVH;
    return len - (Q - 1 - (h % per_kv) / (per_kv / Q));
}

#define DEFINE_KERNEL(NAME, T, LOAD)                                                          \
static void NAME(SEQ_ARGS(T)) {                                                               \
    const int group = H / KVH;                                                                \
    for (int64_t t = 0; t < len; t++) {                                                       \
        const T *krow = k + (table[t / BS] * BS + t % BS) * (int64_t)KVH * D;                 \
        if (t % BS == 0 && t + BS < len)                                                      \
            prefetch_slice(k + table[t / BS + 1] * BS * (int64_t)KVH * D,                     \
                           BS * KVH * D * (int64_t)sizeof(T), 0, 1);                          \
        for (int kh = 0; kh < KVH; kh++) {                                                    \
            float kf[256];                                                                    \
            for (int d = 0; d < D; d++) kf[d] = LOAD(krow[kh * D + d]);                       \
            for (int g = 0; g < group; g++) {                                                 \
                const int h = kh * group + g;                                                 \
                const float *qh = qf + h * D;                                                 \
                float s = 0.f;                                                                \
                for (int d = 0; d < D; d++) s += qh[d] * kf[d];                               \
                scores[h * len + t] = s;                                                      \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int h = 0; h < H; h++) {                                                             \
        const int64_t n = head_len(h, H, KVH, Q, len);                                        \
        float *sh = scores + h * len, m = -FLT_MAX, sum = 0.f;                                \
        for (int64_t t = 0; t < n; t++) m = sh[t] > m ? sh[t] : m;                            \
        for (int64_t t = 0; t < n; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }            \
        for (int64_t t = 0; t < n; t++) sh[t] /= sum;                                         \
        for (int64_t t = n; t < len; t++) sh[t] = 0.f;                                        \
    }                                                                                         \
    memset(ob, 0, sizeof(float) * H * D);                                                     \
    for (int64_t t = 0; t < len; t++) {                                                       \
        const T *vrow = v + (table[t / BS] * BS + t % BS) * (int64_t)KVH * D;                 \
        if (t % BS == 0 && t + BS < len)                                                      \
            prefetch_slice(v + table[t / BS + 1] * BS * (int64_t)KVH * D,                     \
                           BS * KVH * D * (int64_t)sizeof(T), 0, 1);                          \
        for (int kh = 0; kh < KVH; kh++) {                                                    \
            float vf[256];                                                                    \
            for (int d = 0; d < D; d++) vf[d] = LOAD(vrow[kh * D + d]);                       \
            for (int g = 0; g < group; g++) {                                                 \
                const int h = kh * group + g;                                                 \
                const float p = scores[h * len + t];                                          \
                float *oh = ob + h * D;                                                       \
                for (int d = 0; d < D; d++) oh[d] += p * vf[d];                               \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

#define LOAD_F32(x) (x)
DEFINE_KERNEL(generic_bf16, uint16_t, bf16_to_f32)
DEFINE_KERNEL(generic_f32, float, LOAD_F32)

#if defined(__AVX2__) && defined(__FMA__)
/* ---- AVX2 + FMA: the same function, vectorised ------------------------------------------
 * Pass 1 takes 8 tokens at a time: per query head, 8 dot products accumulate side by side
 * and one transpose-add turns them into 8 scores (instead of a horizontal sum per score).
 * Softmax uses a vector exp. Pass 2 keeps up to 2 heads x 32 dims of output in registers
 * while it walks every token, so each V cache line is read once and no sum goes to memory. */
#include <immintrin.h>

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

/* The next block is fetched a slice per KV head, between the computations, rather than in one
 * burst at the block's start: a burst fills the load queue that the block being computed needs,
 * so reading and computing did not overlap. Spread out, a decode step's attention took ~25%
 * less time on one thread and on two (two blocks ahead, or non-temporal hints, measured no
 * better). */
#define AHEAD 1


/* lane i = the sum of a[i]'s eight lanes */
static inline __m256 sum8x8(const __m256 a[8]) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* In place over n scores: exp(s - max) / sum. */
static void softmax_row(float *s, int64_t n) {
    __m256 mv = _mm256_set1_ps(-FLT_MAX);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float lanes[8], m = -FLT_MAX, sum = 0.f;
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (int64_t u = t; u < n; u++) m = s[u] > m ? s[u] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
        _mm256_storeu_ps(s + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    _mm256_storeu_ps(lanes, sv);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    for (int64_t u = t; u < n; u++) { s[u] = expf(s[u] - m); sum += s[u]; }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
    for (int64_t u = t; u < n; u++) s[u] /= sum;
}

#define DEFINE_AVX2(NAME, T, LOAD8)                                                           \
/* scores[h * len + t0 + i] for the n (<= 8) tokens at rows[i] of KV head kh's group */       \
static void NAME##_scores8(const float *qf, const T *const rows[8], int n, int kh, int group,  \
                           int D, int64_t len, int64_t t0, float *scores) {                   \
    for (int g = 0; g < group; g++) {                                                         \
        const int h = kh * group + g;                                                         \
        __m256 acc[8];                                                                        \
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();                             \
        for (int d = 0; d < D; d += 8) {                                                      \
            const __m256 qv = _mm256_loadu_ps(qf + h * D + d);                                \
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, LOAD8(rows[i] + d), acc[i]); \
        }                                                                                     \
        float s[8];                                                                           \
        _mm256_storeu_ps(s, sum8x8(acc));                                                     \
        memcpy(scores + h * len + t0, s, sizeof(float) * n);                                  \
    }                                                                                         \
}                                                                                             \
/* out[j][0..8*nc) += sum_t p[j * pstride + t] * V_t[col..col+8*nc) over tokens t0..t1 of one   \
 * block, for the nh (<= 2) heads j: nh x nc <= 8 sums stay in registers across the block. */  \
static inline __attribute__((always_inline)) void NAME##_pv_n(                                \
        const T *vblock, int64_t row, int64_t t0, int64_t t1, int col,                        \
        const float *p, int64_t pstride, const int nh, const int nc, float *out, int D) {     \
    __m256 acc[2][4];                                                                         \
    for (int j = 0; j < nh; j++)                                                              \
        for (int c = 0; c < nc; c++) acc[j][c] = _mm256_loadu_ps(out + j * D + 8 * c);        \
    for (int64_t t = t0; t < t1; t++) {                                                       \
        const T *vrow = vblock + (t - t0) * row + col;                                        \
        __m256 vv[4];                                                                         \
        for (int c = 0; c < nc; c++) vv[c] = LOAD8(vrow + 8 * c);                             \
        for (int j = 0; j < nh; j++) {                                                        \
            const __m256 pj = _mm256_set1_ps(p[j * pstride + t]);                             \
            for (int c = 0; c < nc; c++) acc[j][c] = _mm256_fmadd_ps(pj, vv[c], acc[j][c]);   \
        }                                                                                     \
    }                                                                                         \
    for (int j = 0; j < nh; j++)                                                              \
        for (int c = 0; c < nc; c++) _mm256_storeu_ps(out + j * D + 8 * c, acc[j][c]);         \
}                                                                                             \
static void NAME##_pv(const T *vblock, int64_t row, int64_t t0, int64_t t1, int col,          \
                      const float *p, int64_t pstride, int nh, int nc, float *out, int D) {   \
    switch (nh * 4 + nc) {                                                                    \
    case 5: NAME##_pv_n(vblock, row, t0, t1, col, p, pstride, 1, 1, out, D); break;           \
    case 6: NAME##_pv_n(vblock, row, t0, t1, col, p, pstride, 1, 2, out, D); break;           \
    case 7: NAME##_pv_n(vblock, row, t0, t1, col, p, pstride, 1, 3, out, D); break;           \
    case 8: NAME##_pv_n(vblock, row, t0, t1, col, p, pstride, 1, 4, out, D); break;           \
    case 9: NAME##_pv_n(vblock, row, t0, t1, col, p, pstride, 2, 1, out, D); break;           \
    case 10: NAME##_pv_n(vblock, row, t0, t1, col, p, pstride, 2, 2, out, D); break;          \
    case 11: NAME##_pv_n(vblock, row, t0, t1, col, p, pstride, 2, 3, out, D); break;          \
    default: NAME##_pv_n(vblock, row, t0, t1, col, p, pstride, 2, 4, out, D); break;          \
    }                                                                                         \
}                                                                                             \
static void NAME(SEQ_ARGS(T)) {                                                               \
    const int group = H / KVH;                                                                \
    const int64_t row = (int64_t)KVH * D;                                                     \
    {                                                                                         \
        for (int64_t t0 = 0; t0 < len; t0 += 8) {                                            \
            const int n = len - t0 < 8 ? (int)(len - t0) : 8;                                 \
            const T *tok[8];                                                                  \
            for (int i = 0; i < 8; i++) {                                                     \
                const int64_t t = t0 + (i < n ? i : n - 1);                                   \
                tok[i] = k + (table[t / BS] * BS + t % BS) * row;                             \
            }                                                                                 \
            /* the same 8 tokens' rows one block ahead */                                    \
            const int64_t ahead = t0 + AHEAD * BS;                                            \
            const char *next = ahead < len ? (const char *)(k + (table[ahead / BS] * BS + ahead % BS) * row) : NULL; \
            for (int kh = 0; kh < KVH; kh++) {                                                \
                const T *rows[8];                                                             \
                for (int i = 0; i < 8; i++) rows[i] = tok[i] + kh * D;                        \
                prefetch_slice(next, 8 * row * (int64_t)sizeof(T), kh, KVH);                  \
                NAME##_scores8(qf, rows, n, kh, group, D, len, t0, scores);                   \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < H; h++) {                                                         \
            const int64_t n = head_len(h, H, KVH, Q, len);                                    \
            softmax_row(scores + h * len, n);                                                 \
            memset(scores + h * len + n, 0, sizeof(float) * (len - n));                       \
        }                                                                                     \
        memset(ob, 0, sizeof(float) * H * D);                                                 \
        /* block by block: a V block is fetched once, then every head's sums pass over it in L1 */ \
        for (int64_t t0 = 0; t0 < len; t0 += BS) {                                            \
            const T *vblock = v + table[t0 / BS] * BS * row;                                  \
            const int64_t t1 = t0 + BS < len ? t0 + BS : len;                                 \
            const char *next = t0 + AHEAD * BS < len ? (const char *)(v + table[t0 / BS + AHEAD] * BS * row) : NULL; \
            for (int kh = 0; kh < KVH; kh++) {                                                \
                prefetch_slice(next, BS * row * (int64_t)sizeof(T), kh, KVH);                 \
                for (int g0 = 0; g0 < group; g0 += 2)                                         \
                    for (int d0 = 0; d0 < D; d0 += 32)                                        \
                        NAME##_pv(vblock, row, t0, t1, kh * D + d0, scores + (kh * group + g0) * len, \
                                  len, group - g0 < 2 ? 1 : 2, (D - d0) / 8 < 4 ? (D - d0) / 8 : 4, \
                                  ob + (kh * group + g0) * D + d0, D);                        \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}
DEFINE_AVX2(avx2_bf16, uint16_t, widen8_bf16)
DEFINE_AVX2(avx2_f32, float, load8_f32)
#define VECTOR_OK(D) ((D) % 8 == 0)
#else
#define VECTOR_OK(D) 0
#define avx2_bf16 generic_bf16
#define avx2_f32 generic_f32
#endif

/* The exported entry points: sequences are shared between threads; per sequence, q scaled to
 * fp32 and a scores scratch, then the AVX2 kernel where head_dim is a multiple of 8, else the
 * generic one. */
struct decode_job {
    const void *q, *k, *v;
    const int64_t *block_tables, *context_lens, *queries, *first_row;
    float *out, scale;
    int H, KVH, D, BS, max_blocks, bf16;
    atomic_int failed;
};

/* One sequence's Q queries: qf holds them scaled, in fp32, heads ordered (KV head, query, head
 * in group) so that the kernel's heads of one KV head are all Q queries' (for Q = 1 that is
 * q's own order, and the kernel writes straight into out). */
#define DEFINE_SEQUENCE(NAME, T, LOAD, SUFFIX)                                                \
static void NAME(const struct decode_job *jb, int b) {                                        \
    const int H = jb->H, D = jb->D, KVH = jb->KVH, group = H / KVH;                           \
    const int Q = jb->queries ? (int)jb->queries[b] : 1;                                      \
    const int64_t len = jb->context_lens[b], row = jb->first_row ? jb->first_row[b] : b;      \
    const T *q = (const T *)jb->q + row * H * D;                                              \
    float *out = jb->out + row * H * D;                                                       \
    float *qf = malloc(sizeof(float) * Q * H * D), *scores = malloc(sizeof(float) * Q * H * (len > 0 ? len : 1)); \
    float *ob = Q == 1 ? out : malloc(sizeof(float) * Q * H * D);                             \
    if (qf && scores && ob) {                                                                 \
        for (int i = 0; i < Q; i++)                                                           \
            for (int h = 0; h < H; h++) {                                                     \
                const int to = (h / group * Q + i) * group + h % group;                       \
                for (int d = 0; d < D; d++) qf[to * D + d] = LOAD(q[(i * H + h) * D + d]) * jb->scale; \
            }                                                                                 \
        (VECTOR_OK(D) ? avx2_##SUFFIX : generic_##SUFFIX)(qf, jb->k, jb->v, jb->block_tables + (int64_t)b * jb->max_blocks, \
                                                         len, scores, ob, Q * H, KVH, D, jb->BS, Q); \
        if (Q > 1)                                                                            \
            for (int i = 0; i < Q; i++)                                                       \
                for (int h = 0; h < H; h++)                                                   \
                    memcpy(out + (i * H + h) * D, ob + ((h / group * Q + i) * group + h % group) * D, sizeof(float) * D); \
    } else {                                                                                  \
        atomic_store((atomic_int *)&jb->failed, 1);                                           \
    }                                                                                         \
    free(qf); free(scores);                                                                   \
    if (ob != out) free(ob);                                                                  \
}
DEFINE_SEQUENCE(sequence_bf16, uint16_t, bf16_to_f32, bf16)
DEFINE_SEQUENCE(sequence_f32, float, LOAD_F32, f32)

static void decode_task(void *ctx, int b) {
    const struct decode_job *jb = ctx;
    if (jb->bf16) sequence_bf16(jb, b);
    else sequence_f32(jb, b);
}

/* Threads only when the K/V to read is worth a thread's start (MIN_BYTES_PER_THREAD, parallel.h).
 * Returns 0; -1 when scratch memory could not be allocated; -2 when the queries do not number N
 * or a sequence has none or more than its context. */

static int decode(const void *q, const void *k, const void *v, const int64_t *block_tables,
                  const int64_t *context_lens, const int64_t *queries, float *out, int N, int B, int H,
                  int KVH, int D, int BS, int max_blocks, float scale, int threads, int bf16) {
    struct decode_job jb = {.q = q, .k = k, .v = v, .block_tables = block_tables, .context_lens = context_lens,
                            .queries = queries, .out = out, .scale = scale, .H = H, .KVH = KVH, .D = D,
                            .BS = BS, .max_blocks = max_blocks, .bf16 = bf16};
    atomic_init(&jb.failed, 0);
    int64_t tokens = 0, rows = 0, *first_row = NULL;
    if (queries) {
        if ((first_row = malloc(sizeof(int64_t) * (B > 0 ? B : 1))) == NULL) return -1;
        for (int b = 0; b < B; rows += queries[b], b++) {
            if (queries[b] < 1 || queries[b] > context_lens[b]) { free(first_row); return -2; }
            first_row[b] = rows;
        }
    } else {
        rows = B;
    }
    if (rows != N) { free(first_row); return -2; }
    jb.first_row = first_row;
    for (int b = 0; b < B; b++) tokens += context_lens[b];
    const int64_t most = tokens * 2 * KVH * D * (bf16 ? 2 : 4) / MIN_BYTES_PER_THREAD;
    parallel_for(decode_task, &jb, B, most < 1 ? 1 : most < threads ? (int)most : threads);
    free(first_row);
    return atomic_load(&jb.failed) ? -1 : 0;
}

int paged_decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *block_tables,
                                const int64_t *context_lens, const int64_t *queries, float *out, int N, int B,
                                int H, int KVH, int D, int BS, int max_blocks, float scale, int threads) {
    return decode(q, k, v, block_tables, context_lens, queries, out, N, B, H, KVH, D, BS, max_blocks, scale, threads, 1);
}

int paged_decode_attention_f32(const float *q, const float *k, const float *v, const int64_t *block_tables,
                               const int64_t *context_lens, const int64_t *queries, float *out, int N, int B,
                               int H, int KVH, int D, int BS, int max_blocks, float scale, int threads) {
    return decode(q, k, v, block_tables, context_lens, queries, out, N, B, H, KVH, D, BS, max_blocks, scale, threads, 0);
}
