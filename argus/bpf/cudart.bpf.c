/* CUDA runtime channel (libcudart.so.N).
 *
 * Thin on purpose: one return probe per call counts the call per (tgid, epoch) and its result when
 * non-zero (a cudaError_t). Launches, copies and syncs are measured by the driver channel
 * (libcuda.so.1), which every runtime call that reaches the GPU goes through; this channel adds
 * what only the runtime knows: which runtime calls ran and how they failed.
 * The runtime never closes an epoch (the driver's syncs do).
 */

#include "helpers.h"

static __always_inline int cudart_result(struct pt_regs *ctx, u32 call) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    count_call(tgid, call, cur_epoch(tgid));
    count_error(tgid, call, (s32)PT_REGS_RC(ctx));
    record_call(call, 0, 0, 0);
    return 0;
}

#define CUDART_PROBE(name) \
    int name##_return(struct pt_regs *ctx) { return cudart_result(ctx, CALL_##name); }

CUDART_PROBE(cudaRuntimeGetVersion)
CUDART_PROBE(cudaDriverGetVersion)
CUDART_PROBE(cudaGetDeviceCount)
CUDART_PROBE(cudaSetDevice)
CUDART_PROBE(cudaMalloc)
CUDART_PROBE(cudaFree)
CUDART_PROBE(cudaMallocAsync)
CUDART_PROBE(cudaFreeAsync)
CUDART_PROBE(cudaMemcpy)
CUDART_PROBE(cudaMemcpyAsync)
CUDART_PROBE(cudaMemsetAsync)
CUDART_PROBE(cudaLaunchKernel)
CUDART_PROBE(cudaLaunchKernelExC)
CUDART_PROBE(cudaStreamCreate)
CUDART_PROBE(cudaStreamCreateWithFlags)
CUDART_PROBE(cudaStreamSynchronize)
CUDART_PROBE(cudaStreamWaitEvent)
CUDART_PROBE(cudaDeviceSynchronize)
CUDART_PROBE(cudaEventCreate)
CUDART_PROBE(cudaEventRecord)
CUDART_PROBE(cudaEventSynchronize)
CUDART_PROBE(cudaEventElapsedTime)
CUDART_PROBE(cudaGetLastError)
