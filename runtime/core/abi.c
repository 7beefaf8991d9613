/* The kernel-interface version: a hash of templates/kvf_abi.h as embedded in
 * this library (the generator writes it into every module, a context checks
 * it in every image it loads). */
#include "internal.h"

#include <pthread.h>
#include <xxhash.h>

static uint32_t abi;
static pthread_once_t abi_once = PTHREAD_ONCE_INIT;

static void abi_init(void) {
    const kvf_embedded_file *f = kvf_find_embedded(kvf_embedded_templates, "kvf_abi.h");
    /* The header is embedded with the templates (Makefile): never absent.
     * 31 bits: PTX writes a .u32 initializer as a signed decimal, and the
     * image checks (tests) read it back as text. */
    abi = f ? XXH32(f->data, f->size, 0) & 0x7fffffffu : 0;
}

uint32_t kvf_kernel_abi(void) {
    pthread_once(&abi_once, abi_init);
    return abi;
}
