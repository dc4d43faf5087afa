/* Flash-style prefill attention for CPUs: the new queries of a step's sequences against their
 * whole contexts, K/V read in place from the block-structured cache (no gather copy, no mask
 * tensor, no [queries x keys] score matrix). Built at first use by kernels/__init__.py.
 *
 *   tm_prefill_attention_batch_{bf16,f32}(q [N, H, D], k, v [blocks, BS, KVH, D], tables [S, W] i64,
 *                                         q_starts [S] i64, q_lens [S] i64, context_lens [S] i64,
 *                                         out [N, H, D] f32, S, W, H, KVH, D, BS, scale, threads)
 * Sequence s's Q = q_lens[s] queries are rows q_starts[s].. of q and out (rows of no sequence
 * are left as they are); its query i sits at position context_lens[s] - Q + i and sees keys
 * 0..that position, in the blocks tables[s]. Returns 0, -1
 * when scratch memory could not be allocated, -2 when this build or shape has no kernel
 * (AVX2+FMA and D a multiple of 16 up to 256 are required: the caller keeps its PyTorch path).
 *
 * Work is split into tasks of (KV head, block of query rows), or of a sequence's few rows over
 * all its KV heads (decodes, when there are sequences enough for every thread). A task's rows are the `group`
 * query heads sharing that KV head, interleaved by position (row = i * group + g), so causal
 * masking skips whole key chunks per 6-row tile. For every 64-key chunk a task widens K
 * (transposed) and V to fp32 once, then per tile: scores in registers (6 rows x 16 keys),
 * an online softmax (running max and sum per row), and P.V into the tile's fp32 output.
 * A row's result is the same bits wherever it is computed: its tile's other rows, the query
 * rows before it and the sequences beside it change nothing in its sums, key chunks start at
 * absolute positions (multiples of 64), and a chunk past its own position adds exact zeros. So a
 * decode through this kernel equals the same row computed in a prompt chunk.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "vector_math.h"

#define NK 64               /* keys per chunk */
#define MR 6                /* query rows per register tile */
#define MAX_D 256
#define ROW_BLOCK_BYTES 131072 /* a task's fp32 queries + outputs stay within L2 */
#define MASKED (-1e30f)      /* not -inf: the build assumes finite math */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>


static inline float hmax8(__m256 v) {
    float lanes[8], m;
    _mm256_storeu_ps(lanes, v);
    m = lanes[0];
    for (int i = 1; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}

static inline float hsum8(__m256 v) {
    float lanes[8], s = 0.f;
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; i++) s += lanes[i];
    return s;
}

/* s[r][0..NK) = q[r] . kt[.][j] for the MR rows of a tile, 16 keys at a time: 12 sums in
 * registers with AVX2, 6 with AVX-512 (twice as wide). Either sums a score's products in the
 * same order (d ascending, one fused multiply-add each), so both give the same bits. */
#define INLINE static inline __attribute__((always_inline))

INLINE void tile_scores(const float *q, const float *kt, int D, float s[MR][NK], const int nr) {
    for (int j0 = 0; j0 < NK; j0 += 16) {
#if defined(__AVX512F__)
        __m512 a[MR];
        for (int r = 0; r < nr; r++) a[r] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 kv = _mm512_loadu_ps(kt + d * NK + j0);
            for (int r = 0; r < nr; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), kv, a[r]);
        }
        for (int r = 0; r < nr; r++) _mm512_storeu_ps(s[r] + j0, a[r]);
#else
        __m256 a0[MR], a1[MR];
        for (int r = 0; r < nr; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 k0 = _mm256_loadu_ps(kt + d * NK + j0), k1 = _mm256_loadu_ps(kt + d * NK + j0 + 8);
            for (int r = 0; r < nr; r++) {
                const __m256 b = _mm256_broadcast_ss(q + r * D + d);
                a0[r] = _mm256_fmadd_ps(b, k0, a0[r]);
                a1[r] = _mm256_fmadd_ps(b, k1, a1[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            _mm256_storeu_ps(s[r] + j0, a0[r]);
            _mm256_storeu_ps(s[r] + j0 + 8, a1[r]);
        }
#endif
    }
}

/* o[r] = alpha[r] * o[r] + sum_j p[r][j] * vrows[j] over the first nk keys, 16 dims at a time (the
 * same operations in the same order with AVX2 and AVX-512). */
INLINE void tile_pv(float s[MR][NK], const float *alpha, const float *const *vrows, int nk, int D, float *o,
                    const int nr) {
    for (int d0 = 0; d0 < D; d0 += 16) {
#if defined(__AVX512F__)
        __m512 a[MR];
        for (int r = 0; r < nr; r++) a[r] = _mm512_mul_ps(_mm512_set1_ps(alpha[r]), _mm512_loadu_ps(o + r * D + d0));
        for (int j = 0; j < nk; j++) {
            const __m512 vv = _mm512_loadu_ps(vrows[j] + d0);
            for (int r = 0; r < nr; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(s[r][j]), vv, a[r]);
        }
        for (int r = 0; r < nr; r++) _mm512_storeu_ps(o + r * D + d0, a[r]);
#else
        __m256 a0[MR], a1[MR];
        for (int r = 0; r < nr; r++) {
            const __m256 al = _mm256_set1_ps(alpha[r]);
            a0[r] = _mm256_mul_ps(al, _mm256_loadu_ps(o + r * D + d0));
            a1[r] = _mm256_mul_ps(al, _mm256_loadu_ps(o + r * D + d0 + 8));
        }
        for (int j = 0; j < nk; j++) {
            const __m256 v0 = _mm256_loadu_ps(vrows[j] + d0), v1 = _mm256_loadu_ps(vrows[j] + d0 + 8);
            for (int r = 0; r < nr; r++) {
                const __m256 b = _mm256_broadcast_ss(s[r] + j);
                a0[r] = _mm256_fmadd_ps(b, v0, a0[r]);
                a1[r] = _mm256_fmadd_ps(b, v1, a1[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            _mm256_storeu_ps(o + r * D + d0, a0[r]);
            _mm256_storeu_ps(o + r * D + d0 + 8, a1[r]);
        }
#endif
    }
}

/* Masks keys past each row's position, then turns scores into probabilities against the
 * running max; alpha[r] rescales what the row summed before this chunk. */
INLINE void tile_softmax(float s[MR][NK], const int64_t *pos, int64_t c0, float *m, float *l, float *alpha,
                         const int nr) {
    for (int r = 0; r < nr; r++) {
        const int64_t visible = pos[r] - c0 + 1; /* keys j < visible are seen */
        for (int64_t j = visible < 0 ? 0 : visible; j < NK; j++) s[r][j] = MASKED;
        __m256 mv = _mm256_loadu_ps(s[r]);
        for (int j = 8; j < NK; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s[r] + j));
        const float chunk_max = hmax8(mv), m_new = chunk_max > m[r] ? chunk_max : m[r];
        const __m256 mb = _mm256_set1_ps(m_new);
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < NK; j += 8) {
            const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s[r] + j), mb));
            _mm256_storeu_ps(s[r] + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        alpha[r] = expf(m[r] - m_new);
        l[r] = l[r] * alpha[r] + hsum8(sum);
        m[r] = m_new;
    }
}

struct job {
    const void *q, *k, *v;
    const int64_t *table;
    float *out;
    int64_t context_len;
    int qlen, H, KVH, D, BS, bf16, rows_per_block, blocks_per_head, heads_per_task;
    float scale;
    atomic_int failed;
};

/* r[0..8) (8 keys' 8 dims each) -> r[d] = dim d of the 8 keys, in registers. */
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

static inline __m256 load8_as_f32(const struct job *jb, const void *base, int64_t at) {
    return jb->bf16 ? widen8_bf16((const uint16_t *)base + at) : _mm256_loadu_ps((const float *)base + at);
}

/* Key t of a later chunk (the caller asks two chunks ahead): its K and V rows are scattered
 * through the pool (a block of BS keys here, the next elsewhere), which the hardware prefetcher
 * does not follow. */
static inline void prefetch_key(const struct job *jb, int kh, int64_t t) {
    if (t >= jb->context_len) return;
    const int64_t elem = jb->bf16 ? sizeof(uint16_t) : sizeof(float), bytes = jb->D * elem;
    const int64_t at = (jb->table[t / jb->BS] * jb->BS + t % jb->BS) * (int64_t)jb->KVH * jb->D + kh * jb->D;
    const char *k = (const char *)jb->k + at * elem, *v = (const char *)jb->v + at * elem;
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + off, 0, 3);
        __builtin_prefetch(v + off, 0, 3);
    }
}

/* kt[d][j] and vrows[j] (V of key j as fp32: the cache's own row for fp32, widened into vf for
 * bf16) for keys c0..c0+NK of KV head kh, zero past the context. K is turned 8 keys x 8 dims at
 * a time in registers: one store of 8 keys per dim, not one per value. */
static void widen_chunk(const struct job *jb, int kh, int64_t c0, float *kt, float *vf, const float **vrows) {
    const int D = jb->D;
    const int64_t row = (int64_t)jb->KVH * D;
    int64_t at[NK];
    for (int j = 0; j < NK; j++) {
        const int64_t t = c0 + j;
        if (t >= jb->context_len) {
            at[j] = -1;
            memset(vf + j * D, 0, sizeof(float) * D);
            vrows[j] = vf + j * D;
            continue;
        }
        at[j] = (jb->table[t / jb->BS] * jb->BS + t % jb->BS) * row + kh * D;
        if (jb->bf16) {
            for (int d = 0; d < D; d += 8) _mm256_storeu_ps(vf + j * D + d, widen8_bf16((const uint16_t *)jb->v + at[j] + d));
            vrows[j] = vf + j * D;
        } else {
            vrows[j] = (const float *)jb->v + at[j];
        }
        prefetch_key(jb, kh, t + 2 * NK);
    }
    for (int j0 = 0; j0 < NK; j0 += 8)
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = at[j0 + i] < 0 ? _mm256_setzero_ps() : load8_as_f32(jb, jb->k, at[j0 + i] + d0);
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (d0 + i) * NK + j0, r[i]);
        }
}

/* One key chunk for the first nr rows of a tile (the rest are padding): a copy per row count,
 * each with its sums in registers. */
INLINE void tile_chunk_n(const float *q, const float *kt, const float *const *vrows, const int64_t *pos, int64_t c0,
                         int D, float *m, float *l, float *o, const int nr) {
    float s[MR][NK], alpha[MR];
    const int64_t reach = pos[MR - 1] - c0 + 1;
    tile_scores(q, kt, D, s, nr);
    tile_softmax(s, pos, c0, m, l, alpha, nr);
    tile_pv(s, alpha, vrows, reach < NK ? (int)reach : NK, D, o, nr);
}

static void tile_chunk(const float *q, const float *kt, const float *const *vrows, const int64_t *pos, int64_t c0,
                       int D, float *m, float *l, float *o, int nr) {
    switch (nr) {
    case 1: tile_chunk_n(q, kt, vrows, pos, c0, D, m, l, o, 1); break;
    case 2: tile_chunk_n(q, kt, vrows, pos, c0, D, m, l, o, 2); break;
    case 3: tile_chunk_n(q, kt, vrows, pos, c0, D, m, l, o, 3); break;
    case 4: tile_chunk_n(q, kt, vrows, pos, c0, D, m, l, o, 4); break;
    case 5: tile_chunk_n(q, kt, vrows, pos, c0, D, m, l, o, 5); break;
    default: tile_chunk_n(q, kt, vrows, pos, c0, D, m, l, o, MR); break;
    }
}

/* q[r] = the scaled query of row r0 + r of KV head kh for r < n (zero for the padding rows up
 * to `rows`), m[r] = MASKED: no key seen yet. */
static void load_queries(const struct job *jb, int kh, int r0, int n, int rows, float *q, float *m) {
    const int D = jb->D, H = jb->H, group = H / jb->KVH;
    for (int r = 0; r < rows; r++) {
        m[r] = MASKED;
        if (r >= n) continue; /* padding rows: zero queries, outputs dropped */
        const int rr = r0 + r, i = rr / group, h = kh * group + rr % group;
        const int64_t at = ((int64_t)i * H + h) * D;
        for (int d = 0; d < D; d++)
            q[r * D + d] = jb->scale * (jb->bf16 ? bf16_to_f32(((const uint16_t *)jb->q)[at + d])
                                                  : ((const float *)jb->q)[at + d]);
    }
}

/* One task: the query rows [r0, r1) of KV heads [kh0, kh1), chunk by chunk, each chunk through
 * the heads in turn (a key's K and V rows of all heads lie together). Scratch is the task's own. */
static int run_rows(const struct job *jb, int kh0, int kh1, int r0, int r1) {
    const int D = jb->D, H = jb->H, group = H / jb->KVH, n = r1 - r0, tiles = (n + MR - 1) / MR;
    const int heads = kh1 - kh0;
    /* one allocation for the task's scratch (a decode's task is a few microseconds of work) */
    const size_t rows = (size_t)tiles * MR, rows_d = rows * D, per_head = 2 * rows_d + 2 * rows;
    int64_t *pos = malloc(sizeof(int64_t) * rows + sizeof(float) * (heads * per_head + 2 * (size_t)NK * D));
    if (!pos) return -1;
    float *kt = (float *)(pos + rows), *vf = kt + (size_t)NK * D, *state = vf + (size_t)NK * D;
    memset(state, 0, sizeof(float) * heads * per_head);
    const int64_t first = jb->context_len - jb->qlen;
    for (int r = 0; r < tiles * MR; r++) pos[r] = first + (r0 + (r < n ? r : n - 1)) / group;
    for (int kh = kh0; kh < kh1; kh++)
        load_queries(jb, kh, r0, n, tiles * MR, state + (kh - kh0) * per_head,
                     state + (kh - kh0) * per_head + 2 * rows_d);
    const float *vrows[NK];
    for (int64_t c0 = 0; c0 <= pos[tiles * MR - 1]; c0 += NK)
        for (int kh = kh0; kh < kh1; kh++) {
            float *q = state + (kh - kh0) * per_head, *o = q + rows_d, *m = o + rows_d, *l = m + rows;
            widen_chunk(jb, kh, c0, kt, vf, vrows);
            for (int t = 0; t < tiles; t++) {
                if (c0 > pos[t * MR + MR - 1]) continue; /* every row of the tile is before this chunk */
                const int nr = n - t * MR < MR ? n - t * MR : MR;
                tile_chunk(q + t * MR * D, kt, vrows, pos + t * MR, c0, D, m + t * MR, l + t * MR, o + t * MR * D, nr);
            }
        }
    for (int kh = kh0; kh < kh1; kh++) {
        const float *o = state + (kh - kh0) * per_head + rows_d, *l = o + rows_d + rows;
        for (int r = 0; r < n; r++) {
            const int rr = r0 + r, i = rr / group, h = kh * group + rr % group;
            const float inv = 1.f / l[r];
            float *dst = jb->out + ((int64_t)i * H + h) * D;
            for (int d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
        }
    }
    free(pos);
    return 0;
}

/* Tasks in descending row blocks: the last rows see the most keys, so they go first. */
static void run_task(void *ctx, int task) {
    struct job *jb = ctx;
    const int groups = jb->KVH / jb->heads_per_task, kh0 = task % groups * jb->heads_per_task;
    const int block = jb->blocks_per_head - 1 - task / groups;
    const int rows = jb->qlen * (jb->H / jb->KVH), r0 = block * jb->rows_per_block;
    const int r1 = r0 + jb->rows_per_block < rows ? r0 + jb->rows_per_block : rows;
    if (run_rows(jb, kh0, kh0 + jb->heads_per_task, r0, r1)) atomic_store(&jb->failed, 1);
}

/* Splits the job's rows into blocks of whole tiles: small enough to stay in L2, and enough of
 * them for every thread when the heads alone are too few. */
static void plan_row_blocks(struct job *jb, int threads, int sequences) {
    const int rows = jb->qlen * (jb->H / jb->KVH);
    int per_block = ROW_BLOCK_BYTES / (int)(2 * sizeof(float) * jb->D) / MR * MR;
    while (per_block > MR && (int64_t)jb->KVH * ((rows + per_block - 1) / per_block) < threads) per_block -= MR;
    jb->rows_per_block = per_block;
    jb->blocks_per_head = (rows + per_block - 1) / per_block;
    /* a decode's few rows: one task for all the heads, which read each key's rows together,
     * when the step's sequences alone give every thread work */
    jb->heads_per_task = jb->blocks_per_head == 1 && rows <= MR && sequences >= threads ? jb->KVH : 1;
}

static int job_tasks(const struct job *jb) {
    return jb->KVH / jb->heads_per_task * jb->blocks_per_head;
}

/* Several sequences in one call: each its own job, their tasks shared out together. */
struct batch {
    struct job *jobs;
    int *task_job, *task_of_job;
};

static void run_batch_task(void *ctx, int task) {
    const struct batch *b = ctx;
    run_task(&b->jobs[b->task_job[task]], b->task_of_job[task]);
}

static int prefill_batch(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *q_starts,
                         const int64_t *q_lens, const int64_t *context_lens, float *out, int S, int W, int H,
                         int KVH, int D, int BS, float scale, int threads, int bf16) {
    if (D % 16 || D > MAX_D || KVH <= 0 || H % KVH || S <= 0) return -2;
    for (int s = 0; s < S; s++)
        if (q_lens[s] <= 0 || context_lens[s] < q_lens[s] || context_lens[s] > (int64_t)W * BS) return -2;
    const size_t q_row = (size_t)H * D * (bf16 ? sizeof(uint16_t) : sizeof(float));
    struct batch b = {.jobs = calloc(S, sizeof(struct job))};
    int tasks = 0, rc = -1;
    if (!b.jobs) return -1;
    for (int s = 0; s < S; s++) {
        struct job *jb = &b.jobs[s];
        *jb = (struct job){.q = (const char *)q + q_starts[s] * q_row, .k = k, .v = v, .table = tables + (size_t)s * W,
                           .out = out + q_starts[s] * H * D, .context_len = context_lens[s], .qlen = (int)q_lens[s],
                           .H = H, .KVH = KVH, .D = D, .BS = BS, .bf16 = bf16, .scale = scale};
        atomic_init(&jb->failed, 0);
        plan_row_blocks(jb, threads, S);
        tasks += job_tasks(jb);
    }
    b.task_job = malloc(sizeof(int) * tasks);
    b.task_of_job = malloc(sizeof(int) * tasks);
    if (!b.task_job || !b.task_of_job) goto done;
    for (int s = 0, t = 0; s < S; s++)
        for (int i = 0; i < job_tasks(&b.jobs[s]); i++, t++) { b.task_job[t] = s; b.task_of_job[t] = i; }
    parallel_for(run_batch_task, &b, tasks, threads < 1 ? 1 : threads);
    rc = 0;
    for (int s = 0; s < S; s++) if (atomic_load(&b.jobs[s].failed)) rc = -1;
done:
    free(b.jobs); free(b.task_job); free(b.task_of_job);
    return rc;
}
#else
/* no vector build: the caller keeps its PyTorch path */
static int prefill_batch(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *q_starts,
                         const int64_t *q_lens, const int64_t *context_lens, float *out, int S, int W, int H,
                         int KVH, int D, int BS, float scale, int threads, int bf16) {
    (void)q; (void)k; (void)v; (void)tables; (void)q_starts; (void)q_lens; (void)context_lens; (void)out; (void)S;
    (void)W; (void)H; (void)KVH; (void)D; (void)BS; (void)scale; (void)threads; (void)bf16;
    return -2;
}
#endif

int tm_prefill_attention_batch_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *tables,
                                    const int64_t *q_starts, const int64_t *q_lens, const int64_t *context_lens,
                                    float *out, int S, int W, int H, int KVH, int D, int BS, float scale, int threads) {
    return prefill_batch(q, k, v, tables, q_starts, q_lens, context_lens, out, S, W, H, KVH, D, BS, scale, threads, 1);
}

int tm_prefill_attention_batch_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                                   const int64_t *q_starts, const int64_t *q_lens, const int64_t *context_lens,
                                   float *out, int S, int W, int H, int KVH, int D, int BS, float scale, int threads) {
    return prefill_batch(q, k, v, tables, q_starts, q_lens, context_lens, out, S, W, H, KVH, D, BS, scale, threads, 0);
}
