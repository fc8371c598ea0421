/*
 * kv_synth.h - the per-sample kernel of kvcoll.data.SyntheticCTR (synthetic CTR data
 * with Zipf ids and a planted logistic model); kvcoll/data/synthetic.py documents the
 * data set and derives every parameter below from the seed.
 *
 * Sample g of a stream (g any uint64) is a pure function of (parameters, keys, g):
 *   h[c]   = splitmix64_finaliser(g * 0x9E3779B97F4A7C15 + keys[c]), one hash per
 *            channel c: F categorical fields, then D numbers, then the label;
 *   rank_f = min(floor(x) - 1, vocab_f - 1), u = (h[f] >> 11) * 2^-53 and
 *            x = pow(1 + u * zipf_c[f], zipf_exponent), or exp(u * zipf_c[f]) when
 *            log_uniform, as libm computes them (see kv_synth.c: an inline log and exp
 *            compute x, and libm's pow or exp where that could change the rank);
 *   id_f   = offsets[f] + perm_f(rank_f) (see kv_synth_perm_t);
 *   num_j  = log1p(exp(mu_j + sigma_j * sqrt(-2 log u1) * cos(2 pi u2))) in float32
 *            steps, u1 = ((h[F + j] >> 40) + 0.5) * 2^-24, u2 = its low 24 bits * 2^-24
 *            (inline float functions, about an ulp each);
 *   logit  = the planted model's float32 logit of the ranks and numbers (kv_synth.c's
 *            block_logit) + bias, in double;
 *   label  = (h[F + D] >> 11) * 2^-53 < 0.5 * (1 + tanh(logit / 2)) (libm's tanh,
 *            exactly: kv_synth.c).
 * Nothing depends on the other samples of a call, so any range of samples is bit for
 * bit the same whichever call, block, thread or KV_SYNTH_ISA_* copy generates it.
 *
 * Every array is the caller's and only read; no function keeps state or locks:
 * all are thread-safe.
 */
#ifndef KV_SYNTH_H
#define KV_SYNTH_H

#include <stdint.h>
#include "kv_status.h"

#define KV_SYNTH_PERM_ROUNDS 3   /* rounds of the id scrambling (A B A B A) */
#define KV_SYNTH_PARTS 4         /* width of the planted interaction vectors */

/* Which compiled copy of the kernel runs (kv_synth_t.isa). All give the same bits. */
#define KV_SYNTH_ISA_BEST 0      /* the fastest this CPU runs (the default) */
#define KV_SYNTH_ISA_BASE 1      /* baseline (x86-64: SSE2) */
#define KV_SYNTH_ISA_AVX2 2      /* x86-64 with AVX2 */
#define KV_SYNTH_ISA_AVX512 3    /* x86-64 with AVX-512 F, DQ, VL, BW */

/*
 * Per-field bijections of [0, vocab_f). With M = mask + 1 the largest power of two
 * <= vocab_f, round r of A maps x < M to
 *     y = (x + add) & mask; y ^= y >> shift; y = (y * mul) & mask; y ^= y >> shift
 * and leaves x >= M alone; B is x -> (x + rot) mod vocab_f. perm = A0 B0 A1 B1 A2.
 * Arrays are field-major inside a round: add[r * F + f].
 */
typedef struct kv_synth_perm {
    int32_t num_fields;   /* F >= 1 */
    const uint64_t *vocab; /* [F] 1 <= vocab < 2^62 */
    const uint64_t *mask;  /* [F] M - 1 */
    const uint64_t *shift; /* [F] 1 <= shift <= 63, 2 * shift >= log2(M) */
    const uint64_t *add;   /* [ROUNDS][F] <= mask */
    const uint64_t *mul;   /* [ROUNDS][F] odd */
    const uint64_t *inv;   /* [ROUNDS][F] mul * inv == 1 (mod 2^64) */
    const uint64_t *rot;   /* [ROUNDS - 1][F] < vocab */
} kv_synth_perm_t;

/* The generator's parameters (F = perm.num_fields categorical fields, D numbers). */
typedef struct kv_synth {
    kv_synth_perm_t perm;
    int32_t num_numeric;      /* D >= 0 */
    int32_t log_uniform;      /* 0: power law, 1: log-uniform ranks (zipf_a == 1) */
    int32_t isa;              /* KV_SYNTH_ISA_*: BEST, or a level <= kv_synth_best_isa() */
    double zipf_exponent;     /* 1 / (1 - zipf_a), finite and non-zero (power law) */
    const double *zipf_c;     /* [F] power law: (vocab+1)^(1-a) - 1 >= -1;
                                 log-uniform: log(vocab + 1), in [0, 64] */
    const int64_t *offsets;   /* [F] >= 0, offsets + vocab <= 2^62 */
    const uint64_t *param_keys; /* [F] hash keys of the planted weights and vectors */
    const float *w_mul;       /* [F] weight = (16-bit part * w_mul - w_sub) * decay */
    const float *w_sub;       /* [F] */
    const float *v_mul;       /* [F] vector component = 12-bit part * (decay * v_mul) */
    const float *v_sub;       /* [F]                     - decay * v_sub */
    const float *mu;          /* [D] in [-16, 16] */
    const float *sigma;       /* [D] in [0, 8] */
    const float *center;      /* [D] numeric term = sum_j (num_j - center_j) * beta_j */
    const float *beta;        /* [D] */
    double bias;              /* added to the float32 logit, in double */
} kv_synth_t;

/* The highest KV_SYNTH_ISA_* level this CPU (and this build) runs. */
int kv_synth_best_isa(void);

/* KV_OK if p (or m) is consistent as documented above, else KV_EINVAL. */
int kv_synth_perm_check(const kv_synth_perm_t *p);
int kv_synth_check(const kv_synth_t *m);

/*
 * out[i][f] = perm_f(in[i][f]) (inverse == 0) or perm_f^-1(in[i][f]) (inverse != 0),
 * for n rows of F values; in and out may be the same array. Returns KV_OK, or
 * KV_EINVAL (out untouched) for a bad p or n, NULL buffers or a value >= vocab_f.
 */
int kv_synth_permute(const kv_synth_perm_t *p, const uint64_t *in, int64_t n, int32_t inverse,
                     uint64_t *out);

/*
 * Samples first, first + 1, ..., first + n - 1 (mod 2^64) of the stream whose channel
 * keys are keys[F + D + 1]:
 *   categorical[n][F]  global ids (required)
 *   numeric[n][D]      numbers (required unless D == 0)
 *   label[n]           0.0f or 1.0f (NULL: not wanted)
 *   logit[n]           the planted logit the labels are drawn from (NULL: not wanted)
 * Scratch memory (about 2 KiB per field and number) is allocated and freed inside.
 * Returns KV_OK, KV_EINVAL (bad m or arguments) or KV_ENOMEM.
 */
int kv_synth_samples(const kv_synth_t *m, const uint64_t *keys, uint64_t first, int64_t n,
                     int64_t *categorical, float *numeric, float *label, double *logit);

/*
 * logit[i] = the planted logit of ranks[i][F] (ranks, not ids: see kv_synth_permute)
 * and numeric[i][D], computed by the same code as kv_synth_samples' labels, so a
 * sample's logit is bit for bit the one its label was drawn from.
 * Returns KV_OK, KV_EINVAL (bad m, n, NULL buffers, a rank >= vocab_f) or KV_ENOMEM.
 */
int kv_synth_logit(const kv_synth_t *m, const uint64_t *ranks, const float *numeric, int64_t n,
                   double *logit);

#endif
