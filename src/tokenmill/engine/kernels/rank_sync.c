// Sequence counters in shared memory for the ranks of one parallel worker on one host
// (engine/parallel/shm_collectives.py): a rank publishes the number of the collective it has
// entered (its data already written), and waits until every rank has entered it.
//
// Publishing is a release store followed by a futex wake; waiting spins briefly (collectives
// within a step arrive close together, and each rank runs on its own core), then sleeps on the
// futex in slices so that the caller can check its peers' liveness between them. The counters
// are 32-bit (futex words) and compared modulo 2^32.
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0);
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int reached(uint32_t value, uint32_t target) {
    return (int32_t)(value - target) >= 0;
}

void rank_sync_publish(uint32_t *counter, uint32_t value) {
    __atomic_store_n(counter, value, __ATOMIC_RELEASE);
    futex(counter, FUTEX_WAKE, INT32_MAX, NULL);
}

// Wait until counters[i * stride] has reached `target` for every i < count. Returns 0 when
// they all have, 1 when `slice_us` passed first (the caller checks liveness and calls again).
int rank_sync_wait(uint32_t *counters, int count, int stride, uint32_t target, int spins, int slice_us) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int i = 0; i < count; i++) {
        uint32_t *word = counters + (long)i * stride;
        int spun = 0;
        for (;;) {
            uint32_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if (reached(value, target))
                break;
            if (spun < spins) {
                spun++;
                relax();
                continue;
            }
            clock_gettime(CLOCK_MONOTONIC, &now);
            long waited_us = (now.tv_sec - start.tv_sec) * 1000000L + (now.tv_nsec - start.tv_nsec) / 1000;
            if (waited_us >= slice_us)
                return 1;
            long left_us = slice_us - waited_us;
            struct timespec timeout = {left_us / 1000000L, (left_us % 1000000L) * 1000L};
            // sleeps only while the word still holds `value`: a publish in between is not missed
            futex(word, FUTEX_WAIT, value, &timeout);
        }
    }
    return 0;
}
