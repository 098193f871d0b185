"""Call a real NVIDIA library through ctypes, after a gate, and print the results as one JSON line.

    python nvidia_calls.py cudart|nccl|cuda LIBRARY GATE_FILE

Loads LIBRARY, prints ``loaded`` (the library is mapped: a probe can attach now), waits until
GATE_FILE exists (the test creates it once `argus probe` is tracing), makes the calls, prints
``{"calls": [[name, result], ...], "values": {...}}`` (in call order; "values" holds what the
calls wrote back), and exits 0.
No GPU or driver is needed: the calls that need one fail with their documented error codes.
Exit 3 when the gate never opens.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

GATE_TIMEOUT_S = 120.0


def wait_gate(path: str) -> None:
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"gate {path} never opened", file=sys.stderr)
            sys.exit(3)
        time.sleep(0.01)


def cudart_calls(lib: ctypes.CDLL) -> dict:
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    calls, values = [], {}

    def call(name: str, *args: object) -> int:
        rc = int(getattr(lib, name)(*args))
        calls.append([name, rc])
        return rc

    v = ctypes.c_int(-1)
    call("cudaRuntimeGetVersion", ctypes.byref(v))
    values["runtime_version"] = v.value
    v = ctypes.c_int(-1)
    call("cudaDriverGetVersion", ctypes.byref(v))
    values["driver_version"] = v.value  # 0: no driver
    n = ctypes.c_int(-1)
    rc = call("cudaGetDeviceCount", ctypes.byref(n))
    values["device_count"] = n.value
    values["device_count_error"] = lib.cudaGetErrorString(rc).decode()
    call("cudaSetDevice", 0)
    ptr = ctypes.c_void_p()
    call("cudaMalloc", ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
    call("cudaFree", ptr)
    call("cudaDeviceSynchronize")
    call("cudaSetDevice", 1 << 20)  # no such device: fails with or without a GPU
    call("cudaGetLastError")
    return {"calls": calls, "values": values}


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def nccl_calls(lib: ctypes.CDLL) -> dict:
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclCommInitRank.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        NcclUniqueId,
        ctypes.c_int,
    ]
    calls, values = [], {}
    v = ctypes.c_int(-1)
    calls.append(["ncclGetVersion", lib.ncclGetVersion(ctypes.byref(v))])
    values["version"] = v.value
    uid = NcclUniqueId()
    calls.append(["ncclGetUniqueId", lib.ncclGetUniqueId(ctypes.byref(uid))])
    comm = ctypes.c_void_p()
    # one rank of one; the unique id is passed by value (128 bytes on the stack). Fails without a GPU.
    rc = lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0)
    calls.append(["ncclCommInitRank", rc])
    values["comm"] = comm.value or 0
    values["init_error"] = lib.ncclGetErrorString(rc).decode()
    return {"calls": calls, "values": values}


CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2
LAUNCHES = {"exported": 7, "proc-address": 5, "exported _ptsz": 3, "proc-address _ptsz": 2}
GRAPH_LAUNCHES = 4


def cuda_calls(lib: ctypes.CDLL) -> dict:
    """The driver API both ways in: exported symbols (what code linked against libcuda calls) and
    pointers from cuGetProcAddress (what libcudart calls). Each launch path gets its own CUfunction
    (a zeroed buffer: the driver reads it and returns an error), so the probe's per-kernel counts
    say which path each launch came through. "calls" names each as the call it counts as."""
    calls, values = [], {}
    proto = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3))
    lib.cuGetProcAddress.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_uint64,
    ]

    def call(name: str, fn: object, *args: object) -> int:
        rc = int(fn(*args))  # type: ignore[operator]
        calls.append([name, rc])
        return rc

    call("cuInit", lib.cuInit, 0)  # 100 (no device) on a host without a GPU
    v = ctypes.c_int(-1)
    lib.cuDriverGetVersion(ctypes.byref(v))
    values["driver_version"] = v.value
    pointers = {}
    for label, flags in (
        ("proc-address", 0),
        ("proc-address _ptsz", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM),
    ):
        pfn = ctypes.c_void_p()
        rc = lib.cuGetProcAddress(b"cuLaunchKernel", ctypes.byref(pfn), 12000, flags)
        values[f"cuGetProcAddress {label}"] = [rc, pfn.value or 0]
        pointers[label] = proto(pfn.value)
    paths = {
        "exported": proto(ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value),
        "exported _ptsz": proto(ctypes.cast(lib.cuLaunchKernel_ptsz, ctypes.c_void_p).value),
        **pointers,
    }
    funcs = {label: ctypes.create_string_buffer(4096) for label in paths}
    values["functions"] = {label: ctypes.addressof(buf) for label, buf in funcs.items()}
    for label, fn in paths.items():
        f = ctypes.c_void_p(ctypes.addressof(funcs[label]))
        for _ in range(LAUNCHES[label]):
            call("cuLaunchKernel", fn, f, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    for _ in range(GRAPH_LAUNCHES):
        call("cuGraphLaunch", lib.cuGraphLaunch, ctypes.c_void_p(0x2001), None)
    call("cuStreamSynchronize", lib.cuStreamSynchronize, None)
    call("cuStreamSynchronize", lib.cuStreamSynchronize_ptsz, None)
    return {"calls": calls, "values": values}


def stub_slot(fn: object) -> int:
    """The slot an NVIDIA dispatch stub jumps through: its `jmp *disp32(%rip)` (ff 25), read here
    from the process's own memory, independently of argus."""
    addr = ctypes.cast(fn, ctypes.c_void_p).value or 0
    code = ctypes.string_at(addr, 32)
    at = code.index(b"\xff\x25")
    return addr + at + 6 + int.from_bytes(code[at + 2 : at + 6], "little", signed=True)


def main(argv: list) -> int:
    kind, path, gate = argv
    lib = ctypes.CDLL(path)
    interposer = None
    if kind == "cuda-interposed":  # a tool replaced cuLaunchKernel's slot before the probe came
        interposer = ctypes.CDLL(os.environ["ARGUS_TEST_INTERPOSER"])
        through = int(os.environ.get("ARGUS_TEST_INTERPOSE_THROUGH", "1"))
        assert interposer.interpose(ctypes.c_void_p(stub_slot(lib.cuLaunchKernel)), through) == 0
    print("loaded", flush=True)
    wait_gate(gate)
    out = {"cudart": cudart_calls, "nccl": nccl_calls, "cuda": cuda_calls, "cuda-interposed": cuda_calls}[
        kind
    ](lib)
    if interposer is not None:
        interposer.interposed_count.restype = ctypes.c_long
        out["values"]["interposed_calls"] = interposer.interposed_count()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
