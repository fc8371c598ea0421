/*
 * kv_optim.h - row optimizers applied in C, one row (or a block of rows) at a time.
 *
 * A row optimizer owns `kv_optim_slot_floats(o, dim)` floats of state per row, laid
 * out right after the row's embedding in the table arena (and, for dense
 * parameters in SSP/ASP, beside a flat parameter vector). The rules and the slot
 * layout of each kind are documented in kv_optim.c next to the code.
 *
 *   KV_OPT_SGD            w -= lr * g                                    slots: none
 *   KV_OPT_ADAGRAD        TF ResourceSparseApplyAdagradV2 (epsilon
 *                         outside the sqrt), or Keras 3's Adagrad (inside,
 *                         flag KV_OPTF_EPS_INSIDE_SQRT)                  slots: accum[dim]
 *   KV_OPT_ADAM           TF Adam (bias correction from the step)        slots: m[dim] v[dim] step
 *   KV_OPT_FTRL           TF ResourceSparseApplyFtrlV2 (l1, l2,
 *                         l2_shrinkage, lr_power), plus Keras' beta      slots: accum[dim] linear[dim]
 *   KV_OPT_GROUP_ADAM     TFPlus Group Adam (l1, l2, l21)                see kv_optim.c
 *   KV_OPT_GROUP_ADAGRAD  TFPlus Group Adagrad / sparse group FTRL       see kv_optim.c
 *   KV_OPT_ROWWISE_ADAGRAD  FBGEMM's EXACT_ROWWISE_ADAGRAD (TorchRec's
 *                         RowWiseAdagrad): one accumulator per row, fed
 *                         the mean of g^2 over the row; weight decay
 *                         none, L2 or decoupled (flags KV_OPTF_WD_*)     slots: accum (1)
 *
 * The hyperparameters may change between calls (a learning-rate schedule): nothing
 * derived from them is cached in the slots, so every call uses the values in `o` as
 * they are then (FTRL's beta / (2 lr) included).
 *
 * No function here locks or keeps global state: all are thread-safe as long as two
 * threads do not update the same row at once (the table's lock sees to that).
 */
#ifndef KV_OPTIM_H
#define KV_OPTIM_H

#include <stdint.h>
#include "kv_status.h"

#define KV_OPT_SGD 0
#define KV_OPT_ADAGRAD 1
#define KV_OPT_ADAM 2
#define KV_OPT_FTRL 3
#define KV_OPT_GROUP_ADAM 4
#define KV_OPT_GROUP_ADAGRAD 5
#define KV_OPT_ROWWISE_ADAGRAD 6

/* kv_optim_t.flags (bits) */
#define KV_OPTF_EPS_INSIDE_SQRT 1 /* Adagrad only: w -= lr g / sqrt(accum + epsilon)
                                     (Keras 3) instead of / (sqrt(accum) + epsilon) (TF) */
#define KV_OPTF_WD_L2 2           /* Row-wise Adagrad only: FBGEMM's weight_decay_mode L2
                                     (weight_decay * w joins the gradient) */
#define KV_OPTF_WD_DECOUPLED 4    /* Row-wise Adagrad only: FBGEMM's DECOUPLE mode
                                     (w shrinks by lr * weight_decay); not with WD_L2 */

typedef struct kv_optim {
    int32_t kind;          /* KV_OPT_* */
    int32_t per_row_step;  /* Adam, Group Adam: 1 = bias correction from the row's own
                              update count (kept in a slot), 0 = from the step argument */
    int32_t flags;         /* KV_OPTF_* bits; a flag given to a kind it does not apply
                              to is an error */
    float lr;              /* learning rate, > 0 */
    float beta1;           /* Adam, Group Adam: first-moment decay, [0, 1) */
    float beta2;           /* Adam, Group Adam: second-moment decay, [0, 1) */
    float epsilon;         /* Adagrad, Adam, Group Adam: >= 0 */
    float initial_accumulator; /* Adagrad, FTRL, Group Adagrad (and Group Adam's v): >= 0 */
    float lr_power;        /* FTRL, Group Adagrad: <= 0, usually -0.5 */
    float l1;              /* FTRL, Group Adam, Group Adagrad: >= 0 */
    float l2;              /* FTRL, Group Adam, Group Adagrad: >= 0 */
    float l21;             /* Group Adam, Group Adagrad: group lasso strength, >= 0 */
    float l2_shrinkage;    /* FTRL, Group Adagrad: >= 0 */
    float beta;            /* FTRL: Keras' beta, adds beta / (2 lr) to l2 (with the lr of
                              each call), >= 0 */
    float weight_decay;    /* Row-wise Adagrad: FBGEMM's weight_decay, >= 0; > 0 needs one
                              of the KV_OPTF_WD_* modes (it would be ignored without),
                              and every other kind needs 0 */
} kv_optim_t;

/* KV_OK if kind and hyperparameters are valid, else KV_EOPTIM. Thread-safe. */
int kv_optim_check(const kv_optim_t *o);

/* Floats of optimizer state per row of width dim (0 for SGD). Assumes a checked o. */
int32_t kv_optim_slot_floats(const kv_optim_t *o, int32_t dim);

/* Write the initial state of one row's slots (initial accumulator, zeros, step 0). */
void kv_optim_init_slots(const kv_optim_t *o, int32_t dim, float *slots);

/*
 * Apply one summed gradient to `nrows` consecutive rows of width dim:
 *   w[nrows][dim]       parameters, updated in place
 *   slots[nrows][S]     state, S = kv_optim_slot_floats(o, dim), updated in place
 *   g[nrows][dim]       gradient (already summed over duplicates, finite)
 *   step                the training step, >= 1 (Adam's bias correction unless
 *                       per_row_step)
 * The caller has checked o and that g is finite. Returns nothing: cannot fail.
 */
void kv_optim_apply_rows(const kv_optim_t *o, int32_t dim, int64_t nrows, float *w,
                         float *slots, const float *g, int64_t step);

#endif
