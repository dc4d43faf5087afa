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
 * stream at every block boundary: the kernels ask for the next block explicitly, through a
 * cursor over its lines (NULL: nothing to fetch) whose `steps` steps fetch all of it. */
struct ahead { const char *p, *end; int per_step; };
static inline __attribute__((always_inline)) void ahead_step(struct ahead *a) {
    for (int i = 0; i < a->per_step && a->p < a->end; i++, a->p += 64) __builtin_prefetch(a->p, 0, 3);
}
static inline struct ahead ahead_of(const char *p, int64_t bytes, int64_t steps) {
    struct ahead a = {p, p ? p + bytes : p, p ? (int)(((bytes + 63) / 64 + steps - 1) / steps) : 0};
    return a;
}
static inline void fetch_block(const void *p, int64_t bytes) {
    struct ahead a = ahead_of(p, bytes, 1);
    ahead_step(&a);
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
            fetch_block(k + table[t / BS + 1] * BS * (int64_t)KVH * D, BS * KVH * D * (int64_t)sizeof(T)); \
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
            fetch_block(v + table[t / BS + 1] * BS * (int64_t)KVH * D, BS * KVH * D * (int64_t)sizeof(T)); \
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
 * A tile keeps HEADS query heads of one KV head in registers with 4 tokens of scores (pass 1)
 * or 32 dims of output (pass 2): 12 of the 16 registers hold sums, so each K or V load feeds
 * HEADS FMAs and 12 independent sums hide the FMA latency. Pass 1 turns each head's 4 dot
 * products into 4 scores with one transpose-add; softmax uses a vector exp; pass 2 goes a block
 * at a time, so a V block is fetched once and every head's sums pass over it in L1. */
#include <immintrin.h>

#define HEADS 3
#define TILE_TOKENS 4
/* GCC keeps a tile's sums in registers only when the loops over them are unrolled; rolled, it
 * stored all 12 to the stack on every token and pass 2 ran at half speed. */
#define UNROLL _Pragma("GCC unroll 4")

/* The next block is fetched a few lines at a time, between the loads of the block being computed
 * (a tile's dims in pass 1, its rows in pass 2). In bursts, even a slice per KV head, prefetches
 * filled the miss buffers the block being computed needed and stalled there. Spread out, decode
 * attention took ~20% less time on one thread (two blocks ahead measured no better). */
#define AHEAD 1

/* The empty asm keeps the vector in a register: GCC would fold the load into every FMA using it,
 * loading it once per head (AMD cores have fewer load slots than FMA slots a cycle). */
static inline __attribute__((always_inline)) __m256 load8(const char *p, const int bf16) {
    __m256 x = bf16 ? widen8_bf16((const uint16_t *)p) : _mm256_loadu_ps((const float *)p);
    __asm__("" : "+x"(x));
    return x;
}

/* lane i = the sum of a_i's eight lanes, added in the same order for every i: a score does not
 * depend on the tile it was computed in */
static inline __m128 sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
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

/* dst[j * len + i] = q_j . K_i for the nh (<= HEADS) heads at qh (D apart) and the 4 token rows
 * at tok[i] (this KV head's slice of each); the first n are stored */
static inline __attribute__((always_inline)) void qk_tile(const float *qh, const char *const tok[TILE_TOKENS],
                                                          const int nh, int n, int D, int64_t len, float *dst,
                                                          const int bf16, struct ahead *pf) {
    __m256 acc[HEADS][TILE_TOKENS];
    UNROLL for (int j = 0; j < nh; j++)
        UNROLL for (int i = 0; i < TILE_TOKENS; i++) acc[j][i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        ahead_step(pf);
        __m256 qv[HEADS];
        UNROLL for (int j = 0; j < nh; j++) qv[j] = load8((const char *)(qh + j * D + d), 0);
        UNROLL for (int i = 0; i < TILE_TOKENS; i++) {
            const __m256 kv = load8(tok[i] + d * (bf16 ? 2 : 4), bf16);
            UNROLL for (int j = 0; j < nh; j++) acc[j][i] = _mm256_fmadd_ps(qv[j], kv, acc[j][i]);
        }
    }
    UNROLL for (int j = 0; j < nh; j++) {
        const __m128 s = sum4x8(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
        if (n == TILE_TOKENS) {
            _mm_storeu_ps(dst + j * len, s);
        } else {
            float part[TILE_TOKENS];
            _mm_storeu_ps(part, s);
            memcpy(dst + j * len, part, sizeof(float) * n);
        }
    }
}

/* out[j * D + 8c ..] += sum_t p[j * len + t] * V_t[8c ..] over the n rows at vrows (row bytes
 * apart), for the nh (<= HEADS) heads and nc (<= 4) 8-dim columns: the sums stay in registers
 * across the rows, each head's added in token order */
static inline __attribute__((always_inline)) void pv_tile(const char *vrows, int64_t row, int n, const float *p,
                                                          int64_t len, const int nh, const int nc, float *out,
                                                          int D, const int bf16, struct ahead *pf) {
    __m256 acc[HEADS][4];
    UNROLL for (int j = 0; j < nh; j++)
        UNROLL for (int c = 0; c < nc; c++) acc[j][c] = _mm256_loadu_ps(out + j * D + 8 * c);
    for (int t = 0; t < n; t++) {
        ahead_step(pf);
        const char *vr = vrows + t * row;
        __m256 pj[HEADS];
        UNROLL for (int j = 0; j < nh; j++) pj[j] = _mm256_broadcast_ss(p + j * len + t);
        UNROLL for (int c = 0; c < nc; c++) {
            const __m256 vv = load8(vr + 8 * c * (bf16 ? 2 : 4), bf16);
            UNROLL for (int j = 0; j < nh; j++) acc[j][c] = _mm256_fmadd_ps(pj[j], vv, acc[j][c]);
        }
    }
    UNROLL for (int j = 0; j < nh; j++)
        UNROLL for (int c = 0; c < nc; c++) _mm256_storeu_ps(out + j * D + 8 * c, acc[j][c]);
}

/* One compiled tile per shape: the register counts must be constants. */
static void qk_any(const float *qh, const char *const tok[TILE_TOKENS], int nh, int n, int D, int64_t len,
                   float *dst, int bf16, struct ahead *pf) {
    switch (nh * 2 + bf16) {
    case 2: qk_tile(qh, tok, 1, n, D, len, dst, 0, pf); break;
    case 3: qk_tile(qh, tok, 1, n, D, len, dst, 1, pf); break;
    case 4: qk_tile(qh, tok, 2, n, D, len, dst, 0, pf); break;
    case 5: qk_tile(qh, tok, 2, n, D, len, dst, 1, pf); break;
    case 6: qk_tile(qh, tok, 3, n, D, len, dst, 0, pf); break;
    default: qk_tile(qh, tok, 3, n, D, len, dst, 1, pf); break;
    }
}

#define PV_CASE(NH, NC)                                                                       \
    case NH * 8 + NC * 2:     pv_tile(vrows, row, n, p, len, NH, NC, out, D, 0, pf); break;       \
    case NH * 8 + NC * 2 + 1: pv_tile(vrows, row, n, p, len, NH, NC, out, D, 1, pf); break;
static void pv_any(const char *vrows, int64_t row, int n, const float *p, int64_t len, int nh, int nc,
                   float *out, int D, int bf16, struct ahead *pf) {
    switch (nh * 8 + nc * 2 + bf16) {
    PV_CASE(1, 1) PV_CASE(1, 2) PV_CASE(1, 3) PV_CASE(1, 4)
    PV_CASE(2, 1) PV_CASE(2, 2) PV_CASE(2, 3) PV_CASE(2, 4)
    PV_CASE(3, 1) PV_CASE(3, 2) PV_CASE(3, 3) PV_CASE(3, 4)
    }
}

static inline int min_int(int64_t a, int64_t b) { return (int)(a < b ? a : b); }

/* Pass 1: scores, 4 tokens at a time, each KV head's query heads HEADS at a time. */
static void avx2_scores(const float *qf, const char *k, const int64_t *table, int64_t len, float *scores,
                        int KVH, int group, int D, int BS, int64_t row, int bf16) {
    const int size = bf16 ? 2 : 4;
    for (int64_t t0 = 0; t0 < len; t0 += TILE_TOKENS) {
        const int n = min_int(TILE_TOKENS, len - t0);
        const char *tok[TILE_TOKENS];
        for (int i = 0; i < TILE_TOKENS; i++) {
            const int64_t t = t0 + (i < n ? i : n - 1);
            tok[i] = k + (table[t / BS] * BS + t % BS) * row;
        }
        const int64_t ahead = t0 + AHEAD * BS;  /* the same tokens' rows one block ahead */
        const char *next = ahead < len ? k + (table[ahead / BS] * BS + ahead % BS) * row : NULL;
        struct ahead pf = ahead_of(next, TILE_TOKENS * row, (int64_t)KVH * ((group + HEADS - 1) / HEADS) * (D / 8));
        for (int kh = 0; kh < KVH; kh++) {
            const char *rows[TILE_TOKENS];
            for (int i = 0; i < TILE_TOKENS; i++) rows[i] = tok[i] + (int64_t)kh * D * size;
            for (int g0 = 0; g0 < group; g0 += HEADS) {
                const int h = kh * group + g0;
                qk_any(qf + h * D, rows, min_int(HEADS, group - g0), n, D, len, scores + h * len + t0, bf16, &pf);
            }
        }
    }
}

/* Pass 2: ob = scores . V, a block at a time. */
static void avx2_values(const char *v, const int64_t *table, int64_t len, const float *scores, float *ob,
                        int KVH, int group, int D, int BS, int64_t row, int bf16) {
    const int size = bf16 ? 2 : 4;
    memset(ob, 0, sizeof(float) * KVH * group * D);
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const char *vblock = v + table[t0 / BS] * BS * row;
        const int n = min_int(BS, len - t0);
        const char *next = t0 + AHEAD * BS < len ? v + table[t0 / BS + AHEAD] * BS * row : NULL;
        struct ahead pf = ahead_of(next, BS * row, (int64_t)KVH * ((group + HEADS - 1) / HEADS) * ((D + 31) / 32) * n);
        for (int kh = 0; kh < KVH; kh++) {
            for (int g0 = 0; g0 < group; g0 += HEADS)
                for (int d0 = 0; d0 < D; d0 += 32) {
                    const int h = kh * group + g0;
                    pv_any(vblock + (int64_t)(kh * D + d0) * size, row, n, scores + h * len + t0, len,
                           min_int(HEADS, group - g0), min_int(4, (D - d0) / 8), ob + h * D + d0, D, bf16, &pf);
                }
        }
    }
}

static void avx2_sequence(const float *qf, const char *k, const char *v, const int64_t *table, int64_t len,
                          float *scores, float *ob, int H, int KVH, int D, int BS, int Q, int bf16) {
    const int group = H / KVH;
    const int64_t row = (int64_t)KVH * D * (bf16 ? 2 : 4);
    avx2_scores(qf, k, table, len, scores, KVH, group, D, BS, row, bf16);
    for (int h = 0; h < H; h++) {
        const int64_t n = head_len(h, H, KVH, Q, len);
        softmax_row(scores + h * len, n);
        memset(scores + h * len + n, 0, sizeof(float) * (len - n));
    }
    avx2_values(v, table, len, scores, ob, KVH, group, D, BS, row, bf16);
}

static void avx2_bf16(SEQ_ARGS(uint16_t)) {
    avx2_sequence(qf, (const char *)k, (const char *)v, table, len, scores, ob, H, KVH, D, BS, Q, 1);
}
static void avx2_f32(SEQ_ARGS(float)) {
    avx2_sequence(qf, (const char *)k, (const char *)v, table, len, scores, ob, H, KVH, D, BS, Q, 0);
}
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
