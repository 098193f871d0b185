"""Every Python mirror in argus/probes/records.py has the size and field offsets bcc compiled for the
C struct in argus/bpf/records.h (the values are measured by a BPF program, not recomputed in Python)."""

from __future__ import annotations

import ctypes
from typing import List, Tuple

import pytest

from argus.agent.bpfprog import BPF_DIR
from argus.probes.records import MIRRORS

pytestmark = pytest.mark.bpf


def layout_items() -> List[Tuple[str, str, str]]:
    """(label, C expression, python value) for every struct size and field offset."""
    items = []
    for cname, cls in MIRRORS.items():
        items.append((f"sizeof({cname})", f"sizeof(struct {cname})", str(ctypes.sizeof(cls))))
        for fname, _t in cls._fields_:
            off = getattr(cls, fname).offset
            items.append((f"{cname}.{fname}", f"offsetof(struct {cname}, {fname})", str(off)))
    return items


def test_python_mirrors_match_the_compiled_c_layout() -> None:
    from bcc import BPF

    items = layout_items()
    body = "\n".join(
        f"    i = {n}; v = {expr}; layout.update(&i, &v);" for n, (_label, expr, _py) in enumerate(items)
    )
    text = f"""
#include <uapi/linux/ptrace.h>
#include "records.h"
BPF_ARRAY(layout, u64, {len(items)});
int fill(struct pt_regs *ctx) {{
    int i; u64 v;
{body}
    return 0;
}}
"""
    b = BPF(text=text, cflags=[f"-I{BPF_DIR}"])
    try:
        b.attach_uprobe(name="c", sym="getpid", fn_name="fill")
        ctypes.CDLL("libc.so.6").getpid()
        table = b["layout"]
        compiled = {label: int(table[ctypes.c_int(n)].value) for n, (label, _e, _p) in enumerate(items)}
    finally:
        b.cleanup()
    mismatches = {label: (compiled[label], int(py)) for label, _e, py in items if compiled[label] != int(py)}
    assert not mismatches, f"C vs Python (compiled, mirror): {mismatches}"
    assert compiled["sizeof(rec_comm_init)"] > 128  # the table was really filled


def test_records_decode_from_the_ring_memory_as_from_bytes() -> None:
    """decode_from (the agent's path: bcc's ring memory at an offset, one copy) gives what
    decode(bytes) gives, and refuses what decode refuses."""
    from argus.probes import records as R

    for kind, cls in R._BY_KIND.items():
        rec = cls()
        rec.h.kind, rec.h.tgid, rec.h.ts = kind, 4242, 10**18 + kind
        raw = bytes(rec) + b"\xff" * 8  # a record may come with trailing bytes
        buf = bytearray(b"\x00" * 24 + raw)
        got = R.decode_from(buf, 24, len(raw))
        assert type(got) is cls and bytes(got) == bytes(R.decode(raw)) == bytes(rec)
    buf = bytearray(64)
    buf[:4] = (999).to_bytes(4, "little")
    for size, says in ((8, "short record"), (64, "unknown record kind 999")):
        with pytest.raises(R.DecodeError, match=says):
            R.decode_from(buf, 0, size)
    buf[:4] = R.REC_NCCL.to_bytes(4, "little")
    with pytest.raises(R.DecodeError, match="expected"):
        R.decode_from(buf, 0, ctypes.sizeof(R.RecHdr))
