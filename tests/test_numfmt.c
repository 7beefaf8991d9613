/* Number formats of the packed cache (runtime/core/numfmt.c): FP8 E4M3 scales
 * against a table of values worked out by hand, and FP8 scale groups through
 * the CPU reference. */
#include "testutil.h"
#include "cpu/ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 holds
 * m * 2^-9; 0x7F is NaN; no infinities; the largest finite value is
 * 1.75 * 2^8 = 448 (0x7E). */
static void e4m3_table(void **state) {
    (void)state;
    const struct { float f; uint8_t code; float back; } t[] = {
        {0.0f, 0x00, 0.0f},
        {-0.0f, 0x80, -0.0f},
        {1.0f, 0x38, 1.0f},            /* exponent 7, mantissa 0 */
        {1.125f, 0x39, 1.125f},        /* mantissa 1 */
        {1.0625f, 0x38, 1.0f},         /* halfway 1 | 1.125: to the even mantissa */
        {1.1875f, 0x3a, 1.25f},        /* halfway 1.125 | 1.25: to the even one, 1.25 */
        {-2.5f, 0xc2, -2.5f},          /* -1.25 * 2: exponent 1 + 7, mantissa 2 */
        {448.0f, 0x7e, 448.0f},        /* the largest finite */
        {460.0f, 0x7e, 448.0f},        /* rounds to 448 */
        {464.0f, 0x7e, 448.0f},        /* would round to 480, saturates */
        {1e6f, 0x7e, 448.0f},
        {-1e6f, 0xfe, -448.0f},
        {0.015625f, 0x08, 0.015625f},  /* 2^-6: the smallest normal */
        {0.013671875f, 0x07, 0.013671875f}, /* 7 * 2^-9: the largest subnormal */
        {0.001953125f, 0x01, 0.001953125f}, /* 2^-9: the smallest subnormal */
        {0.0009765625f, 0x00, 0.0f},   /* 2^-10: halfway 0 | 2^-9: to even, 0 */
        {0.0029296875f, 0x02, 0.00390625f}, /* 1.5 * 2^-9: halfway 1 | 2: to even, 2 */
        {240.0f, 0x77, 240.0f},        /* 1.875 * 2^7 */
        {248.0f, 0x78, 256.0f},        /* halfway 240 | 256: to even (256) */
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        const uint8_t c = kvf_f32_to_e4m3(t[i].f);
        if (c != t[i].code) fail_msg("%g: 0x%02x, want 0x%02x", (double)t[i].f, c, t[i].code);
        const float b = kvf_e4m3_to_f32(c);
        assert_memory_equal(&b, &t[i].back, sizeof b);
        uint8_t e;
        assert_int_equal(kvf_e4m3_encode(t[i].f, &e), KVF_OK);
        assert_int_equal(e, c);
    }
    /* Every code reads back to itself (NaN aside). */
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) {
            assert_true(isnan(kvf_e4m3_to_f32((uint8_t)c)));
            continue;
        }
        assert_int_equal(kvf_f32_to_e4m3(kvf_e4m3_to_f32((uint8_t)c)), c);
    }
    /* NaN and infinities: none in E4M3. The checked form refuses them; the
     * quantizer's stores NaN as 0x7F and saturates infinities. */
    uint8_t e = 0x11;
    assert_int_equal(kvf_e4m3_encode(NAN, &e), KVF_ERANGE);
    assert_non_null(strstr(kvf_last_error(), "NaN"));
    assert_int_equal(kvf_e4m3_encode(INFINITY, &e), KVF_ERANGE);
    assert_non_null(strstr(kvf_last_error(), "Inf"));
    assert_int_equal(e, 0x11); /* untouched */
    assert_int_equal(kvf_f32_to_e4m3(NAN), 0x7f);
    assert_int_equal(kvf_f32_to_e4m3(-INFINITY), 0xfe);
}

/* RTN with FP8 scales through the reference: one byte of scale (and zero) a
 * group, and a round trip whose error grows by no more than the scale's
 * coarser steps allow. */
static void fp8_groups_round_trip(void **state) {
    (void)state;
    struct kvf_scheme s16, s8, sym;
    tu_hand_scheme(&s16, 128, 2, 2, 64, KVF_MODE_AFFINE);
    tu_hand_scheme(&s8, 128, 2, 2, 64, KVF_MODE_AFFINE);
    s8.key.scale_format = s8.value.scale_format = KVF_SCALE_FP8;
    tu_finalize(&s8);
    tu_hand_scheme(&sym, 128, 2, 2, 64, KVF_MODE_SYMMETRIC);
    sym.key.scale_format = sym.value.scale_format = KVF_SCALE_FP8;
    tu_finalize(&sym);
    const int64_t N = 64;
    const int H = 2;
    size_t b16, b8, bs;
    kvf_packed_size(&s16, N, H, &b16);
    kvf_packed_size(&s8, N, H, &b8);
    kvf_packed_size(&sym, N, H, &bs);
    kvf_layout L8, LS;
    kvf_layout_compute(&s8, N, H, &L8);
    kvf_layout_compute(&sym, N, H, &LS);
    assert_int_equal(L8.key.stage[0].scales_bytes, (size_t)N * H * 2); /* 2 groups a row, a byte each */
    assert_int_equal(L8.key.stage[0].zeros_bytes, (size_t)N * H * 2);
    assert_int_equal(LS.key.stage[0].zeros_bytes, 0);
    assert_true(b8 < b16);
    uint16_t *k = malloc((size_t)N * H * 128 * 2), *v = malloc((size_t)N * H * 128 * 2);
    uint16_t *ko = malloc((size_t)N * H * 128 * 2), *vo = malloc((size_t)N * H * 128 * 2);
    kvf_synth_kv(k, N, H, 128, 11);
    kvf_synth_kv(v, N, H, 128, 12);
    uint8_t *p = malloc(b16);
    kvf_shape sh = {N, H, 0, 0};
    double e[3];
    const struct kvf_scheme *all[3] = {&s16, &s8, &sym};
    for (int i = 0; i < 3; i++) {
        size_t b;
        kvf_packed_size(all[i], N, H, &b);
        assert_int_equal(kvf_ref_encode(all[i], k, v, &sh, NULL, p, b), KVF_OK);
        assert_int_equal(kvf_ref_decode(all[i], p, b, &sh, NULL, ko, vo), KVF_OK);
        double s2 = 0;
        for (size_t j = 0; j < (size_t)N * H * 128; j++) {
            double d = (double)kvf_bf16_to_f32(k[j]) - kvf_bf16_to_f32(ko[j]);
            s2 += d * d;
        }
        e[i] = s2 / ((double)N * H * 128);
    }
    print_message("RTN INT2 key MSE: fp16 scales %.4f, FP8 affine %.4f, FP8 symmetric %.4f\n", e[0], e[1], e[2]);
    assert_true(e[1] < 1.5 * e[0]);
    assert_true(e[2] > 0 && e[2] < 10 * e[0]);
    free(k), free(v), free(ko), free(vo), free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(e4m3_table),
        cmocka_unit_test(fp8_groups_round_trip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
