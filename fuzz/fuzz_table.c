/*
 * libFuzzer target: the sensitivity table of calibrated mixed precision
 * (runtime/core/sensitivity.c, kvf_mixed_map_parse) on arbitrary bytes, for a
 * scheme refining 24 key and 16 value channels of head_dim 128 and two KV
 * heads, layers 0 and 1 asked for. Oracles: a table accepted gives a map
 * whose every head refines exactly the scheme's count of channels, numbered
 * 0 .. count - 1 in channel order, and 255 elsewhere; a refused one leaves a
 * message naming the table.
 */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static kvf_scheme *s;
    if (!s) {
        const char *text = "return { name = 'fuzz_table', mixed_precision = { key_fraction = 0.2, value_fraction = 0.125 } }";
        FUZZ_CHECK(kvf_scheme_load_string(text, strlen(text), "=fuzz_table", &s) == KVF_OK);
    }
    const int want[2] = {24, 16};
    for (int layer = 0; layer < 2; layer++) {
        uint8_t map[2 * 2 * 128];
        memset(map, 0xA5, sizeof map);
        int rc = kvf_mixed_map_parse(s, (const char *)data, size, "<fuzz>", layer, 2, map);
        if (rc) {
            FUZZ_CHECK(rc == KVF_EFORMAT || rc == KVF_ENOMEM);
            FUZZ_CHECK(strstr(kvf_last_error(), "<fuzz>") != NULL);
            continue;
        }
        for (int t = 0; t < 2; t++)
            for (int h = 0; h < 2; h++) {
                int next = 0;
                for (int c = 0; c < 128; c++) {
                    const uint8_t e = map[(t * 2 + h) * 128 + c];
                    if (e == 255) continue;
                    FUZZ_CHECK(e == next);
                    next++;
                }
                FUZZ_CHECK(next == want[t]);
            }
    }
    return 0;
}
