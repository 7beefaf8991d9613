/* BF16 and FP16 conversions, bit-exact with the GPU's cvt.rn instructions. */
#include "internal.h"

#include <math.h>
#include <string.h>

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float kvf_bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

uint16_t kvf_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; /* canonical NaN (FORMAT.md) */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

float kvf_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 0x1.0p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Round to nearest even, like cvt.rn.f16.f32, then saturate finite values to
 * +-65504 (the packed formats never store infinities for finite inputs). */
uint16_t kvf_f32_to_f16(float f) {
    uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);        /* NaN */
    if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);       /* Inf */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7bffu);       /* rounds past 65504: saturate */
    if (a < 0x38800000u) {                                         /* below 2^-14: subnormal */
        if (a < 0x33000000u) return (uint16_t)sign;                /* below half of 2^-24 */
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;                                 /* 14..24 -> m >> (shift - 0) */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | (((r >> 13) - (112u << 10)) & 0x7fffu));
}

/* FP8 E4M3 (the OCP "E4M3FN" kind: bias 7, no infinities, 0x7F and 0xFF
 * NaN, largest finite 448), the scale format QVG stores. Round to nearest
 * even; finite values past 448 and infinities saturate to +-448; a NaN is
 * 0x7F. The templates' kvf_f32_to_e4m3 is this, operation for operation. */
uint8_t kvf_f32_to_e4m3(float f) {
    const uint32_t u = f32_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fu;                 /* NaN */
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7eu); /* >= 448, Inf: saturate */
    const int e = (int)(a >> 23) - 127;
    if (e < -6) {                                      /* below 2^-6: subnormal, q * 2^-9 */
        const float q = rintf(bits_f32(a) * 512.0f);   /* exact scaling; q <= 8 (8 = 2^-6) */
        return (uint8_t)(sign | (uint32_t)q);
    }
    uint32_t r = (a >> 20) & 7u, rem = a & 0xfffffu;
    int ee = e;
    if (rem > 0x80000u || (rem == 0x80000u && (r & 1u))) r++;
    if (r == 8u) r = 0, ee++;
    if (ee > 8 || (ee == 8 && r == 7u)) return (uint8_t)(sign | 0x7eu);
    return (uint8_t)(sign | ((uint32_t)(ee + 7) << 3) | r);
}

float kvf_e4m3_to_f32(uint8_t c) {
    const uint32_t sign = (uint32_t)(c & 0x80u) << 24, exp = (c >> 3) & 15u, man = c & 7u;
    if ((c & 0x7fu) == 0x7fu) return bits_f32(0x7fc00000u | sign);
    if (exp == 0) {
        const float v = (float)man * 0x1.0p-9f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

int kvf_e4m3_encode(float f, uint8_t *out) {
    const uint32_t a = f32_bits(f) & 0x7fffffffu;
    if (a >= 0x7f800000u) return kvf_set_error(KVF_ERANGE, "FP8 E4M3: %s has no E4M3 value", a > 0x7f800000u ? "NaN" : "Inf");
    *out = kvf_f32_to_e4m3(f);
    return KVF_OK;
}
