"""Call a real NVIDIA library through ctypes, after a gate, and print the results as one JSON line.

    python nvidia_calls.py cudart|nccl LIBRARY GATE_FILE

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


def main(argv: list) -> int:
    kind, path, gate = argv
    lib = ctypes.CDLL(path)
    print("loaded", flush=True)
    wait_gate(gate)
    out = cudart_calls(lib) if kind == "cudart" else nccl_calls(lib)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
