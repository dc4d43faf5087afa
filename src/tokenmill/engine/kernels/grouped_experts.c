/* Small-M matmuls that read each weight once: the experts of a MoE layer (all active experts
 * in one call) and dense linears at decode batch sizes. Built at first use by
 * kernels/__init__.py and called through ctypes.
 *
 * Why: with 1-16 rows per expert, a bf16 GEMM library call is dominated by per-call work
 * (weight reorders, small-M tiling) and reads its weights at 3-5 GB/s. Here a weight is
 * pre-packed once into 16-row panels, so one step streams every active expert's panels
 * front to back while the rows stay in L1 and every panel is read once per ROWS rows (6, or 16
 * with AVX-512).
 *
 * Packed layout of a weight W [O, K] (out x in, row-major): P [ceil(O/16)][K][16] with
 * P[j][k][r] = W[16j + r][k], zero past row O. bf16 weights stay bf16 (widened to fp32 in
 * registers: a bf16 is the top half of an fp32); rows and accumulation are fp32.
 *
 *   tm_linear_{bf16,f32}(x [M, K] f32, P, y [M, O] f32, M, K, O, threads)        y = x W^T
 *   tm_moe_{bf16,f32}(x [T, H] f32, ids [T, topk] i64, weights [T, topk] f32,
 *                     P13 [E] x packed [2I, H], P2 [E] x packed [H, I], out [T, H] f32,
 *                     T, topk, E, H, I, threads)
 *       out[t] = sum_k weights[t,k] * W2[e] (silu(g) * u),  [g | u] = W13[e] x[t],  e = ids[t,k]
 *       (an id of -1 is skipped: on an expert-parallel rank, another rank's expert)
 * Both return 0, or -1 when scratch memory could not be allocated; tm_moe -2 for an id
 * outside [-1, E).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "vector_math.h"
#if defined(__AVX2__) && defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PANEL 16
/* Rows sharing one pass over a panel, as many as the registers hold: AVX2 keeps a row's 16 sums in
 * 2 registers (12 for 6 rows, + 2 weights + 1 row value of 16); AVX-512 in 1 (16 of its 32, and
 * each step's products twice as wide). Both sum a row's products in the same order (k ascending,
 * one fused multiply-add each), so a row's result depends neither on which of the two built it
 * nor on the rows beside it. */
#if defined(__AVX512F__)
#define ROWS 16
#else
#define ROWS 6
#endif

/* Panels are read front to back, yet left to the hardware prefetcher the reads and the FMAs
 * took turns (a layer's experts ran at about half the copy bandwidth); fetching 2 KB ahead in
 * the loop overlaps them (~10% faster; 1 or 4 KB measured no better). Past the last panel it
 * touches nothing: a prefetch never faults. */
#define LINE 64
#define PREFETCH_AHEAD 2048
#define PREFETCH(w, k, T)                                                                    \
    if (!((k) & (LINE / (PANEL * sizeof(T)) - 1))) /* once per cache line */                 \
        __builtin_prefetch((const char *)(w) + PREFETCH_AHEAD, 0, 3)

/* acc[r][0..15] = sum_k x[r][k] * panel[k][0..15] for r < nr (nr <= ROWS). Always inlined into
 * a switch on nr, so that each case has a constant row count and its sums live in registers. */
#if defined(__AVX512F__)
#define BF16_16(w) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w))), 16))
#define F32_16(w) _mm512_loadu_ps(w)

#define DEFINE_PANEL(NAME, T, LOAD)                                                           \
static inline __attribute__((always_inline)) void NAME##_n(const float *const *x, const int nr, \
                                                           const T *panel, int K, float acc[ROWS][PANEL]) { \
    __m512 a[ROWS];                                                                          \
    for (int r = 0; r < nr; r++) a[r] = _mm512_setzero_ps();                                 \
    for (int k = 0; k < K; k++) {                                                            \
        const T *w = panel + (size_t)k * PANEL;                                              \
        PREFETCH(w, k, T);                                                                   \
        const __m512 wv = LOAD(w);                                                           \
        for (int r = 0; r < nr; r++) a[r] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r][k]), a[r]); \
    }                                                                                        \
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(acc[r], a[r]);                             \
}
DEFINE_PANEL(panel_bf16, uint16_t, BF16_16)
DEFINE_PANEL(panel_f32, float, F32_16)
#elif defined(__AVX2__) && defined(__FMA__)
#define BF16_LO(w) widen8_bf16(w)
#define BF16_HI(w) widen8_bf16((w) + 8)
#define F32_LO(w) _mm256_loadu_ps(w)
#define F32_HI(w) _mm256_loadu_ps((w) + 8)

#define DEFINE_PANEL(NAME, T, LOAD_LO, LOAD_HI)                                               \
static inline __attribute__((always_inline)) void NAME##_n(const float *const *x, const int nr, \
                                                           const T *panel, int K, float acc[ROWS][PANEL]) { \
    __m256 a0[ROWS], a1[ROWS];                                                               \
    for (int r = 0; r < nr; r++) a0[r] = a1[r] = _mm256_setzero_ps();                        \
    for (int k = 0; k < K; k++) {                                                            \
        const T *w = panel + (size_t)k * PANEL;                                              \
        PREFETCH(w, k, T);                                                                   \
        const __m256 lo = LOAD_LO(w), hi = LOAD_HI(w);                                       \
        for (int r = 0; r < nr; r++) {                                                       \
            const __m256 b = _mm256_broadcast_ss(x[r] + k);                                  \
            a0[r] = _mm256_fmadd_ps(lo, b, a0[r]);                                           \
            a1[r] = _mm256_fmadd_ps(hi, b, a1[r]);                                           \
        }                                                                                    \
    }                                                                                        \
    for (int r = 0; r < nr; r++) {                                                           \
        _mm256_storeu_ps(acc[r], a0[r]);                                                     \
        _mm256_storeu_ps(acc[r] + 8, a1[r]);                                                 \
    }                                                                                        \
}
DEFINE_PANEL(panel_bf16, uint16_t, BF16_LO, BF16_HI)
DEFINE_PANEL(panel_f32, float, F32_LO, F32_HI)
#else
#define DEFINE_PANEL(NAME, T, LOAD)                                                           \
static inline void NAME##_n(const float *const *x, const int nr, const T *panel, int K,      \
                            float acc[ROWS][PANEL]) {                                        \
    memset(acc, 0, sizeof(float) * ROWS * PANEL);                                            \
    for (int k = 0; k < K; k++) {                                                            \
        const T *w = panel + (size_t)k * PANEL;                                              \
        for (int r = 0; r < nr; r++)                                                         \
            for (int i = 0; i < PANEL; i++) acc[r][i] += LOAD(w[i]) * x[r][k];               \
    }                                                                                        \
}
#define F32_1(v) (v)
DEFINE_PANEL(panel_bf16, uint16_t, bf16_to_f32)
DEFINE_PANEL(panel_f32, float, F32_1)
#endif

#if ROWS > 6
#define CASES_PAST_6(NAME)                                                                    \
    case 6: NAME##_n(x, 6, panel, K, acc); break;                                            \
    case 7: NAME##_n(x, 7, panel, K, acc); break;                                            \
    case 8: NAME##_n(x, 8, panel, K, acc); break;                                            \
    case 9: NAME##_n(x, 9, panel, K, acc); break;                                            \
    case 10: NAME##_n(x, 10, panel, K, acc); break;                                          \
    case 11: NAME##_n(x, 11, panel, K, acc); break;                                          \
    case 12: NAME##_n(x, 12, panel, K, acc); break;                                          \
    case 13: NAME##_n(x, 13, panel, K, acc); break;                                          \
    case 14: NAME##_n(x, 14, panel, K, acc); break;                                          \
    case 15: NAME##_n(x, 15, panel, K, acc); break;
#else
#define CASES_PAST_6(NAME)
#endif
#define DEFINE_DISPATCH(NAME, T)                                                              \
static void NAME(const float *const *x, int nr, const T *panel, int K, float acc[ROWS][PANEL]) { \
    switch (nr) {                                                                            \
    case 1: NAME##_n(x, 1, panel, K, acc); break;                                            \
    case 2: NAME##_n(x, 2, panel, K, acc); break;                                            \
    case 3: NAME##_n(x, 3, panel, K, acc); break;                                            \
    case 4: NAME##_n(x, 4, panel, K, acc); break;                                            \
    case 5: NAME##_n(x, 5, panel, K, acc); break;                                            \
    CASES_PAST_6(NAME)                                                                       \
    default: NAME##_n(x, ROWS, panel, K, acc); break;                                        \
    }                                                                                        \
}
DEFINE_DISPATCH(panel_bf16, uint16_t)
DEFINE_DISPATCH(panel_f32, float)

/* y[r][16j0..16j1) of y[r] = x[r] W^T for the nr rows x[0..nr): panels j0..j1, each once per
 * ROWS rows. */
#define DEFINE_ROWS(NAME, T, PANEL_FN)                                                        \
static void NAME(const float *const *x, float *const *y, int nr, const T *packed, int K, int O, \
                 int j0, int j1) {                                                           \
    float acc[ROWS][PANEL];                                                                  \
    for (int j = j0; j < j1; j++) {                                                          \
        const T *panel = packed + (size_t)j * K * PANEL;                                     \
        const int width = O - j * PANEL < PANEL ? O - j * PANEL : PANEL;                     \
        for (int r0 = 0; r0 < nr; r0 += ROWS) {                                              \
            const int n = nr - r0 < ROWS ? nr - r0 : ROWS;                                   \
            PANEL_FN(x + r0, n, panel, K, acc);                                              \
            for (int r = 0; r < n; r++) memcpy(y[r0 + r] + j * PANEL, acc[r], sizeof(float) * width); \
        }                                                                                    \
    }                                                                                        \
}
DEFINE_ROWS(rows_bf16, uint16_t, panel_bf16)
DEFINE_ROWS(rows_f32, float, panel_f32)

/* A call's weights are split between threads only when each share is worth a thread's start
 * (MIN_BYTES_PER_THREAD, parallel.h). */
static int threads_for(size_t weight_bytes, int threads) {
    const size_t most = weight_bytes / MIN_BYTES_PER_THREAD;
    return most < 1 ? 1 : (size_t)threads < most ? threads : (int)most;
}

struct linear_job {
    const float *const *x;
    float *const *y;
    const void *packed;
    int nr, K, O, panels_per_task, bf16;
};

static void linear_task(void *ctx, int task) {
    const struct linear_job *jb = ctx;
    const int panels = (jb->O + PANEL - 1) / PANEL, j0 = task * jb->panels_per_task;
    const int j1 = j0 + jb->panels_per_task < panels ? j0 + jb->panels_per_task : panels;
    if (jb->bf16) rows_bf16(jb->x, jb->y, jb->nr, jb->packed, jb->K, jb->O, j0, j1);
    else rows_f32(jb->x, jb->y, jb->nr, jb->packed, jb->K, jb->O, j0, j1);
}

/* All panels of one weight for nr rows, split into 4 tasks per thread. */
static void rows_parallel(const float *const *x, float *const *y, int nr, const void *packed, int K, int O,
                          int bf16, int threads) {
    const int panels = (O + PANEL - 1) / PANEL;
    threads = threads_for((size_t)panels * K * PANEL * (bf16 ? 2 : 4), threads);
    const int tasks = threads == 1 ? 1 : 4 * threads;
    struct linear_job jb = {.x = x, .y = y, .packed = packed, .nr = nr, .K = K, .O = O, .bf16 = bf16,
                            .panels_per_task = (panels + tasks - 1) / tasks};
    parallel_for(linear_task, &jb, (panels + jb.panels_per_task - 1) / jb.panels_per_task, threads);
}

#define DEFINE_LINEAR(NAME, T, BF16)                                                          \
int NAME(const float *x, const T *packed, float *y, int M, int K, int O, int threads) {      \
    const float **xr = malloc(sizeof(float *) * (M ? M : 1));                                \
    float **yr = malloc(sizeof(float *) * (M ? M : 1));                                      \
    if (!xr || !yr) { free(xr); free(yr); return -1; }                                       \
    for (int m = 0; m < M; m++) { xr[m] = x + (size_t)m * K; yr[m] = y + (size_t)m * O; }     \
    rows_parallel(xr, yr, M, packed, K, O, BF16, threads);                                   \
    free(xr); free(yr);                                                                      \
    return 0;                                                                                \
}
DEFINE_LINEAR(tm_linear_bf16, uint16_t, 1)
DEFINE_LINEAR(tm_linear_f32, float, 0)

/* Clamped: exp(-g) overflows below g = -88, and the build assumes finite math. */
static inline float silu(float g) { return g < -80.f ? 0.f : g / (1.f + expf(-g)); }

/* h[c] = silu(g[c]) * u[c]. The vector form takes e = exp(-|g|) (never overflows):
 * sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below. */
static void silu_mul(const float *g, const float *u, float *h, int n) {
    int c = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; c + 8 <= n; c += 8) {
        const __m256 gv = _mm256_loadu_ps(g + c);
        const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  /* -|g| */
        const __m256 num = _mm256_blendv_ps(one, e, gv);            /* sign bit of g picks e */
        const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(h + c, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + c)));
    }
#endif
    for (; c < n; c++) h[c] = silu(g[c]) * u[c];
}

/* Assignments (t, k) grouped by expert, in token order within an expert: order[start[e]..start[e+1]).
 * Id -1 (an expert another rank holds) is left out: start[E] counts the others. */
static int group_by_expert(const int64_t *ids, int A, int E, int *start, int *order) {
    int *fill = malloc(sizeof(int) * (E ? E : 1));
    if (!fill) return -1;
    memset(start, 0, sizeof(int) * (E + 1));
    for (int a = 0; a < A; a++) if (ids[a] >= 0) start[ids[a] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int) * E);
    for (int a = 0; a < A; a++) if (ids[a] >= 0) order[fill[ids[a]]++] = a;
    free(fill);
    return 0;
}

/* One expert's rows: gate/up, SiLU(gate) * up, down. */
struct moe_job {
    const float **xr, **hr;
    float **gr, **yr;
    float *h;
    const int *start;
    const void *p13, *p2;
    size_t s13, s2;
    int H, I, bf16;
};

static void expert_task(void *ctx, int e) {
    const struct moe_job *jb = ctx;
    const int n = jb->start[e + 1] - jb->start[e], I = jb->I, H = jb->H, at = jb->start[e];
    const size_t width = jb->bf16 ? 2 : 4;
    if (!n) return;
    const char *p13 = (const char *)jb->p13 + e * jb->s13 * width, *p2 = (const char *)jb->p2 + e * jb->s2 * width;
    const int up_panels = (2 * I + PANEL - 1) / PANEL, down_panels = (H + PANEL - 1) / PANEL;
    if (jb->bf16) rows_bf16(jb->xr + at, jb->gr + at, n, (const uint16_t *)p13, H, 2 * I, 0, up_panels);
    else rows_f32(jb->xr + at, jb->gr + at, n, (const float *)p13, H, 2 * I, 0, up_panels);
    for (int i = at; i < at + n; i++) silu_mul(jb->gr[i], jb->gr[i] + I, jb->h + (size_t)i * I, I);
    if (jb->bf16) rows_bf16(jb->hr + at, jb->yr + at, n, (const uint16_t *)p2, I, H, 0, down_panels);
    else rows_f32(jb->hr + at, jb->yr + at, n, (const float *)p2, I, H, 0, down_panels);
}

/* Experts run in parallel, each on one thread: an expert's weights are read once per step
 * whatever its token count, so the tasks cost about the same. */
#define DEFINE_MOE(NAME, T, BF16)                                                             \
int NAME(const float *x, const int64_t *ids, const float *weights, const T *p13, const T *p2, \
         float *out, int Tn, int topk, int E, int H, int I, int threads) {                    \
    const int A = Tn * topk;                                                                  \
    const size_t s13 = (size_t)((2 * I + PANEL - 1) / PANEL) * H * PANEL;                    \
    const size_t s2 = (size_t)((H + PANEL - 1) / PANEL) * I * PANEL;                         \
    int *start = malloc(sizeof(int) * (E + 1)), *order = malloc(sizeof(int) * (A ? A : 1));  \
    float *gu = malloc(sizeof(float) * (size_t)(A ? A : 1) * 2 * I);                         \
    float *h = malloc(sizeof(float) * (size_t)(A ? A : 1) * I);                              \
    float *yd = malloc(sizeof(float) * (size_t)(A ? A : 1) * H);                             \
    const float **xr = malloc(sizeof(float *) * (A ? A : 1));                                \
    float **gr = malloc(sizeof(float *) * (A ? A : 1)), **yr = malloc(sizeof(float *) * (A ? A : 1)); \
    const float **hr = malloc(sizeof(float *) * (A ? A : 1));                                \
    int rc = -1;                                                                             \
    if (!start || !order || !gu || !h || !yd || !xr || !gr || !yr || !hr) goto done;         \
    for (int a = 0; a < A; a++) if (ids[a] < -1 || ids[a] >= E) { rc = -2; goto done; }      \
    if (group_by_expert(ids, A, E, start, order)) goto done;                                 \
    int active = 0;                                                                          \
    for (int e = 0; e < E; e++) active += start[e + 1] > start[e];                           \
    for (int i = 0; i < start[E]; i++) {                                                     \
        xr[i] = x + (size_t)(order[i] / topk) * H;                                           \
        gr[i] = gu + (size_t)i * 2 * I; hr[i] = h + (size_t)i * I; yr[i] = yd + (size_t)i * H; \
    }                                                                                        \
    struct moe_job jb = {.xr = xr, .hr = hr, .gr = gr, .yr = yr, .h = h, .start = start, .p13 = p13, \
                         .p2 = p2, .s13 = s13, .s2 = s2, .H = H, .I = I, .bf16 = BF16};      \
    parallel_for(expert_task, &jb, E, threads_for((s13 + s2) * sizeof(T) * active, threads)); \
    memset(out, 0, sizeof(float) * (size_t)Tn * H);                                          \
    for (int i = 0; i < start[E]; i++) {                                                     \
        const float w = weights[order[i]];                                                   \
        float *o = out + (size_t)(order[i] / topk) * H;                                      \
        for (int c = 0; c < H; c++) o[c] += w * yr[i][c];                                    \
    }                                                                                        \
    rc = 0;                                                                                  \
done:                                                                                        \
    free(start); free(order); free(gu); free(h); free(yd);                                   \
    free(xr); free(gr); free(yr); free(hr);                                                  \
    return rc;                                                                               \
}
DEFINE_MOE(tm_moe_bf16, uint16_t, 1)
DEFINE_MOE(tm_moe_f32, float, 0)
