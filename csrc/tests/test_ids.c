/*
 * test_ids.c - XXH64 and FarmHash Fingerprint64 over every id layout against reference
 * values and against each other (the same ids give the same keys in every layout),
 * UTF-8 encoding of UCS-4 ids, Criteo hex ids, bad arguments and a failing allocation.
 */
#include <string.h>

#include "../kv_ids.h"
#include "test_util.h"

/* XXH64 reference values (seed 0), from the xxhash library */
static const char *WORDS[] = {"", "a", "abc", "68fd1e64",
                              "hello world, this is a longer string of 40+ bytes"};
static const uint64_t WANT[] = {0xef46db3751d8e999ULL, 0xd24ec4f1a98c6e5bULL,
                                0x44bc2cf5ad770999ULL, 0x5d3ccd85c9c22fe4ULL,
                                0xe326d2c9a3358a9fULL};
#define NW 5

static void test_hash_strings(void) {
    const char *text = "a" "abc" "68fd1e64" "hello world, this is a longer string of 40+ bytes";
    int64_t starts[NW] = {0, 0, 1, 4, 12}, lens[NW] = {0, 1, 3, 8, 49}, out[NW];
    CHECK_EQ_INT(kv_hash_strings((const uint8_t *)text, starts, lens, NW, 0, out), KV_OK);
    for (int i = 0; i < NW; i++) CHECK((uint64_t)out[i] == WANT[i]);
    CHECK_EQ_INT(kv_hash_strings(NULL, starts, lens, 1, 0, out), KV_OK); /* empty string */
    CHECK((uint64_t)out[0] == WANT[0]);
    CHECK_EQ_INT(kv_hash_strings(NULL, starts, lens, 2, 0, out), KV_EINVAL);
    lens[0] = -1;
    CHECK_EQ_INT(kv_hash_strings((const uint8_t *)text, starts, lens, 1, 0, out), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_strings((const uint8_t *)text, starts, lens, -1, 0, out), KV_EINVAL);
}

static void test_offsets(void) {
    /* Arrow layout of WORDS, starting at byte 3 of the buffer (a sliced array) */
    char buf[128] = "xyz";
    int32_t off32[NW + 1];
    int64_t off64[NW + 1], out[NW];
    off32[0] = 3;
    for (int i = 0; i < NW; i++) {
        memcpy(buf + off32[i], WORDS[i], strlen(WORDS[i]));
        off32[i + 1] = off32[i] + (int32_t)strlen(WORDS[i]);
    }
    for (int i = 0; i <= NW; i++) off64[i] = off32[i];
    CHECK_EQ_INT(kv_hash_offsets32((const uint8_t *)buf, off32, NW, 0, out), KV_OK);
    for (int i = 0; i < NW; i++) CHECK((uint64_t)out[i] == WANT[i]);
    memset(out, 0, sizeof out);
    CHECK_EQ_INT(kv_hash_offsets64((const uint8_t *)buf, off64, NW, 0, out), KV_OK);
    for (int i = 0; i < NW; i++) CHECK((uint64_t)out[i] == WANT[i]);
    /* the hash matters; an unknown one is refused */
    CHECK_EQ_INT(kv_hash_offsets64((const uint8_t *)buf, off64, NW, KV_ID_FARMHASH64, out), KV_OK);
    CHECK((uint64_t)out[1] != WANT[1]);
    CHECK_EQ_INT(kv_hash_offsets64((const uint8_t *)buf, off64, NW, 2, out), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_offsets32((const uint8_t *)buf, off32, NW, -1, out), KV_EINVAL);
    /* all-empty ids need no bytes; n = 0 needs one offset */
    int32_t zeros[3] = {0, 0, 0};
    CHECK_EQ_INT(kv_hash_offsets32(NULL, zeros, 2, 0, out), KV_OK);
    CHECK((uint64_t)out[0] == WANT[0] && (uint64_t)out[1] == WANT[0]);
    CHECK_EQ_INT(kv_hash_offsets32(NULL, zeros, 0, 0, NULL), KV_OK);
    /* bad: decreasing, negative first offset, bytes missing, NULL offsets, n < 0 */
    int32_t down[3] = {0, 5, 4};
    CHECK_EQ_INT(kv_hash_offsets32((const uint8_t *)buf, down, 2, 0, out), KV_EINVAL);
    int64_t neg[2] = {-1, 2};
    CHECK_EQ_INT(kv_hash_offsets64((const uint8_t *)buf, neg, 1, 0, out), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_offsets32(NULL, off32, NW, 0, out), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_offsets32((const uint8_t *)buf, NULL, 1, 0, out), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_offsets64((const uint8_t *)buf, off64, -1, 0, out), KV_EINVAL);
}

static void test_fixed(void) {
    /* numpy 'S8': trailing NULs are not part of the id; inner NULs are */
    uint8_t buf[4 * 8] = {0};
    memcpy(buf + 8, "a", 1);
    memcpy(buf + 16, "abc", 3);
    memcpy(buf + 24, "68fd1e64", 8);
    int64_t out[4];
    CHECK_EQ_INT(kv_hash_fixed(buf, 8, 4, 0, out), KV_OK);
    for (int i = 0; i < 4; i++) CHECK((uint64_t)out[i] == WANT[i]);
    uint8_t inner[4] = {'a', 0, 'b', 0};
    int64_t s = 0, l = 3, want;
    CHECK_EQ_INT(kv_hash_strings(inner, &s, &l, 1, 0, &want), KV_OK);
    CHECK_EQ_INT(kv_hash_fixed(inner, 4, 1, 0, out), KV_OK);
    CHECK(out[0] == want);
    CHECK_EQ_INT(kv_hash_fixed(NULL, 0, 2, 0, out), KV_OK); /* 'S0': empty ids */
    CHECK((uint64_t)out[0] == WANT[0]);
    CHECK_EQ_INT(kv_hash_fixed(buf, -1, 1, 0, out), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_fixed(NULL, 8, 1, 0, out), KV_EINVAL);
}

/* UTF-8 bytes of a code point list, by hand, for the reference keys */
static void test_ucs4(void) {
    /* "a", "ü" (2 bytes), "日" (3 bytes), "🙂" (4 bytes), "" ; width 2 with NUL padding */
    const uint32_t chars[5 * 2] = {'a', 0, 0xFC, 'x', 0x65E5, 0, 0x1F642, 0, 0, 0};
    const char *utf8[5] = {"a", "\xc3\xbc" "x", "\xe6\x97\xa5", "\xf0\x9f\x99\x82", ""};
    int64_t out[5], want[5], bad = 7;
    for (int i = 0; i < 5; i++) {
        int64_t s = 0, l = (int64_t)strlen(utf8[i]);
        CHECK_EQ_INT(kv_hash_strings((const uint8_t *)utf8[i], &s, &l, 1, 0, &want[i]), KV_OK);
    }
    CHECK_EQ_INT(kv_hash_ucs4(chars, 2, 5, 0, out, &bad), KV_OK);
    CHECK_EQ_INT(bad, -1);
    for (int i = 0; i < 5; i++) CHECK(out[i] == want[i]);
    CHECK((uint64_t)out[0] == WANT[1] && (uint64_t)out[4] == WANT[0]);
    /* a lone surrogate and a value above U+10FFFF cannot be UTF-8 */
    const uint32_t sur[3] = {'a', 0xD800, 0x110000};
    CHECK_EQ_INT(kv_hash_ucs4(sur, 1, 3, 0, out, &bad), KV_EINVAL);
    CHECK_EQ_INT(bad, 1);
    CHECK_EQ_INT(kv_hash_ucs4(sur + 2, 1, 1, 0, out, &bad), KV_EINVAL);
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(kv_hash_ucs4(NULL, 0, 3, 0, out, &bad), KV_OK); /* 'U0' */
    CHECK((uint64_t)out[2] == WANT[0]);
    CHECK_EQ_INT(kv_hash_ucs4(chars, 2, 1, 0, out, NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_ucs4(chars, -2, 1, 0, out, &bad), KV_EINVAL);
    /* the scratch buffer's allocation failing is KV_ENOMEM, not a crash */
    fail_alloc_install();
    fail_alloc_arm(1);
    CHECK_EQ_INT(kv_hash_ucs4(chars, 2, 5, 0, out, &bad), KV_ENOMEM);
    fail_alloc_arm(0);
    kv_set_allocator(NULL, NULL, NULL);
}

/* FarmHash Fingerprint64 reference values: what TensorFlow 2.21's tf.fingerprint gives
 * for these strings (its 8 bytes read little-endian); "" is FarmHash's k2. */
static const char *FWORDS[] = {"", "a", "abc", "68fd1e64",
                               "hello world, this is a longer string of 40+ bytes",
                               "xxxxxxxxxxxxxxxxx", "0123456789abcdef"};
static const uint64_t FWANT[] = {0x9ae16a3b2f90404fULL, 0xb3454265b6df75e3ULL,
                                 0x24a5b3a074e7f369ULL, 0x6dea854a18f8ca86ULL,
                                 0x3f314df07cf219b5ULL, 0x9ce745a1f3812fa5ULL,
                                 0x54b961e5dc834067ULL};
#define NF 7

static uint64_t farm1(const uint8_t *p, int64_t len) {
    int64_t s = 0, out;
    CHECK_EQ_INT(kv_hash_strings(p, &s, &len, 1, KV_ID_FARMHASH64, &out), KV_OK);
    return (uint64_t)out;
}

static void test_farmhash(void) {
    for (int i = 0; i < NF; i++)
        CHECK(farm1((const uint8_t *)FWORDS[i], (int64_t)strlen(FWORDS[i])) == FWANT[i]);
    /* bytes 0..99: the long (> 64 bytes) path */
    uint8_t seq[256];
    for (int i = 0; i < 256; i++) seq[i] = (uint8_t)i;
    CHECK(farm1(seq, 100) == 0x3cff0f886d8d6195ULL);
    /* every length 0..200 of one pattern (each path and every tail length), folded:
     * h = rotl(h, 5) ^ key, against the same fold of tf.fingerprint's keys */
    for (int i = 0; i < 256; i++) seq[i] = (uint8_t)(i * 131 + 7);
    uint64_t h = 0;
    for (int k = 0; k <= 200; k++) h = ((h << 5) | (h >> 59)) ^ farm1(seq, k);
    CHECK(h == 0xb660b8c90d03a4f7ULL);
    /* UTF-8: "ü", "日本", "🙂x" */
    const char *u[3] = {"\xc3\xbc", "\xe6\x97\xa5\xe6\x9c\xac", "\xf0\x9f\x99\x82x"};
    const uint64_t uwant[3] = {0x35e423784da23503ULL, 0x4ec82a69b1a34bcbULL,
                               0x14698c163c80dec7ULL};
    for (int i = 0; i < 3; i++) CHECK(farm1((const uint8_t *)u[i], (int64_t)strlen(u[i])) == uwant[i]);
    /* the same keys in every layout: offsets (at an odd start), fixed width, UCS-4 */
    char buf[256] = "q";
    int32_t off32[NF + 1];
    int64_t off64[NF + 1], out[NF];
    off32[0] = 1;
    for (int i = 0; i < NF; i++) {
        memcpy(buf + off32[i], FWORDS[i], strlen(FWORDS[i]));
        off32[i + 1] = off32[i] + (int32_t)strlen(FWORDS[i]);
    }
    for (int i = 0; i <= NF; i++) off64[i] = off32[i];
    CHECK_EQ_INT(kv_hash_offsets32((const uint8_t *)buf, off32, NF, KV_ID_FARMHASH64, out), KV_OK);
    for (int i = 0; i < NF; i++) CHECK((uint64_t)out[i] == FWANT[i]);
    memset(out, 0, sizeof out);
    CHECK_EQ_INT(kv_hash_offsets64((const uint8_t *)buf, off64, NF, KV_ID_FARMHASH64, out), KV_OK);
    for (int i = 0; i < NF; i++) CHECK((uint64_t)out[i] == FWANT[i]);
    uint8_t fixed[4 * 8] = {0};
    memcpy(fixed + 8, "a", 1);
    memcpy(fixed + 16, "abc", 3);
    memcpy(fixed + 24, "68fd1e64", 8);
    CHECK_EQ_INT(kv_hash_fixed(fixed, 8, 4, KV_ID_FARMHASH64, out), KV_OK);
    for (int i = 0; i < 4; i++) CHECK((uint64_t)out[i] == FWANT[i]);
    const uint32_t chars[3 * 2] = {0xFC, 0, 0x65E5, 0x672C, 0x1F642, 'x'};
    int64_t bad = 7;
    CHECK_EQ_INT(kv_hash_ucs4(chars, 2, 3, KV_ID_FARMHASH64, out, &bad), KV_OK);
    CHECK_EQ_INT(bad, -1);
    for (int i = 0; i < 3; i++) CHECK((uint64_t)out[i] == uwant[i]);
    CHECK_EQ_INT(kv_hash_ucs4(NULL, 0, 2, KV_ID_FARMHASH64, out, &bad), KV_OK); /* 'U0' */
    CHECK((uint64_t)out[1] == FWANT[0]);
    CHECK_EQ_INT(kv_hash_fixed(NULL, 0, 1, 5, out), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_ucs4(chars, 2, 1, 5, out, &bad), KV_EINVAL);
    int64_t s0 = 0, l0 = 0;
    CHECK_EQ_INT(kv_hash_strings(NULL, &s0, &l0, 1, 5, out), KV_EINVAL);
}

static void test_hex(void) {
    /* column 0: every kind of id; column 1: all good but row 6, so the first bad row's
     * column is the lower one (row 5: column 0) */
    const char *ids0[] = {"68fd1e64", "", "0", "FFFFFFFF", "abc", "123456789", "12g4", "-1"};
    const char *ids1[] = {"1", "2", "3", "4", "5", "6", "zz", "8"};
    enum { N = 8 };
    char buf0[64], buf1[64];
    int32_t off0[N + 1] = {0}, off1[N + 1] = {0};
    for (int i = 0; i < N; i++) {
        memcpy(buf0 + off0[i], ids0[i], strlen(ids0[i]));
        off0[i + 1] = off0[i] + (int32_t)strlen(ids0[i]);
        memcpy(buf1 + off1[i], ids1[i], strlen(ids1[i]));
        off1[i + 1] = off1[i] + (int32_t)strlen(ids1[i]);
    }
    const uint8_t *bytes[2] = {(const uint8_t *)buf0, (const uint8_t *)buf1};
    const int32_t *offs[2] = {off0, off1};
    const int64_t missing = (int64_t)1 << 32;
    const int64_t bases[2] = {(int64_t)3 << 33, (int64_t)4 << 33};
    int64_t out[2 * 10], n_bad = -5, first[2] = {-5, -5};
    uint8_t bad[N];
    CHECK_EQ_INT(kv_hex_ids32(2, N, bytes, offs, bases, missing, out, 10, bad, &n_bad, first),
                 KV_OK);
    const int64_t base = bases[0];
    CHECK(out[0] == (base | 0x68fd1e64));
    CHECK(out[1] == (base | missing));
    CHECK(out[2] == base);
    CHECK(out[3] == (base | 0xFFFFFFFFLL));
    CHECK(out[4] == (base | 0xabc));
    for (int i = 5; i < N; i++) CHECK(out[i] == (base | missing));
    CHECK(out[10] == (bases[1] | 1) && out[17] == (bases[1] | 8));
    CHECK(out[16] == (bases[1] | missing));
    CHECK_EQ_INT(n_bad, 3);  /* rows 5, 6, 7 (row 6 bad in both columns counts once) */
    CHECK_EQ_INT(first[0], 5);
    CHECK_EQ_INT(first[1], 0);
    for (int i = 0; i < N; i++) CHECK_EQ_INT(bad[i], i >= 5);
    /* without bad[], bad ids are counted: 3 in column 0, 1 in column 1 */
    CHECK_EQ_INT(kv_hex_ids32(2, N, bytes, offs, bases, missing, out, 10, NULL, &n_bad, first),
                 KV_OK);
    CHECK_EQ_INT(n_bad, 4);
    /* only column 1: its first bad id is row 6 */
    CHECK_EQ_INT(kv_hex_ids32(1, N, bytes + 1, offs + 1, bases + 1, missing, out, N, NULL,
                              &n_bad, first), KV_OK);
    CHECK(first[0] == 6 && first[1] == 0 && n_bad == 1);
    /* bad arguments */
    CHECK_EQ_INT(kv_hex_ids32(2, N, bytes, offs, bases, missing, out, N - 1, NULL, &n_bad,
                              first), KV_EINVAL);
    CHECK_EQ_INT(kv_hex_ids32(2, N, bytes, offs, bases, missing, out, 10, NULL, NULL, first),
                 KV_EINVAL);
    int32_t down[3] = {4, 2, 2};
    const int32_t *offs_down[1] = {down};
    CHECK_EQ_INT(kv_hex_ids32(1, 2, bytes, offs_down, bases, missing, out, 2, NULL, &n_bad,
                              first), KV_EINVAL);
    const uint8_t *nobytes[1] = {NULL};
    CHECK_EQ_INT(kv_hex_ids32(1, N, nobytes, offs, bases, missing, out, N, NULL, &n_bad,
                              first), KV_EINVAL);
    /* every 8-digit id the unrolled path reads, against the loop (7 digits + a prefix) */
    uint64_t seed = 9;
    for (int r = 0; r < 2000; r++) {
        char s8[9], s7[8];
        uint32_t v = (uint32_t)test_rand(&seed);
        snprintf(s8, sizeof s8, (r & 1) ? "%08X" : "%08x", v);
        snprintf(s7, sizeof s7, "%07x", v & 0x0FFFFFFF);
        int32_t o8[2] = {0, 8}, o7[2] = {0, 7};
        const uint8_t *b8[1] = {(const uint8_t *)s8}, *b7[1] = {(const uint8_t *)s7};
        const int32_t *p8[1] = {o8}, *p7[1] = {o7};
        int64_t zero = 0, x8, x7;
        CHECK_EQ_INT(kv_hex_ids32(1, 1, b8, p8, &zero, missing, &x8, 1, NULL, &n_bad, first),
                     KV_OK);
        CHECK_EQ_INT(kv_hex_ids32(1, 1, b7, p7, &zero, missing, &x7, 1, NULL, &n_bad, first),
                     KV_OK);
        CHECK(x8 == (int64_t)v && x7 == (int64_t)(v & 0x0FFFFFFF));
    }
}

int main(void) {
    test_hash_strings();
    test_offsets();
    test_fixed();
    test_ucs4();
    test_farmhash();
    test_hex();
    return test_summary();
}
