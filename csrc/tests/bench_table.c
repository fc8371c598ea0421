/*
 * bench_table.c - single-thread throughput and memory of the C table (a benchmark,
 * not a test: it prints numbers and checks nothing beyond return codes).
 *
 *   make -C csrc bench [BENCH_ARGS="rows dim [rows dim ...]"]
 *
 * For each (rows, dim): insert `rows` random 64-bit keys with find_or_create in
 * batches of 65,536 (SGD, uniform init), then time find, find_or_create (all keys
 * present) and apply_gradients over uniform random resident keys in batches of
 * 65,536, and report the bytes per row beyond the row's floats:
 * (stats.bytes - rows * 4 * (dim + slot_floats)) / rows.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../kv_table.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rnd(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

#define BATCH 65536

static int bench(int64_t rows, int32_t dim, int32_t init_kind) {
    kv_table_config_t c;
    memset(&c, 0, sizeof c);
    c.dim = dim;
    c.init_kind = init_kind;
    c.init_a = -0.05f;
    c.init_b = 0.05f;
    c.seed = 1;
    c.table_id = 2;
    c.optim.kind = KV_OPT_SGD;
    c.optim.lr = 0.01f;
    kv_table_t *t;
    if (kv_table_create(&c, &t) != KV_OK) return 1;
    int64_t *keys = malloc((size_t)rows * 8), q[BATCH];
    float *out = malloc((size_t)BATCH * dim * 4);
    uint64_t s = 12345;
    for (int64_t i = 0; i < rows; i++) keys[i] = (int64_t)rnd(&s);
    double t0 = now();
    for (int64_t b = 0; b < rows; b += BATCH) {
        int64_t m = rows - b < BATCH ? rows - b : BATCH;
        if (kv_table_find_or_create(t, keys + b, m, out, 1, NULL) != KV_OK) return 1;
    }
    double ins = (double)rows / (now() - t0);
    kv_table_stats_t st;
    kv_table_stats(t, &st);
    double over = (double)(st.bytes - st.rows * 4 * (int64_t)(dim + st.slot_floats)) / (double)st.rows;

    int64_t total = rows < 2000000 ? 8000000 : 20000000;
    double tf = 0, tfc = 0, ta = 0;
    for (int64_t done = 0; done < total; done += BATCH) {
        for (int i = 0; i < BATCH; i++) q[i] = keys[rnd(&s) % (uint64_t)rows];
        double a = now();
        if (kv_table_find(t, q, BATCH, out, NULL, NULL) != KV_OK) return 1;
        double b = now();
        for (int i = 0; i < BATCH; i++) q[i] = keys[rnd(&s) % (uint64_t)rows];
        b = now(); /* fresh keys for each op: none reads rows the previous one cached */
        if (kv_table_find_or_create(t, q, BATCH, out, 2, NULL) != KV_OK) return 1;
        double c2 = now();
        for (int i = 0; i < BATCH * dim; i++) out[i] = 1e-3f;
        for (int i = 0; i < BATCH; i++) q[i] = keys[rnd(&s) % (uint64_t)rows];
        double d = now();
        if (kv_table_apply_gradients(t, q, BATCH, out, 3, 0, NULL) != KV_OK) return 1;
        double e = now();
        tf += b - a;
        tfc += c2 - b;
        ta += e - d;
    }
    printf("rows %9lld dim %3d init %d | insert %6.2f M/s | find %6.2f M/s | "
           "find_or_create %6.2f M/s | apply(sgd) %6.2f M/s | %.2f B/row overhead "
           "(load %.3f, %.1f MiB)\n",
           (long long)rows, dim, init_kind, ins / 1e6, (double)total / tf / 1e6,
           (double)total / tfc / 1e6, (double)total / ta / 1e6, over, st.load_factor,
           (double)st.bytes / (1 << 20));
    fflush(stdout);
    free(keys);
    free(out);
    kv_table_destroy(t);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3) {
        for (int i = 1; i + 1 < argc; i += 2)
            if (bench(atoll(argv[i]), atoi(argv[i + 1]), KV_INIT_UNIFORM)) return 1;
        return 0;
    }
    int64_t rows[2] = {1000000, 10000000};
    int32_t dims[2] = {16, 64};
    for (int d = 0; d < 2; d++)
        for (int r = 0; r < 2; r++)
            if (bench(rows[r], dims[d], KV_INIT_UNIFORM)) return 1;
    return bench(1000000, 16, KV_INIT_TRUNCATED_NORMAL);
}
