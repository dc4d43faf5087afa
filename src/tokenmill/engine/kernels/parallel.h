/* A parallel-for for the native kernels: the calling thread and up to threads-1 pthreads made
 * for this call take tasks from one shared counter until none is left.
 *
 * Why threads per call and not a pool: a pool's idle threads would spin or sleep beside
 * PyTorch's own. Starting and joining a thread costs ~100 us on a 2-vCPU VM (the idle vCPU has
 * to wake up), so callers thread only calls of a millisecond or more. If a thread cannot be
 * created, its share runs on the others. */
#ifndef TOKENMILL_PARALLEL_H
#define TOKENMILL_PARALLEL_H
#include <pthread.h>
#include <stdatomic.h>

#define MAX_THREADS 64

typedef void (*task_fn)(void *ctx, int task);

struct parallel_run {
    task_fn fn;
    void *ctx;
    int tasks;
    atomic_int next;
};

static void *parallel_worker(void *arg) {
    struct parallel_run *run = arg;
    for (int t; (t = atomic_fetch_add(&run->next, 1)) < run->tasks;) run->fn(run->ctx, t);
    return NULL;
}

static void parallel_for(task_fn fn, void *ctx, int tasks, int threads) {
    struct parallel_run run = {.fn = fn, .ctx = ctx, .tasks = tasks};
    atomic_init(&run.next, 0);
    pthread_t ids[MAX_THREADS];
    int started = 0;
    if (threads > tasks) threads = tasks;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int i = 1; i < threads; i++)
        if (pthread_create(&ids[started], NULL, parallel_worker, &run) == 0) started++;
    parallel_worker(&run);
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
}
#endif
