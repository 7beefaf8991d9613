/* The GPU quantizer's codes without a division per value (templates/
 * kvf_common.cuh, kvf_rint_mul and kvf_rint_mul_add, the fast paths of
 * kvf_rint_div8, which divides all 8 values of a lane where any one misses;
 * METHODS.md 2): this
 * file repeats their f32 arithmetic on the CPU (C11 floats, no contraction)
 * and checks the argument they rest on, that the fast path's integer is the
 * one the division gives, on random values and on values a few ulp from a
 * half-integer quotient, where the fast path must hand over to the
 * division. The two functions below must change with the templates'
 * (margins_are_the_templates checks their margins).
 * Sampling catches a margin that is far too small (2^-24 |y| or less); the
 * proof, not this test, says 2^-21 |y| is enough. */
#include "testutil.h"

#include <math.h>
#include <string.h>

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The templates' margins, written once: FMA is fmaf here and __fmaf_rn in
 * kvf_common.cuh, whose text margins_are_the_templates looks for. */
#define DIV_MARGIN(FMA, y) FMA(fabsf(y), 0x1p-21f, 0x1p-140f)
#define ADD_MARGIN(FMA, y, t) FMA(fabsf(y), 0x1p-21f, FMA(fabsf(t), 0x1p-22f, 0x1p-140f))
#define TEXT(...) TEXT_(__VA_ARGS__)
#define TEXT_(...) #__VA_ARGS__

/* kvf_rint_mul, then the division: rint(fl(x / S)) for S > 0, r = fl(1 / S). */
static float rint_div(float x, float S, float r, long *slow) {
    const float y = x * r, n = rintf(y);
    if (fabsf(y - n) < 0.5f - DIV_MARGIN(fmaf, y)) return n;
    ++*slow;
    return rintf(x / S);
}

/* kvf_rint_mul_add, then the division: rint(fl(fl(x / S) + z)) for an integer z. */
static float rint_div_add(float x, float S, float r, float z, long *slow) {
    const float y = x * r, t = y + z, n = rintf(t);
    const float m = ADD_MARGIN(fmaf, y, t);
    if (fabsf(t - n) < 0.5f - m) return n;
    ++*slow;
    return rintf(x / S + z);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) { return tu_rng_next(&rng); }

/* A scale as encode8 makes them: an fp16 value (1 in 2), a two-level
 * T * u with u in 1..127 (exact in f32, up to 65504 * 127), or +Inf (an fp16
 * scale that overflowed; 1 in 64). */
static float sample_scale(uint64_t a) {
    if (a % 64 == 0) return INFINITY;
    const float T = kvf_f16_to_f32((uint16_t)(1u + (a >> 8) % 0x7bffu)); /* positive finite */
    return (a >> 6) & 1 ? T : T * (float)(1 + (a >> 24) % 127);
}

/* x: any f32 bits (1 in 4), a small multiple of S (1 in 4), or within 32
 * ulp of (k + 1/2) S for k in [-150, 150) (1 in 2: *near = 1). */
static float sample_x(uint64_t a, float S, int *near) {
    *near = 0;
    switch ((a >> 16) % 4) {
    case 0: return bits_f32((uint32_t)(a >> 32));
    case 1: return S * (float)((int)((a >> 20) % 9) - 1) * ((a >> 30) & 1 ? 1.0f : 0.37f);
    default: {
        *near = 1;
        const float h = ((float)((int)((a >> 20) % 300) - 150) + 0.5f) * S;
        return bits_f32(f32_bits(h) + (uint32_t)((int)((a >> 40) % 64) - 32));
    }
    }
}

static int same(float a, float b) { return a == b || (isnan(a) && isnan(b)); }

static void codes_equal_division(void **state) {
    (void)state;
    long n = 0, near_n = 0, slow = 0, slow_z = 0, near_slow = 0, bad = 0, bad_z = 0;
    for (long i = 0; i < 10000000L; i++) {
        const uint64_t a = next();
        const float S = sample_scale(a), r = 1.0f / S;
        int near;
        const float x = sample_x(next(), S, &near), z = (float)((int)((a >> 48) % 256) - 128);
        if (!isfinite(x)) continue;
        n++;
        const long before = slow;
        if (!same(rint_div(x, S, r, &slow), rintf(x / S))) bad++;
        if (!same(rint_div_add(x, S, r, z, &slow_z), rintf(x / S + z))) bad_z++;
        if (near && isfinite(S)) near_n++, near_slow += slow - before;
    }
    print_message("  %ld values: %ld and %ld differ; the division ran for %ld and %ld (%ld of %ld near a "
                  "half-integer quotient)\n", n, bad, bad_z, slow, slow_z, near_slow, near_n);
    assert_int_equal(bad, 0);
    assert_int_equal(bad_z, 0);
    assert_true(n > 9000000L);
    /* The values near a half-integer quotient must reach the division (a
     * margin that never hands over would pass the others), though not all of
     * them: within 32 ulp, most are far enough for the margin. */
    assert_true(near_slow > near_n / 20 && near_slow < near_n);
}

/* The margins above are the templates': the library's embedded
 * kvf_common.cuh states the same expressions (DIV_MARGIN and ADD_MARGIN,
 * used by both functions above, spelled with __fmaf_rn), so changing one
 * side alone fails here. */
static void margins_are_the_templates(void **state) {
    (void)state;
    const kvf_embedded_file *t = kvf_find_embedded(kvf_embedded_templates, "kvf_common.cuh");
    assert_non_null(t);
    assert_non_null(strstr(t->data, "__fsub_rn(0.5f, " TEXT(DIV_MARGIN(__fmaf_rn, y)) ")"));
    assert_non_null(strstr(t->data, TEXT(ADD_MARGIN(__fmaf_rn, y, t))));
}

/* Non-finite inputs and quotients always take the division. */
static void non_finite_take_the_division(void **state) {
    (void)state;
    long slow = 0;
    const float S = 0.25f, r = 4.0f;
    assert_true(isnan(rint_div(NAN, S, r, &slow)));
    assert_true(isinf(rint_div(INFINITY, S, r, &slow)));
    assert_true(rint_div(3.0e38f, S, r, &slow) == rintf(3.0e38f / S));
    assert_true(rint_div_add(-INFINITY, S, r, 3.0f, &slow) == -INFINITY);
    assert_int_equal(slow, 4);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(codes_equal_division),
        cmocka_unit_test(non_finite_take_the_division),
        cmocka_unit_test(margins_are_the_templates),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
