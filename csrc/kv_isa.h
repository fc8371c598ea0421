/*
 * kv_isa.h - what the kernels compiled for several x86 ISAs share (kv_init.c,
 * synth/kv_synth.c): each is compiled as a baseline copy and, where KV_ISA_CLONES is 1, as
 * AVX2 and AVX-512 copies picked at run time (__builtin_cpu_supports).
 *
 * The copies must give the same bits, so no copy may contract a * b + c into an FMA
 * (AVX-512 has FMA): GCC in ISO C mode (-std=c99, as kvcoll builds it: GCC then
 * defaults to -ffp-contract=off), or clang with the pragma below. Elsewhere only the
 * baseline copy exists.
 */
#ifndef KV_ISA_H
#define KV_ISA_H

#if defined(__GNUC__)
#define KV_INLINE static inline __attribute__((always_inline))
#else
#define KV_INLINE static inline
#endif

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || defined(__STRICT_ANSI__))
#define KV_ISA_CLONES 1
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
#define KV_TARGET_AVX2 __attribute__((target("avx2")))
#define KV_TARGET_AVX512 __attribute__((target("avx2,avx512f,avx512dq,avx512vl,avx512bw")))
#else
#define KV_ISA_CLONES 0
#endif

/* The copies a CPU can run, as numbered in kv_init.h and kv_synth.h (KV_*_ISA_*). */
#define KV_ISA_BASE 1   /* baseline (x86-64: SSE2) */
#define KV_ISA_AVX2 2   /* x86-64 with AVX2 */
#define KV_ISA_AVX512 3 /* x86-64 with AVX-512 F, DQ, VL, BW */

/* The fastest copy this CPU runs. */
static inline int kv_isa_detect(void) {
#if KV_ISA_CLONES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
        return KV_ISA_AVX512;
    if (__builtin_cpu_supports("avx2")) return KV_ISA_AVX2;
#endif
    return KV_ISA_BASE;
}

#endif
