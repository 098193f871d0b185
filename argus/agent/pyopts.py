"""Command-line options of the Python, host and GPU-metric channels, shared by `probe` and `record`."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import click

from argus.agent.phases import PhaseSpecError, parse_phase_option
from argus.agent.pyagent import PyOptions
from argus.errors import UsageError
from argus.probes import cpython, host
from argus.probes.base import Channel

F = Callable[..., Any]


def python_options(f: F) -> F:
    """The options, as one decorator (kept out of each command's long option list)."""
    opts = [
        click.option(
            "--no-python", is_flag=True, help="Skip the Python channel (stack sampling, phases, GC)."
        ),
        click.option(
            "--python-hz",
            type=click.IntRange(1, 999),
            default=49,
            show_default=True,
            help="Python stack samples per second per CPU (software CPU_CLOCK).",
        ),
        click.option(
            "--phase",
            "phases",
            multiple=True,
            metavar="NAME=PATTERN",
            help="Extra phase rule, before the defaults (qualname glob, or PATHGLOB:QUALGLOB). Repeatable.",
        ),
        click.option("--no-default-phases", is_flag=True, help="Only the --phase rules name phases."),
        click.option(
            "--python-precise",
            "precise",
            multiple=True,
            metavar="QUALNAME",
            help="Also time every call of these functions (glob) with an eval-loop uprobe: opt-in, "
            "~1-3 µs per Python call entered from C (docs/probe.md). Repeatable.",
        ),
        click.option(
            "--python-stacks",
            type=click.IntRange(0, 50),
            default=5,
            show_default=True,
            help="Folded stacks kept per step (python and host sections).",
        ),
        click.option(
            "--host-channel/--no-host",
            "host_channel",
            default=None,
            help="Host channel: native+kernel stacks and off-CPU time per thread. Off by default in "
            "`probe` (measured on a CPU PyTorch loop: +59% step time, the agent symbolising native "
            "stacks on 65% of a core); on by default in `record`.",
        ),
        click.option(
            "--host-hz",
            type=click.IntRange(1, 999),
            default=19,
            show_default=True,
            help="Native stack samples per second per CPU.",
        ),
        click.option("--no-gpu-metrics", is_flag=True, help="Skip the NVML GPU-metrics channel."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def from_cli(
    aux: Dict[str, Any], host_default: bool = False
) -> Tuple[List[Channel], PyOptions, Dict[str, Any]]:
    """(channels to add, Python options, BpfOptions fields) from the parsed options."""
    rules = []
    for spec in aux.get("phases", ()):
        try:
            rules.append(parse_phase_option(spec))
        except PhaseSpecError as e:
            raise UsageError(f"--phase: {e}", "e.g. --phase forward=MyModel.forward") from None
    if aux.get("no_default_phases") and not rules:
        raise UsageError("--no-default-phases without any --phase names no phase", "add --phase NAME=PATTERN")
    python = not aux.get("no_python")
    host_on = host_default if aux.get("host_channel") is None else bool(aux.get("host_channel"))
    channels: List[Channel] = []
    if python:
        channels.append(cpython.CHANNEL)
    if host_on:
        channels.append(host.CHANNEL)
    po = PyOptions(
        python=python,
        host=host_on,
        hz=int(aux.get("python_hz", 49)),
        host_hz=int(aux.get("host_hz", 19)),
        phases=tuple(rules),
        default_phases=not aux.get("no_default_phases"),
        precise=tuple(aux.get("precise", ())),
        top_stacks=int(aux.get("python_stacks", 5)),
    )
    bpf = {"python_hz": po.hz, "host_hz": po.host_hz}
    return channels, po, bpf
