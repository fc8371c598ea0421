/*
 * kv_init.c - a new key's initial embedding (see kv_init.h).
 *
 * Initial values come from a counter-based generator: element e of key k draws
 * kv_mix64(base(seed, table_id, k) + golden * (counter(e, attempt) + 1)), so the
 * value depends on (seed, table_id, key, initializer) only.
 *
 * The batch kernel (rows_kernel) works on blocks of up to BLOCK draws: R whole rows
 * (or a slice of one wide row), laid out draw-major so that every loop but the last
 * runs over contiguous arrays with the same operation in every lane: the hash inputs
 * (a row's draws are an arithmetic sequence: no multiply), the hashes, then the
 * uniforms, Box-Muller with kv_fmath's float log and sincos, and the scaling, in
 * loops over whole groups of `lanes` draws (the vector width, so no scalar tail),
 * which the compiler vectorises. The last loop copies each row's elements out; for a
 * truncated normal it also lists the elements beyond 2 sd, whose first redraws are
 * then computed together in the same vectorised way.
 *
 * On x86-64 the kernel is compiled three times, for the baseline ISA, AVX2 and
 * AVX-512 (AVX-512 DQ also vectorises the 64-bit multiplies of the hash), and the
 * copy is picked once, at run time, from the CPU (__builtin_cpu_supports). All three
 * give the same bits: no value depends on another, every float operation is an IEEE
 * one on one lane (integer to float conversions are of integers below 2^24 + 1, so
 * exact), nothing is reassociated (no -ffast-math) and nothing is contracted into an
 * FMA (ISO C mode, or the clang pragma; see KV_ISA_CLONES). csrc/tests/test_init.c
 * checks every copy the CPU runs against a plain per-element reference.
 */
#include "kv_init.h"

#include <math.h>
#include <string.h>

#include "kv_fmath.h"
#include "kv_isa.h"
#include "kv_route.h"

#if KV_INIT_ISA_BASE != KV_ISA_BASE || KV_INIT_ISA_AVX2 != KV_ISA_AVX2 || \
    KV_INIT_ISA_AVX512 != KV_ISA_AVX512
#error "KV_INIT_ISA_* must number the copies as kv_isa.h does"
#endif

#define GOLDEN 0x9e3779b97f4a7c15ULL
#define BLOCK 128    /* draws per pass of rows_kernel, a multiple of every `lanes` */
#define ROW_MAJOR 16 /* rows of this many elements or more are laid out row-major */

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
 * angle). Pair p of a row uses counter 2p << 24 for elements 2p and 2p + 1; a
 * truncated-normal redraw of element e (attempt >= 1) uses (e << 24) + 2 attempt,
 * which no pair uses. A uniform element e uses counter e << 24. (h >> 40) + 1 and
 * the other fields are below 2^24 + 1, so their conversion to float (or double) is
 * exact, whatever the integer type converted from. */
KV_INLINE void pair_uniforms(uint64_t h, float *u1, float *u2) {
    *u1 = (float)(int32_t)((h >> 40) + 1) * 0x1p-24f;         /* (0, 1] */
    *u2 = (float)(int32_t)((h >> 16) & 0xffffff) * 0x1p-24f;  /* [0, 1) */
}

KV_INLINE void box_muller(float u1, float u2, float *z0, float *z1) {
    float r = sqrtf(-2.0f * kv_logf(u1)), sn, cs;
    kv_sincos_turn(u2, &sn, &cs);
    *z0 = r * cs;
    *z1 = r * sn;
}

static float normal_redraw(uint64_t base, uint64_t e, uint64_t attempt) {
    float u1, u2, z0, z1;
    pair_uniforms(draw(base, (e << 24) + 2 * attempt), &u1, &u2);
    box_muller(u1, u2, &z0, &z1);
    (void)z1;
    return z0;
}

/* kv_mix64(x), in a loop the compiler vectorises if vmul. Without AVX-512 DQ's
 * vector 64-bit multiply it emulates it with three 32-bit ones: still faster than the
 * scalar multiplier with AVX2's 4 lanes, slower with SSE2's 2, so the baseline copy
 * passes vmul = 0 and the empty asm keeps x in a scalar register. */
KV_INLINE uint64_t mix(uint64_t x, const int vmul) {
#if defined(__GNUC__)
    if (!vmul) __asm__("" : "+r"(x));
#endif
    return kv_mix64(x);
}

/* What the kernel needs of a config, worked out once per call. */
typedef struct init_params {
    int32_t dim, kind;
    int32_t per_row;   /* draws per row: dim (uniform) or (dim + 1) / 2 pairs (normal) */
    int32_t clamp;     /* uniform: a < b */
    float a, b;
    float b_below;     /* uniform: nextafterf(b, a), the largest value below b */
    double ad, span;   /* uniform: a and b - a, in double */
    uint64_t salt;     /* kv_mix64(kv_mix64(seed) ^ table_id) */
    uint64_t step;     /* hash input of draw d + 1 - that of draw d: golden * counter step */
} init_params_t;

static void params_of(const kv_table_config_t *c, init_params_t *p) {
    memset(p, 0, sizeof *p);
    p->dim = c->dim;
    p->kind = c->init_kind;
    p->a = c->init_a;
    p->b = c->init_b;
    p->salt = kv_mix64(kv_mix64(c->seed) ^ c->table_id);
    if (c->init_kind == KV_INIT_UNIFORM) {
        p->per_row = c->dim;
        p->clamp = c->init_a < c->init_b;
        p->b_below = p->clamp ? nextafterf(c->init_b, c->init_a) : c->init_b;
        p->ad = (double)c->init_a;
        p->span = (double)c->init_b - (double)c->init_a;
        p->step = GOLDEN << 24;       /* counter e << 24 */
    } else {
        p->per_row = (c->dim + 1) / 2;
        p->step = GOLDEN << 25;       /* counter 2p << 24 */
    }
}

/* Element e of a truncated normal row whose draws before `attempt` gave |z| > 2: the
 * redraws from `attempt` on until |z| <= 2, or 0 after 2^20 attempts. */
static float truncated_redraw(const init_params_t *p, int64_t key, int32_t e, uint64_t attempt) {
    uint64_t base = kv_mix64(p->salt ^ (uint64_t)key);
    float z = 3.0f;
    while (fabsf(z) > 2.0f && attempt < (1u << 20)) z = normal_redraw(base, (uint64_t)e, attempt++);
    if (fabsf(z) > 2.0f) z = 0.0f; /* unreachable in practice; keeps it bounded */
    return z;
}

/*
 * Truncated normal: pairs[k] (k < np) = (r << 19) | (e << 2) | bits lists the pairs of
 * elements e, e + 1 of row r (key keys[r], base base[r], output out[r]) where bit 0
 * says |z| > 2 for e, bit 1 for e + 1 (about 4.6 % of elements). Their first
 * redraws are computed together (vectorised, like the pairs), the rare second ones
 * one by one (truncated_redraw). redo, x and z: scratch for 2 BLOCK elements.
 */
KV_INLINE void truncated_fixup(const init_params_t *p, const int64_t *keys, float *const *out,
                               const uint64_t *base, const int32_t *pairs, int32_t np,
                               int32_t *redo, uint64_t *x, float *z, const int32_t lanes,
                               const int vmul) {
    int32_t nb = 0; /* redo[k] = (r << 17) | e, k < nb: the elements */
    for (int32_t k = 0; k < np; k++) {
        int32_t c = pairs[k], e = (c >> 2) & 0x1ffff, re = (c >> 19 << 17) | e;
        redo[nb] = re;
        nb += c & 1;
        redo[nb] = re + 1;
        nb += (c >> 1) & (e + 1 < p->dim);
    }
    for (int32_t k = 0; k < nb; k++) /* attempt 1: counter (e << 24) + 2 */
        x[k] = base[redo[k] >> 17] + GOLDEN * (((uint64_t)(redo[k] & 0x1ffff) << 24) + 3);
    for (int32_t k = nb; k % lanes; k++) x[k] = 0;
    for (int32_t k = 0; k < nb; k++) x[k] = mix(x[k], vmul);
    for (int32_t k0 = 0; k0 < nb; k0 += lanes)
        for (int32_t k = k0; k < k0 + lanes; k++) {
            float u1, u2, z1;
            pair_uniforms(x[k], &u1, &u2);
            box_muller(u1, u2, &z[k], &z1);
        }
    for (int32_t k = 0; k < nb; k++) {
        int32_t r = redo[k] >> 17, e = redo[k] & 0x1ffff;
        float zk = z[k];
        if (fabsf(zk) > 2.0f) zk = truncated_redraw(p, keys[r], e, 2);
        out[r][e] = p->a + p->b * zk;
    }
}

/*
 * out[i][0..dim) = the initial embedding of keys[i] for the uniform and normal kinds.
 * Draw d of row i is kv_mix64(base_i + golden + d * step), with nd draws a row
 * (uniform: element d; normal: elements 2d and 2d + 1). A block is R rows times
 * draws [d0, d0 + nq) of each, at most BLOCK draws: whole rows (d0 = 0, nq = nd)
 * when a row has at most BLOCK draws, else a slice of one row (R = 1). Draw d0 + dd
 * of row r is at [r * nq + dd] (row-major) when rows have ROW_MAJOR elements or more,
 * else at [dd * R + r] (draw-major), so that the loops that lay out the hash inputs
 * and copy the values out have a long inner loop either way; the float loops run
 * over the whole block in groups of `lanes` (the vector width: no scalar tail).
 * vmul: vectorise kv_mix64's 64-bit multiplies (see mix()).
 */
KV_INLINE void rows_kernel(const init_params_t *p, const int64_t *keys, int64_t n,
                           float *const *out, const int32_t lanes, const int vmul) {
    const int32_t dim = p->dim, nd = p->per_row;
    const int uniform = p->kind == KV_INIT_UNIFORM;
    const int truncated = p->kind == KV_INIT_TRUNCATED_NORMAL;
    const int row_major = (uniform ? nd : 2 * nd) >= ROW_MAJOR; /* else nd < BLOCK: d0 = 0 */
    const uint64_t salt = p->salt, step = p->step;
    const float a = p->a, b = p->b;
    const int32_t rows_per_block = nd <= BLOCK ? BLOCK / nd : 1;
    uint64_t base[BLOCK], off[BLOCK], x[2 * BLOCK]; /* x, z0: also truncated_fixup's */
    float v0[BLOCK], v1[BLOCK], z0[2 * BLOCK], z1[BLOCK];
    int32_t bad[BLOCK], pairs[BLOCK], redo[2 * BLOCK]; /* truncated normal */
    /* off[dd] = golden + dd * step: the hash input of draw d0 + dd less base + d0 step */
    int32_t noff = nd < BLOCK ? nd : BLOCK;
    for (int32_t dd = 0; dd < noff; dd++) off[dd] = GOLDEN + (uint64_t)dd * step;
    for (int64_t i = 0; i < n;) {
        int32_t R = n - i < rows_per_block ? (int32_t)(n - i) : rows_per_block;
        for (int32_t r = 0; r < R; r++) base[r] = kv_mix64(salt ^ (uint64_t)keys[i + r]);
        for (int32_t d0 = 0; d0 < nd; d0 += BLOCK) { /* one pass unless R = 1 */
            const int32_t nq = nd - d0 < BLOCK ? nd - d0 : BLOCK, m = nq * R;
            if (row_major) {
                for (int32_t r = 0; r < R; r++) {
                    const uint64_t br = base[r] + (uint64_t)d0 * step;
                    uint64_t *xr = x + (size_t)r * nq;
                    for (int32_t dd = 0; dd < nq; dd++) xr[dd] = br + off[dd];
                }
            } else {
                for (int32_t dd = 0; dd < nq; dd++)
                    for (int32_t r = 0; r < R; r++) x[dd * R + r] = base[r] + off[dd];
            }
            for (int32_t j = m; j % lanes; j++) x[j] = 0; /* lanes past m: computed, unused */
            for (int32_t j0 = 0; j0 < m; j0 += lanes)
                for (int32_t j = j0; j < j0 + lanes; j++) x[j] = mix(x[j], vmul);
            if (uniform) {
                const double ad = p->ad, span = p->span;
                const float lim = p->clamp ? b : INFINITY, below = p->b_below;
                for (int32_t j0 = 0; j0 < m; j0 += lanes)
                    for (int32_t j = j0; j < j0 + lanes; j++) {
                        double u = (double)(int32_t)(x[j] >> 40) * 0x1p-24;
                        float f = (float)(ad + span * u);
                        v0[j] = f >= lim ? below : f; /* keep [a, b) after rounding */
                    }
                for (int32_t r = 0; r < R; r++) {
                    float *o = out[i + r] + d0;
                    if (row_major)
                        memcpy(o, v0 + (size_t)r * nq, (size_t)nq * sizeof(float));
                    else
                        for (int32_t dd = 0; dd < nq; dd++) o[dd] = v0[dd * R + r];
                }
                continue;
            }
            for (int32_t j0 = 0; j0 < m; j0 += lanes)
                for (int32_t j = j0; j < j0 + lanes; j++) {
                    float u1, u2;
                    pair_uniforms(x[j], &u1, &u2);
                    box_muller(u1, u2, &z0[j], &z1[j]);
                    v0[j] = a + b * z0[j];
                    v1[j] = a + b * z1[j];
                }
            /* pairs dd < full give two elements; a last one past them, one (odd dim) */
            const int32_t e0 = 2 * d0, full = (dim - e0) / 2 < nq ? (dim - e0) / 2 : nq;
            for (int32_t r = 0; r < R; r++) {
                float *o = out[i + r] + e0;
                if (row_major) {
                    const float *p0 = v0 + (size_t)r * nq, *p1 = v1 + (size_t)r * nq;
                    for (int32_t dd = 0; dd < full; dd++) {
                        o[2 * dd] = p0[dd];
                        o[2 * dd + 1] = p1[dd];
                    }
                    if (full < nq) o[2 * full] = p0[full];
                } else {
                    for (int32_t dd = 0; dd < full; dd++) {
                        o[2 * dd] = v0[dd * R + r];
                        o[2 * dd + 1] = v1[dd * R + r];
                    }
                    if (full < nq) o[2 * full] = v0[full * R + r];
                }
            }
            if (!truncated) continue;
            /* truncated: list the pairs with |z| > 2 without a branch, as
             * (r << 19) | (first element << 2) | bits (1: |z0| > 2, 2: |z1| > 2) */
            for (int32_t j = 0; j < m; j++)
                bad[j] = (fabsf(z0[j]) > 2.0f ? 1 : 0) | (fabsf(z1[j]) > 2.0f ? 2 : 0);
            int32_t np = 0;
            if (row_major) {
                for (int32_t r = 0, j = 0; r < R; r++)
                    for (int32_t dd = 0; dd < nq; dd++, j++) {
                        pairs[np] = (r << 19) | ((e0 + 2 * dd) << 2) | bad[j];
                        np += bad[j] != 0;
                    }
            } else {
                for (int32_t dd = 0, j = 0; dd < nq; dd++)
                    for (int32_t r = 0; r < R; r++, j++) {
                        pairs[np] = (r << 19) | ((e0 + 2 * dd) << 2) | bad[j];
                        np += bad[j] != 0;
                    }
            }
            truncated_fixup(p, keys + i, out + i, base, pairs, np, redo, x, z0, lanes, vmul);
        }
        i += R;
    }
}

/* ---- dispatch ---------------------------------------------------------------------- */

typedef void (*rows_fn)(const init_params_t *, const int64_t *, int64_t, float *const *);

static void rows_base(const init_params_t *p, const int64_t *keys, int64_t n, float *const *out) {
    rows_kernel(p, keys, n, out, 4, 0);
}

#if KV_ISA_CLONES
KV_TARGET_AVX2 static void rows_avx2(const init_params_t *p, const int64_t *keys, int64_t n,
                                  float *const *out) {
    rows_kernel(p, keys, n, out, 8, 1);
}
KV_TARGET_AVX512 static void rows_avx512(const init_params_t *p, const int64_t *keys, int64_t n,
                                      float *const *out) {
    rows_kernel(p, keys, n, out, 16, 1);
}
#endif

static int g_best_isa; /* 0 until the first call works it out */

int kv_init_best_isa(void) {
    int isa = __atomic_load_n(&g_best_isa, __ATOMIC_RELAXED);
    if (!isa) {
        isa = kv_isa_detect();
        __atomic_store_n(&g_best_isa, isa, __ATOMIC_RELAXED);
    }
    return isa;
}

static rows_fn rows_for(int32_t isa) {
    switch (isa == KV_INIT_ISA_BEST ? kv_init_best_isa() : isa) {
#if KV_ISA_CLONES
    case KV_INIT_ISA_AVX512: return rows_avx512;
    case KV_INIT_ISA_AVX2: return rows_avx2;
#endif
    default: return rows_base;
    }
}

/* ---- entry points ------------------------------------------------------------------ */

static void init_rows(const kv_table_config_t *c, const int64_t *keys, int64_t n,
                      float *const *out, rows_fn fn) {
    if (c->init_kind == KV_INIT_ZEROS || c->init_kind == KV_INIT_CONSTANT) {
        const float a = c->init_kind == KV_INIT_ZEROS ? 0.0f : c->init_a;
        const size_t dim = (size_t)c->dim;
        for (int64_t i = 0; i < n; i++) {
            float *r = out[i];
            for (size_t e = 0; e < dim; e++) r[e] = a;
        }
        return;
    }
    init_params_t p;
    params_of(c, &p);
    fn(&p, keys, n, out);
}

void kv_init_rows(const kv_table_config_t *c, const int64_t *keys, int64_t n,
                  float *const *out) {
    init_rows(c, keys, n, out, rows_for(KV_INIT_ISA_BEST));
}

int kv_initial_values_isa(const kv_table_config_t *cfg, const int64_t *keys, int64_t n,
                          float *out, int32_t isa) {
    if (!cfg || n < 0 || (n > 0 && (!keys || !out))) return KV_EINVAL;
    if (cfg->dim < 1 || cfg->dim > KV_MAX_DIM) return KV_EINVAL;
    if (isa < KV_INIT_ISA_BEST || isa > kv_init_best_isa()) return KV_EINVAL;
    int rc = kv_init_check(cfg);
    if (rc != KV_OK) return rc;
    rows_fn fn = rows_for(isa);
    float *rows[64];
    for (int64_t i = 0; i < n; i += 64) {
        int64_t m = n - i < 64 ? n - i : 64;
        for (int64_t j = 0; j < m; j++) rows[j] = out + (size_t)(i + j) * (size_t)cfg->dim;
        init_rows(cfg, keys + i, m, rows, fn);
    }
    return KV_OK;
}

int kv_initial_values(const kv_table_config_t *cfg, const int64_t *keys, int64_t n,
                      float *out) {
    return kv_initial_values_isa(cfg, keys, n, out, KV_INIT_ISA_BEST);
}
