"""Struct offsets of CPython 3.9-3.13 (x86-64, default GIL builds): the table and how it is derived.

Every value was printed by `DERIVE_C` (offsetof / sizeof compiled with -DPy_BUILD_CORE against
each interpreter's own headers: pyenv 3.9.18, 3.10.13, 3.11.7, 3.12.1, 3.13.0 and Debian's 3.11.2,
which agrees with 3.11.7). `tests/test_python_units.py` recompiles it against every interpreter
whose headers are on the machine and compares. 3.13+ also carries `_Py_DebugOffsets` at the start
of `_PyRuntime`; `argus.probes.cpython` reads those from the process and prefers them, so a patch
release that moves a field is still walked correctly.

Regenerate a row: `python -m argus.probes.cpython_offsets PREFIX/include/python3.X`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple

SUPPORTED: Tuple[Tuple[int, int], ...] = ((3, 9), (3, 10), (3, 11), (3, 12), (3, 13))
SUPPORTED_TEXT = "3.9-3.13"
NONE = -1  # the field does not exist in this version
PY_FRAME_READ = 72  # bytes the BPF walk reads per frame (argus/bpf/records.h)


@dataclass(frozen=True)
class Offsets:
    runtime_interpreters_head: int
    runtime_tstate_current: int  # gilstate.tstate_current (3.9-3.11); NONE after
    interp_next: int
    interp_threads_head: int  # tstate_head (3.9, 3.10), threads.head (3.11+)
    tstate_next: int
    tstate_interp: int
    tstate_thread_id: int  # pthread_t of the thread
    tstate_native_thread_id: int  # the kernel tid (3.11+)
    tstate_frame: int  # the current frame, or the _PyCFrame pointer when cframe_frame != NONE
    cframe_frame: int  # _PyCFrame.current_frame (3.11, 3.12)
    frame_code: int  # f_code / f_executable
    frame_back: int  # f_back / previous
    frame_owner: int  # owner byte; NONE where no C-stack shim frames exist (3.9-3.11)
    code_qualname: int  # NONE before 3.11 (qualnames are rebuilt from the source file)
    code_name: int
    code_filename: int
    code_firstlineno: int
    unicode_state: int
    unicode_ascii_data: int  # sizeof(PyASCIIObject)
    unicode_compact_data: int  # sizeof(PyCompactUnicodeObject)
    object_type: int
    type_name: int

    def as_dict(self) -> Dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def frame_fields_fit(self) -> bool:
        """Whether the BPF walk's one read per frame (PY_FRAME_READ bytes, argus/bpf/python.bpf.c) holds
        the code, caller and owner fields; the walk masks the two pointer offsets to 0..63."""
        ptrs_ok = all(0 <= o <= 63 and o + 8 <= PY_FRAME_READ for o in (self.frame_code, self.frame_back))
        return ptrs_ok and (self.frame_owner == NONE or 0 <= self.frame_owner < PY_FRAME_READ)


_3_9_10 = dict(
    runtime_interpreters_head=32,
    runtime_tstate_current=568,
    interp_next=0,
    interp_threads_head=8,
    tstate_next=8,
    tstate_interp=16,
    tstate_thread_id=176,
    tstate_native_thread_id=NONE,
    tstate_frame=24,
    cframe_frame=NONE,
    frame_code=32,
    frame_back=24,
    frame_owner=NONE,
    code_qualname=NONE,
    code_name=112,
    code_filename=104,
    code_firstlineno=40,
    unicode_state=32,
    unicode_ascii_data=48,
    unicode_compact_data=72,
    object_type=8,
    type_name=24,
)

TABLE: Dict[Tuple[int, int], Offsets] = {
    (3, 9): Offsets(**_3_9_10),
    (3, 10): Offsets(**_3_9_10),
    (3, 11): Offsets(
        runtime_interpreters_head=40,
        runtime_tstate_current=576,
        interp_next=0,
        interp_threads_head=16,
        tstate_next=8,
        tstate_interp=16,
        tstate_thread_id=152,
        tstate_native_thread_id=160,
        tstate_frame=56,
        cframe_frame=8,
        frame_code=32,
        frame_back=48,
        frame_owner=NONE,
        code_qualname=128,
        code_name=120,
        code_filename=112,
        code_firstlineno=72,
        unicode_state=32,
        unicode_ascii_data=48,
        unicode_compact_data=72,
        object_type=8,
        type_name=24,
    ),
    (3, 12): Offsets(
        runtime_interpreters_head=40,
        runtime_tstate_current=NONE,
        interp_next=0,
        interp_threads_head=72,
        tstate_next=8,
        tstate_interp=16,
        tstate_thread_id=136,
        tstate_native_thread_id=144,
        tstate_frame=56,
        cframe_frame=0,
        frame_code=0,
        frame_back=8,
        frame_owner=70,
        code_qualname=128,
        code_name=120,
        code_filename=112,
        code_firstlineno=68,
        unicode_state=32,
        unicode_ascii_data=40,
        unicode_compact_data=56,
        object_type=8,
        type_name=24,
    ),
    (3, 13): Offsets(
        runtime_interpreters_head=632,
        runtime_tstate_current=NONE,
        interp_next=7264,
        interp_threads_head=7344,
        tstate_next=8,
        tstate_interp=16,
        tstate_thread_id=152,
        tstate_native_thread_id=160,
        tstate_frame=72,
        cframe_frame=NONE,
        frame_code=0,
        frame_back=8,
        frame_owner=70,
        code_qualname=128,
        code_name=120,
        code_filename=112,
        code_firstlineno=68,
        unicode_state=32,
        unicode_ascii_data=40,
        unicode_compact_data=56,
        object_type=8,
        type_name=24,
    ),
}

DERIVE_C = r"""
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include <frameobject.h>
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#include "internal/pycore_pystate.h"
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#include "internal/pycore_code.h"
#endif
#define P(name, expr) printf("%s %ld\n", name, (long)(expr))
int main(void) {
    P("runtime_interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
#if PY_VERSION_HEX < 0x030C0000
    P("runtime_tstate_current", offsetof(_PyRuntimeState, gilstate.tstate_current));
#endif
    P("interp_next", offsetof(PyInterpreterState, next));
#if PY_VERSION_HEX >= 0x030B0000
    P("interp_threads_head", offsetof(PyInterpreterState, threads.head));
    P("tstate_native_thread_id", offsetof(PyThreadState, native_thread_id));
#else
    P("interp_threads_head", offsetof(PyInterpreterState, tstate_head));
#endif
    P("tstate_next", offsetof(PyThreadState, next));
    P("tstate_interp", offsetof(PyThreadState, interp));
    P("tstate_thread_id", offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX >= 0x030D0000
    P("tstate_frame", offsetof(PyThreadState, current_frame));
    P("frame_code", offsetof(_PyInterpreterFrame, f_executable));
#elif PY_VERSION_HEX >= 0x030B0000
    P("tstate_frame", offsetof(PyThreadState, cframe));
    P("cframe_frame", offsetof(_PyCFrame, current_frame));
    P("frame_code", offsetof(_PyInterpreterFrame, f_code));
#else
    P("tstate_frame", offsetof(PyThreadState, frame));
    P("frame_code", offsetof(PyFrameObject, f_code));
    P("frame_back", offsetof(PyFrameObject, f_back));
#endif
#if PY_VERSION_HEX >= 0x030B0000
    P("frame_back", offsetof(_PyInterpreterFrame, previous));
    P("code_qualname", offsetof(PyCodeObject, co_qualname));
#endif
#if PY_VERSION_HEX >= 0x030C0000
    P("frame_owner", offsetof(_PyInterpreterFrame, owner));
#endif
    P("code_name", offsetof(PyCodeObject, co_name));
    P("code_filename", offsetof(PyCodeObject, co_filename));
    P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
    P("unicode_state", offsetof(PyASCIIObject, state));
    P("unicode_ascii_data", sizeof(PyASCIIObject));
    P("unicode_compact_data", sizeof(PyCompactUnicodeObject));
    P("object_type", offsetof(PyObject, ob_type));
    P("type_name", offsetof(PyTypeObject, tp_name));
    return 0;
}
"""


def derive(include_dirs: Tuple[str, ...], cc: str = "cc") -> Offsets:
    """Compile DERIVE_C against an interpreter's headers and run it (needs a C compiler)."""
    with tempfile.TemporaryDirectory(prefix="argus-pyoff-") as tmp:
        src, exe = os.path.join(tmp, "off.c"), os.path.join(tmp, "off")
        with open(src, "w") as f:
            f.write(DERIVE_C)
        args = [cc, "-w", *[f"-I{d}" for d in include_dirs], "-o", exe, src]
        subprocess.run(args, check=True, capture_output=True, text=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    values = {f.name: NONE for f in fields(Offsets)}
    for line in out.splitlines():
        name, value = line.split()
        values[name] = int(value)
    return Offsets(**values)


def lookup(version: Tuple[int, int]) -> Optional[Offsets]:
    return TABLE.get(version)


if __name__ == "__main__":
    print(derive(tuple(sys.argv[1:])))
