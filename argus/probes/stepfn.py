"""--step-fn: a native function of the process whose every call ends a step.

Not a library channel (the function is the user's, found per process when attached: argus/agent/
attach.py), but its call is in the call table like every other: argus/bpf/steps.bpf.c, compiled in
every unit, records it as a sync with call id CALL_step_marker.
"""

from __future__ import annotations

from argus.probes.base import MARKER, register_calls

STEP_MARKER = "step_marker"
CHANNEL_NAME = "step"
register_calls([STEP_MARKER], CHANNEL_NAME, MARKER)
