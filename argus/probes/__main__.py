"""Where `argus probe` would attach in a library file, without a process or root.

    python -m argus.probes /usr/lib/x86_64-linux-gnu/libcuda.so.1

One line per probed function: the exported symbol, the function probed (the implementation behind
a dispatch stub, or the symbol itself), the instruction the uprobe lands on, and whether the kernel
emulates it (~1 µs a hit) or single-steps it (~13 µs). Exit 1 when any is single-stepped.
"""

from __future__ import annotations

import os
import re
import sys
from typing import List

from argus.probes import libcuda, libcudart, libnccl
from argus.probes.base import LibraryProbes, MappedLibrary, resolve

CHANNELS = (libcuda.CHANNEL, libcudart.CHANNEL, libnccl.CHANNEL)


def table(lp: LibraryProbes) -> List[str]:
    rows = [f"{'symbol':<28} {'stub slot':>10} {'probed at':>10}  {'first instruction':<22} cost"]
    for p in lp.probes:
        slot = f"{p.stub.slot:#x}" if p.stub is not None else "-"
        where = f"{p.address:#x}"
        cost = "emulated" if p.plan.fast else "SINGLE-STEPPED"
        note = " (same implementation as another name: probed once)" if p.duplicate else ""
        insn = p.plan.insn + (f" +{p.plan.offset}" if p.plan.offset else "")
        rows.append(f"{p.spec.symbol:<28} {slot:>10} {where:>10}  {insn:<22} {cost}{note}")
    for name in lp.missing_required + lp.missing_optional:
        rows.append(f"{name:<28} (not in this library)")
    return rows


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    path = os.path.realpath(argv[0])
    base = os.path.basename(argv[0])
    chans = [c for c in CHANNELS if re.fullmatch(c.library_re, base)]
    if not chans:
        print(f"ERROR: {base} is none of libcuda.so*, libcudart.so*, libnccl.so*", file=sys.stderr)
        return 2
    st = os.stat(path)
    lp = resolve(chans[0], MappedLibrary(argv[0], path, (st.st_dev, st.st_ino)))
    for row in table(lp):
        print(row)
    live = [p for p in lp.probes if not p.duplicate]
    behind = sum(1 for p in live if p.stub is not None)
    slow = sum(1 for p in live if not p.plan.fast)
    print(f"{base}: {len(live)} functions probed, {behind} behind a dispatch stub, {slow} single-stepped")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
