/* BF16 and FP16 conversions, bit-exact with the GPU's cvt.rn instructions. */
#include "internal.h"

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
