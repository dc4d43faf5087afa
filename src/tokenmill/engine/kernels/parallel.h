/* A parallel-for for the native kernels: up to `threads` threads take tasks from one shared
 * counter until none is left. Which thread runs a task never changes what the task computes, so
 * results do not depend on the thread count.
 *
 * Built with OpenMP (the default), the threads are PyTorch's own: torch has loaded its libgomp
 * before these kernels, so the dynamic linker binds them to it (same soname) and they run on its
 * pool, whose threads are already awake between torch's ops: a region starts in microseconds.
 * Without OpenMP, the caller and threads-1 pthreads made for the call share the tasks; starting
 * and joining a thread costs ~100 us on a 2-vCPU VM (the idle vCPU has to wake up), so callers
 * thread only calls of a millisecond or more. If a thread cannot be created, its share runs on
 * the others. */
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

#ifdef _OPENMP
#include <omp.h>
/* A thread's share must move at least this much memory to be worth handing to it. */
#define MIN_BYTES_PER_THREAD (128 * 1024)

static void parallel_for(task_fn fn, void *ctx, int tasks, int threads) {
    struct parallel_run run = {.fn = fn, .ctx = ctx, .tasks = tasks};
    atomic_init(&run.next, 0);
    if (threads > tasks) threads = tasks;
    if (threads <= 1) {
        parallel_worker(&run);
        return;
    }
#pragma omp parallel num_threads(threads)
    parallel_worker(&run);
}
#else
#define MIN_BYTES_PER_THREAD (2 * 1024 * 1024)

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
#endif
