/*
 * kv_ids.h - string and hex ids to int64 keys, one call per column of ids.
 *
 * String ids become keys through one of two published 64-bit hashes of their UTF-8
 * bytes, chosen per call by `hash`:
 *   KV_ID_FARMHASH64  FarmHash Fingerprint64 (github.com/google/farmhash; farmhashna's
 *                     Hash64): what TensorFlow's tf.fingerprint computes for a string,
 *                     so a SavedModel hashes raw strings in its graph. The default for
 *                     new models.
 *   KV_ID_XXH64       XXH64 with seed 0 (github.com/Cyan4973/xxHash, XXH64 spec): what
 *                     every model used before, kept so their checkpoints keep their keys.
 * out[i] = (int64) hash(bytes of id i). Equal byte strings get equal keys on every rank,
 * run and machine under one hash; the two hashes give unrelated keys, so a model's hash
 * is part of its state (kvcoll records it in its checkpoints). For n distinct strings
 * the chance that any two share a key is about n(n-1)/2^65 for either (birthday bound,
 * ~2.7e-4 at 10^8 strings, ~2.7 % at 10^9).
 *
 * One function per memory layout a reader hands over, each reading the caller's
 * buffers in place (no copy, no per-id call from Python):
 *   kv_hash_strings     bytes + starts[n] + lens[n]         (any layout)
 *   kv_hash_offsets32   bytes + offsets[n + 1], int32       (Arrow string / binary)
 *   kv_hash_offsets64   bytes + offsets[n + 1], int64       (Arrow large_string / large_binary)
 *   kv_hash_fixed       n ids of `width` bytes, trailing NULs dropped (numpy 'S<width>')
 *   kv_hash_ucs4        n ids of `width` UCS-4 code points, trailing NULs dropped,
 *                       encoded to UTF-8 first (numpy 'U<width>', native byte order)
 * and kv_hex_ids32, Criteo's hexadecimal categorical values (Arrow offsets layout,
 * every categorical column of a parsed block in one call) to `base | value` keys.
 *
 * Offsets follow Arrow: id i is bytes[offsets[i] .. offsets[i + 1]); offsets must
 * start at >= 0 and never decrease (checked: KV_EINVAL otherwise). `bytes` may be NULL
 * when every id is empty.
 *
 * None of these functions lock anything or keep state: all are thread-safe, and the
 * Python bindings release the GIL while they run.
 */
#ifndef KV_IDS_H
#define KV_IDS_H

#include <stdint.h>
#include "kv_status.h"

/* The string hashes (the `hash` argument). */
#define KV_ID_XXH64 0
#define KV_ID_FARMHASH64 1

/* Every function below returns KV_EINVAL for a `hash` other than KV_ID_XXH64 and
 * KV_ID_FARMHASH64. */

/* out[i] = hash(bytes[starts[i] .. starts[i] + lens[i])).
 * Returns KV_OK or KV_EINVAL (negative n, start or length, NULL buffers). */
int kv_hash_strings(const uint8_t *bytes, const int64_t *starts, const int64_t *lens,
                    int64_t n, int32_t hash, int64_t *out);

/* out[i] = hash(bytes[offsets[i] .. offsets[i + 1])), offsets[n + 1].
 * Returns KV_OK or KV_EINVAL (negative n, NULL buffers, decreasing offsets). */
int kv_hash_offsets32(const uint8_t *bytes, const int32_t *offsets, int64_t n, int32_t hash,
                      int64_t *out);
int kv_hash_offsets64(const uint8_t *bytes, const int64_t *offsets, int64_t n, int32_t hash,
                      int64_t *out);

/* out[i] = hash of bytes[i * width .. (i + 1) * width) without its trailing NUL bytes
 * (numpy's rule for 'S' arrays). Returns KV_OK or KV_EINVAL (negative n or width, NULL). */
int kv_hash_fixed(const uint8_t *bytes, int64_t width, int64_t n, int32_t hash, int64_t *out);

/* out[i] = hash of the UTF-8 encoding of chars[i * width .. (i + 1) * width) without
 * its trailing NUL code points (numpy's rule for 'U' arrays). A code point that UTF-8
 * cannot encode (a surrogate, D800-DFFF, or above 10FFFF) stops the call: *bad is set
 * to its id's index and KV_EINVAL returned (out is then partly written); otherwise
 * *bad = -1. Scratch: one buffer of 4 * width bytes, allocated and freed inside.
 * Returns KV_OK, KV_EINVAL (also for bad arguments, with *bad = -1) or KV_ENOMEM. */
int kv_hash_ucs4(const uint32_t *chars, int64_t width, int64_t n, int32_t hash, int64_t *out,
                 int64_t *bad);

/*
 * Hexadecimal ids (Criteo's categorical values, "68fd1e64"; upper or lower case, at
 * most 8 digits, so a value is below 2^32) of `ncols` columns of n rows, each in
 * Arrow's offsets layout (bytes[c], offsets[c][n + 1]), into out[c * out_stride + i]:
 *   base[c] | value         id i of column c is a hex string of 1 to 8 digits
 *   base[c] | missing       it is empty
 *   base[c] | missing, bad  anything else
 * bad[i] (when bad is not NULL) is 1 for the rows with any bad id; *n_bad counts bad
 * rows when bad is given, bad ids otherwise; first_bad[0..1] is the (row, column) of
 * the bad id in the lowest row (lowest column among equals), or -1, -1. Bad data is not
 * an error of the call: the caller decides (raise, or skip the rows). One call covers a
 * whole parsed block of every categorical column.
 * Returns KV_OK or KV_EINVAL (negative sizes, NULL buffers, decreasing offsets,
 * out_stride < n).
 */
int kv_hex_ids32(int32_t ncols, int64_t n, const uint8_t *const *bytes,
                 const int32_t *const *offsets, const int64_t *bases, int64_t missing,
                 int64_t *out, int64_t out_stride, uint8_t *bad, int64_t *n_bad,
                 int64_t *first_bad);

#endif
