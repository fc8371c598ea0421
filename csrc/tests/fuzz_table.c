/*
 * fuzz_table.c - libFuzzer target for the C table API (kv_table.h).
 *
 * An input is a small program: its first bytes pick the table's configuration (dim,
 * row optimizer, initializer, admission), the rest is a sequence of operations, each
 * an opcode byte and its arguments (keys from a small universe that includes 0, -1 and
 * the int64 extremes; gradients that may be NaN or huge; steps; budgets). Every call's
 * return code must be one the header documents, and after every operation:
 *   - kv_table_size equals the rows an export sees, every exported key is distinct and
 *     finds exactly its exported row (no lost or duplicated key, no stale index entry);
 *   - a call that fails (KV_ENONFINITE, KV_EINVAL) leaves the table exactly as it was
 *     (the full export before and after are equal);
 *   - with admission off, the keys present are exactly those the program created and
 *     did not remove (a presence model over the key universe; evictions read back).
 * Built with clang's -fsanitize=fuzzer,address,undefined by `make -C csrc fuzz`, which
 * runs it for FUZZ_SECONDS over the corpus in tests/corpus/table (kept in the repo).
 */
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../kv_table.h"

#define NKEYS 64
#define MAXN 48

typedef struct {
    const uint8_t *p;
    size_t n;
} in_t;

static uint8_t u8(in_t *in) {
    if (!in->n) return 0;
    in->n--;
    return *in->p++;
}

static int64_t key_at(uint8_t b) {
    static const int64_t special[6] = {0, -1, 1, INT64_MIN, INT64_MAX, INT64_MIN + 1};
    uint8_t k = b % NKEYS;
    if (k < 6) return special[k];
    return (int64_t)((uint64_t)k * 0x9e3779b97f4a7c15ULL);
}

static int key_index(int64_t key) {
    for (int k = 0; k < NKEYS; k++)
        if (key_at((uint8_t)k) == key) return k;
    return -1;
}

static float value_of(uint8_t b) {
    switch (b & 15) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return 1e30f;
    case 3: return -1e-30f;
    default: return (float)((int)b - 128) / 16.0f;
    }
}

typedef struct {
    int64_t n;
    int64_t *keys;
    float *vals;
    float *slots;
    uint32_t *steps, *counts;
} dump_t;

static dump_t dump(kv_table_t *t, int32_t dim, int32_t nslot) {
    dump_t d = {0};
    int64_t cap = kv_table_size(t) + 1, cursor = 0, got = 0;
    d.keys = malloc((size_t)cap * 8);
    d.vals = malloc((size_t)(cap * dim) * 4);
    d.slots = malloc((size_t)(cap * (nslot ? nslot : 1)) * 4);
    d.steps = malloc((size_t)cap * 4);
    d.counts = malloc((size_t)cap * 4);
    if (kv_table_export(t, &cursor, cap, 0, d.keys, d.vals, nslot ? d.slots : NULL, d.steps,
                        d.counts, NULL, &got) != KV_OK)
        abort();
    d.n = got;
    return d;
}

static void dump_free(dump_t *d) {
    free(d->keys);
    free(d->vals);
    free(d->slots);
    free(d->steps);
    free(d->counts);
}

static int dumps_equal(const dump_t *a, const dump_t *b, int32_t dim, int32_t nslot) {
    return a->n == b->n && !memcmp(a->keys, b->keys, (size_t)a->n * 8) &&
           !memcmp(a->vals, b->vals, (size_t)(a->n * dim) * 4) &&
           (!nslot || !memcmp(a->slots, b->slots, (size_t)(a->n * nslot) * 4)) &&
           !memcmp(a->steps, b->steps, (size_t)a->n * 4) &&
           !memcmp(a->counts, b->counts, (size_t)a->n * 4);
}

/* Size, distinct keys, every key finds its row; with a presence model, the same keys. */
static void check_table(kv_table_t *t, int32_t dim, int32_t nslot, const uint8_t *present) {
    dump_t d = dump(t, dim, nslot);
    if (d.n != kv_table_size(t)) abort();
    float *out = malloc((size_t)(d.n * dim + 1) * 4);
    uint8_t *found = malloc((size_t)d.n + 1);
    if (kv_table_find(t, d.keys, d.n, out, found, NULL) != KV_OK) abort();
    for (int64_t i = 0; i < d.n; i++) {
        if (!found[i]) abort();
        for (int64_t j = i + 1; j < d.n; j++)
            if (d.keys[i] == d.keys[j]) abort();
    }
    if (memcmp(out, d.vals, (size_t)(d.n * dim) * 4)) abort();
    if (present) {
        int64_t live = 0;
        for (int k = 0; k < NKEYS; k++) live += present[k];
        if (live != d.n) abort();
        for (int64_t i = 0; i < d.n; i++) {
            int k = key_index(d.keys[i]);
            if (k < 0 || !present[k]) abort();
        }
    }
    free(out);
    free(found);
    dump_free(&d);
}

static void resync(kv_table_t *t, int32_t dim, int32_t nslot, uint8_t *present) {
    dump_t d = dump(t, dim, nslot);
    memset(present, 0, NKEYS);
    for (int64_t i = 0; i < d.n; i++) {
        int k = key_index(d.keys[i]);
        if (k < 0) abort();
        present[k] = 1;
    }
    dump_free(&d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    in_t in = {data, size};
    kv_table_config_t c;
    memset(&c, 0, sizeof c);
    c.dim = 1 + u8(&in) % 6;
    c.init_kind = u8(&in) % 4;
    c.init_a = -0.1f;
    c.init_b = 0.1f;
    c.seed = u8(&in);
    c.table_id = 7;
    uint8_t o = u8(&in);
    c.optim.kind = o % 6;
    c.optim.lr = 0.05f;
    c.optim.beta1 = 0.9f;
    c.optim.beta2 = 0.99f;
    c.optim.epsilon = 1e-6f;
    c.optim.initial_accumulator = 0.1f;
    c.optim.lr_power = -0.5f;
    c.optim.l1 = (o & 64) ? 0.01f : 0.0f;
    c.optim.l21 = (o & 128) ? 0.01f : 0.0f;
    c.optim.flags = (c.optim.kind == KV_OPT_ADAGRAD && (o & 32)) ? KV_OPTF_EPS_INSIDE_SQRT : 0;
    uint8_t a = u8(&in);
    c.admit_min_count = (a & 3) == 3 ? 2 : 0;
    c.admit_mode = (a & 4) ? KV_ADMIT_BLOOM : KV_ADMIT_EXACT;
    c.bloom_counters = 1 << 10;
    kv_table_t *t = NULL;
    int rc = kv_table_create(&c, &t);
    if (rc != KV_OK) {
        if (rc != KV_EINVAL && rc != KV_EOPTIM && rc != KV_EINIT) abort();
        return 0;
    }
    kv_table_stats_t st;
    kv_table_stats(t, &st);
    const int32_t dim = c.dim, nslot = (int32_t)st.slot_floats;
    uint8_t present[NKEYS] = {0};
    uint8_t *model = c.admit_min_count ? NULL : present; /* admission: no presence model */
    int64_t keys[MAXN];
    float *out = malloc((size_t)MAXN * (size_t)dim * 4);
    float *grads = malloc((size_t)MAXN * (size_t)dim * 4);
    uint32_t refs[MAXN];
    uint8_t flags[MAXN];
    uint32_t step = 1;
    int tracking = 0;
    while (in.n) {
        uint8_t op = u8(&in) % 12;
        int64_t n = u8(&in) % MAXN;
        for (int64_t i = 0; i < n; i++) keys[i] = key_at(u8(&in));
        for (int64_t i = 0; i < n * dim; i++) grads[i] = value_of(u8(&in));
        step += u8(&in) % 3;
        dump_t before = dump(t, dim, nslot);
        int64_t cnt = 0;
        uint64_t gen = 0;
        switch (op) {
        case 0:
        case 1:
            rc = kv_table_find_or_create(t, keys, n, out, step, &cnt, flags);
            if (rc == KV_OK && model)
                for (int64_t i = 0; i < n; i++) present[key_index(keys[i])] = 1;
            break;
        case 2:
            rc = kv_table_find(t, keys, n, out, flags, NULL);
            break;
        case 3:
            rc = kv_table_apply_gradients(t, keys, n, grads, step, u8(&in) & 1, &cnt);
            if (rc == KV_OK && model) resync(t, dim, nslot, present);
            break;
        case 4:
            rc = kv_table_delete(t, keys, n, &cnt);
            if (rc == KV_OK && model)
                for (int64_t i = 0; i < n; i++) present[key_index(keys[i])] = 0;
            break;
        case 5:
            rc = kv_table_evict(t, step > 2 ? step - (u8(&in) % 3) : 0, (int64_t)(u8(&in) % 40) - 1,
                                u8(&in) & 1 ? KV_EVICT_LFU : KV_EVICT_LRU, &cnt);
            if (rc == KV_OK && model) resync(t, dim, nslot, present);
            break;
        case 6: { /* export everything, clear, import it back: the same table */
            dump_t d = dump(t, dim, nslot);
            rc = kv_table_clear(t);
            if (rc == KV_OK)
                rc = kv_table_import(t, d.keys, d.n, d.vals, nslot ? d.slots : NULL, d.steps,
                                     d.counts);
            int finite = 1; /* huge gradients can overflow a row to inf: import refuses it */
            for (int64_t i = 0; i < d.n * dim; i++) finite &= isfinite(d.vals[i]) != 0;
            for (int64_t i = 0; nslot && i < d.n * nslot; i++) finite &= isfinite(d.slots[i]) != 0;
            if (rc != KV_OK && !(rc == KV_ENONFINITE && !finite)) abort();
            if (rc == KV_OK) {
                dump_t e = dump(t, dim, nslot);
                if (e.n != d.n) abort();
                dump_free(&e);
            } else if (model) {
                memset(present, 0, NKEYS); /* cleared, and nothing imported */
            }
            rc = KV_OK; /* the clear was the point; import's refusal is checked above */
            dump_free(&d);
            break;
        }
        case 7:
            rc = kv_table_update(t, keys, n, grads);
            if (rc == KV_OK && model)
                for (int64_t i = 0; i < n; i++) present[key_index(keys[i])] = 1;
            break;
        case 8: { /* a lookup that keeps refs, then an update at those refs */
            int64_t m = 0; /* apply_refs needs distinct keys */
            for (int64_t i = 0; i < n; i++) {
                int dup = 0;
                for (int64_t j = 0; j < m; j++) dup |= keys[j] == keys[i];
                if (!dup) keys[m++] = keys[i];
            }
            rc = kv_table_find_or_create_gen(t, keys, m, out, step, &cnt, refs, &gen);
            if (rc == KV_OK) {
                if (model)
                    for (int64_t i = 0; i < m; i++) present[key_index(keys[i])] = 1;
                dump_free(&before);
                before = dump(t, dim, nslot);
                rc = kv_table_apply_refs(t, keys, refs, m, grads, step, gen, &cnt);
            }
            break;
        }
        case 9:
            rc = kv_table_forget_new(t, keys, n, step, &cnt);
            if (rc == KV_OK && model) resync(t, dim, nslot, present);
            break;
        case 10: {
            kv_optim_t opt = c.optim;
            opt.lr = value_of(u8(&in));
            rc = kv_table_set_optim(t, &opt);
            break;
        }
        default: {
            tracking = !tracking;
            rc = kv_table_track_removed(t, tracking);
            int64_t got = 0;
            if (rc == KV_OK) rc = kv_table_take_removed(t, keys, MAXN, &got);
            break;
        }
        }
        if (rc != KV_OK && rc != KV_EINVAL && rc != KV_ENONFINITE && rc != KV_EOPTIM &&
            rc != KV_ENOMEM && rc != KV_EFULL)
            abort();
        if (rc == KV_EINVAL || rc == KV_ENONFINITE || rc == KV_EOPTIM) {
            dump_t after = dump(t, dim, nslot);
            if (!dumps_equal(&before, &after, dim, nslot)) { /* unchanged on error */
                if (getenv("KV_FUZZ_DEBUG")) fprintf(stderr, "op %d rc %d: changed\n", op, rc);
                abort();
            }
            dump_free(&after);
        }
        dump_free(&before);
        check_table(t, dim, nslot, model);
    }
    free(out);
    free(grads);
    kv_table_destroy(t);
    return 0;
}
