/*
 * kv_exchange.h - the batch kernels of one BSP exchange, for every table at once.
 *
 * A pull moves, per table t, a rank's ids to their owners and the rows back; a push
 * moves the rows' gradients the same way. Python does the all-to-alls (kvcoll/comm.py);
 * these kernels do everything on either side of them in one C call each, so a step
 * costs a few calls whatever the number of tables:
 *
 *   kv_xplan    sender: unique + partition every table's ids by owner, lay the unique
 *               ids out for the id all-to-all (by destination, then table), and say
 *               where each id's row will sit in the rows that come back;
 *   kv_xserve   owner: look up (creating) the ids of every (source, table) segment and
 *               write their rows into the reply, in the same layout;
 *   kv_xprepare owner: sum the gradients of an id sent by several sources and compute
 *               every updated row and slot at the rows the serve found, into a buffer,
 *               changing no table (kv_table_prepare_refs); it says which (table, key)
 *               an update would make NaN/Inf, so the ranks can refuse the step alike;
 *   kv_xcommit  owner: write what kv_xprepare computed (kv_table_commit_refs);
 *   kv_xapply   both at once;
 *   kv_xregroup / kv_xungroup: move rows between the payload layout and one matrix
 *               per group of tables (tables of one dim), when there is more than one;
 *   kv_xrowgrad sender: the gradient of a group's rows matrix from the gradients of
 *               the gathers the model made of it (TensorFlow's gather gradient, one
 *               row per gathered position, summed here rather than by TensorFlow).
 *
 * Layouts. A payload of ntab tables from/to `world` ranks is a sequence of segments
 * (rank r, table t), r-major: counts[r * ntab + t] ids, or as many rows of dims[t]
 * floats. The rows a pull returns to a rank are such a payload (r = owner); its rows
 * for the tables of group g, taken segment by segment in payload order, form group
 * g's matrix, and kv_xplan's pos/upos index rows of that matrix. With one group the
 * payload is the matrix.
 *
 * Threads: kv_xplan, kv_xserve, kv_xprepare, kv_xcommit, kv_xapply and kv_xrowgrad take
 * a pool (kv_pool.h; NULL: the calling thread alone) and split their work over its
 * threads by table and by key range; the results are the same bits whatever the pool
 * (kv_exchange.c says how). A pool runs one job at a time: two calls at once with the
 * same pool are correct, the second runs on its caller's thread.
 *
 * None of these functions keeps state. kv_xserve, kv_xprepare (read), kv_xcommit and
 * kv_xapply take each table's lock (see kv_table.h), for several tables at once with
 * a pool; kv_xplan and the regroup kernels lock nothing.
 */
#ifndef KV_EXCHANGE_H
#define KV_EXCHANGE_H

#include <stdint.h>
#include "kv_pool.h"
#include "kv_status.h"
#include "kv_table.h"

/*
 * Plan a pull.
 *   ntab             tables (>= 1)
 *   owners, buckets, world   the bucket -> rank map of kv_route.h (owners[buckets],
 *                    every entry in [0, world); NULL allowed when world == 1)
 *   ids[t], n[t]     table t's ids (duplicates allowed; n[t] >= 0)
 *   group[t]         table t's group, 0 <= group[t] < ntab
 *   send_ids         out, capacity sum(n): the unique ids, segment (r, t) = table t's
 *                    ids owned by rank r, in first-appearance order
 *   counts           out [world * ntab]: ids of segment (r, t)
 *   inverse          out, sum(n): for table t's i-th id (at offset sum(n[<t]) + i), the
 *                    index of its unique id in table t's unique ids, which are table t's
 *                    segments r = 0, 1, .. one after another
 *   upos             out, capacity sum(n): for table t's u-th unique id (at offset
 *                    sum(nu[<t]) + u), its row in group[t]'s matrix
 *   pos              out, sum(n): upos of each id (the row its embedding will be in)
 *   n_unique         out [ntab]: unique ids per table
 * Returns KV_OK, KV_EINVAL (sizes, groups, NULL buffers, an owner outside the world),
 * KV_ENOMEM.
 */
int kv_xplan(kv_pool_t *pool, int32_t ntab, const int32_t *owners, int32_t buckets,
             int32_t world, const int64_t *const *ids, const int64_t *n, const int32_t *group,
             int64_t *send_ids, int64_t *counts, int64_t *inverse, int64_t *upos, int64_t *pos,
             int64_t *n_unique);

/*
 * Serve a pull on the owner.
 *   tables[ntab]     this rank's shards (all dims = dims of the payload)
 *   recv_ids         the ids received, payload layout; recv_counts [world * ntab]
 *   step             stamped on every row (last_step)
 *   create           0: read only (absent ids read zeros, nothing changes; the outputs
 *                    below but reply may be NULL); 1: absent ids are created (admission
 *                    permitting)
 *   reply            out: recv_counts rows of dims[t] floats, payload layout
 * With create = 1, for the push (kv_xapply):
 *   uidx             out [total ids]: each received id's index among its table's
 *                    distinct ids (an id sent by several sources is served once)
 *   ukeys, urefs     out [capacity total ids]: the distinct ids of every table, table
 *                    after table, and their row refs (0: no row, not admitted)
 *   ustart           out [ntab + 1]: where each table's distinct ids start
 *   gens             out [ntab]: each table's generation at the serve
 * Returns KV_OK, KV_EINVAL, KV_ENOMEM, KV_EFULL (the first failing table's, in table
 * order). On an error, the other tables keep their new rows (a retry serves the same
 * values): those before the failing one, and with a pool any other.
 */
int kv_xserve(kv_pool_t *pool, kv_table_t *const *tables, int32_t ntab, int32_t world,
              const int64_t *recv_ids, const int64_t *recv_counts, uint32_t step,
              int32_t create, float *reply, int64_t *uidx, int64_t *ukeys, uint32_t *urefs,
              int64_t *ustart, uint64_t *gens);

/*
 * Prepare a push on the owner, changing no table: grads (payload layout, like
 * kv_xserve's reply) belong to the ids kv_xserve served (its uidx, ukeys, urefs,
 * ustart, gens). Per table, each gradient is multiplied by `scale` and those of one id
 * from several sources are summed in payload order, then the table's row optimizer is
 * applied to a copy of each row (kv_table_prepare_refs):
 *   rows    out: every updated row's embedding and slots, table after table, table t's
 *           ustart[t + 1] - ustart[t] rows of dim + slot floats each
 *           (kv_xprepare_floats gives the total)
 *   ids     out [ustart[ntab]]: the row each update goes to (see kv_table_prepare_refs)
 *   pgens   out [ntab]: each table's generation for ids
 *   bad     out [3]: (table, key, what) of the first update that is not finite:
 *           what = 1 a gradient of it as received is NaN/Inf (the first in payload
 *           order: the sender's own check should have caught it); else, in table order
 *           then distinct-id order, 3 its gradients summed over the sources (and
 *           scaled) overflow, 2 its row or slots after the update would be NaN/Inf;
 *           table -1 if none
 * Returns KV_OK, KV_EINVAL, KV_ENONFINITE (bad says where), KV_ENOMEM. Read locks.
 */
int kv_xprepare(kv_pool_t *pool, kv_table_t *const *tables, int32_t ntab, int32_t world,
                const int64_t *recv_counts, const float *grads, float scale, int64_t step,
                const int64_t *uidx, const int64_t *ukeys, const uint32_t *urefs,
                const int64_t *ustart, const uint64_t *gens, float *rows, uint32_t *ids,
                uint64_t *pgens, int64_t *bad);

/* Floats of kv_xprepare's rows for tables whose distinct ids start at ustart; -1 for
 * bad arguments (or no memory). */
int64_t kv_xprepare_floats(kv_table_t *const *tables, int32_t ntab, const int64_t *ustart);

/*
 * Write what kv_xprepare computed (rows, ids, pgens, for the ids ukeys/ustart of the
 * serve), table after table (kv_table_commit_refs: between the two, change none of
 * these rows). n_missing [ntab] (may be NULL): ids without a row, per table.
 * Returns KV_OK, KV_EINVAL, KV_ENOMEM (only if a row was freed since the prepare;
 * the tables before the failing one are written).
 */
int kv_xcommit(kv_pool_t *pool, kv_table_t *const *tables, int32_t ntab, const int64_t *ukeys,
               const int64_t *ustart, const uint32_t *ids, const uint64_t *pgens,
               const float *rows, int64_t step, int64_t *n_missing);

/*
 * Apply a push on the owner: kv_xprepare, then, if every update is finite,
 * kv_xcommit; otherwise nothing changes (KV_ENONFINITE). n_missing [ntab] (may be
 * NULL): ids without a row, per table.
 * Returns KV_OK, KV_EINVAL, KV_ENONFINITE, KV_ENOMEM.
 */
int kv_xapply(kv_pool_t *pool, kv_table_t *const *tables, int32_t ntab, int32_t world,
              const int64_t *recv_counts, const float *grads, float scale, int64_t step,
              const int64_t *uidx, const int64_t *ukeys, const uint32_t *urefs,
              const int64_t *ustart, const uint64_t *gens, int64_t *n_missing);

/*
 * Payload rows (layout above, dims[t] floats per row) <-> one matrix per group:
 * kv_xregroup copies payload -> out[g], kv_xungroup copies in[g] -> payload.
 * out[g]/in[g] hold group g's rows, dim of its tables wide (groups[t] as kv_xplan's).
 * Returns KV_OK or KV_EINVAL.
 */
int kv_xregroup(int32_t ntab, int32_t world, const int64_t *counts, const int32_t *dims,
                const int32_t *group, const float *payload, float *const *out);
int kv_xungroup(int32_t ntab, int32_t world, const int64_t *counts, const int32_t *dims,
                const int32_t *group, const float *const *in, float *payload);

/*
 * The gradient of a rows matrix from the gradient of gathers of it (what tf.gather's
 * backward gives: one gradient row per gathered position):
 *   out[r] = the sum, in order of i, of vals[i] over the i with idx[i] == r; zeros for
 *            a row no position gathered
 *   n_rows, dim      out is n_rows x dim floats (n_rows >= 0, dim >= 1)
 *   vals, idx, n     n gradient rows of dim floats, and the row each belongs to
 * Returns KV_OK, or KV_EINVAL (a bad size, a NULL buffer, an index outside
 * [0, n_rows)), leaving out unchanged.
 */
int kv_xrowgrad(kv_pool_t *pool, int64_t n_rows, int32_t dim, const float *vals,
                const int64_t *idx, int64_t n, float *out);

/*
 * The first of `rows` rows of `width` floats (v, row-major) that holds a NaN or an Inf:
 * *row = its index, or -1 if none (a checkpoint save checks what it is about to write,
 * since a restore refuses such rows). Returns KV_OK or KV_EINVAL. Thread-safe.
 */
int kv_xfind_nonfinite(const float *v, int64_t rows, int32_t width, int64_t *row);

#endif
