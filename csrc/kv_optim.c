/*
 * kv_optim.c - the row optimizers: one summed gradient applied to one row at a time.
 *
 * Every rule below is a lazy, per-row version of a published kernel: a row that is
 * not in the batch keeps its value and its slots untouched, and a row that is in the
 * batch gets exactly one update with the sum of its gradients (the table sums
 * duplicates before calling here). The arithmetic is float32 and follows the
 * operation order of the reference kernel (TensorFlow's training_ops.cc for SGD,
 * Adagrad, Adam and FTRL; TFPlus's kv_variable/kernels/training_ops.cc for Group Adam
 * and Group Adagrad), so results agree with them to a few ulps. Only scalars computed
 * once per call (beta powers) and the group norm's sum of squares use double.
 * Row-wise Adagrad follows FBGEMM's CPU kernel bit for bit (see its comment).
 *
 * Slot layout per kind (floats per row, right after the embedding):
 *
 *   SGD            (none)                                   0
 *   Adagrad        accum[dim]                               dim
 *   Adam           m[dim] v[dim] step                       2 dim + 1
 *   FTRL           accum[dim] linear[dim]                   2 dim
 *   Group Adam     m[dim] v[dim] linear[dim] step           3 dim + 1
 *   Group Adagrad  accum[dim] linear[dim]                   2 dim
 *   Row-wise Adagrad  accum (one per row)                   1
 *
 * `step` is the row's own update count stored as the bits of a uint32 (memcpy, not a
 * float conversion, so it is exact), incremented before use on every update and
 * saturating at 0x7F7FFFFF, the largest bit pattern that still reads as a finite
 * float (so exported slots never contain NaN/Inf). With per_row_step it replaces the
 * global step in the bias correction.
 *
 * Invariants: the functions here never allocate, lock, fail or print; a group-lasso
 * row that is switched off is written as exact 0.0f in every component.
 */
#include "kv_optim.h"

#include <math.h>
#include <string.h>

#define KV_STEP_MAX 0x7F7FFFFFu /* bits of FLT_MAX: the count stays a finite float */

/* ---- checks and layout ------------------------------------------------------------ */

static int finite_nonneg(float x) { return isfinite(x) && x >= 0.0f; }

int kv_optim_check(const kv_optim_t *o)
{
    if (o == NULL)
        return KV_EINVAL;
    if (o->kind < KV_OPT_SGD || o->kind > KV_OPT_ROWWISE_ADAGRAD)
        return KV_EOPTIM;
    if (o->per_row_step != 0 && o->per_row_step != 1)
        return KV_EOPTIM;
    if (!(isfinite(o->lr) && o->lr > 0.0f))
        return KV_EOPTIM;
    if (!(finite_nonneg(o->beta1) && o->beta1 < 1.0f))
        return KV_EOPTIM;
    if (!(finite_nonneg(o->beta2) && o->beta2 < 1.0f))
        return KV_EOPTIM;
    if (!finite_nonneg(o->epsilon) || !finite_nonneg(o->initial_accumulator) ||
        !finite_nonneg(o->l1) || !finite_nonneg(o->l2) || !finite_nonneg(o->l21) ||
        !finite_nonneg(o->l2_shrinkage))
        return KV_EOPTIM;
    if (!(isfinite(o->lr_power) && o->lr_power <= 0.0f))
        return KV_EOPTIM;
    if (!finite_nonneg(o->beta) || !finite_nonneg(o->weight_decay))
        return KV_EOPTIM;
    if (o->flags & ~(KV_OPTF_EPS_INSIDE_SQRT | KV_OPTF_WD_L2 | KV_OPTF_WD_DECOUPLED))
        return KV_EOPTIM; /* unknown bits */
    /* A flag or a weight decay the kind would ignore: refuse rather than look as if it
     * worked. */
    if ((o->flags & KV_OPTF_EPS_INSIDE_SQRT) && o->kind != KV_OPT_ADAGRAD)
        return KV_EOPTIM;
    const int32_t wd_mode = o->flags & (KV_OPTF_WD_L2 | KV_OPTF_WD_DECOUPLED);
    if (o->kind != KV_OPT_ROWWISE_ADAGRAD && (wd_mode || o->weight_decay != 0.0f))
        return KV_EOPTIM;
    if (wd_mode == (KV_OPTF_WD_L2 | KV_OPTF_WD_DECOUPLED))
        return KV_EOPTIM; /* one mode at a time */
    if (o->weight_decay != 0.0f && !wd_mode)
        return KV_EOPTIM; /* FBGEMM's mode NONE ignores weight_decay */
    return KV_OK;
}

/* Returns the slot count, or KV_EOPTIM (unknown kind) / KV_EINVAL (dim out of range). */
int32_t kv_optim_slot_floats(const kv_optim_t *o, int32_t dim)
{
    if (o == NULL || dim < 1 || dim > (INT32_MAX - 1) / 3)
        return KV_EINVAL;
    switch (o->kind) {
    case KV_OPT_SGD: return 0;
    case KV_OPT_ADAGRAD: return dim;
    case KV_OPT_ADAM: return 2 * dim + 1;
    case KV_OPT_FTRL: return 2 * dim;
    case KV_OPT_GROUP_ADAM: return 3 * dim + 1;
    case KV_OPT_GROUP_ADAGRAD: return 2 * dim;
    case KV_OPT_ROWWISE_ADAGRAD: return 1;
    default: return KV_EOPTIM;
    }
}

static void fill(float *p, int32_t n, float x)
{
    for (int32_t i = 0; i < n; i++)
        p[i] = x;
}

void kv_optim_init_slots(const kv_optim_t *o, int32_t dim, float *slots)
{
    const float a0 = o->initial_accumulator;
    switch (o->kind) {
    case KV_OPT_ADAGRAD: /* accum */
        fill(slots, dim, a0);
        break;
    case KV_OPT_ROWWISE_ADAGRAD: /* the row's one accum */
        slots[0] = a0;
        break;
    case KV_OPT_ADAM: /* m, v, step: all zero bits */
        memset(slots, 0, sizeof(float) * (2 * (size_t)dim + 1));
        break;
    case KV_OPT_FTRL: /* accum, linear */
    case KV_OPT_GROUP_ADAGRAD:
        fill(slots, dim, a0);
        fill(slots + dim, dim, 0.0f);
        break;
    case KV_OPT_GROUP_ADAM: /* m, v, linear, step; TFPlus starts v at 0, the default */
        fill(slots, dim, 0.0f);
        fill(slots + dim, dim, a0);
        fill(slots + 2 * (size_t)dim, dim, 0.0f);
        memset(slots + 3 * (size_t)dim, 0, sizeof(float));
        break;
    default: /* SGD: no slots */
        break;
    }
}

/* ---- helpers ---------------------------------------------------------------------- */

/* Increment the row's update count kept as uint32 bits in *slot; return the new value. */
static uint32_t bump_step(float *slot)
{
    uint32_t n;
    memcpy(&n, slot, sizeof n);
    if (n < KV_STEP_MAX)
        n++;
    memcpy(slot, &n, sizeof n);
    return n;
}

/* beta^t rounded to float, t >= 1 (pow in double, as a float32 running product or
 * tf.pow would give to within an ulp). */
static float beta_power(float beta, int64_t t)
{
    return (float)pow((double)beta, (double)t);
}

static float clampf(float x, float lo, float hi)
{
    /* Eigen's cwiseMin(l1).cwiseMax(-l1) */
    x = x < hi ? x : hi;
    return x > lo ? x : lo;
}

/* ---- SGD -------------------------------------------------------------------------- */

/* w -= lr * g */
static void sgd_row(const kv_optim_t *o, int32_t dim, float *w, const float *g)
{
    const float lr = o->lr;
    for (int32_t i = 0; i < dim; i++)
        w[i] -= lr * g[i];
}

/* ---- Adagrad (tf.raw_ops.ResourceSparseApplyAdagradV2, update_slots = true; or
 *      Keras 3's Adagrad.update_step) ------------------------------------------------ */

/*
 * accum += g^2, then
 *   w -= lr * g / (sqrt(accum) + epsilon)    TensorFlow's kernel (the default; Keras 2
 *                                            and tf.compat.v1 Adagrad run it)
 *   w -= lr * g / sqrt(accum + epsilon)      Keras 3's Adagrad (KV_OPTF_EPS_INSIDE_SQRT)
 * They differ where accum is small: near accum = 0 (initial accumulator 0, a tiny first
 * gradient) the first divides by about epsilon, the second by about sqrt(epsilon), so
 * TF's step is up to 1 / sqrt(epsilon) times Keras 3's.
 *                                                                 slots: accum[dim]
 */
static void adagrad_row(const kv_optim_t *o, int32_t dim, float *w, float *s,
                        const float *g)
{
    const float lr = o->lr, eps = o->epsilon;
    float *accum = s;
    if (o->flags & KV_OPTF_EPS_INSIDE_SQRT) {
        for (int32_t i = 0; i < dim; i++) {
            accum[i] += g[i] * g[i];
            w[i] -= lr * g[i] / sqrtf(accum[i] + eps);
        }
    } else {
        for (int32_t i = 0; i < dim; i++) {
            accum[i] += g[i] * g[i];
            w[i] -= lr * g[i] / (sqrtf(accum[i]) + eps);
        }
    }
}

/* ---- Adam (tf.raw_ops.ResourceApplyAdam on the rows of the batch) ------------------- */

/*
 * t = step (or the row's own count with per_row_step)
 * lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
 * m += (g - m) * (1 - beta1)          i.e. m = beta1 m + (1 - beta1) g
 * v += (g^2 - v) * (1 - beta2)        i.e. v = beta2 v + (1 - beta2) g^2
 * w -= m * lr_t / (sqrt(v) + epsilon)                   slots: m[dim] v[dim] step
 */
static void adam_row(const kv_optim_t *o, int32_t dim, float *w, float *s, const float *g,
                     int64_t step)
{
    float *m = s, *v = s + dim;
    const uint32_t count = bump_step(s + 2 * (size_t)dim);
    const int64_t t = o->per_row_step ? (int64_t)count : step;
    const float b1 = o->beta1, b2 = o->beta2, eps = o->epsilon;
    const float b1p = beta_power(b1, t), b2p = beta_power(b2, t);
    const float alpha = o->lr * sqrtf(1.0f - b2p) / (1.0f - b1p);
    const float one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
    for (int32_t i = 0; i < dim; i++) {
        m[i] += (g[i] - m[i]) * one_b1;
        v[i] += (g[i] * g[i] - v[i]) * one_b2;
        w[i] -= (m[i] * alpha) / (sqrtf(v[i]) + eps);
    }
}

/* ---- FTRL (tf.raw_ops.ResourceSparseApplyFtrlV2, multiply_linear_by_lr = false;
 *      with beta, Keras 3's Ftrl.update_step) ---------------------------------------- */

/*
 * p = lr_power (<= 0), P(x) = x^(-p), P = sqrt when p == -0.5 exactly
 * l2'       = l2 + beta / (2 lr)                         (Keras' beta; l2' = l2 when
 *                                                         beta = 0, bit for bit)
 * g_s       = g + 2 * l2_shrinkage * w
 * accum'    = accum + g^2                                (plain gradient)
 * linear   += g_s - (P(accum') - P(accum)) / lr * w      (gradient with shrinkage)
 * w         = (clip(linear, -l1, l1) - linear) / (P(accum') / lr + 2 l2')
 * accum     = accum'                                     slots: accum[dim] linear[dim]
 * l2' is computed from this call's lr, so it follows a learning-rate schedule as
 * Keras' does (it evaluates beta / (2 lr) at every step).
 */
static void ftrl_row(const kv_optim_t *o, int32_t dim, float *w, float *s, const float *g)
{
    float *accum = s, *linear = s + dim;
    const float lr = o->lr, l1 = o->l1;
    const float two_l2 = 2.0f * (o->l2 + o->beta / (2.0f * lr));
    const float two_shrink = 2.0f * o->l2_shrinkage;
    const int use_sqrt = o->lr_power == -0.5f;
    const float neg_p = -o->lr_power;
    for (int32_t i = 0; i < dim; i++) {
        const float gs = g[i] + two_shrink * w[i];
        const float new_accum = accum[i] + g[i] * g[i];
        const float p_new = use_sqrt ? sqrtf(new_accum) : powf(new_accum, neg_p);
        const float p_old = use_sqrt ? sqrtf(accum[i]) : powf(accum[i], neg_p);
        linear[i] += gs - (p_new - p_old) / lr * w[i];
        const float x = clampf(linear[i], -l1, l1) - linear[i];
        const float y = p_new / lr + two_l2;
        w[i] = x / y;
        accum[i] = new_accum;
    }
}

/* ---- Group Adam (TFPlus KvVariableGroupSparseApplyAdamV4, GroupAdamOptimizer's
 *      default version=4; Yue et al., ECML PKDD 2021, Algorithm 1) ------------------- */

/*
 * t = step (or the row's own count with per_row_step); beta1_power = beta1^t,
 * beta2_power = beta2^t, exactly what TFPlus's Python passes (tf v1 Adam's beta
 * accumulators, which start at beta and are multiplied after every apply).
 * Scalars:
 *   alpha  = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
 *   l1' = l1 * lr,  l2' = l2 * lr,  l21' = l21 * lr     (V4 scales them by lr)
 *   thr    = l21' * sqrt(dim)                             (the group threshold)
 * Per component:
 *   m       = beta1 m + (1 - beta1) g
 *   v'      = beta2 v + (1 - beta2) g^2
 *   linear += alpha m - (sqrt(v') - sqrt(v)) w            if beta1 > beta1^t
 *   linear += alpha m - (sqrt(v') + epsilon) w            else (TFPlus's "first step":
 *                     t == 1, or always when beta1 == 0; decided by the step above)
 *   u       = clip(linear, -l1', l1') - linear
 * Per row:
 *   if ||u||_2 > thr:  w = u (1 - thr / ||u||_2) / (sqrt(v') + epsilon + 2 l2')
 *   else:              w = 0 exactly (TFPlus blacklists the key: it reads as zeros)
 *   v = v'                                   slots: m[dim] v[dim] linear[dim] step
 */
static void group_adam_row(const kv_optim_t *o, int32_t dim, float *w, float *s,
                           const float *g, int64_t step)
{
    float *m = s, *v = s + dim, *linear = s + 2 * (size_t)dim;
    const uint32_t count = bump_step(s + 3 * (size_t)dim);
    const int64_t t = o->per_row_step ? (int64_t)count : step;
    const float lr = o->lr, b1 = o->beta1, b2 = o->beta2, eps = o->epsilon;
    const float b1p = beta_power(b1, t), b2p = beta_power(b2, t);
    const float alpha = lr * sqrtf(1.0f - b2p) / (1.0f - b1p);
    const float l1 = o->l1 * lr, two_l2 = 2.0f * (o->l2 * lr), l21 = o->l21 * lr;
    const float thr = l21 * sqrtf((float)dim);
    const int first = !(b1 > b1p);
    double sumsq = 0.0;

    for (int32_t i = 0; i < dim; i++) {
        m[i] = b1 * m[i] + (1.0f - b1) * g[i];
        const float new_v = b2 * v[i] + (1.0f - b2) * (g[i] * g[i]);
        const float sq_new = sqrtf(new_v);
        if (!first)
            linear[i] += alpha * m[i] - (sq_new - sqrtf(v[i])) * w[i];
        else
            linear[i] += alpha * m[i] - (sq_new + eps) * w[i];
        v[i] = new_v;
        const float u = clampf(linear[i], -l1, l1) - linear[i];
        sumsq += (double)u * (double)u;
    }
    const float norm = (float)sqrt(sumsq);
    if (norm > thr) {
        const float shrink = 1.0f - thr / norm;
        for (int32_t i = 0; i < dim; i++) {
            const float u = clampf(linear[i], -l1, l1) - linear[i];
            const float y = sqrtf(v[i]) + eps + two_l2;
            w[i] = u * shrink / y;
        }
    } else {
        fill(w, dim, 0.0f);
    }
}

/* ---- Group Adagrad (TFPlus KvVariableSparseGroupSparseApplyFtrlV2, i.e.
 *      SparseGroupFtrlOptimizer; Yue et al., ECML PKDD 2021) ------------------------- */

/*
 * p = lr_power (<= 0), P(x) = x^(-p), P = sqrt when p == -0.5 exactly
 * thr = l21 * sqrt(dim)                       (l1, l2, l21 are NOT scaled by lr here)
 * Per component:
 *   g_s     = g + 2 * l2_shrinkage * w        (TFPlus uses g_s for accum too, unlike
 *                                              TF's FTRL which squares the plain g)
 *   accum'  = accum + g_s^2
 *   linear += g_s - (P(accum') - P(accum)) / lr * w
 *   u       = clip(linear, -l1, l1) - linear
 *   accum   = accum'
 * Per row:
 *   if ||u||_2 > thr:  w = u (1 - thr / ||u||_2) / (P(accum') / lr + 2 l2)
 *   else:              w = 0 exactly (TFPlus blacklists the key: it reads as zeros)
 *                                                     slots: accum[dim] linear[dim]
 */
static void group_adagrad_row(const kv_optim_t *o, int32_t dim, float *w, float *s,
                              const float *g)
{
    float *accum = s, *linear = s + dim;
    const float lr = o->lr, l1 = o->l1, two_l2 = 2.0f * o->l2;
    const float two_shrink = 2.0f * o->l2_shrinkage;
    const float thr = o->l21 * sqrtf((float)dim);
    const int use_sqrt = o->lr_power == -0.5f;
    const float neg_p = -o->lr_power;
    double sumsq = 0.0;

    for (int32_t i = 0; i < dim; i++) {
        const float gs = g[i] + two_shrink * w[i];
        const float new_accum = accum[i] + gs * gs;
        const float p_new = use_sqrt ? sqrtf(new_accum) : powf(new_accum, neg_p);
        const float p_old = use_sqrt ? sqrtf(accum[i]) : powf(accum[i], neg_p);
        linear[i] += gs - (p_new - p_old) / lr * w[i];
        accum[i] = new_accum;
        const float u = clampf(linear[i], -l1, l1) - linear[i];
        sumsq += (double)u * (double)u;
    }
    const float norm = (float)sqrt(sumsq);
    if (norm > thr) {
        const float shrink = 1.0f - thr / norm;
        for (int32_t i = 0; i < dim; i++) {
            const float u = clampf(linear[i], -l1, l1) - linear[i];
            const float p_new = use_sqrt ? sqrtf(accum[i]) : powf(accum[i], neg_p);
            const float y = p_new / lr + two_l2;
            w[i] = u * shrink / y;
        }
    } else {
        fill(w, dim, 0.0f);
    }
}

/* ---- Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD, which TorchRec's
 *      RowWiseAdagrad selects for its fused tables) -------------------------------- */

/*
 * wd = weight_decay; the mode is fbgemm_gpu's weight_decay_mode (flags):
 *   g'_i   = g_i + wd * w_i                  (L2)        g'_i = g_i  (none, decoupled)
 *   accum += (sum_i g'_i^2) / dim            the MEAN of the squares over the row
 *   m      = lr / (sqrt(accum) + epsilon)    (epsilon outside the sqrt)
 *   c      = 1 - m * wd  (L2),  1 - lr * wd  (decoupled),  1  (none)
 *   w_i    = c * w_i - g_i * m               (the plain gradient: L2's term is in c, so
 *                                            this is w_i - m * g'_i)
 * The rule and the modes are fbgemm_gpu's (codegen/genscript/optimizers.py,
 * rowwise_adagrad). The arithmetic is that of the kernel TorchRec runs on CPU for float
 * tables (fbgemm's JIT GenerateSparseAdaGrad(rowwise), stated by
 * rowwise_sparse_adagrad_ref in src/RefImplementations.cc): float32, the squares summed
 * into 8 partial sums (element i into sum i mod 8, the lanes of an AVX2 register) and
 * those reduced pairwise, ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); w += g * (-m), which is
 * w - g * m bit for bit. So with no weight decay (TorchRec's default) a row gets
 * FBGEMM's bits (tested against fbgemm_gpu 1.8.0). fbgemm_gpu's CPU path passes weight
 * decay 0 to that kernel, so there the modes only exist on its GPU and shared-table
 * paths, whose formula this is.
 * Every component of the row moves with one step size m: the accumulator is one float
 * per row, not dim (a row's optimizer state is 4 bytes). With dim = 1 it is Adagrad.
 *                                                                 slots: accum (1)
 */
static void rowwise_adagrad_row(const kv_optim_t *o, int32_t dim, float *w, float *s,
                                const float *g)
{
    const float lr = o->lr, eps = o->epsilon, wd = o->weight_decay;
    const int l2 = (o->flags & KV_OPTF_WD_L2) != 0;
    float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (l2) {
        for (int32_t i = 0; i < dim; i++) {
            const float gi = g[i] + wd * w[i];
            part[i & 7] += gi * gi;
        }
    } else {
        for (int32_t i = 0; i < dim; i++)
            part[i & 7] += g[i] * g[i];
    }
    const float sumsq = ((part[0] + part[1]) + (part[2] + part[3])) +
                        ((part[4] + part[5]) + (part[6] + part[7]));
    const float accum = s[0] + sumsq / (float)dim;
    s[0] = accum;
    const float m = lr / (sqrtf(accum) + eps);
    float c = 1.0f;
    if (l2)
        c = 1.0f - m * wd;
    else if (o->flags & KV_OPTF_WD_DECOUPLED)
        c = 1.0f - lr * wd;
    for (int32_t i = 0; i < dim; i++)
        w[i] = c * w[i] - g[i] * m;
}

/* ---- dispatch ------------------------------------------------------------------- */

void kv_optim_apply_rows(const kv_optim_t *o, int32_t dim, int64_t nrows, float *w,
                         float *slots, const float *g, int64_t step)
{
    const int32_t ns = kv_optim_slot_floats(o, dim);
    if (ns < 0)
        return; /* unchecked optimizer or bad dim: the contract says this cannot happen */
    if (step < 1)
        step = 1; /* beta^0 = 1 would divide by zero in the bias correction */
    for (int64_t r = 0; r < nrows; r++) {
        float *wr = w + r * (int64_t)dim;
        float *sr = ns > 0 ? slots + r * (int64_t)ns : slots; /* SGD: slots may be NULL */
        const float *gr = g + r * (int64_t)dim;
        switch (o->kind) {
        case KV_OPT_SGD: sgd_row(o, dim, wr, gr); break;
        case KV_OPT_ADAGRAD: adagrad_row(o, dim, wr, sr, gr); break;
        case KV_OPT_ADAM: adam_row(o, dim, wr, sr, gr, step); break;
        case KV_OPT_FTRL: ftrl_row(o, dim, wr, sr, gr); break;
        case KV_OPT_GROUP_ADAM: group_adam_row(o, dim, wr, sr, gr, step); break;
        case KV_OPT_GROUP_ADAGRAD: group_adagrad_row(o, dim, wr, sr, gr); break;
        case KV_OPT_ROWWISE_ADAGRAD: rowwise_adagrad_row(o, dim, wr, sr, gr); break;
        default: return;
        }
    }
}
