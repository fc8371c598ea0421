/*
 * kv_wire.h - 16-bit floats for the exchange's payloads: rows and row gradients may
 * cross the wire as IEEE binary16 (fp16) or bfloat16 (bf16) instead of float32.
 *
 * Only the payload is narrow: tables, gradient sums and the row optimizers stay
 * float32. A sender packs the float32 rows (or gradients) it sends into 16-bit values
 * (kv_wire_pack, one call per payload), the receiver unpacks them into float32
 * (kv_wire_unpack), exactly: every fp16 and bf16 value is a float32 value.
 *
 * Rounding: to nearest, ties to even (IEEE's default), for both formats, with plain
 * integer and float arithmetic that gives the same bits on every CPU (no F16C or
 * AVX-512 BF16 instruction, no _Float16: compilers without them get the same code).
 *
 *   fp16: 1 sign, 5 exponent, 10 mantissa bits. Largest finite 65504; smallest
 *         normal 2^-14 (6.1e-5); subnormals down to 2^-24 (6.0e-8), below which a
 *         value rounds to (signed) zero. A finite float32 whose magnitude is 65520 or
 *         more (the midpoint between 65504 and 2^16, which rounds to the even side)
 *         does not fit: it becomes +-Inf and is reported as an overflow (below).
 *   bf16: the top 16 bits of a float32, rounded: float32's exponent range (largest
 *         finite 3.3895e38), 8 significant bits. Only a finite float32 of magnitude
 *         3.3961e38 (0x7f7f8000) or more overflows to +-Inf. Float32 subnormals round
 *         to bf16 subnormals (integer rounding, unaffected by flush-to-zero modes).
 *   Inf stays Inf (with its sign); NaN stays NaN (its sign kept, made quiet; fp16
 *   keeps no payload).
 *
 * Overflows are reported, never hidden: *first says where the first finite value that
 * became Inf is, and the caller decides (kvcoll refuses the step on every rank with an
 * error naming the table, the key and the fix). Saturating to the largest finite value
 * instead would train on a silently clipped value.
 *
 * The kernels are compiled for x86-64's baseline, AVX2 and AVX-512 (picked at run time,
 * as kv_init.c's are); every copy gives the same bits. With a pool (kv_pool.h; NULL: the
 * calling thread) a large payload is split into ranges over its threads. Thread-safe:
 * no state.
 */
#ifndef KV_WIRE_H
#define KV_WIRE_H

#include <stdint.h>
#include "kv_pool.h"
#include "kv_status.h"

#define KV_WIRE_F32 0  /* float32: no conversion (the default; not a 16-bit format) */
#define KV_WIRE_F16 1  /* IEEE 754 binary16 */
#define KV_WIRE_BF16 2 /* bfloat16 */

/*
 * Pack n floats into 16-bit values of format fmt (KV_WIRE_F16 or KV_WIRE_BF16),
 * rounding to nearest even.
 *   in, out    n values each (n >= 0; may be NULL when n == 0); they must not overlap
 *   first      out: the index of the first finite input that does not fit the format
 *              (it was written as +-Inf), or -1 if none
 * Returns KV_OK or KV_EINVAL (fmt, n, NULL pointers). Every output is written either way
 * on KV_OK.
 */
int kv_wire_pack(kv_pool_t *pool, int32_t fmt, const float *in, int64_t n, uint16_t *out,
                 int64_t *first);

/*
 * Unpack n 16-bit values of format fmt into floats (exact).
 *   first      out: the index of the first value that is NaN or Inf, or -1 if none (a
 *              row or gradient kvcoll sends is finite, so one that arrives as Inf
 *              overflowed at its sender)
 * Returns KV_OK or KV_EINVAL.
 */
int kv_wire_unpack(kv_pool_t *pool, int32_t fmt, const uint16_t *in, int64_t n, float *out,
                   int64_t *first);

/*
 * A payload of segments (one per destination rank), the exchange's format. bf16: the
 * values of every segment, packed plainly (as kv_wire_pack), one after another. fp16:
 * each non-empty segment is [k][its n values times 2^k, packed], k an int16 (stored as
 * its uint16 bits), chosen from the segment's largest finite magnitude m so that
 * m * 2^k lies in [2^14, 2^15) (k = 14 - floor(log2 m), within [-126, 126]; 0 when the
 * segment holds no nonzero finite value). Multiplying by a power of two is exact, so a
 * value's only rounding is fp16's 11 significant bits, relative to its segment's largest:
 * gradients far below fp16's smallest normal (6.1e-5; a mean loss over a large batch
 * gives such) keep their precision instead of rounding to subnormals or zero, and no
 * finite value can overflow. An empty segment takes no wire value.
 *   seg[nseg]   values per segment (>= 0)
 *   in, out     pack: sum(seg) floats in, kv_wire_segments_len() wire values out;
 *               unpack: the reverse
 *   first       out: pack, the index (in the floats) of the first finite value that
 *               overflowed (only bf16, near float32's largest), or -1; unpack, the index
 *               of the first NaN/Inf value written, or -1
 * Returns KV_OK, KV_EINVAL, KV_ENOMEM.
 */
#define KV_WIRE_MAX_EXP 126
int kv_wire_pack_segments(kv_pool_t *pool, int32_t fmt, const float *in, const int64_t *seg,
                          int64_t nseg, uint16_t *out, int64_t *first);
int kv_wire_unpack_segments(kv_pool_t *pool, int32_t fmt, const uint16_t *in,
                            const int64_t *seg, int64_t nseg, float *out, int64_t *first);

/* The exponent k an fp16 segment of these n values gets (see above). */
int32_t kv_wire_exponent(const float *in, int64_t n);

/* One value, for tests and for Python's error messages: the same conversions. */
uint16_t kv_wire_from_float(int32_t fmt, float x);
float kv_wire_to_float(int32_t fmt, uint16_t h);

/* Which compiled copy the kernels use (as kv_init.h numbers them: 1 baseline, 2 AVX2,
 * 3 AVX-512); kv_wire_pack_isa/kv_wire_unpack_isa run a given copy (tests: every copy
 * must give the same bits). KV_EINVAL for a copy this CPU or build does not run. */
int kv_wire_best_isa(void);
int kv_wire_pack_isa(int32_t isa, int32_t fmt, const float *in, int64_t n, uint16_t *out,
                     int64_t *first);
int kv_wire_unpack_isa(int32_t isa, int32_t fmt, const uint16_t *in, int64_t n, float *out,
                       int64_t *first);

#endif
