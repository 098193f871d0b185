"""The BPF files are self-contained: each compiles on its own with what it includes, and the compile
unit of a set of channels is the same whatever order the channels come in (argus/agent/bpfprog.py
pastes each file's argus/bpf includes in, once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Sequence

import pytest

from argus.agent import bpfprog
from argus.agent import session as _session  # noqa: F401  (registers the step marker's call id)
from argus.probes import cpython, host, libcuda, libcudart, libnccl
from argus.probes.base import call_cflags

CHANNELS = [libcuda.CHANNEL, libcudart.CHANNEL, libnccl.CHANNEL, cpython.CHANNEL, host.CHANNEL]
ALL_MACROS = [c.macro for c in CHANNELS] + ["ARGUS_RECORD", "ARGUS_LAUNCH_LATENCY", "ARGUS_LAUNCH_WAIT"]


def _compile(text: str, macros: Sequence[str]) -> Any:
    from bcc import BPF

    return BPF(text=text, cflags=[f"-I{bpfprog.BPF_DIR}", *(f"-D{m}" for m in macros), *call_cflags()])


def _compile_unit(channels: Sequence[Any]) -> Any:
    from bcc import BPF

    opts = bpfprog.BpfOptions(launch_wait=True)  # the probe's defaults
    return BPF(text=bpfprog.source(channels), cflags=bpfprog.cflags(channels, opts))


def _functions(b: Any) -> List[str]:
    from bcc import lib

    return sorted(lib.bpf_function_name(b.module, i).decode() for i in range(lib.bpf_num_functions(b.module)))


@pytest.mark.bpf
def test_every_bpf_file_compiles_on_its_own() -> None:
    """A channel file with its own macro only (no other channel's file in the unit), every other
    file and header with every channel's macro, record mode and launch latency on."""
    own = {c.source: c.macro for c in CHANNELS}
    files = sorted(p.name for p in bpfprog.BPF_DIR.iterdir() if p.suffix in (".c", ".h"))
    assert {"argus.h", "helpers.h", "cuda.bpf.c", "offcpu.bpf.c"} <= set(files)
    for name in files:
        out: List[str] = []
        bpfprog._paste(name, out, set())
        text = "\n".join(out) + "\nint argus_alone(void *ctx) { return 0; }\n"
        extra = ["ARGUS_RECORD", "ARGUS_LAUNCH_LATENCY", "ARGUS_LAUNCH_WAIT"]
        macros = [own[name], *extra] if name in own else ALL_MACROS
        try:
            b = _compile(text, macros)
        except Exception as e:
            pytest.fail(f"{name} does not compile on its own ({e}); the compiler's message is above")
        b.cleanup()


@pytest.mark.bpf
def test_the_order_of_channels_does_not_change_the_programs() -> None:
    """The same programs of the same instruction counts (the bytes differ: map fds are in them)."""
    sizes = []
    for chans in (CHANNELS, CHANNELS[::-1]):
        b = _compile_unit(chans)
        sizes.append({f: len(b.dump_func(f)) for f in _functions(b)})
        b.cleanup()
    assert sizes[0] == sizes[1]
    assert "cuLaunchKernel_entry" in sizes[0] and "tracepoint__sched__sched_switch" in sizes[0]


def test_each_file_is_pasted_once_with_its_line_numbers() -> None:
    text = bpfprog.source(CHANNELS[::-1])
    for name in (
        "argus.h",
        "records.h",
        "helpers.h",
        "pyhooks.h",
        "pystack.h",
        "offcpu.bpf.c",
        "steps.bpf.c",
    ):
        assert text.count(f'#line 1 "{bpfprog.BPF_DIR / name}"') == 1, name
    assert '#include "' not in text  # every argus/bpf include is pasted: bcc rewrites map calls only there
    only_cuda = bpfprog.source([libcuda.CHANNEL])
    for name in ("python.bpf.c", "offcpu.bpf.c", "host.bpf.c"):
        assert f'"{bpfprog.BPF_DIR / name}"' not in only_cuda, name


def test_an_include_inside_an_if_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pasting a header once is what its include guard does, unless its first include was skipped."""
    (tmp_path / "a.h").write_text("#ifndef A_H\n#define A_H\nint a;\n#endif\n")
    (tmp_path / "x.bpf.c").write_text('#ifdef ARGUS_X\n#include "a.h"\n#endif\n')
    monkeypatch.setattr(bpfprog, "BPF_DIR", tmp_path)
    with pytest.raises(ValueError, match=r'x\.bpf\.c:2: #include "a\.h" inside an #if'):
        bpfprog._paste("x.bpf.c", [], set())
    (tmp_path / "y.bpf.c").write_text('#include "a.h"\n#include "a.h"\nint y;\n')
    out: List[str] = []
    bpfprog._paste("y.bpf.c", out, set())
    assert out.count("int a;") == 1 and out[-1] == "int y;"
