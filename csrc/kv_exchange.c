/*
 * kv_exchange.c - one BSP exchange's work on either side of the all-to-alls, for every
 * table in one call (see kv_exchange.h for the layouts).
 *
 * kv_xplan runs kv_unique_partition per table (unique ids grouped by their owner under
 * the bucket -> rank map, first appearance inside a group), then walks the segments r-major to copy the unique ids
 * into the send payload and to number the rows each group's matrix will hold: a
 * group's rows are its tables' segments in payload order, so a running base per group
 * gives every unique id its row (upos), and pos = upos[inverse].
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
 * Nothing here keeps state; the tables' own locks are taken table by table.
 */
#include "kv_exchange.h"

#include <math.h>
#include <string.h>

#include "kv_fmath.h"
#include "kv_route.h"

#define XMAX_N ((int64_t)UINT32_MAX - 1) /* kv_unique_partition's limit */

static int bad_counts(int32_t ntab, int32_t world, const int64_t *counts, int64_t *total) {
    int64_t sum = 0;
    for (int64_t k = 0; k < (int64_t)ntab * world; k++) {
        if (counts[k] < 0 || counts[k] > XMAX_N - sum) return 1;
        sum += counts[k];
    }
    *total = sum;
    return 0;
}

int kv_xplan(int32_t ntab, const int32_t *owners, int32_t buckets, int32_t world,
             const int64_t *const *ids, const int64_t *n, const int32_t *group,
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
    /* scratch: the unique ids of every table; per table where they start and the
     * running start of its next segment; per group its next row; per rank a count */
    int64_t *uq = kv_malloc(((size_t)total + 3 * (size_t)ntab + (size_t)world) * sizeof(int64_t));
    if (!uq) return KV_ENOMEM;
    int64_t *uoff = uq + total, *seg = uoff + ntab, *gb = seg + ntab, *cnt = gb + ntab;
    int64_t off = 0, us = 0;
    for (int32_t t = 0; t < ntab; t++) {
        int64_t nu = 0;
        int rc = kv_unique_partition(ids[t], n[t], owners, buckets, world, uq + us,
                                     inverse + off, cnt, &nu);
        if (rc != KV_OK) {
            kv_free(uq);
            return rc;
        }
        for (int32_t r = 0; r < world; r++) counts[(int64_t)r * ntab + t] = cnt[r];
        uoff[t] = us;
        n_unique[t] = nu;
        seg[t] = 0;
        off += n[t];
        us += nu;
    }
    /* send payload and rows: segments r-major; a group's rows run on across ranks */
    memset(gb, 0, (size_t)ntab * sizeof(int64_t));
    int64_t at = 0;
    for (int32_t r = 0; r < world; r++) {
        for (int32_t t = 0; t < ntab; t++) {
            int64_t c = counts[(int64_t)r * ntab + t], u0 = uoff[t] + seg[t];
            if (c) memcpy(send_ids + at, uq + u0, (size_t)c * sizeof(int64_t));
            int64_t base = gb[group[t]];
            for (int64_t j = 0; j < c; j++) upos[u0 + j] = base + j;
            gb[group[t]] = base + c;
            seg[t] += c;
            at += c;
        }
    }
    off = 0;
    for (int32_t t = 0; t < ntab; t++) {
        const int64_t *up = upos + uoff[t];
        for (int64_t i = 0; i < n[t]; i++) pos[off + i] = up[inverse[off + i]];
        off += n[t];
    }
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

int kv_xserve(kv_table_t *const *tables, int32_t ntab, int32_t world, const int64_t *recv_ids,
              const int64_t *recv_counts, uint32_t step, int32_t create, float *reply,
              int64_t *uidx, int64_t *ukeys, uint32_t *urefs, int64_t *ustart, uint64_t *gens) {
    if (!tables || ntab < 1 || world < 1 || !recv_counts) return KV_EINVAL;
    int64_t total = 0;
    if (bad_counts(ntab, world, recv_counts, &total)) return KV_EINVAL;
    if (total > 0 && (!recv_ids || !reply)) return KV_EINVAL;
    if (create && (!ustart || !gens || (total > 0 && (!uidx || !ukeys || !urefs))))
        return KV_EINVAL;
    for (int32_t t = 0; t < ntab; t++)
        if (!tables[t]) return KV_EINVAL;
    size_t k2 = (size_t)ntab * (size_t)world;
    int64_t *id_at = kv_malloc(2 * k2 * sizeof(int64_t) + (size_t)ntab * sizeof(int32_t));
    if (!id_at) return KV_ENOMEM;
    int64_t *fl_at = id_at + k2;
    int32_t *dims = (int32_t *)(void *)(fl_at + k2);
    for (int32_t t = 0; t < ntab; t++) dims[t] = kv_table_dim(tables[t]);
    seg_starts(ntab, world, recv_counts, dims, id_at, fl_at);
    int rc = KV_OK;
    if (!create) {
        for (int64_t k = 0; rc == KV_OK && k < (int64_t)k2; k++)
            rc = kv_table_find(tables[k % ntab], recv_ids + id_at[k], recv_counts[k],
                               reply + fl_at[k], NULL, NULL);
        kv_free(id_at);
        return rc;
    }
    int64_t us = 0;
    if (world == 1) { /* one source: every table's ids are distinct */
        for (int32_t t = 0; rc == KV_OK && t < ntab; t++) {
            int64_t c = recv_counts[t], a = id_at[t];
            ustart[t] = us;
            rc = kv_table_find_or_create_gen(tables[t], recv_ids + a, c, reply + fl_at[t], step,
                                             NULL, urefs + us, &gens[t]);
            if (c) memcpy(ukeys + us, recv_ids + a, (size_t)c * sizeof(int64_t));
            for (int64_t j = 0; j < c; j++) uidx[a + j] = j;
            us += c;
        }
        ustart[ntab] = us;
        kv_free(id_at);
        return rc;
    }
    /* several sources: per table, gather, dedup, serve once, copy out */
    int64_t most = 0, most_rows = 0;
    for (int32_t t = 0; t < ntab; t++) {
        int64_t m = 0;
        for (int32_t r = 0; r < world; r++) m += recv_counts[(int64_t)r * ntab + t];
        if (m > most) most = m;
        if (m * dims[t] > most_rows) most_rows = m * dims[t];
    }
    int64_t *keys = kv_malloc((size_t)(2 * most + 1) * sizeof(int64_t));
    float *rows = kv_malloc((size_t)(most_rows ? most_rows : 1) * sizeof(float));
    if (!keys || !rows) {
        kv_free(keys);
        kv_free(rows);
        kv_free(id_at);
        return KV_ENOMEM;
    }
    int64_t *inv = keys + most;
    for (int32_t t = 0; rc == KV_OK && t < ntab; t++) {
        size_t d = (size_t)dims[t];
        int64_t m = 0, nu = 0;
        for (int32_t r = 0; r < world; r++) {
            int64_t k = (int64_t)r * ntab + t;
            if (recv_counts[k])
                memcpy(keys + m, recv_ids + id_at[k], (size_t)recv_counts[k] * sizeof(int64_t));
            m += recv_counts[k];
        }
        ustart[t] = us;
        rc = kv_unique(keys, m, ukeys + us, inv, &nu);
        if (rc == KV_OK)
            rc = kv_table_find_or_create_gen(tables[t], ukeys + us, nu, rows, step, NULL,
                                             urefs + us, &gens[t]);
        if (rc != KV_OK) break;
        m = 0;
        for (int32_t r = 0; r < world; r++) {
            int64_t k = (int64_t)r * ntab + t, a = id_at[k];
            float *out = reply + fl_at[k];
            for (int64_t j = 0; j < recv_counts[k]; j++, m++) {
                uidx[a + j] = inv[m];
                memcpy(out + (size_t)j * d, rows + (size_t)inv[m] * d, d * sizeof(float));
            }
        }
        us += nu;
    }
    ustart[ntab] = us;
    kv_free(keys);
    kv_free(rows);
    kv_free(id_at);
    return rc;
}

/* Check kv_xapply/kv_xprepare's arguments; fill id_at, fl_at (payload starts) and
 * dims. KV_OK or KV_EINVAL. */
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

int kv_xprepare(kv_table_t *const *tables, int32_t ntab, int32_t world,
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
    if (ustart[ntab] > 0 && (!rows || !ids)) return KV_EINVAL;
    size_t k2 = (size_t)ntab * (size_t)world;
    int64_t *id_at = kv_malloc((3 * k2 + (size_t)ntab + 1) * sizeof(int64_t) +
                               (size_t)ntab * sizeof(int32_t));
    if (!id_at) return KV_ENOMEM;
    int64_t *fl_at = id_at + k2, *roff = fl_at + k2;
    int32_t *dims = (int32_t *)(void *)(roff + ntab + 1);
    int64_t most = 0;
    for (int32_t t = 0; t < ntab; t++) {
        dims[t] = kv_table_dim(tables[t]);
        int64_t nu = ustart[t + 1] - ustart[t];
        if (nu * dims[t] > most) most = nu * dims[t];
    }
    seg_starts(ntab, world, recv_counts, dims, id_at, fl_at);
    prep_starts(tables, ntab, ustart, roff);
    /* uidx must index each table's distinct ids (the sums below write there) */
    for (size_t k = 0; k < k2; k++) {
        int32_t t = (int32_t)(k % (size_t)ntab);
        int64_t nu = ustart[t + 1] - ustart[t];
        for (int64_t j = 0; j < recv_counts[k]; j++)
            if ((uint64_t)uidx[id_at[k] + j] >= (uint64_t)nu) {
                kv_free(id_at);
                return KV_EINVAL;
            }
    }
    /* a received gradient that is NaN/Inf: name the first (table, key) */
    for (size_t k = 0; k < k2; k++) {
        int32_t t = (int32_t)(k % (size_t)ntab);
        size_t d = (size_t)dims[t];
        for (int64_t j = 0; j < recv_counts[k]; j++)
            if (!kv_all_finite(grads + fl_at[k] + (size_t)j * d, d)) {
                bad[0] = t;
                bad[1] = ukeys[ustart[t] + uidx[id_at[k] + j]];
                bad[2] = 1;
                kv_free(id_at);
                return KV_ENONFINITE;
            }
    }
    float *sums = kv_malloc((size_t)(most ? most : 1) * sizeof(float));
    uint8_t *seen = kv_malloc((size_t)(total ? total : 1));
    if (!sums || !seen) {
        kv_free(sums);
        kv_free(seen);
        kv_free(id_at);
        return KV_ENOMEM;
    }
    for (int32_t t = 0; rc == KV_OK && t < ntab; t++) {
        size_t d = (size_t)dims[t];
        int64_t us = ustart[t], nu = ustart[t + 1] - us, b = -1;
        /* sums[u] = the scaled gradients of distinct id u, added in payload order */
        if (world == 1) { /* one source, distinct ids, in uniq order */
            const float *src = grads + fl_at[t];
            for (size_t e = 0; e < (size_t)nu * d; e++) sums[e] = scale * src[e];
        } else {
            memset(seen, 0, (size_t)nu);
            for (int32_t r = 0; r < world; r++) {
                int64_t k = (int64_t)r * ntab + t;
                const float *src = grads + fl_at[k];
                for (int64_t j = 0; j < recv_counts[k]; j++, src += d) {
                    int64_t u = uidx[id_at[k] + j];
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
        for (int64_t u = 0; u < nu; u++) /* a sum (or a scaled one) can overflow */
            if (!kv_all_finite(sums + (size_t)u * d, d)) {
                bad[0] = t;
                bad[1] = ukeys[us + u];
                bad[2] = 3;
                rc = KV_ENONFINITE;
                break;
            }
        if (rc != KV_OK) break;
        rc = kv_table_prepare_refs(tables[t], ukeys + us, urefs + us, nu, sums, step, gens[t],
                                   rows + roff[t], ids + us, &pgens[t], &b);
        if (rc == KV_ENONFINITE && b >= 0) {
            bad[0] = t;
            bad[1] = ukeys[us + b];
            bad[2] = 2;
        }
    }
    kv_free(sums);
    kv_free(seen);
    kv_free(id_at);
    return rc;
}

int kv_xcommit(kv_table_t *const *tables, int32_t ntab, const int64_t *ukeys,
               const int64_t *ustart, const uint32_t *ids, const uint64_t *pgens,
               const float *rows, int64_t step, int64_t *n_missing) {
    if (!tables || ntab < 1 || !ustart || !pgens || step < 1 || ustart[0] != 0)
        return KV_EINVAL;
    for (int32_t t = 0; t < ntab; t++)
        if (!tables[t] || ustart[t + 1] < ustart[t]) return KV_EINVAL;
    if (ustart[ntab] > 0 && (!ukeys || !ids || !rows)) return KV_EINVAL;
    int64_t *roff = kv_malloc(((size_t)ntab + 1) * sizeof(int64_t));
    if (!roff) return KV_ENOMEM;
    prep_starts(tables, ntab, ustart, roff);
    int rc = KV_OK;
    for (int32_t t = 0; rc == KV_OK && t < ntab; t++) {
        int64_t us = ustart[t], miss = 0;
        rc = kv_table_commit_refs(tables[t], ukeys + us, ids + us, ustart[t + 1] - us,
                                  rows + roff[t], step, pgens[t], &miss);
        if (n_missing) n_missing[t] = miss;
    }
    kv_free(roff);
    return rc;
}

int kv_xapply(kv_table_t *const *tables, int32_t ntab, int32_t world, const int64_t *recv_counts,
              const float *grads, float scale, int64_t step, const int64_t *uidx,
              const int64_t *ukeys,
              const uint32_t *urefs, const int64_t *ustart, const uint64_t *gens,
              int64_t *n_missing) {
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
        rc = kv_xprepare(tables, ntab, world, recv_counts, grads, scale, step, uidx, ukeys,
                         urefs, ustart, gens, rows, ids, pgens, bad);
        if (rc == KV_OK)
            rc = kv_xcommit(tables, ntab, ukeys, ustart, ids, pgens, rows, step, n_missing);
    }
    kv_free(rows);
    kv_free(ids);
    kv_free(pgens);
    return rc;
}

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

int kv_xrowgrad(int64_t n_rows, int32_t dim, const float *vals, const int64_t *idx, int64_t n,
                float *out) {
    if (n_rows < 0 || n < 0 || dim < 1 || (n_rows && !out) || (n && (!vals || !idx)))
        return KV_EINVAL;
    if (n_rows > INT64_MAX / dim) return KV_EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= n_rows) return KV_EINVAL;
    if (n_rows) memset(out, 0, (size_t)n_rows * (size_t)dim * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        float *o = out + idx[i] * dim;
        const float *v = vals + i * dim;
        for (int32_t k = 0; k < dim; k++) o[k] += v[k];
    }
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
