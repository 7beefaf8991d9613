/* The CUDA driver API and NVRTC, loaded with dlopen (nothing needs a GPU or
 * NVRTC to build, test, or run precompiled kernels). */
#ifndef KVF_CUDA_API_H
#define KVF_CUDA_API_H

#include <cuda.h>
#include <nvrtc.h>

#include "internal.h"

typedef struct kvf_cuda_api {
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*cuDeviceGetName)(char *, int, CUdevice);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
    CUresult (*cuCtxPushCurrent)(CUcontext);
    CUresult (*cuCtxPopCurrent)(CUcontext *);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuModuleLoadData)(CUmodule *, const void *);
    CUresult (*cuModuleUnload)(CUmodule);
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*cuFuncSetAttribute)(CUfunction, CUfunction_attribute, int);
    CUresult (*cuModuleGetGlobal)(CUdeviceptr *, size_t *, CUmodule, const char *);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, CUstream, void **, void **);
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree)(CUdeviceptr);
    CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
    CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
    CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*cuEventCreate)(CUevent *, unsigned int);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*cuStreamSynchronize)(CUstream);
} kvf_cuda_api;

typedef struct kvf_nvrtc_api {
    nvrtcResult (*nvrtcVersion)(int *, int *);
    nvrtcResult (*nvrtcGetNumSupportedArchs)(int *);
    nvrtcResult (*nvrtcGetSupportedArchs)(int *);
    nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram *, const char *, const char *, int, const char *const *,
                                      const char *const *);
    nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram *);
    nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram, int, const char *const *);
    nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram, size_t *);
    nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram, char *);
    nvrtcResult (*nvrtcGetPTXSize)(nvrtcProgram, size_t *);
    nvrtcResult (*nvrtcGetPTX)(nvrtcProgram, char *);
    nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t *);
    nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram, char *);
    const char *(*nvrtcGetErrorString)(nvrtcResult);
    int major, minor;
} kvf_nvrtc_api;

/* Load libcuda and cuInit once: KVF_OK, KVF_ENOCUDA (message says why). */
int kvf_cuda_load(const kvf_cuda_api **api);
/* Load libnvrtc once ($KVFORGE_NVRTC_PATH, the soname, $CUDA_HOME/lib64). */
int kvf_nvrtc_load(const kvf_nvrtc_api **api);

/* Record a failed driver call: "cuX(...) failed: NAME (text) at file:line [device N]". */
int kvf_cuda_fail(CUresult r, const char *call, const char *file, int line, int device);

/* The checked-call macro for every driver call: on failure it records the
 * statement, file, line and device, and returns KVF_ECUDA from the caller. */
#define KVF_CU(api, device, call)                                                        \
    do {                                                                                 \
        CUresult kvf_cu_r_ = (api)->call;                                                \
        if (kvf_cu_r_ != CUDA_SUCCESS)                                                   \
            return kvf_cuda_fail(kvf_cu_r_, #call, __FILE__, __LINE__, (device));        \
    } while (0)

/* Compile CUDA source with NVRTC for an arch ("sm_90"): a cubin (or PTX when
 * want_ptx). headers/names are the templates passed as include files. On a
 * failed compile the message carries the log; KVFORGE_DUMP_SOURCE=1 writes
 * the source and log to files named in the message. */
int kvf_nvrtc_compile(const char *source, const char *name, const char *arch, int want_ptx,
                      void **image, size_t *size);
/* kvf_nvrtc_compile of a cubin with ptxas's per-kernel report (registers,
 * spills, stack, shared memory) in *report, NVRTC's log (the caller frees
 * it). The cubin differs in bytes from kvf_nvrtc_compile's (the options are
 * recorded in it), so it is not for the cache. */
int kvf_nvrtc_compile_report(const char *source, const char *name, const char *arch, void **image, size_t *size,
                             char **report);
/* The options every compile uses (for the cache key), NULL-terminated. */
const char *const *kvf_nvrtc_options(void);
/* Arch string for a device ("sm_90"), or the PTX fallback "compute_XX" when the
 * GPU is newer than NVRTC supports (*ptx set). */
int kvf_nvrtc_pick_arch(int cc_major, int cc_minor, char *arch, size_t len, int *ptx);

#endif
