/*
 * kv_init.c - a new key's initial embedding (see kv_init.h).
 *
 * Initial values come from a counter-based generator: element e of key k draws
 * kv_mix64(base(seed, table_id, k) + golden * (counter(e, attempt) + 1)), so the
 * value depends on (seed, table_id, key, initializer) only.
 */
#include "kv_init.h"

#include <math.h>

#include "kv_fmath.h"
#include "kv_route.h"

#define GOLDEN 0x9e3779b97f4a7c15ULL

int kv_init_check(const kv_table_config_t *c) {
    if (c->init_kind < KV_INIT_ZEROS || c->init_kind > KV_INIT_TRUNCATED_NORMAL) return KV_EINIT;
    if (!isfinite(c->init_a) || !isfinite(c->init_b)) return KV_EINIT;
    if (c->init_kind == KV_INIT_UNIFORM && !(c->init_a <= c->init_b)) return KV_EINIT;
    if ((c->init_kind == KV_INIT_NORMAL || c->init_kind == KV_INIT_TRUNCATED_NORMAL) &&
        !(c->init_b >= 0))
        return KV_EINIT;
    return KV_OK;
}

static inline uint64_t draw(uint64_t base, uint64_t counter) {
    return kv_mix64(base + GOLDEN * (counter + 1));
}

/* Box-Muller: two standard normals from one draw (24 bits for the radius, 24 for the
 * angle). Pair p of a row uses counter 2p << 24 for elements 2p and 2p + 1 (initial_rows
 * runs the two halves below in separate, vectorised passes); a truncated-normal redraw
 * of element e (attempt >= 1) uses (e << 24) + 2 attempt, which no pair uses. */
static inline void pair_uniforms(uint64_t h, float *u1, float *u2) {
    *u1 = (float)((h >> 40) + 1) * 0x1p-24f;          /* (0, 1] */
    *u2 = (float)((h >> 16) & 0xffffff) * 0x1p-24f;   /* [0, 1) */
}

static inline void box_muller(float u1, float u2, float *z0, float *z1) {
    float r = sqrtf(-2.0f * kv_logf(u1)), sn, cs;
    kv_sincos_turn(u2, &sn, &cs);
    *z0 = r * cs;
    *z1 = r * sn;
}

static inline void normal_pair(uint64_t base, uint64_t c, float *z0, float *z1) {
    float u1, u2;
    pair_uniforms(draw(base, c), &u1, &u2);
    box_muller(u1, u2, z0, z1);
}

static float normal_redraw(uint64_t base, uint64_t e, uint64_t attempt) {
    float z0, z1;
    normal_pair(base, (e << 24) + 2 * attempt, &z0, &z1);
    (void)z1;
    return z0;
}

static inline uint64_t init_base(const kv_table_config_t *c, int64_t key) {
    return kv_mix64(kv_mix64(kv_mix64(c->seed) ^ c->table_id) ^ (uint64_t)key);
}

/* Element e of a row: a + b z, for the normal kinds; a truncated normal redraws
 * |z| > 2. */
static inline float normal_value(const kv_table_config_t *c, int64_t key, int32_t e, float z) {
    if (c->init_kind == KV_INIT_TRUNCATED_NORMAL && fabsf(z) > 2.0f) {
        uint64_t base = init_base(c, key), attempt = 1;
        while (fabsf(z) > 2.0f && attempt < (1u << 20))
            z = normal_redraw(base, (uint64_t)e, attempt++);
        if (fabsf(z) > 2.0f) z = 0.0f; /* unreachable in practice; keeps it bounded */
    }
    return c->init_a + c->init_b * z;
}

#define INIT_PAIRS 128 /* normal pairs computed per pass of initial_rows */

/*
 * out[i][0..dim) = the initial embedding of keys[i]. The normal kinds draw pairs of
 * elements: INIT_PAIRS pairs at a time, across rows, the hashing in one loop and the
 * float math in another that the compiler vectorises. Each value depends only on its
 * (seed, table, key, element): the same whatever the batch, its order or its split.
 */
void kv_init_rows(const kv_table_config_t *c, const int64_t *keys, int64_t n,
                  float *const *out) {
    int32_t dim = c->dim;
    float a = c->init_a, b = c->init_b;
    if (c->init_kind == KV_INIT_ZEROS || c->init_kind == KV_INIT_CONSTANT) {
        for (int64_t i = 0; i < n; i++)
            for (int32_t e = 0; e < dim; e++) out[i][e] = c->init_kind == KV_INIT_ZEROS ? 0.0f : a;
        return;
    }
    if (c->init_kind == KV_INIT_UNIFORM) {
        double span = (double)b - (double)a;
        for (int64_t i = 0; i < n; i++) {
            uint64_t base = init_base(c, keys[i]);
            for (int32_t e = 0; e < dim; e++) {
                double u = (double)(draw(base, (uint64_t)e << 24) >> 40) * 0x1p-24;
                float v = (float)((double)a + span * u);
                if (v >= b && a < b) v = nextafterf(b, a); /* keep [a, b) after rounding */
                out[i][e] = v;
            }
        }
        return;
    }
    const int32_t np = (dim + 1) / 2;
    float u1[INIT_PAIRS], u2[INIT_PAIRS], z0[INIT_PAIRS], z1[INIT_PAIRS];
    int64_t i = 0;
    int32_t p = 0;
    uint64_t base = n ? init_base(c, keys[0]) : 0;
    while (i < n) {
        int64_t ri = i; /* the block starts at pair p of row i */
        int32_t rp = p, m = 0;
        for (; m < INIT_PAIRS && i < n; m++) {
            pair_uniforms(draw(base, (uint64_t)(2 * p) << 24), &u1[m], &u2[m]);
            if (++p == np) {
                p = 0;
                if (++i < n) base = init_base(c, keys[i]);
            }
        }
        for (int32_t j = 0; j < m; j++) box_muller(u1[j], u2[j], &z0[j], &z1[j]);
        for (int32_t j = 0; j < m; j++) {
            int32_t e = 2 * rp;
            out[ri][e] = normal_value(c, keys[ri], e, z0[j]);
            if (e + 1 < dim) out[ri][e + 1] = normal_value(c, keys[ri], e + 1, z1[j]);
            if (++rp == np) {
                rp = 0;
                ri++;
            }
        }
    }
}

int kv_initial_values(const kv_table_config_t *cfg, const int64_t *keys, int64_t n,
                      float *out) {
    if (!cfg || n < 0 || (n > 0 && (!keys || !out))) return KV_EINVAL;
    if (cfg->dim < 1 || cfg->dim > KV_MAX_DIM) return KV_EINVAL;
    int rc = kv_init_check(cfg);
    if (rc != KV_OK) return rc;
    float *rows[64];
    for (int64_t i = 0; i < n; i += 64) {
        int64_t m = n - i < 64 ? n - i : 64;
        for (int64_t j = 0; j < m; j++) rows[j] = out + (size_t)(i + j) * (size_t)cfg->dim;
        kv_init_rows(cfg, keys + i, m, rows);
    }
    return KV_OK;
}
