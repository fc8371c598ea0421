/*
 * bench_init.c - ns per row of kv_initial_values_isa, for every ISA copy this CPU runs
 * (prints numbers; not a test).
 *
 *   bench_init [dim [kind [keys [reps]]]]   defaults: 9, KV_INIT_NORMAL, 20000, 50
 *
 * Each line is the best of `reps` calls over `keys` keys (short: a few ms in all).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../kv_init.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    int32_t dim = argc > 1 ? atoi(argv[1]) : 9, kind = argc > 2 ? atoi(argv[2]) : KV_INIT_NORMAL;
    int64_t n = argc > 3 ? atoll(argv[3]) : 20000;
    int reps = argc > 4 ? atoi(argv[4]) : 50;
    if (dim < 1 || dim > KV_MAX_DIM || n < 1 || reps < 1) {
        fprintf(stderr, "usage: bench_init [dim [kind [keys [reps]]]]\n");
        return 2;
    }
    kv_table_config_t c;
    memset(&c, 0, sizeof c);
    c.dim = dim;
    c.init_kind = kind;
    c.init_a = kind == KV_INIT_UNIFORM ? -0.05f : 0.0f;
    c.init_b = 0.05f;
    c.seed = 1;
    c.table_id = 2;
    int64_t *keys = malloc((size_t)n * sizeof(int64_t));
    float *out = malloc((size_t)n * (size_t)dim * sizeof(float));
    float *first = malloc((size_t)n * (size_t)dim * sizeof(float));
    if (!keys || !out || !first) return 1;
    for (int64_t i = 0; i < n; i++) keys[i] = (int64_t)((uint64_t)(i + 1) * 0x9e3779b97f4a7c15ULL);
    static const char *names[] = {"best", "base", "avx2", "avx512"};
    int rc = 0;
    for (int32_t isa = KV_INIT_ISA_BASE; isa <= kv_init_best_isa(); isa++) {
        double best = 1e30;
        for (int r = 0; r < reps; r++) {
            double t0 = now();
            if (kv_initial_values_isa(&c, keys, n, out, isa) != KV_OK) return 1;
            double t = now() - t0;
            best = t < best ? t : best;
        }
        if (isa == KV_INIT_ISA_BASE) memcpy(first, out, (size_t)n * (size_t)dim * sizeof(float));
        int same = !memcmp(first, out, (size_t)n * (size_t)dim * sizeof(float));
        rc |= !same;
        printf("dim %d kind %d %-6s %8.2f ns/row  (%.3f ms for %lld keys)%s\n", (int)dim, (int)kind,
               names[isa], best * 1e9 / (double)n, best * 1e3, (long long)n,
               same ? "" : "  NOT THE BASELINE'S BITS");
    }
    free(keys);
    free(out);
    free(first);
    return rc;
}
