/* dlopen of libcuda and libnvrtc, the checked-call error path, NVRTC compiles. */
#include "gpu/cuda_api.h"
#include "gen.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#ifndef KVF_DEFAULT_CUDA_HOME
#define KVF_DEFAULT_CUDA_HOME "/usr/local/cuda"
#endif

const char *kvf_cuda_home(void) {
    const char *home = getenv("CUDA_HOME");
    return home && *home ? home : KVF_DEFAULT_CUDA_HOME;
}

/* ------------------------------------------------------------------- libcuda */

static kvf_cuda_api cuda_api;
static int cuda_status = 1; /* 1 = not tried */
static char cuda_msg[512];
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

#define SYM(lib, api, field, name)                                                   \
    do {                                                                             \
        *(void **)&(api)->field = dlsym(lib, name);                                  \
        if (!(api)->field) { missing = name; goto fail; }                            \
    } while (0)

static int load_cuda_locked(void) {
    const char *missing = NULL;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(cuda_msg, sizeof cuda_msg, "no CUDA driver: dlopen(libcuda.so.1): %s", dlerror());
        return KVF_ENOCUDA;
    }
    kvf_cuda_api *a = &cuda_api;
    SYM(lib, a, cuInit, "cuInit");
    SYM(lib, a, cuDeviceGetCount, "cuDeviceGetCount");
    SYM(lib, a, cuDeviceGet, "cuDeviceGet");
    SYM(lib, a, cuDeviceGetAttribute, "cuDeviceGetAttribute");
    SYM(lib, a, cuDeviceGetName, "cuDeviceGetName");
    SYM(lib, a, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(lib, a, cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    SYM(lib, a, cuCtxPushCurrent, "cuCtxPushCurrent_v2");
    SYM(lib, a, cuCtxPopCurrent, "cuCtxPopCurrent_v2");
    SYM(lib, a, cuCtxSynchronize, "cuCtxSynchronize");
    SYM(lib, a, cuModuleLoadData, "cuModuleLoadData");
    SYM(lib, a, cuModuleUnload, "cuModuleUnload");
    SYM(lib, a, cuModuleGetFunction, "cuModuleGetFunction");
    SYM(lib, a, cuFuncSetAttribute, "cuFuncSetAttribute");
    SYM(lib, a, cuModuleGetGlobal, "cuModuleGetGlobal_v2");
    SYM(lib, a, cuLaunchKernel, "cuLaunchKernel");
    SYM(lib, a, cuGetErrorName, "cuGetErrorName");
    SYM(lib, a, cuGetErrorString, "cuGetErrorString");
    SYM(lib, a, cuMemAlloc, "cuMemAlloc_v2");
    SYM(lib, a, cuMemFree, "cuMemFree_v2");
    SYM(lib, a, cuMemcpyHtoD, "cuMemcpyHtoD_v2");
    SYM(lib, a, cuMemcpyDtoH, "cuMemcpyDtoH_v2");
    SYM(lib, a, cuMemsetD8, "cuMemsetD8_v2");
    SYM(lib, a, cuMemsetD32Async, "cuMemsetD32Async");
    SYM(lib, a, cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
    SYM(lib, a, cuEventCreate, "cuEventCreate");
    SYM(lib, a, cuEventDestroy, "cuEventDestroy_v2");
    SYM(lib, a, cuEventRecord, "cuEventRecord");
    SYM(lib, a, cuEventSynchronize, "cuEventSynchronize");
    SYM(lib, a, cuEventElapsedTime, "cuEventElapsedTime_v2");
    SYM(lib, a, cuStreamSynchronize, "cuStreamSynchronize");
    CUresult r = a->cuInit(0);
    if (r == CUDA_ERROR_NO_DEVICE) {
        snprintf(cuda_msg, sizeof cuda_msg, "no CUDA device: cuInit(0) returned CUDA_ERROR_NO_DEVICE");
        return KVF_ENODEV;
    }
    if (r != CUDA_SUCCESS) {
        const char *name = "?";
        a->cuGetErrorName(r, &name);
        snprintf(cuda_msg, sizeof cuda_msg, "no usable CUDA driver: cuInit(0) failed: %s", name);
        return KVF_ENODEV;
    }
    return KVF_OK;
fail:
    snprintf(cuda_msg, sizeof cuda_msg, "libcuda.so.1 lacks %s (driver too old?)", missing);
    dlclose(lib);
    return KVF_ENOCUDA;
}

/* Run a loader once (under load_lock); its outcome, a failure with its
 * message, is kept for every later call. */
static int load_once(int *status, int (*load_locked)(void), const char *msg) {
    pthread_mutex_lock(&load_lock);
    if (*status == 1) *status = load_locked();
    int rc = *status;
    pthread_mutex_unlock(&load_lock);
    return rc ? kvf_set_error(rc, "%s", msg) : KVF_OK;
}

int kvf_cuda_load(const kvf_cuda_api **api) {
    int rc = load_once(&cuda_status, load_cuda_locked, cuda_msg);
    if (!rc) *api = &cuda_api;
    return rc;
}

int kvf_cuda_fail(CUresult r, const char *call, const char *file, int line, int device) {
    const char *name = "CUDA_ERROR_UNKNOWN", *text = "";
    if (cuda_api.cuGetErrorName) cuda_api.cuGetErrorName(r, &name);
    if (cuda_api.cuGetErrorString) cuda_api.cuGetErrorString(r, &text);
    return kvf_set_error(KVF_ECUDA, "%s failed: %s (%s) at %s:%d on device %d", call, name, text ? text : "",
                         file, line, device);
}

int kvf_device_count(int *count) {
    const kvf_cuda_api *a;
    *count = 0;
    int rc = kvf_cuda_load(&a);
    if (rc) return rc;
    KVF_CU(a, -1, cuDeviceGetCount(count));
    return *count ? KVF_OK : kvf_set_error(KVF_ENODEV, "no CUDA device: cuDeviceGetCount returned 0");
}

/* -------------------------------------------------------------------- NVRTC */

static kvf_nvrtc_api nvrtc_api;
static int nvrtc_status = 1;
static char nvrtc_msg[1024];

static void *open_nvrtc(void) {
    const char *env = getenv("KVFORGE_NVRTC_PATH");
    if (env && *env) return dlopen(env, RTLD_NOW | RTLD_LOCAL);
    static const char *const sonames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
    for (size_t i = 0; i < sizeof sonames / sizeof *sonames; i++) {
        void *lib = dlopen(sonames[i], RTLD_NOW | RTLD_LOCAL);
        if (lib) return lib;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/lib64/libnvrtc.so", kvf_cuda_home());
    return dlopen(path, RTLD_NOW | RTLD_LOCAL);
}

static int load_nvrtc_locked(void) {
    const char *missing = NULL;
    void *lib = open_nvrtc();
    if (!lib) {
        const char *env = getenv("KVFORGE_NVRTC_PATH");
        snprintf(nvrtc_msg, sizeof nvrtc_msg,
                 "NVRTC not found (tried %s): %s; only precompiled (exported) kernels can load",
                 env && *env ? env : "libnvrtc.so.13, .12, $CUDA_HOME/lib64/libnvrtc.so", dlerror());
        return KVF_ENONVRTC;
    }
    kvf_nvrtc_api *a = &nvrtc_api;
    SYM(lib, a, nvrtcVersion, "nvrtcVersion");
    SYM(lib, a, nvrtcGetNumSupportedArchs, "nvrtcGetNumSupportedArchs");
    SYM(lib, a, nvrtcGetSupportedArchs, "nvrtcGetSupportedArchs");
    SYM(lib, a, nvrtcCreateProgram, "nvrtcCreateProgram");
    SYM(lib, a, nvrtcDestroyProgram, "nvrtcDestroyProgram");
    SYM(lib, a, nvrtcCompileProgram, "nvrtcCompileProgram");
    SYM(lib, a, nvrtcGetCUBINSize, "nvrtcGetCUBINSize");
    SYM(lib, a, nvrtcGetCUBIN, "nvrtcGetCUBIN");
    SYM(lib, a, nvrtcGetPTXSize, "nvrtcGetPTXSize");
    SYM(lib, a, nvrtcGetPTX, "nvrtcGetPTX");
    SYM(lib, a, nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize");
    SYM(lib, a, nvrtcGetProgramLog, "nvrtcGetProgramLog");
    SYM(lib, a, nvrtcGetErrorString, "nvrtcGetErrorString");
    a->nvrtcVersion(&a->major, &a->minor);
    return KVF_OK;
fail:
    snprintf(nvrtc_msg, sizeof nvrtc_msg, "libnvrtc lacks %s", missing);
    dlclose(lib);
    return KVF_ENONVRTC;
}

int kvf_nvrtc_load(const kvf_nvrtc_api **api) {
    int rc = load_once(&nvrtc_status, load_nvrtc_locked, nvrtc_msg);
    if (!rc) *api = &nvrtc_api;
    return rc;
}

const char *const *kvf_nvrtc_options(void) {
    /* No CUDA headers are included (the templates need none), so no -I. FMA
     * contraction is off: the templates ask for fused ops where they want
     * them, and the rest rounds like the CPU reference. */
    static const char *const opts[] = {"--std=c++17", "--fmad=false", "-default-device", "--split-compile=0", NULL};
    return opts;
}

int kvf_nvrtc_pick_arch(int cc_major, int cc_minor, char *arch, size_t len, int *ptx) {
    const kvf_nvrtc_api *a;
    int rc = kvf_nvrtc_load(&a);
    if (rc) return rc;
    int n = 0, want = cc_major * 10 + cc_minor, best = 0;
    a->nvrtcGetNumSupportedArchs(&n);
    int *archs = calloc((size_t)(n > 0 ? n : 1), sizeof *archs);
    if (!archs) return kvf_set_error(KVF_ENOMEM, "out of memory");
    a->nvrtcGetSupportedArchs(archs);
    for (int i = 0; i < n; i++) {
        if (archs[i] == want) best = want;
        else if (archs[i] < want && archs[i] > best && best != want) best = archs[i];
    }
    free(archs);
    if (best == want) {
        snprintf(arch, len, "sm_%d", want);
        *ptx = 0;
    } else if (best) { /* GPU newer than this NVRTC: PTX the driver can JIT */
        snprintf(arch, len, "compute_%d", best);
        *ptx = 1;
    } else {
        return kvf_set_error(KVF_ECOMPILE, "NVRTC %d.%d supports no arch at or below sm_%d", a->major,
                             a->minor, want);
    }
    return KVF_OK;
}

static void dump_failed_source(const char *name, const char *source, const char *log, char *where, size_t len) {
    const char *env = getenv("KVFORGE_DUMP_SOURCE");
    where[0] = 0;
    if (!env || strcmp(env, "1")) return;
    char path[512];
    const char *dir = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/kvforge-%s", dir && *dir ? dir : "/tmp", name);
    char src_path[600], log_path[600];
    snprintf(src_path, sizeof src_path, "%s.cu", path);
    snprintf(log_path, sizeof log_path, "%s.log", path);
    if (!kvf_write_file(src_path, source, strlen(source)) && !kvf_write_file(log_path, log, strlen(log)))
        snprintf(where, len, " (source and log written to %s and %s)", src_path, log_path);
}

#define NVRTC_CHECK(a, call)                                                                        \
    do {                                                                                            \
        nvrtcResult r_ = (a)->call;                                                                 \
        if (r_ != NVRTC_SUCCESS) {                                                                  \
            rc = kvf_set_error(KVF_ECOMPILE, "%s failed: %s at %s:%d", #call,                      \
                               (a)->nvrtcGetErrorString(r_), __FILE__, __LINE__);                   \
            goto done;                                                                              \
        }                                                                                           \
    } while (0)

/* The errors of a failed compile as NVRTC counts them: its log ends with
 * "N error(s) detected in the compilation of ..."; 0 without that line. */
static int log_errors(const char *log) {
    const char *p = strstr(log, " detected in the compilation of");
    if (!p) return 0;
    while (p > log && p[-1] != '\n') p--;
    int n = 0;
    return sscanf(p, "%d error", &n) == 1 ? n : 0;
}

/* A failed compile whose every error is a template's static_assert marked
 * KVF_NOT_ON_THIS_ARCH (kvf_common.cuh, the same text): a valid scheme this
 * arch cannot run, not a broken source. */
static int only_not_on_this_arch(const char *log) {
    const int marked = log ? kvf_count_str(log, "static assertion failed with \"[KVF_ENOTIMPL] ") : 0;
    return marked > 0 && marked == log_errors(log);
}

/* extra: one more option (NULL: none); report: when not NULL, the compile
 * log of a successful compile (the caller frees it). */
static int compile_program(const char *source, const char *name, const char *arch, int want_ptx, const char *extra,
                           void **image, size_t *size, char **report) {
    const kvf_nvrtc_api *a;
    int rc = kvf_nvrtc_load(&a);
    if (rc) return rc;
    /* The templates travel as include files. */
    const char *hdr_data[32], *hdr_name[32];
    int n_hdr = 0;
    for (const kvf_embedded_file *f = kvf_embedded_templates; f->name && n_hdr < 32; f++) {
        hdr_data[n_hdr] = f->data;
        hdr_name[n_hdr++] = f->name;
    }
    const char *const *base = kvf_nvrtc_options();
    const char *opts[16];
    int n_opt = 0;
    char arch_opt[64];
    snprintf(arch_opt, sizeof arch_opt, "--gpu-architecture=%s", arch);
    opts[n_opt++] = arch_opt;
    for (int i = 0; base[i]; i++) opts[n_opt++] = base[i];
    if (extra) opts[n_opt++] = extra;
    nvrtcProgram prog = NULL;
    char *log = NULL;
    *image = NULL;
    rc = KVF_OK;
    NVRTC_CHECK(a, nvrtcCreateProgram(&prog, source, name, n_hdr, hdr_data, hdr_name));
    nvrtcResult cr = a->nvrtcCompileProgram(prog, n_opt, opts);
    size_t log_size = 0;
    a->nvrtcGetProgramLogSize(prog, &log_size);
    log = calloc(1, log_size + 1);
    if (log && log_size) a->nvrtcGetProgramLog(prog, log);
    if (cr != NVRTC_SUCCESS) {
        char where[1400];
        dump_failed_source(name, source, log ? log : "", where, sizeof where);
        if (only_not_on_this_arch(log))
            rc = kvf_set_error(KVF_ENOTIMPL, "%s cannot run on %s: a template's check for the arch refused it "
                               "(NVRTC %d.%d log below)%s\n%s", name, arch, a->major, a->minor, where, log);
        else
            rc = kvf_set_error(KVF_ECOMPILE, "NVRTC %d.%d could not compile %s for %s: %s%s\n%s", a->major, a->minor,
                               name, arch, a->nvrtcGetErrorString(cr), where, log ? log : "");
        goto done;
    }
    if (want_ptx) NVRTC_CHECK(a, nvrtcGetPTXSize(prog, size));
    else NVRTC_CHECK(a, nvrtcGetCUBINSize(prog, size));
    *image = malloc(*size);
    if (!*image) { rc = kvf_set_error(KVF_ENOMEM, "out of memory for a %zu-byte image", *size); goto done; }
    if (want_ptx) NVRTC_CHECK(a, nvrtcGetPTX(prog, *image));
    else NVRTC_CHECK(a, nvrtcGetCUBIN(prog, *image));
    if (report) {
        if (!log) { rc = kvf_set_error(KVF_ENOMEM, "out of memory for the compile log"); goto done; }
        *report = log;
        log = NULL;
    }
done:
    if (rc) { free(*image); *image = NULL; }
    free(log);
    if (prog) a->nvrtcDestroyProgram(&prog);
    return rc;
}

int kvf_nvrtc_compile(const char *source, const char *name, const char *arch, int want_ptx, void **image,
                      size_t *size) {
    return compile_program(source, name, arch, want_ptx, NULL, image, size, NULL);
}

int kvf_nvrtc_compile_report(const char *source, const char *name, const char *arch, void **image, size_t *size,
                             char **report) {
    *report = NULL;
    return compile_program(source, name, arch, 0, "--ptxas-options=-v", image, size, report);
}
