/* Shared between the simulated libcuda.so.1 and libnccl.so.2.
 *
 * The simulated GPU keeps *virtual* time per stream: every operation has a modelled
 * duration and starts at max(stream's previous completion, the host time it was enqueued).
 * Nothing spins; host-blocking calls sleep until the virtual completion time, so eight
 * "GPUs" run on two cores with faithful timing.
 *
 * Only the argusSim* functions below are sim-specific; everything else in the libraries
 * carries the real driver-API / NCCL name and C signature.
 */
#ifndef ARGUS_SIMGPU_H
#define ARGUS_SIMGPU_H

#include <stdint.h>

/* A stream operation executed by the stream's worker thread. `ready_ns` is the virtual time at
 * which the stream reaches the operation; the function returns the virtual completion time and
 * may block (NCCL rendezvous). Setting *failed marks the stream failed (peer died, abort). */
typedef int64_t (*argus_sim_fn)(void *arg, int64_t ready_ns, int *failed);

/* Enqueue fn on a CUstream (NULL = the context's default stream). free_fn(arg) runs after. */
int argusSimStreamEnqueueFn(void *stream, argus_sim_fn fn, void *arg, void (*free_fn)(void *));

/* CLOCK_MONOTONIC in ns: the time base of all virtual GPU time. */
int64_t argusSimNow(void);

#endif
