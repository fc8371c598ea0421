/*
 * optim_stub.c - TEMPORARY SGD-only row optimizer, linked into the C tests only
 * while csrc/kv_optim.c does not exist (see the Makefile). Never part of the
 * library: delete this file once kv_optim.c has landed.
 */
#include <math.h>

#include "../kv_optim.h"

int kv_optim_check(const kv_optim_t *o) {
    if (!o || o->kind != KV_OPT_SGD || !(o->lr > 0) || !isfinite(o->lr)) return KV_EOPTIM;
    return KV_OK;
}

int32_t kv_optim_slot_floats(const kv_optim_t *o, int32_t dim) {
    (void)o;
    (void)dim;
    return 0;
}

void kv_optim_init_slots(const kv_optim_t *o, int32_t dim, float *slots) {
    (void)o;
    (void)dim;
    (void)slots;
}

void kv_optim_apply_rows(const kv_optim_t *o, int32_t dim, int64_t nrows, float *w,
                         float *slots, const float *g, int64_t step) {
    (void)slots;
    (void)step;
    for (int64_t i = 0; i < nrows * (int64_t)dim; i++) w[i] -= o->lr * g[i];
}
