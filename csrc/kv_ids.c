/*
 * kv_ids.c - string ids to keys (XXH64 or FarmHash Fingerprint64) over the layouts
 * readers hand over, and Criteo's hex ids.
 *
 * XXH64 follows the published specification (xxhash.com, XXH64): four 64-bit lanes
 * over 32-byte stripes for inputs of 32 bytes or more, then 8-, 4- and 1-byte tails
 * and the final avalanche. FarmHash Fingerprint64 is farmhashna's Hash64 (Geoff Pike
 * and Jyrki Alakuijala's FarmHash, github.com/google/farmhash, the function TensorFlow's
 * tf.fingerprint computes for a string): one of four paths by length (0-16, 17-32,
 * 33-64 bytes: a few 64-bit reads from both ends, multiplied and mixed; longer: a
 * 64-byte block loop over a 56-byte state, then the last 64 bytes). Both read their
 * input as little-endian words (one unaligned load each on a little-endian host, byte
 * by byte elsewhere), so the result does not depend on the host's byte order or
 * alignment. The layout functions only
 * find each id's bytes and call the chosen hash; offsets are validated in a first
 * pass, so a bad buffer never leads to a read out of bounds.
 *
 * kv_hash_ucs4 encodes one id at a time into a scratch buffer of 4 * width bytes (the
 * longest UTF-8 encoding of `width` code points) and hashes that, so 'U' arrays get
 * the keys their UTF-8 bytes get. kv_hex_ids32 is a table-driven parse of at most 8
 * hex digits per id. Nothing here locks or keeps state.
 */
#include "kv_ids.h"

#include <string.h>

/* ---- XXH64 ------------------------------------------------------------------------- */

#define XP1 0x9E3779B185EBCA87ULL
#define XP2 0xC2B2AE3D27D4EB4FULL
#define XP3 0x165667B19E3779F9ULL
#define XP4 0x85EBCA77C2B2AE63ULL
#define XP5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl64(uint64_t x, unsigned r) { return (x << r) | (x >> (64 - r)); }
/* Little-endian reads: one unaligned load on a little-endian host (memcpy is how C99
 * says it; GCC did not fold the byte loop into one), byte by byte elsewhere. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static inline uint64_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
#else
static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static inline uint64_t rd32(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24;
}
#endif
static inline uint64_t xround(uint64_t acc, uint64_t in) {
    acc += in * XP2;
    return rotl64(acc, 31) * XP1;
}
static inline uint64_t xmerge(uint64_t acc, uint64_t v) {
    acc ^= xround(0, v);
    return acc * XP1 + XP4;
}

static uint64_t xxh64(const uint8_t *p, uint64_t len, uint64_t seed) {
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + XP1 + XP2, v2 = seed + XP2, v3 = seed, v4 = seed - XP1;
        for (; p + 32 <= end; p += 32) {
            v1 = xround(v1, rd64(p));
            v2 = xround(v2, rd64(p + 8));
            v3 = xround(v3, rd64(p + 16));
            v4 = xround(v4, rd64(p + 24));
        }
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xmerge(xmerge(xmerge(xmerge(h, v1), v2), v3), v4);
    } else {
        h = seed + XP5;
    }
    h += len;
    for (; p + 8 <= end; p += 8) h = rotl64(h ^ xround(0, rd64(p)), 27) * XP1 + XP4;
    if (p + 4 <= end) {
        h = rotl64(h ^ (rd32(p) * XP1), 23) * XP2 + XP3;
        p += 4;
    }
    for (; p < end; p++) h = rotl64(h ^ (*p * XP5), 11) * XP1;
    h ^= h >> 33;
    h *= XP2;
    h ^= h >> 29;
    h *= XP3;
    h ^= h >> 32;
    return h;
}

/* ---- FarmHash Fingerprint64 (farmhashna::Hash64) -------------------------------------- */

#define FK0 0xc3a5c85c97cb3127ULL
#define FK1 0xb492b66fbe98f273ULL
#define FK2 0x9ae16a3b2f90404fULL

static inline uint64_t rotr64(uint64_t x, unsigned r) { return (x >> r) | (x << (64 - r)); }
static inline uint64_t shift_mix(uint64_t v) { return v ^ (v >> 47); }

static inline uint64_t fh_len16(uint64_t u, uint64_t v, uint64_t mul) {
    uint64_t a = (u ^ v) * mul;
    a ^= a >> 47;
    uint64_t b = (v ^ a) * mul;
    b ^= b >> 47;
    return b * mul;
}

static inline uint64_t fh_0to16(const uint8_t *s, uint64_t len) {
    if (len >= 8) {
        uint64_t mul = FK2 + len * 2;
        uint64_t a = rd64(s) + FK2;
        uint64_t b = rd64(s + len - 8);
        uint64_t c = rotr64(b, 37) * mul + a;
        uint64_t d = (rotr64(a, 25) + b) * mul;
        return fh_len16(c, d, mul);
    }
    if (len >= 4) {
        uint64_t mul = FK2 + len * 2;
        return fh_len16(len + (rd32(s) << 3), rd32(s + len - 4), mul);
    }
    if (len > 0) {
        uint32_t y = (uint32_t)s[0] + ((uint32_t)s[len >> 1] << 8);
        uint32_t z = (uint32_t)len + ((uint32_t)s[len - 1] << 2);
        return shift_mix((uint64_t)y * FK2 ^ (uint64_t)z * FK0) * FK2;
    }
    return FK2;
}

static inline uint64_t fh_17to32(const uint8_t *s, uint64_t len) {
    uint64_t mul = FK2 + len * 2;
    uint64_t a = rd64(s) * FK1;
    uint64_t b = rd64(s + 8);
    uint64_t c = rd64(s + len - 8) * mul;
    uint64_t d = rd64(s + len - 16) * FK2;
    return fh_len16(rotr64(a + b, 43) + rotr64(c, 30) + d, a + rotr64(b + FK2, 18) + c, mul);
}

static inline uint64_t fh_33to64(const uint8_t *s, uint64_t len) {
    uint64_t mul = FK2 + len * 2;
    uint64_t a = rd64(s) * FK2;
    uint64_t b = rd64(s + 8);
    uint64_t c = rd64(s + len - 8) * mul;
    uint64_t d = rd64(s + len - 16) * FK2;
    uint64_t y = rotr64(a + b, 43) + rotr64(c, 30) + d;
    uint64_t z = fh_len16(y, a + rotr64(b + FK2, 18) + c, mul);
    uint64_t e = rd64(s + 16) * mul;
    uint64_t f = rd64(s + 24);
    uint64_t g = (y + rd64(s + len - 32)) * mul;
    uint64_t h = (z + rd64(s + len - 24)) * mul;
    return fh_len16(rotr64(e + f, 43) + rotr64(g, 30) + h, e + rotr64(f + a, 18) + g, mul);
}

/* FarmHash's WeakHashLen32WithSeeds over s[0..32): (*p1, *p2) from seeds a, b. */
static inline void fh_weak32(const uint8_t *s, uint64_t a, uint64_t b, uint64_t *p1,
                             uint64_t *p2) {
    uint64_t w = rd64(s), x = rd64(s + 8), y = rd64(s + 16), z = rd64(s + 24);
    a += w;
    b = rotr64(b + a + z, 21);
    uint64_t c = a;
    a += x;
    a += y;
    b += rotr64(a, 44);
    *p1 = a + z;
    *p2 = b + c;
}

static uint64_t fh_long(const uint8_t *s, uint64_t len) {
    const uint64_t seed = 81;
    uint64_t x = seed, y = seed * FK1 + 113, z = shift_mix(y * FK2 + 113) * FK2;
    uint64_t v1 = 0, v2 = 0, w1 = 0, w2 = 0, t;
    x = x * FK2 + rd64(s);
    /* blocks of 64 bytes, leaving 1 to 64 bytes for the last (overlapping) block */
    const uint8_t *end = s + ((len - 1) / 64) * 64;
    const uint8_t *last64 = end + ((len - 1) & 63) - 63;
    do {
        x = rotr64(x + y + v1 + rd64(s + 8), 37) * FK1;
        y = rotr64(y + v2 + rd64(s + 48), 42) * FK1;
        x ^= w2;
        y += v1 + rd64(s + 40);
        z = rotr64(z + w1, 33) * FK1;
        fh_weak32(s, v2 * FK1, x + w1, &v1, &v2);
        fh_weak32(s + 32, z + w2, y + rd64(s + 16), &w1, &w2);
        t = z, z = x, x = t;
        s += 64;
    } while (s != end);
    uint64_t mul = FK1 + ((z & 0xff) << 1);
    s = last64;
    w1 += ((len - 1) & 63);
    v1 += w1;
    w1 += v1;
    x = rotr64(x + y + v1 + rd64(s + 8), 37) * mul;
    y = rotr64(y + v2 + rd64(s + 48), 42) * mul;
    x ^= w2 * 9;
    y += v1 * 9 + rd64(s + 40);
    z = rotr64(z + w1, 33) * mul;
    fh_weak32(s, v2 * mul, x + w1, &v1, &v2);
    fh_weak32(s + 32, z + w2, y + rd64(s + 16), &w1, &w2);
    t = z, z = x, x = t;
    return fh_len16(fh_len16(v1, w1, mul) + shift_mix(y) * FK0 + z, fh_len16(v2, w2, mul) + x,
                    mul);
}

static inline uint64_t farmhash64(const uint8_t *s, uint64_t len) {
    if (len <= 16) return fh_0to16(s, len);
    if (len <= 32) return fh_17to32(s, len);
    if (len <= 64) return fh_33to64(s, len);
    return fh_long(s, len);
}

/* The key of one id under `hash` (checked by the callers). XXH64's seed is 0. */
static inline int64_t id_key(int32_t hash, const uint8_t *p, uint64_t len) {
    return (int64_t)(hash == KV_ID_FARMHASH64 ? farmhash64(p, len) : xxh64(p, len, 0));
}

static inline int bad_hash(int32_t hash) {
    return hash != KV_ID_XXH64 && hash != KV_ID_FARMHASH64;
}

/* for (i < n) out[i] = key of (P, L) under `hash`, with the hash chosen once outside
 * the loop so each copy inlines its own function. PREP declares what P and L read. */
#define EACH_ID(hash, n, PREP, P, L)                                                   \
    do {                                                                               \
        if ((hash) == KV_ID_FARMHASH64) {                                              \
            for (int64_t i = 0; i < (n); i++) {                                        \
                PREP;                                                                  \
                out[i] = (int64_t)farmhash64((P), (uint64_t)(L));                      \
            }                                                                          \
        } else {                                                                       \
            for (int64_t i = 0; i < (n); i++) {                                        \
                PREP;                                                                  \
                out[i] = (int64_t)xxh64((P), (uint64_t)(L), 0);                        \
            }                                                                          \
        }                                                                              \
    } while (0)

static const uint8_t EMPTY[1] = {0};

int kv_hash_strings(const uint8_t *bytes, const int64_t *starts, const int64_t *lens,
                    int64_t n, int32_t hash, int64_t *out) {
    if (n < 0 || bad_hash(hash) || (n > 0 && (!starts || !lens || !out))) return KV_EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (starts[i] < 0 || lens[i] < 0 || (lens[i] > 0 && !bytes)) return KV_EINVAL;
    EACH_ID(hash, n, (void)0, lens[i] ? bytes + starts[i] : EMPTY, lens[i]);
    return KV_OK;
}

/* Arrow offsets: offsets[0] >= 0, non-decreasing, bytes present unless all empty. */
#define CHECK_OFFSETS(bytes, offsets, n)                                         \
    do {                                                                         \
        if ((n) < 0 || !(offsets) || ((n) > 0 && !out)) return KV_EINVAL;        \
        if ((offsets)[0] < 0) return KV_EINVAL;                                  \
        for (int64_t i_ = 0; i_ < (n); i_++)                                     \
            if ((offsets)[i_ + 1] < (offsets)[i_]) return KV_EINVAL;             \
        if ((offsets)[n] > (offsets)[0] && !(bytes)) return KV_EINVAL;           \
    } while (0)

/* The two Arrow offset widths share one body. */
#define HASH_OFFSETS(name, offset_t)                                                  \
    int name(const uint8_t *bytes, const offset_t *offsets, int64_t n, int32_t hash,  \
             int64_t *out) {                                                          \
        if (bad_hash(hash)) return KV_EINVAL;                                         \
        CHECK_OFFSETS(bytes, offsets, n);                                             \
        EACH_ID(hash, n, uint64_t len = (uint64_t)(offsets[i + 1] - offsets[i]),      \
                len ? bytes + offsets[i] : EMPTY, len);                               \
        return KV_OK;                                                                 \
    }
HASH_OFFSETS(kv_hash_offsets32, int32_t)
HASH_OFFSETS(kv_hash_offsets64, int64_t)

/* Length of a fixed-width id without its trailing NULs. */
static inline int64_t trimmed(const uint8_t *p, int64_t width) {
    while (width > 0 && p[width - 1] == 0) width--;
    return width;
}

int kv_hash_fixed(const uint8_t *bytes, int64_t width, int64_t n, int32_t hash, int64_t *out) {
    if (n < 0 || width < 0 || bad_hash(hash) || (n > 0 && (!out || (width > 0 && !bytes))))
        return KV_EINVAL;
    EACH_ID(hash, n, const uint8_t *p = width ? bytes + i * width : EMPTY, p,
            trimmed(p, width));
    return KV_OK;
}

/* UTF-8 of code points c[0..len) into dst (4 * len bytes); -1 at a code point UTF-8
 * cannot encode, else the byte count. */
static int64_t utf8_encode(const uint32_t *c, int64_t len, uint8_t *dst) {
    uint8_t *d = dst;
    for (int64_t k = 0; k < len; k++) {
        uint32_t u = c[k];
        if (u < 0x80) {
            *d++ = (uint8_t)u;
        } else if (u < 0x800) {
            *d++ = (uint8_t)(0xC0 | (u >> 6));
            *d++ = (uint8_t)(0x80 | (u & 0x3F));
        } else if (u < 0x10000) {
            if (u >= 0xD800 && u <= 0xDFFF) return -1;
            *d++ = (uint8_t)(0xE0 | (u >> 12));
            *d++ = (uint8_t)(0x80 | ((u >> 6) & 0x3F));
            *d++ = (uint8_t)(0x80 | (u & 0x3F));
        } else if (u <= 0x10FFFF) {
            *d++ = (uint8_t)(0xF0 | (u >> 18));
            *d++ = (uint8_t)(0x80 | ((u >> 12) & 0x3F));
            *d++ = (uint8_t)(0x80 | ((u >> 6) & 0x3F));
            *d++ = (uint8_t)(0x80 | (u & 0x3F));
        } else {
            return -1;
        }
    }
    return (int64_t)(d - dst);
}

int kv_hash_ucs4(const uint32_t *chars, int64_t width, int64_t n, int32_t hash, int64_t *out,
                 int64_t *bad) {
    if (bad) *bad = -1;
    if (n < 0 || width < 0 || !bad || bad_hash(hash) || (n > 0 && (!out || (width > 0 && !chars))))
        return KV_EINVAL;
    if (width > INT64_MAX / 8) return KV_EINVAL;
    uint8_t *buf = NULL;
    if (n > 0 && width > 0) {
        buf = kv_malloc((size_t)(4 * width));
        if (!buf) return KV_ENOMEM;
    }
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *c = width ? chars + i * width : NULL;
        int64_t len = width;
        while (len > 0 && c[len - 1] == 0) len--;
        int64_t nb = len ? utf8_encode(c, len, buf) : 0;
        if (nb < 0) {
            *bad = i;
            kv_free(buf);
            return KV_EINVAL;
        }
        out[i] = id_key(hash, nb ? buf : EMPTY, (uint64_t)nb);
    }
    kv_free(buf);
    return KV_OK;
}

/* ASCII -> hex digit value + 1; 0 for anything else (the default of the rest). */
static const uint8_t HEX1[256] = {
    ['0'] = 1, ['1'] = 2, ['2'] = 3, ['3'] = 4, ['4'] = 5, ['5'] = 6, ['6'] = 7, ['7'] = 8,
    ['8'] = 9, ['9'] = 10, ['a'] = 11, ['b'] = 12, ['c'] = 13, ['d'] = 14, ['e'] = 15,
    ['f'] = 16, ['A'] = 11, ['B'] = 12, ['C'] = 13, ['D'] = 14, ['E'] = 15, ['F'] = 16,
};

/* One id of len bytes at p: base | value, or base | missing when empty; *ok = 0 when
 * it is not 1 to 8 hex digits. 8 digits (Criteo's usual) take an unrolled path. */
static inline int64_t hex_id(const uint8_t *p, int32_t len, int64_t base, int64_t missing,
                             int *ok) {
    uint64_t v = 0;
    if (len == 8) {
        uint8_t d0 = HEX1[p[0]], d1 = HEX1[p[1]], d2 = HEX1[p[2]], d3 = HEX1[p[3]];
        uint8_t d4 = HEX1[p[4]], d5 = HEX1[p[5]], d6 = HEX1[p[6]], d7 = HEX1[p[7]];
        *ok = (d0 && d1 && d2 && d3 && d4 && d5 && d6 && d7);
        v = (uint64_t)(d0 - 1) << 28 | (uint64_t)(d1 - 1) << 24 | (uint64_t)(d2 - 1) << 20 |
            (uint64_t)(d3 - 1) << 16 | (uint64_t)(d4 - 1) << 12 | (uint64_t)(d5 - 1) << 8 |
            (uint64_t)(d6 - 1) << 4 | (uint64_t)(d7 - 1);
    } else if (len == 0) {
        *ok = 1;
        v = (uint64_t)missing;
    } else {
        int good = len < 8;
        for (int32_t k = 0; good && k < len; k++) {
            uint8_t d = HEX1[p[k]];
            good = d != 0;
            v = (v << 4) | (uint8_t)(d - 1);
        }
        *ok = good;
    }
    if (!*ok) v = (uint64_t)missing;
    return (int64_t)((uint64_t)base | v);
}

int kv_hex_ids32(int32_t ncols, int64_t n, const uint8_t *const *bytes,
                 const int32_t *const *offsets, const int64_t *bases, int64_t missing,
                 int64_t *out, int64_t out_stride, uint8_t *bad, int64_t *n_bad,
                 int64_t *first_bad) {
    if (!n_bad || !first_bad) return KV_EINVAL;
    *n_bad = 0;
    first_bad[0] = first_bad[1] = -1;
    if (ncols < 0 || n < 0 || (ncols > 0 && (!bytes || !offsets || !bases))) return KV_EINVAL;
    if (ncols > 0 && n > 0 && (!out || out_stride < n)) return KV_EINVAL;
    for (int32_t c = 0; c < ncols; c++) {
        const int32_t *off = offsets[c];
        if (!off) return KV_EINVAL;
        if (off[0] < 0) return KV_EINVAL;
        for (int64_t i = 0; i < n; i++)
            if (off[i + 1] < off[i]) return KV_EINVAL;
        if (off[n] > off[0] && !bytes[c]) return KV_EINVAL;
    }
    if (bad) memset(bad, 0, (size_t)n);
    int64_t nb = 0;
    for (int32_t c = 0; c < ncols; c++) {
        const int32_t *off = offsets[c];
        const uint8_t *b = bytes[c];
        int64_t *o = out + (int64_t)c * out_stride;
        for (int64_t i = 0; i < n; i++) {
            int ok;
            int32_t len = off[i + 1] - off[i];
            o[i] = hex_id(len ? b + off[i] : EMPTY, len, bases[c], missing, &ok);
            if (!ok) {
                if (first_bad[0] < 0 || i < first_bad[0]) {
                    first_bad[0] = i;
                    first_bad[1] = c;
                }
                if (bad && !bad[i]) {
                    bad[i] = 1;
                    nb++;
                } else if (!bad) {
                    nb++;
                }
            }
        }
    }
    *n_bad = nb;
    return KV_OK;
}
