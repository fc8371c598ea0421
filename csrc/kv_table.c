/*
 * kv_table.c - one shard of an embedding table: int64 key -> row.
 *
 * Arena. Rows live in chunks that never move. Chunk c owns the block of row ids
 * [c << chunk_shift, (c << chunk_shift) + chunk_rows(c)): a full chunk is rpc rows,
 * as many as fit in a whole number of 2 MiB pages (one page unless a row is wider
 * than 256 KiB), and 2^chunk_shift is rpc rounded up to a power of two, so row id r
 * is row (r & chunk_mask) of chunk (r >> chunk_shift) and the ids in between are
 * never used. The first N_SMALL chunks hold rpc/64, rpc/32, .. rpc/2 rows, so a small
 * table costs little. Chunks of 1 MiB or more are 2 MiB-aligned mappings advised
 * MADV_HUGEPAGE (kv_alloc_huge), so transparent huge pages back them: a random row
 * costs a cache miss but no 4 KiB TLB miss. Growing the arena allocates chunks and
 * reallocs only the array of chunk pointers, so rows never move. A row is
 * row_bytes = 16 + 4 * (dim + slot_floats) bytes:
 *     int64 key | uint32 last_step | uint32 meta | float emb[dim] | float slots[S]
 * The key is read and written with memcpy (a row may start at any multiple of 4).
 * Rows are not padded to a cache-line or 16-byte boundary: at dim 16 with SGD a row
 * is 80 bytes, already a multiple of 16 in a 64-byte-aligned chunk, and key + emb
 * (bytes 0..80) take two lines whatever the alignment; padding only wastes memory.
 * meta: bits 0..28 update count (saturating), bit 29 PUB, bit 30 FREE, bit 31 DIRTY.
 * The valid ids below next_id (`used` of them) have been handed out; each is live or
 * on the free list. A freed row has meta = FREE and its key field holds the next
 * free row id + 1 (0 ends the list); new rows come from the free list first, then
 * from next_id, which skips to the next chunk's block past a chunk's last row.
 *
 * Index. n_slots uint32 slots, linear probing, home bucket = fastrange of the low
 * 32 hash bits ((h & 0xffffffff) * n_slots >> 32, so n_slots need not be a power of
 * two). A slot is 0 (empty) or (tag << rbits) | (row id + 1): rbits is the number
 * of bits the arena's largest row id + 1 needs, and the tag is the next
 * min(8, 32 - rbits) hash bits from bit 32 on, which skips nearly every row read on
 * a probe that passes other keys. Deletion shifts later entries of the cluster back
 * (no tombstones). When live rows would exceed 85 % of the slots, or the arena's row
 * ids outgrow rbits, the index is rebuilt at max(g x, needed) slots by walking
 * the arena; rows are not touched. A rebuild reads every row's key, so the growth
 * factor g sets the rebuild work per inserted row (1 / (g - 1)): g = 2 while the
 * index has under 2^20 slots (4 MiB: small next to the rows), 1.4 beyond. (1.4 x
 * rather than 1.5 x keeps the load between 0.61 and 0.85, so bytes beyond a row's
 * floats stay under 24 at 1M and 10M rows.)
 * A large index is 2 MiB-aligned with THP too, and a whole number of 4 KiB pages.
 *
 * Invariants (between calls, under the lock):
 *   - every live row appears in the index exactly once, reachable from its home
 *     bucket without crossing an empty slot; no other slot is non-zero;
 *   - live + n_free == used <= cap_rows (the rows of the n_chunks chunks), and
 *     next_id is a valid id of an allocated chunk or the first id of chunk n_chunks;
 *   - every row id + 1 < 2^rbits <= 2^32 (n_chunks <= max_chunks);
 *     live <= fill_limit < n_slots;
 *   - a batch that changes the table first validates everything and reserves every
 *     row and slot it will need (reserve()); after reserve() succeeds nothing can
 *     fail, so an error return always leaves the table as it was.
 *
 * Lookups are batched and software-pipelined (lookup_core): hash and prefetch the
 * home slot LK_DA keys ahead, scan the probe run and prefetch the candidate row
 * LK_DB keys ahead, then compare the key and copy the row out right away, while it
 * is in L1 (find, find_or_create): one pass over the batch, no second pass over row
 * ids. A find at 10M rows costs three cache misses (an index line, and the two lines
 * of key + embedding); the pipeline keeps enough of them in flight that memory
 * bandwidth and latency, not instructions, bound it.
 *
 * Admission. Unadmitted keys never get a row. KV_ADMIT_EXACT keeps them in a pending
 * map: a power-of-two array of {key, count, last seen step} (16 bytes), linear
 * probing from kv_mix64(key ^ PEND_SALT), at most half full, backward-shift delete;
 * count 0 marks an empty slot. KV_ADMIT_BLOOM keeps bloom_counters 4-bit counters
 * (two per byte); a key's estimate is the minimum of its 3 counters (positions from
 * two kv_mix64 words, fastrange), a sighting raises each of them to estimate + 1
 * (conservative update, saturating at 15), and after bloom_counters sightings every
 * counter is halved (TinyLFU's reset), so old keys fade and the filter never fills.
 * Both are updated per distinct absent key of a call, after reserve(), so a failed
 * call changes no count.
 *
 * Eviction (kv_table_evict) orders rows by a primary field (LRU: last_step, LFU:
 * count), then the other one, then the key. A first pass over the arena counts TTL
 * rows and histograms the top 16 bits of the primary field; a second pass histograms
 * the low 16 bits inside the bucket where the cut-off falls; rows equal to the
 * cut-off value are sorted only if some of them must stay. Then one pass frees the
 * rows. All memory (histogram, tie list, log growth, the purged pending map) is
 * allocated before the first row is freed.
 *
 * Initial values come from a counter-based generator (kv_init.c): element e of key k
 * draws kv_mix64(base(seed, table_id, k) + golden * (counter(e, attempt) + 1)), so
 * the value depends on (seed, table_id, key, initializer) only.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_table.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kv_init.h"
#include "kv_fmath.h"
#include "kv_route.h"

#ifdef KV_TEST_MAX_ROWS /* tests may lower the row limit to reach KV_EFULL */
#define MAX_ROWS ((uint64_t)(KV_TEST_MAX_ROWS))
#else
#define MAX_ROWS ((uint64_t)UINT32_MAX - 1) /* row id + 1 must fit in 32 bits */
#endif
#define MAX_SLOTS ((uint64_t)UINT32_MAX)  /* fastrange product must fit in 64 bits */
#define SMALL_INDEX_SLOTS ((uint64_t)1 << 20) /* below 4 MiB of index, grow it x 2 */
#define MAX_BATCH ((int64_t)UINT32_MAX - 1)
#define MIN_SLOTS 16
#define HUGE_PAGE ((size_t)2 << 20)
#define CHUNK_MIN_ROWS 8 /* rows of a full chunk, at least (very wide rows) */
#define N_SMALL 6        /* chunks 0 .. N_SMALL-1 hold rpc/64, rpc/32, .. rpc/2 rows */
#define HDR_BYTES 16
#define META_COUNT 0x1fffffffu
#define META_PUB (1u << 29) /* changed since the last kv_table_take_changes */
#define META_FREE (1u << 30)
#define META_DIRTY (1u << 31)

#ifndef LK_DA       /* -D overrides: for tuning runs only */
#define LK_DA 16
#endif
#ifndef LK_DB
#define LK_DB 16
#endif
#define LK_RING (LK_DA + LK_DB < 64 ? 64 : 128) /* power of two, > LK_DA + LK_DB */
#ifndef LK_PF2
#define LK_PF2 4
#endif
#define PF_ROWS 8    /* rows prefetched ahead in passes over known row ids */

struct kv_table {
    pthread_rwlock_t lock;
    kv_table_config_t cfg;
    int32_t dim, nslot;
    size_t row_bytes;
    size_t pf_bytes;         /* bytes of a row prefetched by a lookup: header + emb */
    /* arena */
    unsigned char **chunks;
    uint64_t n_chunks, chunks_cap;
    unsigned chunk_shift;    /* row id = (chunk << chunk_shift) + row in chunk */
    uint64_t chunk_mask;
    uint64_t rpc;            /* rows of a full chunk, <= 2^chunk_shift */
    uint64_t max_chunks;     /* chunks whose row ids + 1 all fit in 32 bits */
    uint64_t cap_rows;       /* rows the allocated chunks hold */
    uint64_t arena_bytes;    /* bytes the allocated chunks hold */
    uint64_t next_id;        /* the next never-used row id */
    uint64_t used, free_head, n_free, live;
    /* index */
    uint32_t *index;
    uint64_t n_slots, fill_limit;
    unsigned rbits, tag_bits;
    uint32_t id_mask;
    /* admission */
    uint32_t admit_k;        /* >= 2: admission on */
    struct pend *pend;       /* KV_ADMIT_EXACT: pend_cap slots, pend_n used */
    uint64_t pend_cap, pend_n;
    uint8_t *bloom;          /* KV_ADMIT_BLOOM: bloom_n 4-bit counters */
    uint64_t bloom_n, bloom_adds;
    /* removed-keys log */
    int log_on;
    int64_t *log;
    uint64_t log_n, log_cap;
    /* change tracking for publishing (kv_table_track_changes): the row ids whose PUB
     * bit went from 0 to 1, and the keys removed, since the last take */
    int pub_on, pub_lost;
    uint32_t *pub_rows;
    uint64_t pub_n, pub_cap;
    int64_t *pub_gone;
    uint64_t pub_gone_n, pub_gone_cap;
    /* lifecycle counters */
    int64_t n_admitted, n_rejected, n_dropped, n_evicted;
    /* bumped whenever a row is freed (evict, delete, clear): row ids handed out at
     * generation g still name the same keys while the generation is g */
    uint64_t gen;
};

typedef struct pend {
    int64_t key;
    uint32_t cnt;  /* sightings; 0 = empty slot */
    uint32_t step; /* last sighting */
} pend_t;

/* ---- rows ------------------------------------------------------------------------ */

/* Rows chunk c holds: rpc from chunk N_SMALL on, rpc / 2^(N_SMALL - c) before. */
static inline uint64_t chunk_rows(const kv_table_t *t, uint64_t c) {
    if (c >= N_SMALL) return t->rpc;
    uint64_t r = t->rpc >> (N_SMALL - c);
    return r ? r : 1;
}
static inline size_t chunk_bytes(const kv_table_t *t, uint64_t c) {
    return (size_t)chunk_rows(t, c) * t->row_bytes;
}
/* Row ids [0, next_id) of chunk c that have been handed out (live or free). */
static inline uint64_t chunk_used(const kv_table_t *t, uint64_t c) {
    uint64_t nc = t->next_id >> t->chunk_shift;
    return c < nc ? chunk_rows(t, c) : c == nc ? t->next_id & t->chunk_mask : 0;
}
/* One past the largest row id the first k chunks can hold. */
static inline uint64_t id_end(const kv_table_t *t, uint64_t k) {
    return k ? ((k - 1) << t->chunk_shift) + chunk_rows(t, k - 1) : 0;
}

static inline unsigned char *row_at(const kv_table_t *t, uint64_t id) {
    return t->chunks[id >> t->chunk_shift] + (size_t)(id & t->chunk_mask) * t->row_bytes;
}
static inline int64_t row_key(const unsigned char *r) {
    int64_t k;
    memcpy(&k, r, sizeof k);
    return k;
}
static inline void row_set_key(unsigned char *r, int64_t k) { memcpy(r, &k, sizeof k); }
static inline uint32_t *row_step(unsigned char *r) { return (uint32_t *)(void *)(r + 8); }
static inline uint32_t *row_meta(unsigned char *r) { return (uint32_t *)(void *)(r + 12); }
static inline float *row_emb(unsigned char *r) { return (float *)(void *)(r + HDR_BYTES); }
static inline float *row_slots(const kv_table_t *t, unsigned char *r) {
    return row_emb(r) + t->dim;
}

/* Prefetch every cache line of [p, p + n). */
static inline void prefetch_bytes(const void *p, size_t n) {
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + n;
    for (; a < end; a += 64) __builtin_prefetch((const void *)a);
}

/* ---- index ----------------------------------------------------------------------- */

static inline uint64_t bucket_of(uint64_t h, uint64_t n_slots) {
    return ((h & 0xffffffffULL) * n_slots) >> 32;
}
static inline uint32_t tag_of(const kv_table_t *t, uint64_t h) {
    if (!t->tag_bits) return 0;
    return (uint32_t)((h >> 32) & ((1u << t->tag_bits) - 1)) << t->rbits;
}
static inline uint64_t next_slot(uint64_t p, uint64_t n_slots) {
    return p + 1 == n_slots ? 0 : p + 1;
}

static uint64_t fill_limit_of(uint64_t slots) {
    return slots >= MAX_SLOTS ? slots - 1 : slots * 85 / 100;
}
static uint64_t slots_for(uint64_t rows) {
    uint64_t s = rows * 100 / 85 + 1;
    while (fill_limit_of(s) < rows) s++;
    if (s < MIN_SLOTS) s = MIN_SLOTS;
    return s > MAX_SLOTS ? MAX_SLOTS : s;
}
/* Bits needed to store row id + 1 for row ids < cap. */
static unsigned rbits_for(uint64_t cap) {
    if (cap > UINT32_MAX) cap = UINT32_MAX;
    unsigned b = 1;
    while (b < 32 && (cap >> b) != 0) b++;
    return b;
}

/* Row id + 1 of key, or 0; *slot_pos gets the slot (only meaningful on a hit). */
static uint32_t probe_from(const kv_table_t *t, int64_t key, uint32_t tag, uint64_t p,
                           uint64_t *slot_pos) {
    const uint32_t *ix = t->index;
    uint32_t hi = ~t->id_mask;
    for (;;) {
        uint32_t s = ix[p];
        if (!s) return 0;
        if ((s & hi) == tag && row_key(row_at(t, (s & t->id_mask) - 1)) == key) {
            if (slot_pos) *slot_pos = p;
            return s & t->id_mask;
        }
        p = next_slot(p, t->n_slots);
    }
}

static inline uint32_t lookup_one(const kv_table_t *t, int64_t key, uint64_t *slot_pos) {
    uint64_t h = kv_mix64((uint64_t)key);
    return probe_from(t, key, tag_of(t, h), bucket_of(h, t->n_slots), slot_pos);
}

/* dst[0..d) = src[0..d): constant-size copies for the common widths. */
static inline void copy_floats(float *restrict dst, const float *restrict src, size_t d) {
    switch (d) {
    case 8: memcpy(dst, src, 8 * sizeof(float)); return;
    case 16: memcpy(dst, src, 16 * sizeof(float)); return;
    case 32: memcpy(dst, src, 32 * sizeof(float)); return;
    case 64: memcpy(dst, src, 64 * sizeof(float)); return;
    case 128: memcpy(dst, src, 128 * sizeof(float)); return;
    default: memcpy(dst, src, d * sizeof(float)); return;
    }
}

/*
 * The batched lookup. Three stages over a ring of LK_RING keys: (A) hash, prefetch
 * the home slot (and the next cache line of the index when the home slot is in the
 * last LK_PF2 slots of its line, as the probe run often crosses into it); (B) LK_DA
 * keys later, scan the run for the first tag match and prefetch that row's first pf
 * bytes; (C) LK_DB keys later, compare the key (on a tag collision, continue probing
 * in place) and hand the row over while it is in L1:
 *   ids      ids[k] = row id + 1 of keys[k], or 0 if absent (may be NULL);
 *   out      out[k][dim] = the row's embedding; for an absent key dflt (NULL: zeros)
 *            if fill_absent, else left alone (may be NULL);
 *   found    found[k] = 1 or 0 (may be NULL);
 *   old_step if non-NULL, old_step[k] = the row's last_step, which becomes `step`.
 * Always inlined into a few callers, so the NULL arguments fold away.
 */
static inline __attribute__((always_inline)) void
lookup_core(const kv_table_t *t, const int64_t *keys, int64_t n, size_t pf, uint32_t *ids,
            float *out, int fill_absent, const float *dflt, uint8_t *found,
            uint32_t *old_step, uint32_t step) {
    const uint32_t *ix = t->index;
    const uint64_t ns = t->n_slots;
    const uint32_t idm = t->id_mask, hi = ~idm;
    const uint64_t tmask = t->tag_bits ? ((uint64_t)1 << t->tag_bits) - 1 : 0;
    const unsigned rb = t->rbits;
    const size_t d = (size_t)t->dim;
    uint64_t pos[LK_RING];
    uint32_t tg[LK_RING], cand[LK_RING];
    unsigned char *rowp[LK_RING];
    for (int64_t i = 0; i < n + LK_DA + LK_DB; i++) {
        if (i < n) {
            uint64_t h = kv_mix64((uint64_t)keys[i]);
            uint64_t p = bucket_of(h, ns);
            const uint32_t *a = &ix[p];
            __builtin_prefetch(a);
#if LK_PF2 > 0
            if (((uintptr_t)a & 63) >= 64 - 4 * LK_PF2) /* integer math: never a bad pointer */
                __builtin_prefetch((const void *)(((uintptr_t)a | 63) + 1));
#endif
            pos[i & (LK_RING - 1)] = p;
            tg[i & (LK_RING - 1)] = (uint32_t)(((h >> 32) & tmask) << rb);
        }
        int64_t j = i - LK_DA;
        if (j >= 0 && j < n) {
            unsigned r = (unsigned)j & (LK_RING - 1);
            uint64_t p = pos[r];
            uint32_t tag = tg[r], c = 0;
            for (;;) {
                uint32_t s = ix[p];
                if (!s) break;
                if ((s & hi) == tag) {
                    c = s & idm;
                    break;
                }
                p = next_slot(p, ns);
            }
            cand[r] = c;
            pos[r] = p;
            rowp[r] = NULL;
            if (c) {
                rowp[r] = row_at(t, c - 1);
                prefetch_bytes(rowp[r], pf);
            }
        }
        int64_t k = j - LK_DB;
        if (k >= 0) {
            unsigned r = (unsigned)k & (LK_RING - 1);
            uint32_t c = cand[r];
            unsigned char *row = rowp[r];
            if (c && row_key(row) != keys[k]) { /* tag collision: probe on from here */
                c = probe_from(t, keys[k], tg[r], next_slot(pos[r], ns), NULL);
                if (c) row = row_at(t, c - 1);
            }
            if (ids) ids[k] = c;
            if (found) found[k] = c != 0;
            if (c) {
                if (out) copy_floats(out + (size_t)k * d, row_emb(row), d);
                if (old_step) {
                    old_step[k] = *row_step(row);
                    *row_step(row) = step;
                }
            } else if (out && fill_absent) {
                if (dflt)
                    copy_floats(out + (size_t)k * d, dflt, d);
                else
                    memset(out + (size_t)k * d, 0, d * sizeof(float));
            }
        }
    }
}

/* ids[i] = row id + 1 of keys[i], or 0 if absent; prefetches pf bytes of each row. */
static void lookup_ids(const kv_table_t *t, const int64_t *keys, int64_t n, uint32_t *ids,
                       size_t pf) {
    lookup_core(t, keys, n, pf, ids, NULL, 0, NULL, NULL, NULL, 0);
}

static void index_insert_new(kv_table_t *t, uint64_t h, uint32_t id) {
    uint64_t p = bucket_of(h, t->n_slots);
    while (t->index[p]) p = next_slot(p, t->n_slots);
    t->index[p] = tag_of(t, h) | (id + 1);
}

/* Remove the entry at slot i, shifting later entries of its cluster back. */
static void index_erase_at(kv_table_t *t, uint64_t i) {
    uint64_t j = i, ns = t->n_slots;
    for (;;) {
        j = next_slot(j, ns);
        uint32_t s = t->index[j];
        if (!s) break;
        uint64_t home = bucket_of(kv_mix64((uint64_t)row_key(row_at(t, (s & t->id_mask) - 1))), ns);
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->index[i] = s;
            i = j;
        }
    }
    t->index[i] = 0;
}

/* A large index is a whole number of 4 KiB pages of slots: the mapping holds them
 * anyway, so they may as well lower the load. */
static uint64_t round_slots(uint64_t slots) {
    if (slots * sizeof(uint32_t) < KV_HUGE_MIN) return slots;
    uint64_t r = (slots + 1023) & ~(uint64_t)1023;
    return r > MAX_SLOTS ? slots : r;
}

/* Replace the index by one of `slots` slots (zeroed, 2 MiB-aligned with THP when
 * large) and `rbits` id bits. KV_OK or KV_ENOMEM (then the old index is untouched). */
static int rebuild_index(kv_table_t *t, uint64_t slots, unsigned rbits) {
    uint32_t *ix = kv_alloc_huge((size_t)slots * sizeof(uint32_t));
    if (!ix) return KV_ENOMEM;
    kv_free_huge(t->index, (size_t)t->n_slots * sizeof(uint32_t));
    t->index = ix;
    t->n_slots = slots;
    t->fill_limit = fill_limit_of(slots);
    t->rbits = rbits;
    t->tag_bits = 32 - rbits < 8 ? 32 - rbits : 8;
    t->id_mask = rbits >= 32 ? UINT32_MAX : (1u << rbits) - 1;
    const uint64_t ahead = 16;
    for (uint64_t c = 0; c < t->n_chunks; c++) {
        uint64_t nr = chunk_used(t, c), id0 = c << t->chunk_shift;
        const unsigned char *base = t->chunks[c];
        for (uint64_t o = 0; o < nr; o++) {
            if (o + ahead < nr) {
                const unsigned char *f = base + (size_t)(o + ahead) * t->row_bytes;
                __builtin_prefetch(&ix[bucket_of(kv_mix64((uint64_t)row_key(f)), slots)], 1);
            }
            unsigned char *r = t->chunks[c] + (size_t)o * t->row_bytes;
            if (*row_meta(r) & META_FREE) continue;
            index_insert_new(t, kv_mix64((uint64_t)row_key(r)), (uint32_t)(id0 + o));
        }
    }
    return KV_OK;
}

/*
 * Make room for m new rows: enough arena rows (free list + unused + new chunks) and
 * index slots. Returns KV_OK, KV_EFULL or KV_ENOMEM; on error the table holds what
 * it held before (new chunks are freed again).
 */
static int reserve(kv_table_t *t, uint64_t m) {
    if (m == 0) return KV_OK;
    if (m > MAX_ROWS || t->live + m > MAX_ROWS) return KV_EFULL;
    uint64_t from_free = m < t->n_free ? m : t->n_free;
    uint64_t need_used = t->used + (m - from_free);
    uint64_t old_chunks = t->n_chunks, old_cap = t->cap_rows, old_bytes = t->arena_bytes;
    uint64_t want = t->n_chunks;
    for (uint64_t cap = t->cap_rows; cap < need_used; want++) {
        if (want >= t->max_chunks) return KV_EFULL; /* row ids would outgrow 32 bits */
        cap += chunk_rows(t, want);
    }
    if (want > t->n_chunks) {
        if (want > t->chunks_cap) {
            uint64_t cap = t->chunks_cap ? t->chunks_cap * 2 : 16;
            if (cap < want) cap = want;
            unsigned char **c = kv_realloc(t->chunks, (size_t)cap * sizeof(*c));
            if (!c) return KV_ENOMEM;
            t->chunks = c;
            t->chunks_cap = cap;
        }
        for (uint64_t c = t->n_chunks; c < want; c++) {
            unsigned char *p = kv_alloc_huge(chunk_bytes(t, c));
            if (!p) {
                for (uint64_t d = old_chunks; d < c; d++) kv_free_huge(t->chunks[d], chunk_bytes(t, d));
                t->cap_rows = old_cap;
                t->arena_bytes = old_bytes;
                return KV_ENOMEM;
            }
            t->chunks[c] = p;
            t->cap_rows += chunk_rows(t, c);
            t->arena_bytes += kv_huge_size(chunk_bytes(t, c));
        }
        t->n_chunks = want;
    }
    uint64_t need_live = t->live + m;
    unsigned rb = rbits_for(id_end(t, t->n_chunks));
    if (need_live > t->fill_limit || rb > t->rbits) {
        uint64_t slots = t->n_slots;
        if (need_live > t->fill_limit) {
            /* x 2 while the index is small (its memory is nothing next to the rows',
             * and each doubling halves the rebuild work per row), x 1.4 beyond */
            uint64_t grown = slots < SMALL_INDEX_SLOTS ? slots * 2 : slots + slots * 2 / 5;
            slots = slots_for(need_live);
            if (grown > slots) slots = grown > MAX_SLOTS ? MAX_SLOTS : grown;
            slots = round_slots(slots);
        }
        /* id bits for as many rows as this index can take, so that growing the arena
         * alone rarely forces a rebuild */
        uint64_t lim = fill_limit_of(slots), k = t->n_chunks, cap = t->cap_rows;
        while (cap < lim && k < t->max_chunks) cap += chunk_rows(t, k++);
        unsigned rb2 = rbits_for(id_end(t, k));
        if (rebuild_index(t, slots, rb2 > rb ? rb2 : rb) != KV_OK) {
            for (uint64_t d = old_chunks; d < t->n_chunks; d++) kv_free_huge(t->chunks[d], chunk_bytes(t, d));
            t->n_chunks = old_chunks;
            t->cap_rows = old_cap;
            t->arena_bytes = old_bytes;
            return KV_ENOMEM;
        }
    }
    return KV_OK;
}

/* ---- change tracking for publishing ------------------------------------------------ */

/*
 * While on (kv_table_track_changes), a row whose value changes or that is created gets
 * its PUB bit; the first time the bit goes from 0 to 1 its row id is appended to
 * pub_rows, so the list holds every row changed since the last take (a row freed and
 * reused may appear twice, and an id may name a row freed since: the take skips both
 * by the bit). Removed keys go to pub_gone. If pub_rows cannot grow, tracking is
 * "lost" (the next take says so and clears every PUB bit): a training call never fails
 * because of publishing. Everything here runs under the write lock.
 */
static void pub_mark(kv_table_t *t, uint32_t id) {
    if (!t->pub_on) return;
    uint32_t *meta = row_meta(row_at(t, id));
    if (*meta & META_PUB) return;
    *meta |= META_PUB;
    if (t->pub_lost) return;
    if (t->pub_n == t->pub_cap) {
        uint64_t cap = t->pub_cap ? t->pub_cap * 2 : 4096;
        uint32_t *p = kv_realloc(t->pub_rows, (size_t)cap * sizeof(uint32_t));
        if (!p) { /* give up on the list: the next take is a full one */
            t->pub_lost = 1;
            return;
        }
        t->pub_rows = p;
        t->pub_cap = cap;
    }
    t->pub_rows[t->pub_n++] = id;
}

/* Room for `need` keys in a key log (*keys, *cap entries): its capacity doubles from
 * 1024. KV_OK or KV_ENOMEM (the log as it was). */
static int keys_reserve(int64_t **keys, uint64_t *cap, uint64_t need) {
    if (need <= *cap) return KV_OK;
    uint64_t c = *cap ? *cap : 1024;
    while (c < need) c *= 2;
    int64_t *k = kv_realloc(*keys, (size_t)c * sizeof(int64_t));
    if (!k) return KV_ENOMEM;
    *keys = k;
    *cap = c;
    return KV_OK;
}

static int pub_gone_reserve(kv_table_t *t, uint64_t extra) {
    if (!t->pub_on || t->pub_lost) return KV_OK;
    return keys_reserve(&t->pub_gone, &t->pub_gone_cap, t->pub_gone_n + extra);
}

/* Empty both lists (giving large ones' memory back); lost != 0 marks tracking lost.
 * The PUB bits are left to the caller. */
static void pub_forget(kv_table_t *t, int lost) {
    t->pub_n = t->pub_gone_n = 0;
    if (t->pub_cap > 65536) {
        kv_free(t->pub_rows);
        t->pub_rows = NULL;
        t->pub_cap = 0;
    }
    if (t->pub_gone_cap > 65536) {
        kv_free(t->pub_gone);
        t->pub_gone = NULL;
        t->pub_gone_cap = 0;
    }
    if (lost && t->pub_on) t->pub_lost = 1;
}

/* Clear the PUB bit of every live row (O(rows): on, and after a lost take). */
static void pub_clear_bits(kv_table_t *t);

/* Take a row id from the free list or the arena's end (reserve() came first). */
static uint32_t take_row(kv_table_t *t) {
    uint64_t id;
    if (t->free_head) {
        id = t->free_head - 1;
        t->free_head = (uint64_t)row_key(row_at(t, id));
        t->n_free--;
    } else {
        id = t->next_id++;
        t->used++;
        /* past the last row of its chunk: jump to the next chunk's block */
        if ((t->next_id & t->chunk_mask) >= chunk_rows(t, t->next_id >> t->chunk_shift))
            t->next_id = ((id >> t->chunk_shift) + 1) << t->chunk_shift;
    }
    t->live++;
    return (uint32_t)id;
}

/* Create the row of an absent key: header, initial slots, and its index entry (the
 * caller writes the embedding). */
static uint32_t create_row(kv_table_t *t, int64_t key, uint32_t step) {
    uint32_t id = take_row(t);
    unsigned char *r = row_at(t, id);
    row_set_key(r, key);
    *row_step(r) = step;
    *row_meta(r) = META_DIRTY;
    if (t->nslot) kv_optim_init_slots(&t->cfg.optim, t->dim, row_slots(t, r));
    index_insert_new(t, kv_mix64((uint64_t)key), id);
    pub_mark(t, id);
    return id;
}

/* ---- admission state ------------------------------------------------------------- */

#define PEND_SALT 0x2545f4914f6cdd1dULL
#define BLOOM_SALT 0x9fb21c651e98df25ULL

static inline uint64_t pend_home(int64_t key, uint64_t cap) {
    return kv_mix64((uint64_t)key ^ PEND_SALT) & (cap - 1);
}

static pend_t *pend_find(const kv_table_t *t, int64_t key) {
    if (!t->pend_n) return NULL;
    uint64_t p = pend_home(key, t->pend_cap);
    for (;;) {
        pend_t *e = &t->pend[p];
        if (!e->cnt) return NULL;
        if (e->key == key) return e;
        p = (p + 1) & (t->pend_cap - 1);
    }
}

static void pend_put(pend_t *tab, uint64_t cap, int64_t key, uint32_t cnt, uint32_t step) {
    uint64_t p = pend_home(key, cap);
    while (tab[p].cnt) p = (p + 1) & (cap - 1);
    tab[p].key = key;
    tab[p].cnt = cnt;
    tab[p].step = step;
}

/* A pending map with room for `want` entries at most half full, holding the entries
 * of t->pend that keep(e) accepts (all if min_step == 0). NULL on KV_ENOMEM. */
static pend_t *pend_rebuilt(const kv_table_t *t, uint64_t want, uint32_t min_step,
                            uint64_t *cap_out) {
    uint64_t cap = 64;
    while (cap < 2 * want) cap <<= 1;
    pend_t *tab = kv_calloc(cap, sizeof(pend_t));
    if (!tab) return NULL;
    for (uint64_t i = 0; i < t->pend_cap; i++) {
        const pend_t *e = &t->pend[i];
        if (e->cnt && e->step >= min_step) pend_put(tab, cap, e->key, e->cnt, e->step);
    }
    *cap_out = cap;
    return tab;
}

/* Room for `extra` more pending keys. KV_OK or KV_ENOMEM (map unchanged). */
static int pend_reserve(kv_table_t *t, uint64_t extra) {
    if (2 * (t->pend_n + extra) <= t->pend_cap) return KV_OK;
    uint64_t cap;
    pend_t *tab = pend_rebuilt(t, t->pend_n + extra, 0, &cap);
    if (!tab) return KV_ENOMEM;
    kv_free(t->pend);
    t->pend = tab;
    t->pend_cap = cap;
    return KV_OK;
}

/* Remove entry e (backward shift, as index_erase_at). */
static void pend_erase(kv_table_t *t, pend_t *e) {
    uint64_t mask = t->pend_cap - 1, i = (uint64_t)(e - t->pend), j = i;
    for (;;) {
        j = (j + 1) & mask;
        pend_t *s = &t->pend[j];
        if (!s->cnt) break;
        uint64_t home = pend_home(s->key, t->pend_cap);
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->pend[i] = *s;
            i = j;
        }
    }
    t->pend[i].cnt = 0;
    t->pend_n--;
}

static inline void bloom_pos(const kv_table_t *t, int64_t key, uint64_t pos[3]) {
    uint64_t h1 = kv_mix64((uint64_t)key ^ BLOOM_SALT), h2 = kv_mix64(h1);
    pos[0] = ((h1 & 0xffffffffULL) * t->bloom_n) >> 32;
    pos[1] = ((h1 >> 32) * t->bloom_n) >> 32;
    pos[2] = ((h2 & 0xffffffffULL) * t->bloom_n) >> 32;
}
static inline uint32_t bloom_get(const uint8_t *b, uint64_t i) {
    return (b[i >> 1] >> ((i & 1) * 4)) & 15u;
}
static inline void bloom_raise(uint8_t *b, uint64_t i, uint32_t v) {
    if (bloom_get(b, i) >= v) return;
    unsigned sh = (unsigned)(i & 1) * 4;
    b[i >> 1] = (uint8_t)((b[i >> 1] & ~(15u << sh)) | (v << sh));
}
static uint32_t bloom_estimate(const kv_table_t *t, int64_t key) {
    uint64_t p[3];
    bloom_pos(t, key, p);
    uint32_t m = bloom_get(t->bloom, p[0]), c;
    if ((c = bloom_get(t->bloom, p[1])) < m) m = c;
    if ((c = bloom_get(t->bloom, p[2])) < m) m = c;
    return m;
}
static void bloom_sight(kv_table_t *t, int64_t key) {
    uint64_t p[3];
    bloom_pos(t, key, p);
    uint32_t v = bloom_estimate(t, key) + 1;
    if (v > KV_BLOOM_MAX_COUNT) v = KV_BLOOM_MAX_COUNT;
    for (int j = 0; j < 3; j++) bloom_raise(t->bloom, p[j], v);
    if (++t->bloom_adds >= t->bloom_n) { /* age: halve every counter */
        for (uint64_t i = 0; i < (t->bloom_n + 1) / 2; i++) t->bloom[i] = (uint8_t)((t->bloom[i] >> 1) & 0x77u);
        t->bloom_adds = 0;
    }
}
static inline size_t bloom_bytes(uint64_t n) { return (size_t)((n + 1) / 2); }

/* Sightings of an absent key before this one. */
static inline uint32_t seen_before(const kv_table_t *t, int64_t key) {
    if (t->bloom) return bloom_estimate(t, key);
    const pend_t *e = pend_find(t, key);
    return e ? e->cnt : 0;
}

/* 1 if this lookup of an absent key at `step` counts as a new sighting: the exact map
 * counts a key once per step (several workers of SSP/ASP pulling it in their step
 * `step` see it once, as BSP's one owner lookup does); step 0 (no step) always counts,
 * and so does every lookup with the Bloom filter, which keeps no per-key step. */
static inline uint32_t sighting(const kv_table_t *t, int64_t key, uint32_t step) {
    if (t->bloom || step == 0) return 1;
    const pend_t *e = pend_find(t, key);
    return !e || e->step != step;
}

/* ---- removed-keys log -------------------------------------------------------------- */

static int pub_gone_reserve(kv_table_t *t, uint64_t extra);

/* Room for `extra` more keys in the removed-keys log and in the publish removed log
 * (each only while it is on). KV_OK or KV_ENOMEM (both logs as they were in use). */
static int log_reserve(kv_table_t *t, uint64_t extra) {
    if (pub_gone_reserve(t, extra) != KV_OK) return KV_ENOMEM;
    if (!t->log_on) return KV_OK;
    return keys_reserve(&t->log, &t->log_cap, t->log_n + extra);
}

/* Put live row id on the free list (its index entry is already gone) and log it. */
static void free_row(kv_table_t *t, uint32_t id) {
    unsigned char *r = row_at(t, id);
    if (t->log_on) t->log[t->log_n++] = row_key(r); /* log_reserve() came first */
    if (t->pub_on && !t->pub_lost) t->pub_gone[t->pub_gone_n++] = row_key(r); /* here too */
    row_set_key(r, (int64_t)t->free_head);
    *row_meta(r) = META_FREE;
    *row_step(r) = 0;
    t->free_head = (uint64_t)id + 1;
    t->n_free++;
    t->live--;
    t->gen++;
}

/*
 * ids[i] == 0 marks keys[i] (n_absent of them) as absent. Reserve and create one row
 * per distinct absent key, set ids[i] for every absent i and, if out != NULL, copy
 * the new embedding to out[i]. On error (KV_ENOMEM, KV_EFULL) nothing changed.
 */
static int create_absent(kv_table_t *t, const int64_t *keys, int64_t n, uint32_t *ids,
                         int64_t n_absent, uint32_t step, int init_emb, float *out,
                         int64_t *n_created, int admit) {
    if (n_created) *n_created = 0;
    if (n_absent == 0) return KV_OK;
    admit = admit && t->admit_k >= 2;
    /* absent | uniq | inv (int64 each), then one admission flag per unique key */
    int64_t *scratch = kv_malloc((size_t)n_absent * (3 * sizeof(int64_t) + 1));
    if (!scratch) return KV_ENOMEM;
    int64_t *absent = scratch, *uniq = scratch + n_absent, *inv = scratch + 2 * n_absent;
    uint8_t *take = (uint8_t *)(scratch + 3 * n_absent);
    int64_t m = 0, nu;
    for (int64_t i = 0; i < n; i++)
        if (!ids[i]) absent[m++] = keys[i];
    int rc = kv_unique(absent, n_absent, uniq, inv, &nu);
    uint64_t n_take = (uint64_t)nu, n_new_pend = 0;
    if (rc == KV_OK && admit) {
        n_take = 0;
        for (int64_t u = 0; u < nu; u++) {
            uint32_t before = seen_before(t, uniq[u]);
            take[u] = before + sighting(t, uniq[u], step) >= t->admit_k;
            n_take += take[u];
            n_new_pend += !take[u] && !t->bloom && before == 0;
        }
    }
    if (rc == KV_OK) rc = reserve(t, n_take);
    if (rc == KV_OK && n_new_pend) rc = pend_reserve(t, n_new_pend);
    if (rc != KV_OK) {
        kv_free(scratch);
        return rc;
    }
    uint32_t *new_ids = (uint32_t *)(void *)absent; /* absent keys are no longer needed */
    enum { INIT_ROWS = 64 };   /* new rows' embeddings are initialised in batches */
    int64_t init_keys[INIT_ROWS];
    float *init_out[INIT_ROWS];
    int n_init = 0;
    for (int64_t u = 0; u < nu; u++) {
        if (u + LK_DA < nu)
            __builtin_prefetch(&t->index[bucket_of(kv_mix64((uint64_t)uniq[u + LK_DA]), t->n_slots)], 1);
        if (!admit || take[u]) {
            new_ids[u] = create_row(t, uniq[u], step) + 1;
            if (init_emb) {
                init_keys[n_init] = uniq[u];
                init_out[n_init] = row_emb(row_at(t, new_ids[u] - 1));
                if (++n_init == INIT_ROWS) {
                    kv_init_rows(&t->cfg, init_keys, n_init, init_out);
                    n_init = 0;
                }
            }
            if (admit && !t->bloom) {
                pend_t *e = pend_find(t, uniq[u]);
                if (e) pend_erase(t, e);
            }
        } else {
            new_ids[u] = 0;
            if (t->bloom) {
                bloom_sight(t, uniq[u]);
            } else {
                pend_t *e = pend_find(t, uniq[u]);
                if (e) {
                    e->cnt += sighting(t, uniq[u], step);
                    e->step = step;
                } else {
                    pend_put(t->pend, t->pend_cap, uniq[u], 1, step);
                    t->pend_n++;
                }
            }
        }
    }
    kv_init_rows(&t->cfg, init_keys, n_init, init_out);
    size_t d = (size_t)t->dim;
    m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i]) continue;
        uint32_t c = new_ids[inv[m++]];
        ids[i] = c;
        if (!c) t->n_rejected++;
        if (!out) continue;
        if (c)
            memcpy(out + (size_t)i * d, row_emb(row_at(t, c - 1)), d * sizeof(float));
        else
            memset(out + (size_t)i * d, 0, d * sizeof(float));
    }
    if (n_created) *n_created = (int64_t)n_take;
    kv_free(scratch);
    return KV_OK;
}

/* ---- argument checks ------------------------------------------------------------- */


static int check_batch(const kv_table_t *t, const int64_t *keys, int64_t n) {
    if (!t || n < 0 || n > MAX_BATCH || (n > 0 && !keys)) return KV_EINVAL;
    return KV_OK;
}

/* ---- public API ------------------------------------------------------------------ */

int kv_table_create(const kv_table_config_t *cfg, kv_table_t **out) {
    if (!cfg || !out) return KV_EINVAL;
    if (cfg->dim < 1 || cfg->dim > KV_MAX_DIM) return KV_EINVAL;
    if (cfg->initial_capacity < 0 || (uint64_t)cfg->initial_capacity > MAX_ROWS) return KV_EINVAL;
    int rc = kv_init_check(cfg);
    if (rc != KV_OK) return rc;
    if (kv_optim_check(&cfg->optim) != KV_OK) return KV_EOPTIM;
    if (cfg->admit_mode != KV_ADMIT_EXACT && cfg->admit_mode != KV_ADMIT_BLOOM) return KV_EINVAL;
    int bloom = cfg->admit_mode == KV_ADMIT_BLOOM && cfg->admit_min_count >= 2;
    if (bloom && (cfg->admit_min_count > KV_BLOOM_MAX_COUNT || cfg->bloom_counters < 0 ||
                  cfg->bloom_counters > ((int64_t)1 << 32)))
        return KV_EINVAL;

    kv_table_t *t = kv_calloc(1, sizeof(*t));
    if (!t) return KV_ENOMEM;
    if (pthread_rwlock_init(&t->lock, NULL) != 0) {
        kv_free(t);
        return KV_ENOMEM;
    }
    t->cfg = *cfg;
    t->dim = cfg->dim;
    t->nslot = kv_optim_slot_floats(&cfg->optim, cfg->dim);
    t->row_bytes = HDR_BYTES + 4 * ((size_t)t->dim + (size_t)t->nslot);
    t->pf_bytes = HDR_BYTES + 4 * (size_t)t->dim;
    if (t->pf_bytes > 8 * 64) t->pf_bytes = 8 * 64;
    /* A full chunk: the rows that fit in a whole number of 2 MiB pages (one, unless
     * a row is wider than 256 KiB), mapped 2 MiB-aligned. */
    size_t full = HUGE_PAGE;
    while (full / t->row_bytes < CHUNK_MIN_ROWS) full += HUGE_PAGE;
    t->rpc = full / t->row_bytes;
    unsigned shift = 0;
    while (((uint64_t)1 << shift) < t->rpc) shift++;
    t->chunk_shift = shift;
    t->chunk_mask = ((uint64_t)1 << shift) - 1;
    t->max_chunks = (uint64_t)UINT32_MAX >> shift; /* then every id + 1 <= UINT32_MAX */

    t->admit_k = cfg->admit_min_count;
    if (bloom) {
        t->bloom_n = cfg->bloom_counters ? (uint64_t)cfg->bloom_counters
                                         : (uint64_t)KV_BLOOM_DEFAULT_COUNTERS;
        t->bloom = kv_calloc(bloom_bytes(t->bloom_n), 1);
    }
    rc = bloom && !t->bloom ? KV_ENOMEM : rebuild_index(t, slots_for(0), 1); /* empty index */
    if (rc == KV_OK) rc = reserve(t, (uint64_t)cfg->initial_capacity);
    if (rc != KV_OK) {
        kv_table_destroy(t);
        return rc;
    }
    *out = t;
    return KV_OK;
}

void kv_table_destroy(kv_table_t *t) {
    if (!t) return;
    for (uint64_t c = 0; c < t->n_chunks; c++) kv_free_huge(t->chunks[c], chunk_bytes(t, c));
    kv_free(t->chunks);
    kv_free_huge(t->index, (size_t)t->n_slots * sizeof(uint32_t));
    kv_free(t->pend);
    kv_free(t->bloom);
    kv_free(t->log);
    kv_free(t->pub_rows);
    kv_free(t->pub_gone);
    pthread_rwlock_destroy(&t->lock);
    kv_free(t);
}

int32_t kv_table_dim(const kv_table_t *t) { return t ? t->dim : 0; }

int kv_table_set_optim(kv_table_t *t, const kv_optim_t *o) {
    if (!t || !o) return KV_EINVAL;
    if (kv_optim_check(o) != KV_OK) return KV_EOPTIM;
    /* kind and nslot are fixed at create: no lock needed to read them */
    if (o->kind != t->cfg.optim.kind || kv_optim_slot_floats(o, t->dim) != t->nslot)
        return KV_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    t->cfg.optim = *o;
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

/* ---- reserving ahead --------------------------------------------------------------- */

#define PREFAULT_PAGE ((size_t)4096)

static int32_t g_prefault = KV_PREFAULT_AUTO; /* kv_table_set_prefault */
static int32_t g_populate = -1; /* MADV_POPULATE_WRITE works here: -1 not yet known */

void kv_table_set_prefault(int32_t mode) {
    if (mode < KV_PREFAULT_AUTO || mode > KV_PREFAULT_OFF) mode = KV_PREFAULT_AUTO;
    __atomic_store_n(&g_prefault, mode, __ATOMIC_RELAXED);
}

/* Whether madvise(MADV_POPULATE_WRITE) works (Linux >= 5.14), tried once on a page
 * of its own. Two threads may both try it: they find the same answer. */
static int populate_works(void) {
    int32_t v = __atomic_load_n(&g_populate, __ATOMIC_RELAXED);
    if (v >= 0) return v;
    v = 0;
#ifdef MADV_POPULATE_WRITE
    void *p = mmap(NULL, PREFAULT_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (p != MAP_FAILED) {
        v = madvise(p, PREFAULT_PAGE, MADV_POPULATE_WRITE) == 0;
        munmap(p, PREFAULT_PAGE);
    }
#endif
    __atomic_store_n(&g_populate, v, __ATOMIC_RELAXED);
    return v;
}

/* Fault in the whole pages of [p, p + n) for writing, without changing a byte. A
 * failure (no memory for the pages now) is ignored: the first writes fault them as
 * they would have anyway. */
static void populate(unsigned char *p, size_t n) {
#ifdef MADV_POPULATE_WRITE
    uintptr_t a = ((uintptr_t)p + PREFAULT_PAGE - 1) & ~(uintptr_t)(PREFAULT_PAGE - 1);
    uintptr_t e = ((uintptr_t)p + n) & ~(uintptr_t)(PREFAULT_PAGE - 1);
    if (e > a) (void)madvise((void *)a, (size_t)(e - a), MADV_POPULATE_WRITE);
#else
    (void)p, (void)n;
#endif
}

/* Write a zero to every 4 KiB page of a fresh (all-zero, not yet handed out) chunk. */
static void touch_pages(unsigned char *p, size_t n) {
    volatile unsigned char *v = p;
    for (size_t o = 0; o < n; o += PREFAULT_PAGE) v[o] = 0;
}

int kv_table_reserve(kv_table_t *t, int64_t m) {
    if (!t || m < 0) return KV_EINVAL;
    if (m == 0) return KV_OK;
    int32_t mode = __atomic_load_n(&g_prefault, __ATOMIC_RELAXED);
    int pop = mode == KV_PREFAULT_AUTO && populate_works();
    if (mode == KV_PREFAULT_AUTO && !pop) mode = KV_PREFAULT_TOUCH;
    pthread_rwlock_wrlock(&t->lock);
    uint64_t c0 = t->n_chunks;
    /* reserve() leaves the table as it was on an error (it frees the chunks it made;
     * only the array of chunk pointers may have grown, counted in bytes) */
    int rc = reserve(t, (uint64_t)m);
    uint64_t c1 = t->n_chunks; /* chunks [c0, c1) are new, zero, and hold no row yet */
    if (rc == KV_OK && mode == KV_PREFAULT_TOUCH)
        for (uint64_t c = c0; c < c1; c++) touch_pages(t->chunks[c], chunk_bytes(t, c));
    pthread_rwlock_unlock(&t->lock);
    if (rc != KV_OK || !pop) return rc;
    /* MADV_POPULATE_WRITE without the lock: it changes no byte, so it is safe beside
     * calls that write rows into these chunks meanwhile, and a chunk stays where it is
     * until kv_table_destroy (evict, delete and clear keep the arena). Only the array
     * of chunk pointers may move (a reserve's realloc): read each under the read lock. */
    for (uint64_t c = c0; c < c1; c++) {
        pthread_rwlock_rdlock(&t->lock);
        unsigned char *p = t->chunks[c];
        size_t n = chunk_bytes(t, c);
        pthread_rwlock_unlock(&t->lock);
        if (n >= KV_HUGE_MIN) populate(p, n); /* smaller ones were zeroed by memset */
    }
    return KV_OK;
}

int64_t kv_table_size(kv_table_t *t) {
    if (!t) return 0;
    pthread_rwlock_rdlock(&t->lock);
    int64_t n = (int64_t)t->live;
    pthread_rwlock_unlock(&t->lock);
    return n;
}

int kv_table_find(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                  uint8_t *found, const float *default_row) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && !out)) return KV_EINVAL;
    pthread_rwlock_rdlock(&t->lock);
    if (found)
        lookup_core(t, keys, n, t->pf_bytes, NULL, out, 1, default_row, found, NULL, 0);
    else
        lookup_core(t, keys, n, t->pf_bytes, NULL, out, 1, default_row, NULL, NULL, 0);
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

/* find_or_create; ref (may be NULL) gets every key's row id + 1 (0: no row). */
static int find_or_create_impl(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                               uint32_t step, int64_t *n_created, uint8_t *has_row,
                               uint32_t *ref, uint64_t *gen) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && !out)) return KV_EINVAL;
    if (n_created) *n_created = 0;
    if (n == 0) {
        if (gen) {
            pthread_rwlock_rdlock(&t->lock);
            *gen = t->gen;
            pthread_rwlock_unlock(&t->lock);
        }
        return KV_OK;
    }
    uint32_t *buf = kv_malloc((size_t)n * (ref ? 1 : 2) * sizeof(uint32_t));
    if (!buf) return KV_ENOMEM;
    uint32_t *ids = ref ? ref : buf;
    uint32_t *old_step = ref ? buf : buf + n; /* to undo last_step if creating fails */
    int64_t n_absent = 0, nc = 0;
    pthread_rwlock_wrlock(&t->lock);
    lookup_core(t, keys, n, t->pf_bytes, ids, out, 0, NULL, NULL, old_step, step);
    for (int64_t i = 0; i < n; i++) n_absent += !ids[i];
    int rc = create_absent(t, keys, n, ids, n_absent, step, 1, out, &nc, 1);
    if (rc != KV_OK) {
        for (int64_t i = n - 1; i >= 0; i--) /* backwards: duplicates restore the first */
            if (ids[i]) *row_step(row_at(t, ids[i] - 1)) = old_step[i];
    } else {
        t->n_admitted += nc;
        if (n_created) *n_created = nc;
        if (has_row)
            for (int64_t i = 0; i < n; i++) has_row[i] = ids[i] != 0;
        if (gen) *gen = t->gen;
    }
    pthread_rwlock_unlock(&t->lock);
    kv_free(buf);
    return rc;
}

int kv_table_find_or_create(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                            uint32_t step, int64_t *n_created, uint8_t *has_row) {
    return find_or_create_impl(t, keys, n, out, step, n_created, has_row, NULL, NULL);
}

int kv_table_find_or_create_ref(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                                uint32_t step, int64_t *n_created, uint32_t *ref) {
    if (n > 0 && !ref) return KV_EINVAL;
    return find_or_create_impl(t, keys, n, out, step, n_created, NULL, ref, NULL);
}

int kv_table_find_or_create_gen(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                                uint32_t step, int64_t *n_created, uint32_t *ref,
                                uint64_t *gen) {
    if ((n > 0 && !ref) || !gen) return KV_EINVAL;
    return find_or_create_impl(t, keys, n, out, step, n_created, NULL, ref, gen);
}

/* Look every key up (ids[i] = id + 1 or 0) and count the absent ones. */
static int64_t lookup_all(kv_table_t *t, const int64_t *keys, int64_t n, uint32_t *ids) {
    int64_t n_absent = 0;
    lookup_ids(t, keys, n, ids, HDR_BYTES);
    for (int64_t i = 0; i < n; i++) n_absent += !ids[i];
    return n_absent;
}

int kv_table_update(kv_table_t *t, const int64_t *keys, int64_t n, const float *values) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && !values)) return KV_EINVAL;
    if (n == 0) return KV_OK;
    size_t d = (size_t)t->dim;
    if (!kv_all_finite(values, (size_t)n * d)) return KV_ENONFINITE;
    uint32_t *ids = kv_malloc((size_t)n * sizeof(uint32_t));
    if (!ids) return KV_ENOMEM;
    pthread_rwlock_wrlock(&t->lock);
    int64_t n_absent = lookup_all(t, keys, n, ids);
    int rc = create_absent(t, keys, n, ids, n_absent, 0, 0, NULL, NULL, 0);
    if (rc == KV_OK) {
        for (int64_t i = 0; i < n; i++) {
            if (i + PF_ROWS < n) prefetch_bytes(row_at(t, ids[i + PF_ROWS] - 1), t->pf_bytes);
            unsigned char *r = row_at(t, ids[i] - 1);
            memcpy(row_emb(r), values + (size_t)i * d, d * sizeof(float));
            *row_meta(r) |= META_DIRTY;
            pub_mark(t, ids[i] - 1);
        }
    }
    pthread_rwlock_unlock(&t->lock);
    kv_free(ids);
    return rc;
}

/* Remove the rows of `keys` that exist (only_new: only those created at `step` and
 * never yet trained); their count goes to *n_removed. */
static int erase_keys(kv_table_t *t, const int64_t *keys, int64_t n, int only_new,
                      uint32_t step, int64_t *n_removed) {
    if (check_batch(t, keys, n) != KV_OK) return KV_EINVAL;
    int64_t nr = 0;
    pthread_rwlock_wrlock(&t->lock);
    int rc = log_reserve(t, (uint64_t)(n < (int64_t)t->live ? n : (int64_t)t->live));
    for (int64_t i = 0; rc == KV_OK && i < n; i++) {
        uint64_t slot;
        uint32_t c = lookup_one(t, keys[i], &slot);
        if (!c) continue;
        if (only_new) {
            unsigned char *r = row_at(t, c - 1);
            if ((*row_meta(r) & META_COUNT) || *row_step(r) != step) continue; /* not new */
        }
        index_erase_at(t, slot);
        free_row(t, c - 1);
        nr++;
    }
    pthread_rwlock_unlock(&t->lock);
    if (n_removed) *n_removed = nr;
    return rc;
}

int kv_table_delete(kv_table_t *t, const int64_t *keys, int64_t n, int64_t *n_deleted) {
    return erase_keys(t, keys, n, 0, 0, n_deleted);
}

int kv_table_forget_new(kv_table_t *t, const int64_t *keys, int64_t n, uint32_t step,
                        int64_t *n_forgotten) {
    return erase_keys(t, keys, n, 1, step, n_forgotten);
}

int kv_table_clear(kv_table_t *t) {
    if (!t) return KV_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    memset(t->index, 0, (size_t)t->n_slots * sizeof(uint32_t));
    t->next_id = t->used = t->free_head = t->n_free = t->live = 0;
    if (t->pend) memset(t->pend, 0, (size_t)t->pend_cap * sizeof(pend_t));
    t->pend_n = 0;
    if (t->bloom) memset(t->bloom, 0, bloom_bytes(t->bloom_n));
    t->bloom_adds = 0;
    t->log_n = 0;
    pub_forget(t, 1); /* a clear is not logged key by key: the next take says so */
    t->gen++;
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

/* ---- updates: computed apart from the rows, then written (all or nothing) ----------- */

/* Floats of one prepared row: its embedding, then its optimizer slots. */
static inline size_t row_floats(const kv_table_t *t) {
    return (size_t)t->dim + (size_t)t->nslot;
}

/*
 * The optimizer step on the rows of u in [u0, u1) with gradient g[u], computed into
 * out[u] (row_floats: the embedding and slots after the update) without changing the
 * table: ids[u] names the row (id + 1); ids[u] == 0 means keys[u] has no row: with
 * `create` it starts from keys[u]'s initial value and slots (what create_absent gives
 * a new row), else it is skipped (out[u] left alone). Returns the first u whose result
 * is not finite, or -1. The caller holds the lock (read or write) and has checked g.
 */
static int64_t prep_rows(const kv_table_t *t, const int64_t *keys, const uint32_t *ids,
                         int64_t u0, int64_t u1, const float *g, int64_t step, int create,
                         float *out) {
    const size_t d = (size_t)t->dim, f = row_floats(t);
    const size_t pf = t->row_bytes > 512 ? 512 : t->row_bytes;
    if (create) { /* new rows' initial embeddings, in batches */
        enum { INIT_ROWS = 64 };
        int64_t init_keys[INIT_ROWS];
        float *init_out[INIT_ROWS];
        int n_init = 0;
        for (int64_t u = u0; u < u1; u++) {
            if (ids[u]) continue;
            init_keys[n_init] = keys[u];
            init_out[n_init] = out + (size_t)u * f;
            if (t->nslot) kv_optim_init_slots(&t->cfg.optim, t->dim, out + (size_t)u * f + d);
            if (++n_init == INIT_ROWS) {
                kv_init_rows(&t->cfg, init_keys, n_init, init_out);
                n_init = 0;
            }
        }
        if (n_init) kv_init_rows(&t->cfg, init_keys, n_init, init_out);
    }
    int64_t bad = -1;
    for (int64_t u = u0; u < u1; u++) {
        if (u + PF_ROWS < u1 && ids[u + PF_ROWS])
            prefetch_bytes(row_at(t, ids[u + PF_ROWS] - 1), pf);
        float *o = out + (size_t)u * f;
        if (ids[u])
            memcpy(o, row_emb(row_at(t, ids[u] - 1)), f * sizeof(float));
        else if (!create)
            continue;
        kv_optim_apply_rows(&t->cfg.optim, t->dim, 1, o, o + d, g + (size_t)u * d, step);
        if (bad < 0 && !kv_all_finite(o, f)) bad = u;
    }
    return bad;
}

/* Write prepared rows: out[u] becomes the embedding and slots of row ids[u] - 1 (0:
 * skipped), with last_step = step, count + 1 and the dirty bit. Write lock held. */
static void write_rows(kv_table_t *t, const uint32_t *ids, int64_t u0, int64_t u1,
                       const float *out, int64_t step) {
    const size_t f = row_floats(t);
    for (int64_t u = u0; u < u1; u++) {
        if (u + PF_ROWS < u1 && ids[u + PF_ROWS]) { /* the row's first line, for writing */
            const unsigned char *p = row_at(t, ids[u + PF_ROWS] - 1);
            __builtin_prefetch(p, 1);
            if (t->row_bytes > 64) __builtin_prefetch(p + t->row_bytes - 1, 1);
        }
        if (!ids[u]) continue;
        unsigned char *r = row_at(t, ids[u] - 1);
        memcpy(row_emb(r), out + (size_t)u * f, f * sizeof(float));
        *row_step(r) = (uint32_t)step;
        uint32_t meta = *row_meta(r), cnt = meta & META_COUNT;
        *row_meta(r) = (meta & ~META_COUNT) | (cnt < META_COUNT ? cnt + 1 : cnt) | META_DIRTY;
    }
}

/* Publishing's change marks of rows ids[u] - 1 (0: skipped), u < n: a pass of its own,
 * on one thread after every row is written (pub_mark appends to one list: never run it
 * from the pool's tasks). Write lock held. */
static void pub_mark_rows(kv_table_t *t, const uint32_t *ids, int64_t n) {
    if (!t->pub_on) return;
    for (int64_t u = 0; u < n; u++)
        if (ids[u]) pub_mark(t, ids[u] - 1);
}

#ifndef KV_COMMIT_PARALLEL /* -D overrides: tests thread small commits too */
#define KV_COMMIT_PARALLEL 8192 /* rows of a commit below which one thread writes them */
#endif

/* A buffer for n prepared rows of t (at least one byte). */
static float *prep_buffer(const kv_table_t *t, int64_t n) {
    return kv_malloc((size_t)(n ? n : 1) * row_floats(t) * sizeof(float));
}

int32_t kv_table_slot_floats(const kv_table_t *t) { return t ? t->nslot : 0; }

int kv_table_apply_gradients(kv_table_t *t, const int64_t *keys, int64_t n,
                             const float *grads, int64_t step, int32_t flags,
                             int64_t *n_missing) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && !grads)) return KV_EINVAL;
    if (step < 1 || (flags & ~KV_APPLY_CREATE_MISSING)) return KV_EINVAL;
    if (n_missing) *n_missing = 0;
    if (n == 0) return KV_OK;
    size_t d = (size_t)t->dim;
    if (!kv_all_finite(grads, (size_t)n * d)) return KV_ENONFINITE;
    /* Sum duplicates outside the lock: uniq[nu], sums[nu][dim], ids[nu]. */
    int64_t *uniq = kv_malloc((size_t)n * (sizeof(int64_t) + sizeof(uint32_t)));
    float *sums = kv_malloc((size_t)n * d * sizeof(float));
    float *out = prep_buffer(t, n);
    if (!uniq || !sums || !out) {
        kv_free(uniq);
        kv_free(sums);
        kv_free(out);
        return KV_ENOMEM;
    }
    uint32_t *ids = (uint32_t *)(void *)(uniq + n);
    int64_t nu = 0;
    int rc = kv_segment_sum(keys, n, grads, t->dim, uniq, sums, &nu);
    if (rc == KV_OK && !kv_all_finite(sums, (size_t)nu * d)) rc = KV_ENONFINITE;
    if (rc != KV_OK) {
        kv_free(uniq);
        kv_free(sums);
        kv_free(out);
        return rc;
    }
    pthread_rwlock_wrlock(&t->lock);
    int64_t n_absent = lookup_all(t, uniq, nu, ids);
    int create = (flags & KV_APPLY_CREATE_MISSING) && t->admit_k < 2;
    /* every new value first: a result that is not finite changes nothing */
    if (prep_rows(t, uniq, ids, 0, nu, sums, step, create, out) >= 0) rc = KV_ENONFINITE;
    if (rc == KV_OK && create)
        rc = create_absent(t, uniq, nu, ids, n_absent, (uint32_t)step, 0, NULL, NULL, 0);
    if (rc == KV_OK) {
        if (!create) {
            t->n_dropped += n_absent;
            if (n_missing) *n_missing = n_absent;
        }
        write_rows(t, ids, 0, nu, out, step);
        pub_mark_rows(t, ids, nu);
    }
    pthread_rwlock_unlock(&t->lock);
    kv_free(uniq);
    kv_free(sums);
    kv_free(out);
    return rc;
}

/* Whether every ref[i] is 0 or the id + 1 of the live row of keys[i] (prefetching
 * each row whole on the way, for the update that follows). *n_zero: refs that are 0.
 * This is the whole validity check: a ref taken before its row was freed finds the
 * row free, reused by another key, or past the arena's end after a clear. */
static int refs_valid(const kv_table_t *t, const int64_t *keys, const uint32_t *ref,
                      int64_t n, int64_t *n_zero) {
    size_t pf = t->row_bytes > 512 ? 512 : t->row_bytes;
    uint64_t end = t->next_id; /* ids at or past the never-used mark are not rows */
    int64_t z = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PF_ROWS < n && ref[i + PF_ROWS] && ref[i + PF_ROWS] - 1 < end)
            prefetch_bytes(row_at(t, ref[i + PF_ROWS] - 1), pf);
        if (!ref[i]) {
            z++;
            continue;
        }
        uint64_t id = ref[i] - 1;
        if (id >= end || (id & t->chunk_mask) >= chunk_rows(t, id >> t->chunk_shift))
            return 0;
        unsigned char *r = row_at(t, id);
        if ((*row_meta(r) & META_FREE) || row_key(r) != keys[i]) return 0;
    }
    *n_zero = z;
    return 1;
}

int kv_table_apply_gradients_ref(kv_table_t *t, const int64_t *keys, const uint32_t *ref,
                                 int64_t n, const float *grads, int64_t step, int32_t flags,
                                 int64_t *n_missing) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && (!grads || !ref))) return KV_EINVAL;
    if (step < 1 || (flags & ~(KV_APPLY_CREATE_MISSING | KV_APPLY_DISTINCT))) return KV_EINVAL;
    if (n_missing) *n_missing = 0;
    if (n == 0) return KV_OK;
    size_t d = (size_t)t->dim;
    if (!kv_all_finite(grads, (size_t)n * d)) return KV_ENONFINITE;
    int distinct = (flags & KV_APPLY_DISTINCT) != 0;
    int64_t *uniq = NULL, nu = n, n_zero = 0;
    float *sums = NULL, *out = prep_buffer(t, n);
    if (!out) return KV_ENOMEM;
    pthread_rwlock_wrlock(&t->lock);
    int ok = refs_valid(t, keys, ref, n, &n_zero);
    /* a key without a row that must be created goes by key (create_missing without
     * admission: rows are never missing then unless something freed them) */
    if (ok && n_zero && (flags & KV_APPLY_CREATE_MISSING) && t->admit_k < 2) ok = 0;
    int rc = KV_OK;
    int64_t n_miss = n_zero; /* distinct: every zero ref is a key of its own */
    const uint32_t *ids = ref;
    const int64_t *ukeys = keys;
    const float *g = grads;
    if (ok && !distinct) {
        /* sum duplicate rows: a segment sum keyed by ref (the zero refs form one group,
         * which prep_rows skips); the keys without a row count once each */
        uniq = kv_malloc((size_t)n * (4 * sizeof(int64_t) + sizeof(uint32_t)));
        sums = kv_malloc((size_t)n * d * sizeof(float));
        if (!uniq || !sums) {
            rc = KV_ENOMEM;
        } else {
            int64_t *as_key = uniq + n, *zu = uniq + 2 * n, *zi = uniq + 3 * n;
            uint32_t *u32 = (uint32_t *)(void *)(uniq + 4 * n);
            for (int64_t i = 0; i < n; i++) as_key[i] = ref[i];
            rc = kv_segment_sum(as_key, n, grads, t->dim, uniq, sums, &nu);
            for (int64_t u = 0; rc == KV_OK && u < nu; u++) {
                if (uniq[u] && !kv_all_finite(sums + (size_t)u * d, d)) rc = KV_ENONFINITE;
                u32[u] = (uint32_t)uniq[u];
            }
            if (rc == KV_OK && n_zero) {
                int64_t z = 0;
                for (int64_t i = 0; i < n; i++)
                    if (!ref[i]) as_key[z++] = keys[i];
                rc = kv_unique(as_key, z, zu, zi, &n_miss);
            }
            ids = u32;
            ukeys = NULL; /* not read: prep_rows creates nothing here */
            g = sums;
        }
    }
    if (ok && rc == KV_OK && prep_rows(t, ukeys, ids, 0, nu, g, step, 0, out) >= 0)
        rc = KV_ENONFINITE;
    if (ok && rc == KV_OK) {
        write_rows(t, ids, 0, nu, out, step);
        pub_mark_rows(t, ids, nu);
        t->n_dropped += n_miss;
        if (n_missing) *n_missing = n_miss;
    }
    pthread_rwlock_unlock(&t->lock);
    kv_free(uniq);
    kv_free(sums);
    kv_free(out);
    if (!ok) /* a stale or wrong ref: by key, the same result */
        return kv_table_apply_gradients(t, keys, n, grads, step,
                                        flags & KV_APPLY_CREATE_MISSING, n_missing);
    return rc;
}

/* Whether the refs of generation `gen` still name their rows (write or read lock
 * held): no row was freed since, and none lies past the arena's used ids. *n_zero:
 * the refs that are 0. */
static int refs_current(const kv_table_t *t, const uint32_t *ref, int64_t n, uint64_t gen,
                        int64_t *n_zero) {
    if (t->gen != gen) return 0;
    int64_t z = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!ref[i])
            z++;
        else if (ref[i] - 1 >= t->next_id ||
                 ((ref[i] - 1) & t->chunk_mask) >= chunk_rows(t, (ref[i] - 1) >> t->chunk_shift))
            return 0;
    }
    *n_zero = z;
    return 1;
}

int kv_table_apply_refs(kv_table_t *t, const int64_t *keys, const uint32_t *ref, int64_t n,
                        const float *grads, int64_t step, uint64_t gen, int64_t *n_missing) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && (!grads || !ref))) return KV_EINVAL;
    if (step < 1) return KV_EINVAL;
    if (n_missing) *n_missing = 0;
    if (n == 0) return KV_OK;
    if (!kv_all_finite(grads, (size_t)n * (size_t)t->dim)) return KV_ENONFINITE;
    float *out = prep_buffer(t, n);
    if (!out) return KV_ENOMEM;
    int rc = KV_OK;
    int64_t n_zero = 0;
    pthread_rwlock_wrlock(&t->lock);
    int ok = refs_current(t, ref, n, gen, &n_zero);
    if (ok && prep_rows(t, keys, ref, 0, n, grads, step, 0, out) >= 0) rc = KV_ENONFINITE;
    if (ok && rc == KV_OK) {
        write_rows(t, ref, 0, n, out, step);
        pub_mark_rows(t, ref, n);
        t->n_dropped += n_zero;
        if (n_missing) *n_missing = n_zero;
    }
    pthread_rwlock_unlock(&t->lock);
    kv_free(out);
    if (!ok) /* rows were freed since the refs were taken: by key, the same result */
        return kv_table_apply_gradients(t, keys, n, grads, step, KV_APPLY_CREATE_MISSING,
                                        n_missing);
    return rc;
}

int kv_table_prepare_refs(kv_table_t *t, const int64_t *keys, const uint32_t *ref, int64_t n,
                          const float *grads, int64_t step, uint64_t gen, float *out,
                          uint32_t *ids, uint64_t *gen_out, int64_t *bad) {
    if (check_batch(t, keys, n) != KV_OK || !gen_out || !bad ||
        (n > 0 && (!grads || !ref || !out || !ids)))
        return KV_EINVAL;
    if (step < 1) return KV_EINVAL;
    /* a NaN/Inf gradient is not looked for apart: it makes its row's update NaN/Inf
     * (every rule puts g, or g^2 in a slot, into what it writes), which is checked */
    int64_t n_zero = 0;
    pthread_rwlock_rdlock(&t->lock);
    if (refs_current(t, ref, n, gen, &n_zero)) {
        if (n) memcpy(ids, ref, (size_t)n * sizeof(uint32_t));
    } else { /* rows were freed since the refs were taken: by key; gone ones skipped */
        lookup_ids(t, keys, n, ids, HDR_BYTES);
    }
    *gen_out = t->gen;
    *bad = prep_rows(t, keys, ids, 0, n, grads, step, 0, out);
    pthread_rwlock_unlock(&t->lock);
    return *bad >= 0 ? KV_ENONFINITE : KV_OK;
}

typedef struct {
    kv_table_t *t;
    const uint32_t *ids;
    const float *rows;
    int64_t n, parts, step;
} commit_job_t;

/* Part q of a commit's rows (the write lock is held by the caller of the job). */
static void commit_part(void *arg, int64_t q) {
    commit_job_t *j = arg;
    write_rows(j->t, j->ids, q * j->n / j->parts, (q + 1) * j->n / j->parts, j->rows, j->step);
}

int kv_table_commit_refs(kv_table_t *t, kv_pool_t *pool, const int64_t *keys,
                         const uint32_t *ids, int64_t n, const float *rows, int64_t step,
                         uint64_t gen, int64_t *n_missing) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && (!ids || !rows)) || step < 1)
        return KV_EINVAL;
    if (n_missing) *n_missing = 0;
    if (n == 0) return KV_OK;
    uint32_t *now = NULL;
    int64_t n_zero = 0;
    pthread_rwlock_wrlock(&t->lock);
    if (!refs_current(t, ids, n, gen, &n_zero)) {
        /* a row was freed since the prepare: find each key's row again (by key, into a
         * buffer allocated under the lock, the one path that needs it) */
        now = kv_malloc((size_t)n * sizeof(uint32_t));
        if (!now) {
            pthread_rwlock_unlock(&t->lock);
            return KV_ENOMEM;
        }
        lookup_ids(t, keys, n, now, HDR_BYTES);
        n_zero = 0;
        for (int64_t i = 0; i < n; i++) n_zero += !now[i] || !ids[i];
        for (int64_t i = 0; i < n; i++)
            if (!ids[i]) now[i] = 0; /* no row at the prepare: nothing was computed */
        ids = now;
    }
    /* by key range over the pool's threads: each row is written by one of them */
    commit_job_t job = {.t = t, .ids = ids, .rows = rows, .n = n, .step = step, .parts = 1};
    if (n >= KV_COMMIT_PARALLEL) job.parts = 4 * (int64_t)kv_pool_threads(pool);
    kv_pool_run(job.parts > 1 ? pool : NULL, job.parts, commit_part, &job);
    pub_mark_rows(t, ids, n); /* after the join */
    t->n_dropped += n_zero;
    pthread_rwlock_unlock(&t->lock);
    kv_free(now);
    if (n_missing) *n_missing = n_zero;
    return KV_OK;
}

int kv_table_check_update(kv_table_t *t, const int64_t *keys, int64_t n, const float *grads,
                          int64_t step, int32_t flags, int64_t *key, int32_t *what) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && !grads) || !key || !what || step < 1 ||
        (flags & ~(KV_APPLY_CREATE_MISSING | KV_APPLY_DISTINCT)))
        return KV_EINVAL;
    *key = 0;
    *what = 0;
    if (n == 0) return KV_OK;
    size_t d = (size_t)t->dim;
    int64_t *uniq = kv_malloc((size_t)n * (sizeof(int64_t) + sizeof(uint32_t)));
    float *sums = kv_malloc((size_t)n * d * sizeof(float));
    float *out = prep_buffer(t, n);
    int rc = uniq && sums && out ? KV_OK : KV_ENOMEM;
    int64_t nu = 0;
    for (int64_t i = 0; rc == KV_OK && i < n && !*what; i++)
        if (!kv_all_finite(grads + (size_t)i * d, d)) {
            *key = keys[i];
            *what = 1;
        }
    if (rc == KV_OK && !*what) rc = kv_segment_sum(keys, n, grads, t->dim, uniq, sums, &nu);
    for (int64_t u = 0; rc == KV_OK && u < nu && !*what; u++)
        if (!kv_all_finite(sums + (size_t)u * d, d)) {
            *key = uniq[u];
            *what = 3;
        }
    if (rc == KV_OK && !*what) {
        uint32_t *ids = (uint32_t *)(void *)(uniq + n);
        pthread_rwlock_rdlock(&t->lock);
        lookup_ids(t, uniq, nu, ids, HDR_BYTES);
        int create = (flags & KV_APPLY_CREATE_MISSING) && t->admit_k < 2;
        int64_t u = prep_rows(t, uniq, ids, 0, nu, sums, step, create, out);
        pthread_rwlock_unlock(&t->lock);
        if (u >= 0) {
            *key = uniq[u];
            *what = 2;
        }
    }
    kv_free(uniq);
    kv_free(sums);
    kv_free(out);
    return rc;
}

int kv_table_export(kv_table_t *t, int64_t *cursor, int64_t max_n, int32_t flags,
                    int64_t *keys, float *values, float *slots, uint32_t *last_step,
                    uint32_t *counts, uint8_t *dirty, int64_t *n_out) {
    if (!t || !cursor || !n_out || *cursor < 0 || max_n < 0) return KV_EINVAL;
    if (flags & ~(KV_EXPORT_DIRTY_ONLY | KV_EXPORT_CLEAR_DIRTY)) return KV_EINVAL;
    if (max_n > 0 && (!keys || !values)) return KV_EINVAL;
    int clear = (flags & KV_EXPORT_CLEAR_DIRTY) != 0;
    int dirty_only = (flags & KV_EXPORT_DIRTY_ONLY) != 0;
    size_t d = (size_t)t->dim, s = (size_t)t->nslot;
    if (clear)
        pthread_rwlock_wrlock(&t->lock);
    else
        pthread_rwlock_rdlock(&t->lock);
    uint64_t c = (uint64_t)*cursor;
    int64_t k = 0;
    for (; k < max_n && c < t->next_id; c++) {
        if ((c & t->chunk_mask) >= chunk_rows(t, c >> t->chunk_shift)) { /* past a chunk's rows */
            c = (((c >> t->chunk_shift) + 1) << t->chunk_shift) - 1;
            continue;
        }
        unsigned char *r = row_at(t, c);
        uint32_t meta = *row_meta(r);
        if ((meta & META_FREE) || (dirty_only && !(meta & META_DIRTY))) continue;
        keys[k] = row_key(r);
        memcpy(values + (size_t)k * d, row_emb(r), d * sizeof(float));
        if (slots && s) memcpy(slots + (size_t)k * s, row_slots(t, r), s * sizeof(float));
        if (last_step) last_step[k] = *row_step(r);
        if (counts) counts[k] = meta & META_COUNT;
        if (dirty) dirty[k] = (meta & META_DIRTY) != 0;
        if (clear) *row_meta(r) = meta & ~META_DIRTY;
        k++;
    }
    if (c > (uint64_t)*cursor) *cursor = (int64_t)c;
    *n_out = k;
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

int kv_table_import(kv_table_t *t, const int64_t *keys, int64_t n, const float *values,
                    const float *slots, const uint32_t *last_step, const uint32_t *counts) {
    if (check_batch(t, keys, n) != KV_OK || (n > 0 && !values)) return KV_EINVAL;
    if (n == 0) return KV_OK;
    size_t d = (size_t)t->dim, s = (size_t)t->nslot;
    if (!kv_all_finite(values, (size_t)n * d)) return KV_ENONFINITE;
    if (slots && !kv_all_finite(slots, (size_t)n * s)) return KV_ENONFINITE;
    uint32_t *ids = kv_malloc((size_t)n * sizeof(uint32_t));
    if (!ids) return KV_ENOMEM;
    pthread_rwlock_wrlock(&t->lock);
    int64_t n_absent = lookup_all(t, keys, n, ids);
    int rc = create_absent(t, keys, n, ids, n_absent, 0, 0, NULL, NULL, 0);
    if (rc == KV_OK) {
        for (int64_t i = 0; i < n; i++) {
            if (i + PF_ROWS < n) prefetch_bytes(row_at(t, ids[i + PF_ROWS] - 1), t->pf_bytes);
            unsigned char *r = row_at(t, ids[i] - 1);
            memcpy(row_emb(r), values + (size_t)i * d, d * sizeof(float));
            if (s) {
                if (slots)
                    memcpy(row_slots(t, r), slots + (size_t)i * s, s * sizeof(float));
                else
                    kv_optim_init_slots(&t->cfg.optim, t->dim, row_slots(t, r));
            }
            *row_step(r) = last_step ? last_step[i] : 0;
            uint32_t cnt = counts ? counts[i] : 0;
            *row_meta(r) = (cnt < META_COUNT ? cnt : META_COUNT) | /* clean */
                           (*row_meta(r) & META_PUB);
            pub_mark(t, ids[i] - 1); /* changed all the same, for publishing */
        }
    }
    pthread_rwlock_unlock(&t->lock);
    kv_free(ids);
    return rc;
}

int kv_table_stats(kv_table_t *t, kv_table_stats_t *out) {
    if (!t || !out) return KV_EINVAL;
    pthread_rwlock_rdlock(&t->lock);
    uint64_t cap = t->cap_rows;
    out->rows = (int64_t)t->live;
    out->row_capacity = (int64_t)(cap < MAX_ROWS ? cap : MAX_ROWS);
    out->index_slots = (int64_t)t->n_slots;
    out->bytes = (int64_t)(sizeof(*t) + t->chunks_cap * sizeof(*t->chunks) + t->arena_bytes +
                           kv_huge_size((size_t)t->n_slots * sizeof(uint32_t)));
    out->row_bytes = (int64_t)t->row_bytes;
    out->dim = t->dim;
    out->slot_floats = t->nslot;
    out->load_factor = t->n_slots ? (double)t->live / (double)t->n_slots : 0.0;
    out->admitted = t->n_admitted;
    out->rejected = t->n_rejected;
    out->dropped_grads = t->n_dropped;
    out->evicted = t->n_evicted;
    out->pending = (int64_t)t->pend_n;
    out->admission_bytes = (int64_t)(t->pend_cap * sizeof(pend_t) + (t->bloom ? bloom_bytes(t->bloom_n) : 0));
    out->removed_logged = (int64_t)t->log_n;
    out->bytes += out->admission_bytes + (int64_t)(t->log_cap * sizeof(int64_t)) +
                  (int64_t)(t->pub_cap * sizeof(uint32_t) + t->pub_gone_cap * sizeof(int64_t));
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

/* ---- admission state (checkpoints) -------------------------------------------------- */

int kv_table_export_pending(kv_table_t *t, int64_t *cursor, int64_t max_n, int64_t *keys,
                            uint32_t *counts, uint32_t *steps, int64_t *n_out) {
    if (!t || !cursor || !n_out || *cursor < 0 || max_n < 0 || (max_n && (!keys || !counts || !steps)))
        return KV_EINVAL;
    int64_t n = 0;
    pthread_rwlock_rdlock(&t->lock);
    uint64_t i = (uint64_t)*cursor;
    for (; i < t->pend_cap && n < max_n; i++) {
        const pend_t *e = &t->pend[i];
        if (!e->cnt) continue;
        keys[n] = e->key;
        counts[n] = e->cnt;
        steps[n] = e->step;
        n++;
    }
    /* the rest of the map holds no entry: the end */
    while (i < t->pend_cap && !t->pend[i].cnt) i++;
    *cursor = (int64_t)i;
    pthread_rwlock_unlock(&t->lock);
    *n_out = n;
    return KV_OK;
}

int kv_table_import_pending(kv_table_t *t, const int64_t *keys, const uint32_t *counts,
                            const uint32_t *steps, int64_t n) {
    if (!t || n < 0 || (n && (!keys || !counts || !steps))) return KV_EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (!counts[i]) return KV_EINVAL;
    if (t->bloom || t->admit_k < 2) return n ? KV_EINVAL : KV_OK; /* no exact counting here */
    pthread_rwlock_wrlock(&t->lock);
    int rc = pend_reserve(t, (uint64_t)n);
    for (int64_t i = 0; rc == KV_OK && i < n; i++) {
        if (lookup_one(t, keys[i], NULL)) continue; /* a row exists: nothing pending */
        pend_t *e = pend_find(t, keys[i]);
        if (e) {
            e->cnt = counts[i];
            e->step = steps[i];
        } else {
            pend_put(t->pend, t->pend_cap, keys[i], counts[i], steps[i]);
            t->pend_n++;
        }
    }
    pthread_rwlock_unlock(&t->lock);
    return rc;
}

int64_t kv_table_bloom_bytes(kv_table_t *t) {
    if (!t || !t->bloom) return 0;
    return (int64_t)bloom_bytes(t->bloom_n);
}

int kv_table_export_bloom(kv_table_t *t, uint8_t *out, int64_t n, uint64_t *adds) {
    if (!t || !t->bloom || n != (int64_t)bloom_bytes(t->bloom_n) || !out || !adds)
        return KV_EINVAL;
    pthread_rwlock_rdlock(&t->lock);
    memcpy(out, t->bloom, (size_t)n);
    *adds = t->bloom_adds;
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

int kv_table_import_bloom(kv_table_t *t, const uint8_t *in, int64_t n, uint64_t adds,
                          int32_t merge) {
    if (!t || !t->bloom || n != (int64_t)bloom_bytes(t->bloom_n) || !in || adds > t->bloom_n)
        return KV_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    if (!merge) {
        memcpy(t->bloom, in, (size_t)n);
        t->bloom_adds = adds;
    } else { /* the larger of each 4-bit counter: never admits later than either */
        for (int64_t i = 0; i < n; i++) {
            uint8_t a = t->bloom[i], b = in[i];
            uint8_t lo = (a & 15) > (b & 15) ? (a & 15) : (b & 15);
            uint8_t hi = (a >> 4) > (b >> 4) ? (a >> 4) : (b >> 4);
            t->bloom[i] = (uint8_t)(lo | (hi << 4));
        }
        if (adds > t->bloom_adds) t->bloom_adds = adds;
    }
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

/* ---- eviction -------------------------------------------------------------------- */

typedef struct {
    uint32_t second; /* the policy's secondary field */
    uint32_t id;
    int64_t key;
} ev_tie_t;

static int ev_tie_cmp(const void *a, const void *b) {
    const ev_tie_t *x = a, *y = b;
    if (x->second != y->second) return x->second < y->second ? -1 : 1;
    return x->key < y->key ? -1 : x->key > y->key;
}

/* Every live row of the arena, in arena order: `id` and `r` are set in BODY. */
#define FOR_LIVE_ROWS(t, id, r, ...)                                                    \
    for (uint64_t c_ = 0; c_ < (t)->n_chunks; c_++) {                                  \
        uint64_t nr_ = chunk_used((t), c_);                                            \
        for (uint64_t o_ = 0; o_ < nr_; o_++) {                                        \
            uint32_t id = (uint32_t)((c_ << (t)->chunk_shift) + o_);                   \
            unsigned char *r = (t)->chunks[c_] + (size_t)o_ * (t)->row_bytes;          \
            if (*row_meta(r) & META_FREE) continue;                                    \
            __VA_ARGS__                                                                \
        }                                                                              \
    }

static inline uint32_t ev_first(unsigned char *r, int lfu) {
    return lfu ? *row_meta(r) & META_COUNT : *row_step(r);
}
static inline uint32_t ev_second(unsigned char *r, int lfu) {
    return lfu ? *row_step(r) : *row_meta(r) & META_COUNT;
}

/* Remove row id from the index (find its slot from its home bucket). */
static void index_erase_id(kv_table_t *t, uint32_t id) {
    uint64_t p = bucket_of(kv_mix64((uint64_t)row_key(row_at(t, id))), t->n_slots);
    while ((t->index[p] & t->id_mask) != id + 1) p = next_slot(p, t->n_slots);
    index_erase_at(t, p);
}

/* Refill the index in place from the arena (after many rows were freed). */
static void index_refill(kv_table_t *t) {
    memset(t->index, 0, (size_t)t->n_slots * sizeof(uint32_t));
    FOR_LIVE_ROWS(t, id, r, {
        index_insert_new(t, kv_mix64((uint64_t)row_key(r)), id);
    })
}

int kv_table_evict(kv_table_t *t, uint32_t min_last_step, int64_t max_rows, int32_t policy,
                   int64_t *n_evicted) {
    if (!t || (policy != KV_EVICT_LRU && policy != KV_EVICT_LFU)) return KV_EINVAL;
    if (n_evicted) *n_evicted = 0;
    const int lfu = policy == KV_EVICT_LFU;
    uint32_t *hist = NULL;
    ev_tie_t *ties = NULL;
    pend_t *new_pend = NULL;
    uint64_t new_pend_cap = 0, new_pend_n = 0, n_ttl = 0, e_b = 0, n_tie = 0, need_t = 0;
    uint32_t cut = 0;
    int cut_incl = 0, rc = KV_OK, purge = 0;
    pthread_rwlock_wrlock(&t->lock);
    const uint64_t live = t->live;
    const int over = max_rows >= 0 && live > (uint64_t)max_rows;
    /* Pass 1: TTL rows; histogram of the top 16 bits of the primary field of the rest. */
    if (over) {
        hist = kv_calloc(65536, sizeof(uint32_t));
        if (!hist) rc = KV_ENOMEM;
    }
    if (rc == KV_OK && (min_last_step || over)) {
        FOR_LIVE_ROWS(t, id, r, {
            (void)id;
            if (*row_step(r) < min_last_step)
                n_ttl++;
            else if (hist)
                hist[ev_first(r, lfu) >> 16]++;
        })
    }
    uint64_t keep = live - n_ttl;
    if (rc == KV_OK && max_rows >= 0 && keep > (uint64_t)max_rows) {
        e_b = keep - (uint64_t)max_rows;
        uint64_t cum = 0;
        uint32_t hi = 0, lo = 0;
        while (cum + hist[hi] < e_b) cum += hist[hi++];
        /* Pass 2: the low 16 bits inside bucket hi. */
        memset(hist, 0, 65536 * sizeof(uint32_t));
        FOR_LIVE_ROWS(t, id, r, {
            (void)id;
            uint32_t v = ev_first(r, lfu);
            if (*row_step(r) >= min_last_step && (v >> 16) == hi) hist[v & 0xffffu]++;
        })
        while (cum + hist[lo] < e_b) cum += hist[lo++];
        cut = (hi << 16) | lo;
        need_t = e_b - cum; /* rows equal to cut that go: 1 .. hist[lo] */
        if (need_t == hist[lo]) {
            cut_incl = 1;
            need_t = 0;
        } else {
            /* Pass 3: the rows tied at the cut-off, sorted by (second, key). */
            n_tie = hist[lo];
            ties = kv_malloc((size_t)n_tie * sizeof(ev_tie_t));
            if (!ties) {
                rc = KV_ENOMEM;
            } else {
                uint64_t k = 0;
                FOR_LIVE_ROWS(t, id, r, {
                    if (*row_step(r) >= min_last_step && ev_first(r, lfu) == cut) {
                        ties[k].second = ev_second(r, lfu);
                        ties[k].id = id;
                        ties[k].key = row_key(r);
                        k++;
                    }
                })
                qsort(ties, (size_t)n_tie, sizeof(ev_tie_t), ev_tie_cmp);
            }
        }
    }
    /* Exact admission: pending keys last seen before the TTL cut-off go (below). When
     * the map would end up under 1/8 full it is rebuilt smaller (allocated here). */
    if (rc == KV_OK && min_last_step && t->pend_n) {
        uint64_t stay = 0;
        for (uint64_t i = 0; i < t->pend_cap; i++)
            stay += t->pend[i].cnt && t->pend[i].step >= min_last_step;
        if (stay < t->pend_n) {
            purge = 1;
            if (stay * 8 < t->pend_cap && t->pend_cap > 64) {
                purge = 2;
                if (stay) {
                    new_pend = pend_rebuilt(t, stay, min_last_step, &new_pend_cap);
                    if (!new_pend) rc = KV_ENOMEM;
                }
                new_pend_n = stay;
            }
        }
    }
    uint64_t total = n_ttl + e_b;
    if (rc == KV_OK) rc = log_reserve(t, total);
    if (rc != KV_OK) { /* nothing has changed */
        kv_free(hist);
        kv_free(ties);
        kv_free(new_pend);
        pthread_rwlock_unlock(&t->lock);
        return rc;
    }
    /* From here nothing can fail. */
    if (total) {
        const int refill = total * 8 > live;
        FOR_LIVE_ROWS(t, id, r, {
            uint32_t v;
            if (*row_step(r) < min_last_step ||
                (e_b && ((v = ev_first(r, lfu)) < cut || (cut_incl && v == cut)))) {
                if (!refill) index_erase_id(t, id);
                free_row(t, id);
            }
        })
        for (uint64_t i = 0; i < need_t; i++) {
            if (!refill) index_erase_id(t, ties[i].id);
            free_row(t, ties[i].id);
        }
        if (refill) index_refill(t);
        t->n_evicted += (int64_t)total;
    }
    if (purge == 2) {
        kv_free(t->pend);
        t->pend = new_pend;
        t->pend_cap = new_pend_cap;
        t->pend_n = new_pend_n;
    } else if (purge) { /* in place: erase and look at the same slot again */
        for (uint64_t i = 0; i < t->pend_cap;) {
            pend_t *e = &t->pend[i];
            if (e->cnt && e->step < min_last_step)
                pend_erase(t, e);
            else
                i++;
        }
    }
    pthread_rwlock_unlock(&t->lock);
    kv_free(hist);
    kv_free(ties);
    if (n_evicted) *n_evicted = (int64_t)total;
    return KV_OK;
}

int kv_table_track_removed(kv_table_t *t, int32_t on) {
    if (!t) return KV_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    t->log_on = on != 0;
    if (!on) {
        kv_free(t->log);
        t->log = NULL;
        t->log_n = t->log_cap = 0;
    }
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

int kv_table_take_removed(kv_table_t *t, int64_t *out, int64_t max_n, int64_t *n_out) {
    if (!t || !n_out || max_n < 0 || (max_n > 0 && !out)) return KV_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    uint64_t m = (uint64_t)max_n < t->log_n ? (uint64_t)max_n : t->log_n;
    if (m) memcpy(out, t->log + (t->log_n - m), (size_t)m * sizeof(int64_t));
    t->log_n -= m;
    if (!t->log_n && t->log_cap > 1024) { /* give a large log's memory back */
        kv_free(t->log);
        t->log = NULL;
        t->log_cap = 0;
    }
    *n_out = (int64_t)m;
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

/* ---- change tracking for publishing: the API ----------------------------------------- */

static void pub_clear_bits(kv_table_t *t) {
    FOR_LIVE_ROWS(t, id, r, {
        (void)id;
        *row_meta(r) &= ~META_PUB;
    })
}

int kv_table_track_changes(kv_table_t *t, int32_t on) {
    if (!t) return KV_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    pub_clear_bits(t);
    t->pub_on = on != 0;
    t->pub_lost = 0;
    pub_forget(t, 0);
    if (!on) {
        kv_free(t->pub_rows);
        kv_free(t->pub_gone);
        t->pub_rows = NULL;
        t->pub_gone = NULL;
        t->pub_cap = t->pub_gone_cap = 0;
    }
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

int kv_table_changes_pending(kv_table_t *t, int64_t *n_rows, int64_t *n_removed,
                             int32_t *lost) {
    if (!t || !n_rows || !n_removed || !lost) return KV_EINVAL;
    pthread_rwlock_rdlock(&t->lock);
    *n_rows = (int64_t)t->pub_n;
    *n_removed = (int64_t)t->pub_gone_n;
    *lost = t->pub_lost;
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}

int kv_table_take_changes(kv_table_t *t, int64_t max_rows, int64_t *keys, float *values,
                          int64_t max_removed, int64_t *removed, int64_t *n_rows,
                          int64_t *n_removed, int32_t *complete) {
    if (!t || !n_rows || !n_removed || !complete || max_rows < 0 || max_removed < 0 ||
        (max_rows && (!keys || !values)) || (max_removed && !removed))
        return KV_EINVAL;
    pthread_rwlock_wrlock(&t->lock);
    if (!t->pub_on) {
        pthread_rwlock_unlock(&t->lock);
        return KV_EINVAL;
    }
    if (t->pub_lost) { /* the lists are incomplete: start over from a full publish */
        pub_clear_bits(t);
        pub_forget(t, 0);
        t->pub_lost = 0;
        *n_rows = *n_removed = 0;
        *complete = 0;
        pthread_rwlock_unlock(&t->lock);
        return KV_OK;
    }
    *complete = 1;
    if ((uint64_t)max_rows < t->pub_n || (uint64_t)max_removed < t->pub_gone_n) {
        *n_rows = -(int64_t)t->pub_n - 1; /* too small: nothing taken, the sizes needed */
        *n_removed = -(int64_t)t->pub_gone_n - 1;
        pthread_rwlock_unlock(&t->lock);
        return KV_OK;
    }
    size_t d = (size_t)t->dim;
    int64_t k = 0;
    uint64_t end = t->next_id;
    for (uint64_t i = 0; i < t->pub_n; i++) {
        uint64_t id = t->pub_rows[i];
        if (i + PF_ROWS < t->pub_n && t->pub_rows[i + PF_ROWS] < end)
            prefetch_bytes(row_at(t, t->pub_rows[i + PF_ROWS]), t->pf_bytes);
        if (id >= end) continue; /* a row of an arena since cleared */
        unsigned char *r = row_at(t, id);
        uint32_t meta = *row_meta(r);
        if ((meta & META_FREE) || !(meta & META_PUB)) continue; /* freed, or taken already */
        *row_meta(r) = meta & ~META_PUB;
        keys[k] = row_key(r);
        memcpy(values + (size_t)k * d, row_emb(r), d * sizeof(float));
        k++;
    }
    if (t->pub_gone_n) memcpy(removed, t->pub_gone, (size_t)t->pub_gone_n * sizeof(int64_t));
    *n_rows = k;
    *n_removed = (int64_t)t->pub_gone_n;
    pub_forget(t, 0);
    pthread_rwlock_unlock(&t->lock);
    return KV_OK;
}
