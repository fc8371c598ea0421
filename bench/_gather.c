/*
 * _gather.c - this machine's random 64-byte gather rate: the roofline of a hash
 * table lookup, which costs two dependent random cache lines (index slot, then row).
 *
 * bench_gather() maps a buffer of `bytes`, touches every page, then sums one float
 * from each of m cache lines picked by a xorshift generator. The addresses depend
 * only on the generator, never on loaded data, so the core keeps as many misses in
 * flight as it can: the result is a throughput (gathers per second), not a latency.
 * hugepages = 0 asks for 4 KiB pages (MADV_NOHUGEPAGE), as an arena of malloc'd
 * chunks gets; hugepages = 1 asks for transparent huge pages (MADV_HUGEPAGE), which
 * takes most TLB misses out of the measurement. The kernel may ignore either hint.
 *
 * Built at bench time by bench/common.py with cffi into a temporary directory.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdint.h>
#include <sys/mman.h>
#include <time.h>

#define LINE_FLOATS 16 /* 64 bytes */
#define HUGE_BYTES ((uint64_t)2 << 20)

static double now_sec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/*
 * Measure `reps` passes of m random gathers over a fresh buffer of `bytes`.
 *   rates[reps]  out: gathers per second of each pass
 *   checksum     out: sum of everything read (keeps the loads alive)
 * Returns 0, -1 (bytes < 1 MiB, m < 1 or reps < 1) or -2 (mmap failed).
 * Thread-safe; allocates and frees its own buffer.
 */
int bench_gather(uint64_t bytes, int hugepages, int64_t m, int reps, double *rates,
                 double *checksum) {
    if (bytes < ((uint64_t)1 << 20) || m < 1 || reps < 1) return -1;
    size_t map_bytes = (size_t)(bytes + HUGE_BYTES);
    unsigned char *base = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return -2;
    float *buf = (float *)(void *)(((uintptr_t)base + HUGE_BYTES - 1) & ~(HUGE_BYTES - 1));
    (void)madvise(buf, (size_t)bytes, hugepages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    uint64_t lines = bytes / 64;
    for (uint64_t l = 0; l < lines; l++) buf[l * LINE_FLOATS] = 1.0f;

    double total = 0.0;
    for (int r = 0; r < reps; r++) {
        uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(r + 1);
        float acc = 0.0f;
        double t0 = now_sec();
        for (int64_t i = 0; i < m; i++) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            uint64_t line = (uint64_t)(((unsigned __int128)s * lines) >> 64);
            acc += buf[line * LINE_FLOATS];
        }
        double dt = now_sec() - t0;
        rates[r] = (double)m / dt;
        total += acc;
    }
    *checksum = total;
    munmap(base, map_bytes);
    return 0;
}
