/*
 * kv_exchange.c - one BSP exchange's work on either side of the all-to-alls, for every
 * table in one call (see kv_exchange.h for the layouts).
 *
 * kv_xplan runs kv_unique_partition per table (unique ids grouped by their owner under
 * the bucket -> rank map, first appearance inside a group), then walks the segments
 * r-major to copy the unique ids into the send payload and to number the rows each
 * group's matrix will hold: a group's rows are its tables' segments in payload order,
 * so a running base per group gives every unique id its row (upos), and
 * pos = upos[inverse].
 *
 * kv_xserve serves table by table. From one source (world 1) a table's ids are
 * distinct (kv_xplan made them so), and it looks them up straight into the reply. From
 * several sources one id may come from more than one: the table's ids are gathered
 * source after source, deduplicated (kv_unique_partition), looked up once into a
 * scratch block and copied to every place in the reply that asked for them; uidx
 * records, per received id, which distinct id it was. So a key counts as seen once per
 * step (admission) whatever the number of ranks, and is updated once per step.
 *
 * kv_xprepare sums each distinct id's gradients in payload order (the first one copied,
 * the next ones added: a fixed float order) and hands each table's sums to
 * kv_table_prepare_refs with the refs and generation of the serve, which computes every
 * updated row and slot into the caller's buffer (reading each row once, looking nothing
 * up while no row was freed in between) and changes nothing. So an update that would
 * make a row or a slot NaN/Inf (a finite but huge gradient: Adagrad's g^2 overflows) is
 * found before any table changed, and named (table, key); the caller decides, with the
 * other ranks, whether kv_xcommit writes the buffer or the step is given up. kv_xapply
 * is both in one call.
 *
 * Threads. With a pool (kv_pool.h) the work is split into tasks that write disjoint
 * outputs and never depend on each other, so the bits are those of one thread whatever
 * the number of threads or the schedule:
 *   - by table: a plan's dedup and partition (and its pos), a serve's lookups and
 *     inserts (a table is served by one task: its rows are created in the same order
 *     as by one thread), a prepare's gradient sums, the commit of the other tables;
 *   - by key range: a prepare's optimizer step (ranges of a table's distinct ids, each
 *     a kv_table_prepare_refs of its own under the table's read lock), the commit of a
 *     table holding more than its share of the rows (kv_table_commit_refs writes its
 *     ranges on the pool under its one write lock), kv_xrowgrad (ranges of output rows:
 *     each task reads every index and sums the gradients of its own rows, in order of
 *     i, as one thread does).
 * A table's outputs are placed by prefix sums computed before the tasks run (a serve
 * from several sources writes each table's distinct ids at the start of its received
 * ids and packs them afterwards). Errors are reported for the first table in order,
 * as one thread would meet them; unlike one thread, the other tables have been worked
 * on too (a serve's new rows stay, as the serve says of an error). Work too small to
 * pay for waking threads runs on the caller.
 *
 * Nothing here keeps state; the tables' own locks are taken table by table.
 */
#include "kv_exchange.h"

#include <math.h>
#include <string.h>

#include "kv_fmath.h"
#include "kv_route.h"

#define XMAX_N ((int64_t)UINT32_MAX - 1) /* kv_unique_partition's limit */
#ifndef KV_X_MIN_PARALLEL /* -D overrides: the C tests run every path with small data */
#define KV_X_MIN_PARALLEL 4096 /* ids (or rows) below which one thread works */
#endif
#ifndef KV_X_RANGE_ROWS
#define KV_X_RANGE_ROWS 2048 /* a prepare task's distinct ids, at least */
#endif

static int bad_counts(int32_t ntab, int32_t world, const int64_t *counts, int64_t *total) {
    int64_t sum = 0;
    for (int64_t k = 0; k < (int64_t)ntab * world; k++) {
        if (counts[k] < 0 || counts[k] > XMAX_N - sum) return 1;
        sum += counts[k];
    }
    *total = sum;
    return 0;
}

/* The pool to use for `work` ids or rows: NULL (the caller alone) when it is small. */
static kv_pool_t *pool_for(kv_pool_t *pool, int64_t work) {
    return work >= KV_X_MIN_PARALLEL && kv_pool_threads(pool) > 1 ? pool : NULL;
}

/* The first error of rc[0 .. n) in order, or KV_OK. */
static int first_error(const int *rc, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (rc[i] != KV_OK) return rc[i];
    return KV_OK;
}

/* ---- plan ------------------------------------------------------------------------- */

typedef struct {
    int32_t ntab, world, buckets;
    const int32_t *owners;
    const int64_t *const *ids;
    const int64_t *n;
    int64_t *uq, *inverse, *cnt, *nu, *off; /* off[t]: sum(n[<t]) */
    int *rc;
    /* second phase */
    const int64_t *counts, *send_at, *row_at, *uoff;
    int64_t *send_ids, *upos, *pos;
} plan_job_t;

static void plan_unique(void *arg, int64_t t) {
    plan_job_t *j = arg;
    j->rc[t] = kv_unique_partition(j->ids[t], j->n[t], j->owners, j->buckets, j->world,
                                   j->uq + j->off[t], j->inverse + j->off[t],
                                   j->cnt + t * j->world, &j->nu[t]);
}

/* Table t's segments into the send payload, its unique ids' rows, and pos. */
static void plan_place(void *arg, int64_t t) {
    plan_job_t *j = arg;
    const int64_t *uq = j->uq + j->off[t];
    int64_t *up = j->upos + j->uoff[t], u = 0;
    for (int32_t r = 0; r < j->world; r++) {
        int64_t k = (int64_t)r * j->ntab + t, c = j->counts[k];
        if (c) memcpy(j->send_ids + j->send_at[k], uq + u, (size_t)c * sizeof(int64_t));
        for (int64_t i = 0; i < c; i++) up[u + i] = j->row_at[k] + i;
        u += c;
    }
    const int64_t *inv = j->inverse + j->off[t];
    int64_t *pos = j->pos + j->off[t];
    for (int64_t i = 0; i < j->n[t]; i++) pos[i] = up[inv[i]];
}

int kv_xplan(kv_pool_t *pool, int32_t ntab, const int32_t *owners, int32_t buckets,
             int32_t world, const int64_t *const *ids, const int64_t *n, const int32_t *group,
             int64_t *send_ids, int64_t *counts, int64_t *inverse, int64_t *upos, int64_t *pos,
             int64_t *n_unique) {
    if (ntab < 1 || world < 1 || buckets < 1 || buckets > KV_MAX_BUCKETS ||
        (world > 1 && !owners) || !ids || !n || !group || !counts || !n_unique)
        return KV_EINVAL;
    int64_t total = 0;
    for (int32_t t = 0; t < ntab; t++) {
        if (n[t] < 0 || n[t] > XMAX_N - total || (n[t] > 0 && !ids[t])) return KV_EINVAL;
        if (group[t] < 0 || group[t] >= ntab) return KV_EINVAL;
        total += n[t];
    }
    if (total > 0 && (!send_ids || !inverse || !upos || !pos)) return KV_EINVAL;
    /* scratch: every table's unique ids (at its ids' offset); per table its ids' and its
     * unique ids' offsets, per (rank, table) its count, send offset and first row; per
     * group its next row; per table a status */
    size_t k2 = (size_t)ntab * (size_t)world;
    int64_t *uq = kv_malloc(((size_t)total + 3 * (size_t)ntab + 3 * k2) * sizeof(int64_t) +
                            (size_t)ntab * sizeof(int));
    if (!uq) return KV_ENOMEM;
    int64_t *off = uq + total, *uoff = off + ntab, *gb = uoff + ntab, *cnt = gb + ntab;
    int64_t *send_at = cnt + k2, *row_at = send_at + k2;
    int *rc = (int *)(void *)(row_at + k2);
    int64_t at = 0;
    for (int32_t t = 0; t < ntab; t++) {
        off[t] = at;
        at += n[t];
    }
    plan_job_t j = {.ntab = ntab, .world = world, .buckets = buckets, .owners = owners,
                    .ids = ids, .n = n, .uq = uq, .inverse = inverse, .cnt = cnt,
                    .nu = n_unique, .off = off, .rc = rc, .counts = counts,
                    .send_at = send_at, .row_at = row_at, .uoff = uoff,
                    .send_ids = send_ids, .upos = upos, .pos = pos};
    kv_pool_t *p = pool_for(pool, total);
    kv_pool_run(p, ntab, plan_unique, &j);
    int err = first_error(rc, ntab);
    if (err != KV_OK) {
        kv_free(uq);
        return err;
    }
    /* counts; the unique ids' offsets; per segment (r-major) its send offset and the
     * first row of its group's matrix: a group's rows run on across ranks */
    int64_t us = 0;
    for (int32_t t = 0; t < ntab; t++) {
        for (int32_t r = 0; r < world; r++)
            counts[(int64_t)r * ntab + t] = cnt[(int64_t)t * world + r];
        uoff[t] = us;
        us += n_unique[t];
    }
    memset(gb, 0, (size_t)ntab * sizeof(int64_t));
    at = 0;
    for (int32_t r = 0; r < world; r++)
        for (int32_t t = 0; t < ntab; t++) {
            int64_t k = (int64_t)r * ntab + t;
            send_at[k] = at;
            row_at[k] = gb[group[t]];
            gb[group[t]] += counts[k];
            at += counts[k];
        }
    kv_pool_run(p, ntab, plan_place, &j);
    kv_free(uq);
    return KV_OK;
}

/* Start of every segment's ids and floats (payload layout). */
static void seg_starts(int32_t ntab, int32_t world, const int64_t *counts, const int32_t *dims,
                       int64_t *id_at, int64_t *fl_at) {
    int64_t a = 0, b = 0;
    for (int32_t r = 0; r < world; r++)
        for (int32_t t = 0; t < ntab; t++) {
            int64_t k = (int64_t)r * ntab + t;
            id_at[k] = a;
            fl_at[k] = b;
            a += counts[k];
            b += counts[k] * dims[t];
        }
}

/* ---- serve ------------------------------------------------------------------------ */

typedef struct {
    kv_table_t *const *tables;
    int32_t ntab, world;
    const int64_t *recv_ids, *recv_counts, *id_at, *fl_at, *mstart;
    const int32_t *dims;
    uint32_t step;
    float *reply;
    int64_t *uidx, *ukeys, *nu;
    uint32_t *urefs;
    uint64_t *gens;
    int *rc;
} serve_job_t;

/* Read only: every segment of table t. */
static void serve_find(void *arg, int64_t t) {
    serve_job_t *j = arg;
    int rc = KV_OK;
    for (int32_t r = 0; rc == KV_OK && r < j->world; r++) {
        int64_t k = (int64_t)r * j->ntab + t;
        rc = kv_table_find(j->tables[t], j->recv_ids + j->id_at[k], j->recv_counts[k],
                           j->reply + j->fl_at[k], NULL, NULL);
    }
    j->rc[t] = rc;
}

/* One source: table t's ids are distinct; they are its distinct ids, at mstart[t]. */
static void serve_one(void *arg, int64_t t) {
    serve_job_t *j = arg;
    int64_t c = j->recv_counts[t], a = j->id_at[t], us = j->mstart[t];
    j->rc[t] = kv_table_find_or_create_gen(j->tables[t], j->recv_ids + a, c,
                                           j->reply + j->fl_at[t], j->step, NULL,
                                           j->urefs + us, &j->gens[t]);
    if (c) memcpy(j->ukeys + us, j->recv_ids + a, (size_t)c * sizeof(int64_t));
    for (int64_t i = 0; i < c; i++) j->uidx[a + i] = i;
    j->nu[t] = c;
}

/* Several sources: gather table t's ids, dedup, serve once, copy out; its distinct
 * ids go to mstart[t] (its received ids' count fits there). */
static void serve_many(void *arg, int64_t t) {
    serve_job_t *j = arg;
    size_t d = (size_t)j->dims[t];
    int64_t m = 0, nu = 0, us = j->mstart[t];
    for (int32_t r = 0; r < j->world; r++) m += j->recv_counts[(int64_t)r * j->ntab + t];
    int64_t *keys = kv_malloc((size_t)(2 * m + 1) * sizeof(int64_t));
    float *rows = kv_malloc((size_t)(m ? m : 1) * d * sizeof(float));
    int rc = keys && rows ? KV_OK : KV_ENOMEM;
    int64_t *inv = keys + m;
    if (rc == KV_OK) {
        m = 0;
        for (int32_t r = 0; r < j->world; r++) {
            int64_t k = (int64_t)r * j->ntab + t;
            if (j->recv_counts[k])
                memcpy(keys + m, j->recv_ids + j->id_at[k],
                       (size_t)j->recv_counts[k] * sizeof(int64_t));
            m += j->recv_counts[k];
        }
        rc = kv_unique(keys, m, j->ukeys + us, inv, &nu);
    }
    if (rc == KV_OK)
        rc = kv_table_find_or_create_gen(j->tables[t], j->ukeys + us, nu, rows, j->step, NULL,
                                         j->urefs + us, &j->gens[t]);
    if (rc == KV_OK) {
        m = 0;
        for (int32_t r = 0; r < j->world; r++) {
            int64_t k = (int64_t)r * j->ntab + t, a = j->id_at[k];
            float *out = j->reply + j->fl_at[k];
            for (int64_t i = 0; i < j->recv_counts[k]; i++, m++) {
                j->uidx[a + i] = inv[m];
                memcpy(out + (size_t)i * d, rows + (size_t)inv[m] * d, d * sizeof(float));
            }
        }
    }
    j->nu[t] = rc == KV_OK ? nu : 0;
    j->rc[t] = rc;
    kv_free(keys);
    kv_free(rows);
}

int kv_xserve(kv_pool_t *pool, kv_table_t *const *tables, int32_t ntab, int32_t world,
              const int64_t *recv_ids, const int64_t *recv_counts, uint32_t step,
              int32_t create, float *reply, int64_t *uidx, int64_t *ukeys, uint32_t *urefs,
              int64_t *ustart, uint64_t *gens) {
    if (!tables || ntab < 1 || world < 1 || !recv_counts) return KV_EINVAL;
    int64_t total = 0;
    if (bad_counts(ntab, world, recv_counts, &total)) return KV_EINVAL;
    if (total > 0 && (!recv_ids || !reply)) return KV_EINVAL;
    if (create && (!ustart || !gens || (total > 0 && (!uidx || !ukeys || !urefs))))
        return KV_EINVAL;
    for (int32_t t = 0; t < ntab; t++)
        if (!tables[t]) return KV_EINVAL;
    size_t k2 = (size_t)ntab * (size_t)world;
    int64_t *id_at = kv_malloc((2 * k2 + 2 * (size_t)ntab) * sizeof(int64_t) +
                               (size_t)ntab * (sizeof(int32_t) + sizeof(int)));
    if (!id_at) return KV_ENOMEM;
    int64_t *fl_at = id_at + k2, *mstart = fl_at + k2, *nu = mstart + ntab;
    int32_t *dims = (int32_t *)(void *)(nu + ntab);
    int *rc = (int *)(void *)(dims + ntab);
    for (int32_t t = 0; t < ntab; t++) dims[t] = kv_table_dim(tables[t]);
    seg_starts(ntab, world, recv_counts, dims, id_at, fl_at);
    int64_t at = 0;
    for (int32_t t = 0; t < ntab; t++) { /* table t's received ids start here */
        mstart[t] = at;
        for (int32_t r = 0; r < world; r++) at += recv_counts[(int64_t)r * ntab + t];
    }
    serve_job_t j = {.tables = tables, .ntab = ntab, .world = world, .recv_ids = recv_ids,
                     .recv_counts = recv_counts, .id_at = id_at, .fl_at = fl_at,
                     .mstart = mstart, .dims = dims, .step = step, .reply = reply,
                     .uidx = uidx, .ukeys = ukeys, .nu = nu, .urefs = urefs, .gens = gens,
                     .rc = rc};
    kv_pool_t *p = pool_for(pool, total);
    if (!create) {
        kv_pool_run(p, ntab, serve_find, &j);
    } else {
        kv_pool_run(p, ntab, world == 1 ? serve_one : serve_many, &j);
        /* pack every table's distinct ids, table after table */
        int64_t us = 0;
        for (int32_t t = 0; t < ntab; t++) {
            ustart[t] = us;
            if (us != mstart[t] && nu[t]) {
                memmove(ukeys + us, ukeys + mstart[t], (size_t)nu[t] * sizeof(int64_t));
                memmove(urefs + us, urefs + mstart[t], (size_t)nu[t] * sizeof(uint32_t));
            }
            us += nu[t];
        }
        ustart[ntab] = us;
    }
    int err = first_error(rc, ntab);
    kv_free(id_at);
    return err;
}

/* ---- prepare, commit, apply ------------------------------------------------------- */

/* Check kv_xapply/kv_xprepare's arguments; *total = the ids received. KV_OK or
 * KV_EINVAL. */
static int xapply_args(kv_table_t *const *tables, int32_t ntab, int32_t world,
                       const int64_t *recv_counts, const float *grads, float scale,
                       int64_t step, const int64_t *uidx, const int64_t *ukeys,
                       const uint32_t *urefs, const int64_t *ustart, const uint64_t *gens,
                       int64_t *total) {
    if (!tables || ntab < 1 || world < 1 || !recv_counts || !ustart || !gens || step < 1 ||
        !isfinite(scale))
        return KV_EINVAL;
    if (bad_counts(ntab, world, recv_counts, total)) return KV_EINVAL;
    if (*total > 0 && (!grads || !uidx || !ukeys || !urefs)) return KV_EINVAL;
    if (ustart[0] != 0) return KV_EINVAL;
    for (int32_t t = 0; t < ntab; t++) {
        int64_t m = 0;
        for (int32_t r = 0; r < world; r++) m += recv_counts[(int64_t)r * ntab + t];
        int64_t nu = ustart[t + 1] - ustart[t];
        if (!tables[t] || nu < 0 || nu > m || (world == 1 && nu != m)) return KV_EINVAL;
    }
    return KV_OK;
}

/* Per table t: where its prepared rows start in the rows buffer (floats: its distinct
 * ids times dim + slot floats, tables one after another); roff[ntab] = the total. */
static void prep_starts(kv_table_t *const *tables, int32_t ntab, const int64_t *ustart,
                        int64_t *roff) {
    int64_t at = 0;
    for (int32_t t = 0; t < ntab; t++) {
        roff[t] = at;
        at += (ustart[t + 1] - ustart[t]) *
              ((int64_t)kv_table_dim(tables[t]) + kv_table_slot_floats(tables[t]));
    }
    roff[ntab] = at;
}

int64_t kv_xprepare_floats(kv_table_t *const *tables, int32_t ntab, const int64_t *ustart) {
    if (!tables || ntab < 1 || !ustart) return -1;
    for (int32_t t = 0; t < ntab; t++)
        if (!tables[t] || ustart[t + 1] < ustart[t]) return -1;
    int64_t *roff = kv_malloc(((size_t)ntab + 1) * sizeof(int64_t));
    if (!roff) return -1;
    prep_starts(tables, ntab, ustart, roff);
    int64_t n = roff[ntab];
    kv_free(roff);
    return n;
}

typedef struct {
    kv_table_t *const *tables;
    int32_t ntab, world;
    const int64_t *recv_counts, *uidx, *ukeys, *ustart, *id_at, *fl_at, *roff, *small;
    const uint32_t *urefs;
    const uint64_t *gens;
    const int32_t *dims;
    const float *grads;
    float scale, *rows, *sums; /* sums: the big table being prepared by ranges */
    int64_t step, big, piece;  /* big: that table; piece: distinct ids per range */
    uint32_t *ids;
    /* per table: the first bad gradient as received (source rank, index in its
     * segment; -1: none), the first distinct id whose sum is not finite (-1), the
     * first whose update is not (-1), its status and the generation of its ids */
    int64_t *bad_rj, *bad_sum, *bad_upd;
    int *rc;
    uint64_t *pgens;
    /* per range of the big table: first bad update, generation, status */
    int64_t *rbad;
    uint64_t *rgen;
    int *rrc;
} prep_job_t;

/* Table t's sums: sum each distinct id's scaled gradients in payload order into sums
 * (its distinct ids x dim floats) and check them; a NaN/Inf received makes its sum
 * NaN/Inf too, so only when a sum is not finite is what was received looked at, to say
 * which of the two it was. seen: a byte per distinct id. Returns whether all is
 * finite. */
static int prep_sums(prep_job_t *j, int64_t t, float *sums, uint8_t *seen) {
    size_t d = (size_t)j->dims[t];
    int64_t nu = j->ustart[t + 1] - j->ustart[t];
    j->bad_rj[2 * t] = j->bad_sum[t] = j->bad_upd[t] = -1;
    j->rc[t] = KV_OK;
    const float scale = j->scale;
    if (j->world == 1) { /* one source, distinct ids, in uniq order */
        const float *src = j->grads + j->fl_at[t];
        for (size_t e = 0; e < (size_t)nu * d; e++) sums[e] = scale * src[e];
    } else {
        memset(seen, 0, (size_t)nu);
        for (int32_t r = 0; r < j->world; r++) {
            int64_t k = (int64_t)r * j->ntab + t;
            const float *src = j->grads + j->fl_at[k];
            for (int64_t i = 0; i < j->recv_counts[k]; i++, src += d) {
                int64_t u = j->uidx[j->id_at[k] + i];
                float *dst = sums + (size_t)u * d;
                if (!seen[u]) {
                    seen[u] = 1;
                    for (size_t e = 0; e < d; e++) dst[e] = scale * src[e];
                } else {
                    for (size_t e = 0; e < d; e++) dst[e] += scale * src[e];
                }
            }
        }
    }
    if (kv_all_finite(sums, (size_t)nu * d)) return 1;
    for (int32_t r = 0; r < j->world; r++) { /* a NaN/Inf received: the first one */
        int64_t k = (int64_t)r * j->ntab + t;
        for (int64_t i = 0; i < j->recv_counts[k]; i++)
            if (!kv_all_finite(j->grads + j->fl_at[k] + (size_t)i * d, d)) {
                j->bad_rj[2 * t] = r;
                j->bad_rj[2 * t + 1] = i;
                return 0;
            }
    }
    for (int64_t u = 0; u < nu; u++) /* else a sum (or a scaled one) overflowed */
        if (!kv_all_finite(sums + (size_t)u * d, d)) {
            j->bad_sum[t] = u;
            break;
        }
    return 0;
}

/* The optimizer step on distinct ids [u0, u1) of table t (sums: the table's). */
static int prep_part(prep_job_t *j, int64_t t, const float *sums, int64_t u0, int64_t u1,
                     uint64_t *gen, int64_t *bad) {
    int64_t us = j->ustart[t], b = -1;
    size_t d = (size_t)j->dims[t];
    size_t f = d + (size_t)kv_table_slot_floats(j->tables[t]); /* floats per prepared row */
    int rc = kv_table_prepare_refs(j->tables[t], j->ukeys + us + u0, j->urefs + us + u0,
                                   u1 - u0, sums + (size_t)u0 * d, j->step, j->gens[t],
                                   j->rows + j->roff[t] + (size_t)u0 * f, j->ids + us + u0,
                                   gen, &b);
    *bad = -1;
    if (rc == KV_ENONFINITE && b >= 0) {
        *bad = u0 + b;
        rc = KV_OK;
    }
    return rc;
}

/* Task q: table small[q] whole, with sums of its own (so one thread's working set is
 * one table's, as without threads). */
static void prep_table(void *arg, int64_t q) {
    prep_job_t *j = arg;
    int64_t t = j->small[q], nu = j->ustart[t + 1] - j->ustart[t];
    float *sums = kv_malloc((size_t)(nu ? nu : 1) * (size_t)j->dims[t] * sizeof(float));
    uint8_t *seen = kv_malloc((size_t)(nu ? nu : 1));
    if (!sums || !seen) {
        j->bad_rj[2 * t] = j->bad_sum[t] = j->bad_upd[t] = -1;
        j->rc[t] = KV_ENOMEM;
    } else if (prep_sums(j, t, sums, seen)) {
        j->rc[t] = prep_part(j, t, sums, 0, nu, &j->pgens[t], &j->bad_upd[t]);
    }
    kv_free(sums);
    kv_free(seen);
}

/* Range task q of the big table. */
static void prep_range(void *arg, int64_t q) {
    prep_job_t *j = arg;
    int64_t nu = j->ustart[j->big + 1] - j->ustart[j->big];
    int64_t u0 = q * j->piece, u1 = u0 + j->piece < nu ? u0 + j->piece : nu;
    j->rrc[q] = prep_part(j, j->big, j->sums, u0, u1, &j->rgen[q], &j->rbad[q]);
}

int kv_xprepare(kv_pool_t *pool, kv_table_t *const *tables, int32_t ntab, int32_t world,
                const int64_t *recv_counts, const float *grads, float scale, int64_t step,
                const int64_t *uidx, const int64_t *ukeys, const uint32_t *urefs,
                const int64_t *ustart, const uint64_t *gens, float *rows, uint32_t *ids,
                uint64_t *pgens, int64_t *bad) {
    int64_t total = 0;
    if (!bad || !pgens) return KV_EINVAL;
    bad[0] = -1, bad[1] = 0, bad[2] = 0;
    int rc = xapply_args(tables, ntab, world, recv_counts, grads, scale, step, uidx, ukeys,
                         urefs, ustart, gens, &total);
    if (rc != KV_OK) return rc;
    int64_t ndist = ustart[ntab];
    if (ndist > 0 && (!rows || !ids)) return KV_EINVAL;
    size_t k2 = (size_t)ntab * (size_t)world;
    int64_t *id_at = kv_malloc((2 * k2 + 6 * (size_t)ntab + 1) * sizeof(int64_t) +
                               (size_t)ntab * (sizeof(int32_t) + sizeof(int)));
    if (!id_at) return KV_ENOMEM;
    int64_t *fl_at = id_at + k2, *roff = fl_at + k2, *small = roff + ntab + 1;
    int64_t *bad_rj = small + ntab, *bad_sum = bad_rj + 2 * ntab, *bad_upd = bad_sum + ntab;
    int32_t *dims = (int32_t *)(void *)(bad_upd + ntab);
    int *trc = (int *)(void *)(dims + ntab);
    int64_t most_big = 0;
    for (int32_t t = 0; t < ntab; t++) dims[t] = kv_table_dim(tables[t]);
    seg_starts(ntab, world, recv_counts, dims, id_at, fl_at);
    prep_starts(tables, ntab, ustart, roff);
    /* uidx must index each table's distinct ids (the sums write there) */
    for (size_t k = 0; k < k2; k++) {
        int32_t t = (int32_t)(k % (size_t)ntab);
        int64_t nu = ustart[t + 1] - ustart[t];
        for (int64_t i = 0; i < recv_counts[k]; i++)
            if ((uint64_t)uidx[id_at[k] + i] >= (uint64_t)nu) {
                kv_free(id_at);
                return KV_EINVAL;
            }
    }
    /* a table with more than its share of the distinct ids (with several threads) is
     * a big one: its optimizer step runs by key range on every thread, one big table
     * after another; the others run a table per task */
    kv_pool_t *p = pool_for(pool, total);
    int32_t threads = kv_pool_threads(p);
    int64_t share = ndist / threads, ns = 0, piece = 0, most_ranges = 0;
    for (int32_t t = 0; t < ntab; t++) {
        int64_t nu = ustart[t + 1] - ustart[t];
        if (p && nu > share && nu >= 2 * KV_X_RANGE_ROWS) {
            if (nu * dims[t] > most_big) most_big = nu * dims[t];
        } else {
            small[ns++] = t;
        }
    }
    if (most_big) { /* ranges of about a quarter of a thread's share, at least */
        piece = share / 4 > KV_X_RANGE_ROWS ? share / 4 : KV_X_RANGE_ROWS;
        for (int32_t t = 0; t < ntab; t++) {
            int64_t r = (ustart[t + 1] - ustart[t] + piece - 1) / piece;
            if (r > most_ranges) most_ranges = r;
        }
    }
    float *sums = most_big ? kv_malloc((size_t)most_big * sizeof(float)) : NULL;
    uint8_t *seen = most_big ? kv_malloc((size_t)most_big) : NULL;
    int64_t *rbad = most_big ? kv_malloc((size_t)most_ranges * (sizeof(int64_t) +
                                         sizeof(uint64_t) + sizeof(int))) : NULL;
    if (most_big && (!sums || !seen || !rbad)) {
        kv_free(sums);
        kv_free(seen);
        kv_free(rbad);
        kv_free(id_at);
        return KV_ENOMEM;
    }
    uint64_t *rgen = rbad ? (uint64_t *)(void *)(rbad + most_ranges) : NULL;
    int *rrc = rgen ? (int *)(void *)(rgen + most_ranges) : NULL;
    prep_job_t j = {.tables = tables, .ntab = ntab, .world = world,
                    .recv_counts = recv_counts, .uidx = uidx, .ukeys = ukeys, .ustart = ustart,
                    .id_at = id_at, .fl_at = fl_at, .roff = roff, .small = small,
                    .urefs = urefs, .gens = gens, .dims = dims, .grads = grads, .scale = scale,
                    .rows = rows, .sums = sums, .step = step, .piece = piece, .ids = ids,
                    .bad_rj = bad_rj, .bad_sum = bad_sum, .bad_upd = bad_upd, .rc = trc,
                    .pgens = pgens, .rbad = rbad, .rgen = rgen, .rrc = rrc};
    for (int32_t t = 0, s = 0; t < ntab; t++) {
        if (s < ns && small[s] == t) {
            s++;
            continue;
        }
        /* a big table: sums on this thread, then its ranges on the pool */
        int64_t nu = ustart[t + 1] - ustart[t], nr = (nu + piece - 1) / piece;
        if (!prep_sums(&j, t, sums, seen)) continue;
        j.big = t;
        kv_pool_run(p, nr, prep_range, &j);
        pgens[t] = rgen[0];
        for (int64_t q = 0; q < nr; q++) {
            if (trc[t] == KV_OK && rrc[q] != KV_OK) trc[t] = rrc[q];
            if (bad_upd[t] < 0 && rbad[q] >= 0) bad_upd[t] = rbad[q];
            if (rgen[q] != rgen[0] && trc[t] == KV_OK && bad_upd[t] < 0) {
                /* a row was freed by another thread between two ranges: again, whole */
                trc[t] = prep_part(&j, t, sums, 0, nu, &pgens[t], &bad_upd[t]);
                break;
            }
        }
    }
    kv_pool_run(p, ns, prep_table, &j);
    /* a gradient as received that is NaN/Inf: the first in payload order */
    int64_t br = -1, bt = -1, bi = 0;
    for (int32_t t = 0; t < ntab; t++)
        if (bad_rj[2 * t] >= 0 && (br < 0 || bad_rj[2 * t] < br)) {
            br = bad_rj[2 * t];
            bt = t;
            bi = bad_rj[2 * t + 1];
        }
    if (bt >= 0) {
        bad[0] = bt;
        bad[1] = ukeys[ustart[bt] + uidx[id_at[br * ntab + bt] + bi]];
        bad[2] = 1;
        rc = KV_ENONFINITE;
    }
    /* else the first table whose status, sums or updates say no, then its first id */
    for (int32_t t = 0; rc == KV_OK && t < ntab; t++) {
        if (trc[t] != KV_OK) {
            rc = trc[t];
        } else if (bad_sum[t] >= 0 || bad_upd[t] >= 0) {
            bad[0] = t;
            bad[1] = ukeys[ustart[t] + (bad_sum[t] >= 0 ? bad_sum[t] : bad_upd[t])];
            bad[2] = bad_sum[t] >= 0 ? 3 : 2;
            rc = KV_ENONFINITE;
        }
    }
    kv_free(sums);
    kv_free(seen);
    kv_free(rbad);
    kv_free(id_at);
    return rc;
}

typedef struct {
    kv_table_t *const *tables;
    kv_pool_t *inner; /* a table's own pool (its rows by key range), or NULL */
    const int64_t *ukeys, *ustart, *roff, *which;
    const uint32_t *ids;
    const uint64_t *pgens;
    const float *rows;
    int64_t step, *miss;
    int *rc;
} commit_job_t;

/* Commit table which[q] (or table q without `which`). */
static void commit_table(void *arg, int64_t q) {
    commit_job_t *j = arg;
    int64_t t = j->which ? j->which[q] : q, us = j->ustart[t];
    j->rc[t] = kv_table_commit_refs(j->tables[t], j->inner, j->ukeys + us, j->ids + us,
                                    j->ustart[t + 1] - us, j->rows + j->roff[t], j->step,
                                    j->pgens[t], &j->miss[t]);
}

int kv_xcommit(kv_pool_t *pool, kv_table_t *const *tables, int32_t ntab, const int64_t *ukeys,
               const int64_t *ustart, const uint32_t *ids, const uint64_t *pgens,
               const float *rows, int64_t step, int64_t *n_missing) {
    if (!tables || ntab < 1 || !ustart || !pgens || step < 1 || ustart[0] != 0)
        return KV_EINVAL;
    for (int32_t t = 0; t < ntab; t++)
        if (!tables[t] || ustart[t + 1] < ustart[t]) return KV_EINVAL;
    if (ustart[ntab] > 0 && (!ukeys || !ids || !rows)) return KV_EINVAL;
    int64_t *roff = kv_malloc((3 * (size_t)ntab + 1) * sizeof(int64_t) +
                              (size_t)ntab * sizeof(int));
    if (!roff) return KV_ENOMEM;
    int64_t *miss = roff + ntab + 1, *small = miss + ntab;
    int *rc = (int *)(void *)(small + ntab);
    prep_starts(tables, ntab, ustart, roff);
    /* a table with more than its share of the rows writes them by key range on every
     * thread, one such table after another; the others, a table per task */
    kv_pool_t *p = pool_for(pool, ustart[ntab]);
    int64_t share = ustart[ntab] / kv_pool_threads(p), ns = 0;
    commit_job_t j = {.tables = tables, .inner = p, .ukeys = ukeys, .ustart = ustart,
                      .roff = roff, .ids = ids, .pgens = pgens, .rows = rows, .step = step,
                      .miss = miss, .rc = rc};
    for (int32_t t = 0; t < ntab; t++) {
        if (p && ustart[t + 1] - ustart[t] > share)
            commit_table(&j, t);
        else
            small[ns++] = t;
    }
    j.inner = NULL;
    j.which = small;
    kv_pool_run(p, ns, commit_table, &j);
    if (n_missing) memcpy(n_missing, miss, (size_t)ntab * sizeof(int64_t));
    int err = first_error(rc, ntab);
    kv_free(roff);
    return err;
}

int kv_xapply(kv_pool_t *pool, kv_table_t *const *tables, int32_t ntab, int32_t world,
              const int64_t *recv_counts, const float *grads, float scale, int64_t step,
              const int64_t *uidx, const int64_t *ukeys, const uint32_t *urefs,
              const int64_t *ustart, const uint64_t *gens, int64_t *n_missing) {
    int64_t total = 0, bad[3];
    int rc = xapply_args(tables, ntab, world, recv_counts, grads, scale, step, uidx, ukeys,
                         urefs, ustart, gens, &total);
    if (rc != KV_OK) return rc;
    int64_t nf = kv_xprepare_floats(tables, ntab, ustart);
    float *rows = kv_malloc((size_t)(nf > 0 ? nf : 1) * sizeof(float));
    uint32_t *ids = kv_malloc((size_t)(ustart[ntab] ? ustart[ntab] : 1) * sizeof(uint32_t));
    uint64_t *pgens = kv_malloc((size_t)ntab * sizeof(uint64_t));
    if (nf < 0 || !rows || !ids || !pgens) {
        rc = KV_ENOMEM;
    } else {
        rc = kv_xprepare(pool, tables, ntab, world, recv_counts, grads, scale, step, uidx,
                         ukeys, urefs, ustart, gens, rows, ids, pgens, bad);
        if (rc == KV_OK)
            rc = kv_xcommit(pool, tables, ntab, ukeys, ustart, ids, pgens, rows, step,
                            n_missing);
    }
    kv_free(rows);
    kv_free(ids);
    kv_free(pgens);
    return rc;
}

/* ---- regroup, row gradients, checks ------------------------------------------------ */

static int check_groups(int32_t ntab, int32_t world, const int64_t *counts, const int32_t *dims,
                        const int32_t *group) {
    int64_t total;
    if (ntab < 1 || world < 1 || !counts || !dims || !group) return 0;
    if (bad_counts(ntab, world, counts, &total)) return 0;
    for (int32_t t = 0; t < ntab; t++)
        if (dims[t] < 1 || group[t] < 0 || group[t] >= ntab) return 0;
    return 1;
}

/* Copy between a payload (layout of counts) and group matrices: to_groups, payload
 * -> mats[g]; else mats[g] -> payload. */
static int xgroup(int32_t ntab, int32_t world, const int64_t *counts, const int32_t *dims,
                  const int32_t *group, float *const *mats, float *payload, int to_groups) {
    if (!check_groups(ntab, world, counts, dims, group) || !mats || !payload) return KV_EINVAL;
    size_t at = 0;
    int64_t *g = kv_calloc((size_t)ntab, sizeof(int64_t));
    if (!g) return KV_ENOMEM;
    for (int32_t r = 0; r < world; r++)
        for (int32_t t = 0; t < ntab; t++) {
            size_t n = (size_t)counts[(int64_t)r * ntab + t] * (size_t)dims[t];
            float *m = mats[group[t]] + g[group[t]];
            if (to_groups)
                memcpy(m, payload + at, n * sizeof(float));
            else
                memcpy(payload + at, m, n * sizeof(float));
            g[group[t]] += (int64_t)n;
            at += n;
        }
    kv_free(g);
    return KV_OK;
}

int kv_xregroup(int32_t ntab, int32_t world, const int64_t *counts, const int32_t *dims,
                const int32_t *group, const float *payload, float *const *out) {
    return xgroup(ntab, world, counts, dims, group, out, (float *)(uintptr_t)payload, 1);
}

int kv_xungroup(int32_t ntab, int32_t world, const int64_t *counts, const int32_t *dims,
                const int32_t *group, const float *const *in, float *payload) {
    return xgroup(ntab, world, counts, dims, group, (float *const *)(uintptr_t)in, payload, 0);
}

typedef struct {
    int64_t n_rows, n, parts;
    int32_t dim;
    const float *vals;
    const int64_t *idx;
    float *out;
} rowgrad_job_t;

/* Task q: output rows [q n_rows / parts, (q + 1) n_rows / parts): zeroed, then every
 * gathered position of them added, in order of i. */
static void rowgrad_part(void *arg, int64_t q) {
    rowgrad_job_t *j = arg;
    int64_t r0 = q * j->n_rows / j->parts, r1 = (q + 1) * j->n_rows / j->parts;
    const int64_t dim = j->dim;
    if (r1 > r0) memset(j->out + r0 * dim, 0, (size_t)(r1 - r0) * (size_t)dim * sizeof(float));
    for (int64_t i = 0; i < j->n; i++) {
        int64_t r = j->idx[i];
        if (r < r0 || r >= r1) continue;
        float *o = j->out + r * dim;
        const float *v = j->vals + i * dim;
        for (int32_t k = 0; k < j->dim; k++) o[k] += v[k];
    }
}

int kv_xrowgrad(kv_pool_t *pool, int64_t n_rows, int32_t dim, const float *vals,
                const int64_t *idx, int64_t n, float *out) {
    if (n_rows < 0 || n < 0 || dim < 1 || (n_rows && !out) || (n && (!vals || !idx)))
        return KV_EINVAL;
    if (n_rows > INT64_MAX / dim) return KV_EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= n_rows) return KV_EINVAL;
    kv_pool_t *p = pool_for(pool, n);
    rowgrad_job_t j = {.n_rows = n_rows, .n = n, .parts = kv_pool_threads(p), .dim = dim,
                       .vals = vals, .idx = idx, .out = out};
    kv_pool_run(p, j.parts, rowgrad_part, &j);
    return KV_OK;
}

int kv_xfind_nonfinite(const float *v, int64_t rows, int32_t width, int64_t *row) {
    if (!row || rows < 0 || width < 0 || (rows && width && !v)) return KV_EINVAL;
    *row = -1;
    if (!width) return KV_OK;
    const size_t w = (size_t)width, block = 4096; /* rows per pass: branch-free inside */
    for (int64_t r0 = 0; r0 < rows; r0 += (int64_t)block) {
        size_t n = (size_t)(rows - r0) < block ? (size_t)(rows - r0) : block;
        if (kv_all_finite(v + (size_t)r0 * w, n * w)) continue;
        for (size_t i = 0; i < n; i++)
            if (!kv_all_finite(v + ((size_t)r0 + i) * w, w)) {
                *row = r0 + (int64_t)i;
                return KV_OK;
            }
    }
    return KV_OK;
}
