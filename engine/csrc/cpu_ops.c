/* CPU kernels of the engine: paged attention, residual-add + RMSNorm, rotary embedding, SwiGLU.
 *
 * Plain C, compiled on first use by engine/cpu_ops.py (-O3 -march=native -fopenmp) and called
 * through ctypes with raw pointers. Every function exists for float32 (suffix _f32) and bfloat16
 * (suffix _bf16, stored as uint16). Arithmetic is float32; bfloat16 results are rounded to
 * nearest-even at the same points where PyTorch rounds them in the reference path (engine/layers,
 * engine/attention/torch_ref.py), so the two agree to the last bit wherever float32 sums agree.
 *
 * OpenMP comes from the libgomp PyTorch has already loaded (same soname), so the process keeps
 * one thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bit casts through memcpy: the form the vectorizer turns into register moves (unions it does not). */
static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bf16_load(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

static inline uint16_t bf16_store(float f) {
    uint32_t u = float_to_bits(f);
    /* Round to nearest, ties to even; NaN stays a (quiet) NaN. */
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* exp(x) in plain float arithmetic the compiler vectorizes (glibc's expf is a scalar call): x = n ln2 + r,
 * |r| <= ln2 / 2, exp(r) by its degree-7 Taylor-like minimax polynomial (Cephes' expf coefficients),
 * times 2^n built in the exponent bits. Within 2 ulp of expf; 0 below -87.3 (where expf is denormal). */
static inline float exp_approx(float x) {
    /* Comparisons, not fminf/fmaxf, whose NaN rules keep the loop scalar. */
    const float clamped = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = (clamped * 1.44269504f + 12582912.f) - 12582912.f; /* round to nearest integer */
    float r = fmaf(n, -0.693359375f, clamped);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.f;
    const float scale = bits_to_float((uint32_t)((int32_t)n + 127) << 23);
    return x < -87.3f ? 0.f : p * scale;
}

/* 16 float32 lanes in GCC's portable vector extension: the compiler picks the instructions (one
 * AVX-512 register here). Written out, because the loop vectorizer will not reassociate a dot product's
 * sum without -ffast-math and leaves a chain of scalar adds. */
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

static inline vf16 f32_vload(const float *p) {
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf16 bf16_vload(const uint16_t *p) {
    vh16 h;
    memcpy(&h, p, sizeof h);
    return (vf16)(__builtin_convertvector(h, vu16) << 16);
}

static inline void f32_vstore(float *p, vf16 v) { memcpy(p, &v, sizeof v); }

static inline float hsum16(vf16 v) {
    vf8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    const vf8 eight = lo + hi;
    vf4 a, b;
    memcpy(&a, &eight, sizeof a);
    memcpy(&b, (const char *)&eight + sizeof a, sizeof b);
    const vf4 four = a + b;
    return (four[0] + four[2]) + (four[1] + four[3]);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }
/* Round a float32 value to the storage type and back: where PyTorch materializes an intermediate. */
static inline float bf16_round(float x) { return bf16_load(bf16_store(x)); }
static inline float f32_round(float x) { return x; }

#define NAME(fn) fn##_f32
#define T float
#define LOAD f32_load
#define STORE f32_store
#define ROUND f32_round
#define VLOAD f32_vload
#include "cpu_kernels.inc"
#undef NAME
#undef T
#undef LOAD
#undef STORE
#undef ROUND
#undef VLOAD

#define NAME(fn) fn##_bf16
#define T uint16_t
#define LOAD bf16_load
#define STORE bf16_store
#define ROUND bf16_round
#define VLOAD bf16_vload
#include "cpu_kernels.inc"
