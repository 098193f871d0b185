"""What a return probe costs when only some calls need it: a uprobe session link against the
classic uprobe + uretprobe pair, on the simulated libcuda's cuEventQuery called in a tight loop by
the C driver (benchmarks/csrc/hitbench.c).

    sudo .venv/bin/python -m benchmarks.uprobe_session [--quick] [--calls 200000] [--reps 3]

The classic pair takes the return trap at every call, whatever the entry program found. A session
link (BPF_TRACE_UPROBE_SESSION, kernel >= 6.13) runs one program at both ends and the entry's
return value decides whether the return is probed at all (1: not), so a probe can take the return
only for the calls it records (the NCCL channel's sampled collectives, docs/architecture.md). bcc
0.26 has no API for it: the program is loaded by bcc with the session attach type and linked with
BPF_LINK_CREATE by hand. Prints ns per call above the unprobed call for: the classic pair, and a
session asking for the return at every call, 1 in 4, and never.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import struct
import sys
import time
from typing import Any, List, Tuple

from benchmarks._util import REPO, machine, need_root

sys.path.insert(0, str(REPO))

BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_SESSION = 57  # enum bpf_attach_type (uapi, kernel >= 6.13)
SYS_BPF = 321  # x86-64


def link_session(prog_fd: int, path: str, offset: int) -> Tuple[int, tuple]:
    """A uprobe session link of `prog_fd` at `offset` (a file offset) in `path`, every process;
    returns its fd and the buffers the kernel read (kept alive by the caller)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    cpath = ctypes.create_string_buffer(path.encode() + b"\0")
    offs = (ctypes.c_uint64 * 1)(offset)
    attr = bytearray(128)
    # link_create: prog_fd, target_fd, attach_type, flags; then uprobe_multi: path, offsets,
    # ref_ctr_offsets, cookies, cnt, flags, pid
    struct.pack_into("<IIII", attr, 0, prog_fd, 0, BPF_TRACE_UPROBE_SESSION, 0)
    struct.pack_into("<QQQQIII", attr, 16, ctypes.addressof(cpath), ctypes.addressof(offs), 0, 0, 1, 0, 0)
    buf = ctypes.create_string_buffer(bytes(attr), len(attr))
    fd = libc.syscall(SYS_BPF, BPF_LINK_CREATE, buf, len(attr))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"BPF_LINK_CREATE (uprobe session): {os.strerror(err)}")
    return int(fd), (cpath, offs)


def hits(b: Any, entry: int, ret: int) -> Tuple[int, int]:
    """The program's entry and return runs, as counted in its `hits` array."""
    h = b["hits"]
    return h[ctypes.c_int(entry)].value, h[ctypes.c_int(ret)].value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 20,000 calls, 1 run each")
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.quick:
        a.calls, a.reps = 20_000, 1
    if not need_root("uprobe_session"):
        return 3
    import tempfile

    # a build of the simulated libraries of its own: bcc 0.26 cannot put a second uprobe on an
    # instruction another process (an argus probe beside) already probes
    os.environ["ARGUS_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="argus-uprobe-session-")
    import atexit
    import shutil

    atexit.register(shutil.rmtree, cache, True)  # (each run left its build behind in /tmp)
    from bcc import BPF

    from argus.sim.build import build
    from benchmarks.probe_overhead import build_driver, libcuda_site, one_run

    libs, driver = build(), build_driver()
    path, libdir = str(libs.libcuda), libs.libcuda.parent
    addr, file_off = libcuda_site(path, "cuEventQuery")

    def med(n: int) -> float:
        return statistics.median(one_run(driver, libdir, "cuEventQuery", n, None) for _ in range(a.reps))

    base = med(a.calls)
    rows: List[Tuple[str, float, int, int]] = []
    src = str(REPO / "benchmarks" / "bpf" / "session.bpf.c")
    b = BPF(src_file=src)
    b.attach_uprobe(name=path, addr=addr, fn_name="classic_entry")
    b.attach_uretprobe(name=path, addr=addr, fn_name="classic_return")
    ns = med(a.calls)
    rows.append(("uprobe + uretprobe (classic pair)", ns - base, *hits(b, 2, 3)))
    b.cleanup()
    time.sleep(1)
    missing = ""
    for every, what in ((1, "every call"), (4, "1 call in 4"), (1 << 62, "no call")):
        b = BPF(src_file=src, cflags=[f"-DWANT_EVERY={every}ULL"])
        try:
            fn = b.load_func("session", BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_SESSION)
            lfd, keep = link_session(fn.fd, path, file_off)
        except Exception as e:  # bcc raises Exception when the kernel refuses the attach type
            missing = f"{e}".splitlines()[0][:160]
            b.cleanup()
            break
        ns = med(a.calls)
        os.close(lfd)
        del keep
        rows.append((f"session, return asked at {what}", ns - base, *hits(b, 0, 1)))
        b.cleanup()
    print(f"{machine()}\n")
    print(f"# the return probed only where needed: cuEventQuery, {a.calls} calls, median of {a.reps}\n")
    print(f"unprobed call: {base:.0f} ns\n")
    print("| probe | ns per call above the unprobed call | entry runs | return runs |")
    print("|---|---:|---:|---:|")
    for what, ns, entries, returns in rows:
        print(f"| {what} | {ns:.0f} | {entries:,} | {returns:,} |")
    if missing:
        print(f"| session links | not measured: uprobe sessions need Linux >= 6.13 ({missing}) | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
