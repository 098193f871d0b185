/* The Python channel's hooks in native probes (CUDA, NCCL): which Python phase issued the call.
 *
 * py_native_hit decides whether this call's Python stack is walked and stashes what the walk
 * needs; py_tail, at the end of the probe program, tail-calls the one program that walks
 * (py_walk_native). With the Python channel (ARGUS_PYTHON) both are defined in python.bpf.c,
 * which is then in the same compile unit; without it they are no-ops and compile to nothing.
 */
#ifndef ARGUS_PYHOOKS_H
#define ARGUS_PYHOOKS_H

#include "argus.h"

#ifdef ARGUS_PYTHON
static __always_inline void py_native_hit(u32 call, u64 aux, u32 how);
static __always_inline void py_tail(struct pt_regs *ctx);
#else
static __always_inline void py_native_hit(u32 call, u64 aux, u32 how) {}
static __always_inline void py_tail(struct pt_regs *ctx) {}
#endif

#endif
