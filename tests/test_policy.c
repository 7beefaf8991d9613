/* The chunk policy (runtime/core/policy.c) against a cache simulated the
 * way a caller keeps one: a list of waiting BF16 chunks, packed from the
 * oldest, a span at a time, once more than `recent` wait. */
#include "testutil.h"

#include <stdio.h>
#include <string.h>

static kvf_scheme *policy_scheme(int span, int recent, int sink) {
    char text[160];
    snprintf(text, sizeof text, "return { chunk = { span = %d, recent = %d, sink = %d } }", span, recent, sink);
    return tu_scheme_text(text);
}

static void matches_a_simulated_cache(void **state) {
    (void)state;
    for (int span = 1; span <= 4; span++)
        for (int recent = 0; recent <= 3; recent++)
            for (int sink = 0; sink <= 2; sink++) {
                kvf_scheme *s = policy_scheme(span, recent, sink);
                int waiting_first = -1, waiting = 0, last_packed = -1, last_span = 0;
                for (int t = 0; t < 40; t++) {
                    kvf_chunk_step st;
                    assert_int_equal(kvf_chunk_policy(s, t, &st), KVF_OK);
                    assert_int_equal(st.sink, t < sink);
                    int pack_first = -1, pack_chunks = 0;
                    if (t >= sink) {
                        if (!waiting) waiting_first = t;
                        waiting++;
                        if (waiting - recent >= span) {
                            pack_first = waiting_first;
                            pack_chunks = span;
                            waiting -= span;
                            waiting_first += span;
                        }
                    }
                    assert_int_equal(st.pack_chunks, pack_chunks);
                    if (!pack_chunks) continue;
                    assert_int_equal(st.pack_first, pack_first);
                    /* The warm start: the span packed before this one. */
                    assert_int_equal(st.warm_chunks, last_packed >= 0 ? last_span : 0);
                    if (last_packed >= 0) assert_int_equal(st.warm_first, last_packed);
                    last_packed = pack_first;
                    last_span = pack_chunks;
                }
                kvf_scheme_free(s);
            }
}

static void refuses_bad_arguments(void **state) {
    (void)state;
    kvf_scheme *s = policy_scheme(1, 0, 0);
    kvf_chunk_step st;
    assert_int_equal(kvf_chunk_policy(s, -1, &st), KVF_EINVAL);
    assert_int_equal(kvf_chunk_policy(NULL, 0, &st), KVF_EINVAL);
    assert_int_equal(kvf_chunk_policy(s, 0, NULL), KVF_EINVAL);
    /* The defaults pack every chunk in its own append. */
    assert_int_equal(kvf_chunk_policy(s, 5, &st), KVF_OK);
    assert_int_equal(st.pack_first, 5);
    assert_int_equal(st.pack_chunks, 1);
    assert_int_equal(st.warm_first, 4);
    kvf_scheme_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(matches_a_simulated_cache),
        cmocka_unit_test(refuses_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
