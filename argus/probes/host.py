"""The host channel: native and kernel stacks of every target thread, on and off CPU.

No library to find: it applies to every probed process. Source: argus/bpf/host.bpf.c (sampling) and
argus/bpf/offcpu.bpf.c (sched_switch, shared with the Python channel).
"""

from __future__ import annotations

from argus.probes.base import Channel

CHANNEL = Channel(name="host", library_re=r"", source="host.bpf.c", specs=(), macro="ARGUS_HOST")
