/*
 * bench_table.c - single-thread throughput and memory of the C table (a benchmark,
 * not a test: it prints numbers and checks nothing beyond return codes).
 *
 *   make -C csrc bench [BENCH_ARGS="[-i] [-s SECONDS] rows dim [rows dim ...]"]
 *
 * For each (rows, dim): insert `rows` random 64-bit keys with find_or_create in
 * batches of 65,536 (SGD, uniform init; "insert" = new keys per second, growth
 * included), then time find, find_or_create (all keys present) and apply_gradients
 * over uniform random resident keys in batches of 65,536, and report the bytes per
 * row beyond the row's floats: (stats.bytes - rows * 4 * (dim + slot_floats)) / rows.
 *
 * Each timed batch gets fresh keys drawn before its timer starts, and the order of
 * find and find_or_create alternates from round to round, so neither one always
 * runs right after apply_gradients (whose dirty rows the next call has to write
 * back while it evicts them). -i gives the initializer TRUNCATED_NORMAL instead;
 * -s sets the seconds of timed lookups per (rows, dim) (default: about 20M keys of
 * each op, 8M below 2M rows).
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

/* AnonHugePages of this process in MiB (Linux), or -1: shows whether THP backs the table. */
static double thp_mib(void) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    if (!f) return -1;
    char line[256];
    double kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %lf kB", &kb) == 1) break;
    fclose(f);
    return kb < 0 ? -1 : kb / 1024;
}

static void draw_keys(int64_t *q, const int64_t *keys, int64_t rows, uint64_t *s) {
    for (int i = 0; i < BATCH; i++) q[i] = keys[rnd(s) % (uint64_t)rows];
}

static int bench(int64_t rows, int32_t dim, int32_t init_kind, double seconds) {
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
    int64_t *keys = malloc((size_t)rows * 8);
    int64_t *q = malloc(BATCH * 8);
    float *out = malloc((size_t)BATCH * dim * 4), *g = malloc((size_t)BATCH * dim * 4);
    if (!keys || !q || !out || !g) return 1;
    for (int64_t i = 0; i < (int64_t)BATCH * dim; i++) g[i] = 1e-3f;
    uint64_t s = 12345;
    for (int64_t i = 0; i < rows; i++) keys[i] = (int64_t)rnd(&s);
    double t0 = now();
    for (int64_t b = 0; b < rows; b += BATCH) {
        int64_t m = rows - b < BATCH ? rows - b : BATCH;
        if (kv_table_find_or_create(t, keys + b, m, out, 1, NULL, NULL) != KV_OK) return 1;
    }
    double ins = (double)rows / (now() - t0);
    kv_table_stats_t st;
    kv_table_stats(t, &st);
    double over = (double)(st.bytes - st.rows * 4 * (int64_t)(dim + st.slot_floats)) / (double)st.rows;
    double thp = thp_mib();

    int64_t total = rows < 2000000 ? 8000000 : 20000000;
    double tf = 0, tfc = 0, ta = 0, start = now();
    int64_t done = 0;
    for (int round = 0; seconds > 0 ? now() - start < seconds : done < total; round++) {
        for (int op = 0; op < 2; op++) {
            draw_keys(q, keys, rows, &s);
            double a = now();
            int rc = (op ^ (round & 1)) == 0
                         ? kv_table_find(t, q, BATCH, out, NULL, NULL)
                         : kv_table_find_or_create(t, q, BATCH, out, 2, NULL, NULL);
            double b = now();
            if (rc != KV_OK) return 1;
            *((op ^ (round & 1)) == 0 ? &tf : &tfc) += b - a;
        }
        draw_keys(q, keys, rows, &s);
        double d = now();
        if (kv_table_apply_gradients(t, q, BATCH, g, 3, 0, NULL) != KV_OK) return 1;
        ta += now() - d;
        done += BATCH;
    }
    printf("rows %9lld dim %3d init %d | insert %6.2f M/s | find %6.2f M/s | "
           "find_or_create %6.2f M/s | apply(sgd) %6.2f M/s | %.2f B/row overhead "
           "(load %.3f, %.1f MiB, THP %.0f MiB)\n",
           (long long)rows, dim, init_kind, ins / 1e6, (double)done / tf / 1e6,
           (double)done / tfc / 1e6, (double)done / ta / 1e6, over, st.load_factor,
           (double)st.bytes / (1 << 20), thp);
    fflush(stdout);
    free(keys);
    free(q);
    free(out);
    free(g);
    kv_table_destroy(t);
    return 0;
}

int main(int argc, char **argv) {
    int32_t init = KV_INIT_UNIFORM;
    double seconds = 0;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "-i")) {
            init = KV_INIT_TRUNCATED_NORMAL;
        } else if (!strcmp(argv[i], "-s") && i + 1 < argc) {
            seconds = atof(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [-i] [-s SECONDS] [rows dim ...]\n", argv[0]);
            return 2;
        }
    }
    if (i + 1 < argc) {
        for (; i + 1 < argc; i += 2)
            if (bench(atoll(argv[i]), atoi(argv[i + 1]), init, seconds)) return 1;
        return 0;
    }
    int64_t rows[2] = {1000000, 10000000};
    int32_t dims[2] = {16, 64};
    for (int d = 0; d < 2; d++)
        for (int r = 0; r < 2; r++)
            if (bench(rows[r], dims[d], init, seconds)) return 1;
    return bench(1000000, 16, KV_INIT_TRUNCATED_NORMAL, seconds);
}
