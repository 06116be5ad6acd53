/*
 * routing_math.h -- the sigmoid of SIGMOID_TOPK routing, evaluated the same
 * way, bit for bit, by the host (src/routing.c, the CPU backend) and the
 * device (src/cuda/routing_device.cuh), so the selection keys s_e + b_e and
 * the scores agree on every backend for equal fp32 logits.
 *
 * Why not libm's exp: glibc's and CUDA's double exp may differ in the last
 * bit, and a key one ulp apart can flip a selection. This exp uses only
 * operations IEEE 754 rounds correctly on both (fma, add, multiply, divide,
 * rint, ldexp), each written out, so no compiler contracts or reorders them
 * differently: every multiply-add is an explicit fma(), and no plain a*b+c
 * appears (nvcc would fuse it, the host C compiler would not).
 *
 * Accuracy: |error| <= about 1 ulp of double (Cody-Waite reduction with a
 * two-part ln 2, degree-13 Taylor polynomial on |r| <= ln2/2 + tiny), smooth
 * enough for the fp64 finite-difference checks.
 */
#ifndef SMOE_ROUTING_MATH_H
#define SMOE_ROUTING_MATH_H

#include <math.h>

#if defined(__CUDACC__)
#define SMOE_RM_FN static __host__ __device__ __forceinline__
#else
#define SMOE_RM_FN static inline
#endif

/* exp(y) for y <= 0 (the only use: y = -|l|); NaN stays NaN. */
SMOE_RM_FN double smoe_exp_neg(double y)
{
    if (y != y) return y;
    if (y < -746.0) return 0.0;
    const double LOG2E = 1.4426950408889634;
    const double LN2_HI = 6.93147180369123816490e-01; /* 32 bits: k * LN2_HI exact */
    const double LN2_LO = 1.90821492927058770002e-10;
    const double k = rint(y * LOG2E);
    double r = fma(-k, LN2_HI, y);
    r = fma(-k, LN2_LO, r);
    /* 1/j! for j = 13 .. 2 (constants parsed to the nearest double) */
    double p = 1.6059043836821613e-10;
    p = fma(p, r, 2.08767569878681e-09);
    p = fma(p, r, 2.505210838544172e-08);
    p = fma(p, r, 2.755731922398589e-07);
    p = fma(p, r, 2.7557319223985893e-06);
    p = fma(p, r, 2.48015873015873e-05);
    p = fma(p, r, 1.984126984126984e-04);
    p = fma(p, r, 1.388888888888889e-03);
    p = fma(p, r, 8.333333333333333e-03);
    p = fma(p, r, 4.1666666666666664e-02);
    p = fma(p, r, 1.6666666666666666e-01);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    return ldexp(p, (int)k);
}

/* sigmoid(l) = 1 / (1 + exp(-l)), as exp(-|l|) so nothing overflows:
 * l >= 0: 1 / (1 + e); l < 0: e / (1 + e). NaN stays NaN. */
SMOE_RM_FN double smoe_sigmoid(double l)
{
    const double e = smoe_exp_neg(-fabs(l));
    const double den = 1.0 + e;
    return l >= 0.0 ? 1.0 / den : e / den;
}

#undef SMOE_RM_FN
#endif /* SMOE_ROUTING_MATH_H */
