"""Run a stand-in training job: one process per rank, as torchrun would start them.

    job = StandinJob(StandinConfig(ranks=4, steps=20, injects=["straggler:rank=1,factor=2"])).start()
    truth = job.wait(timeout=60)      # or: gate=True, wait_loaded(), attach a tracer, release()
    truth["step_times"][1]            # [(step, start_monotonic_ns, end_monotonic_ns), ...]

The async variant (cuda_async.c / nccl_async.c / train_async.py: collectives enqueued on streams,
CUDA events, a DDP-like rank loop, two simulated hosts):

    job = StandinJob(StandinConfig(variant="async", ranks=8, steps=20, nccl_timing=True)).start()
    truth = job.wait(timeout=60)
    truth["hosts"][5], truth["collectives"][3][0]["gpu_arrive_ns"]

Every rank is its own session (start_new_session), so stop() can kill each whole process
group; an atexit hook stops every job still running, so no rank outlives a test.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Set, Tuple

from tests.standins.build import VARIANTS, build
from tests.standins.train import LAYOUTS, Fault, SpecError, parse_fault

TRAIN_PY = Path(__file__).resolve().parent / "train.py"
TRAIN_ASYNC_PY = Path(__file__).resolve().parent / "train_async.py"
SHM_DIR = Path("/dev/shm")
ID_MAGIC = b"STANDIN-NCCL-ID1"

_LIVE: Set[StandinJob] = set()


@atexit.register
def _stop_all() -> None:
    for job in list(_LIVE):
        job.stop()


class StandinCrashed(RuntimeError):
    """A rank exited before its done line (its log tail is in the message)."""


@dataclass
class StandinConfig:
    ranks: int = 8
    steps: int = 50
    layout: str = "dp"  # "dp" or "pp-dp"
    injects: List[str] = field(default_factory=list)  # fault specs, see train.SPEC_HELP
    run_dir: Optional[str] = None  # default: a fresh temporary directory
    gate: bool = False  # ranks load both libraries, then wait for release()
    hang_hold_s: float = 10.0  # wait() keeps a hung job this long after the hang line, then kills it
    # CUDA_LAUNCH_BLOCKING=1: launches wait for their kernel, so a slow GPU makes its host late at
    # the (blocking) collectives; 0: the GPU's lateness stays inside the collective, invisible to
    # the host without GPU-side signals (the blocking family records no CUDA events).
    # None: 1 for the blocking variant, 0 for the async one (stock PyTorch sets nothing)
    launch_blocking: Optional[bool] = None
    # "blocking" (csrc/cuda.c, nccl.c, train.py) or "async" (csrc/cuda_async.c, nccl_async.c,
    # train_async.py: DDP-like, collectives enqueued on an NCCL stream, CUDA events, layout dp only)
    variant: str = "blocking"
    # ranks h*k .. h*k+k-1 on simulated host "standin-host<h>" (ARGUS_HOST, LOCAL_RANK,
    # LOCAL_WORLD_SIZE, GROUP_RANK set as torchrun sets them per node). None: for "async" two
    # hosts (ceil(ranks/2) ranks each), for "blocking" nothing set (as before)
    ranks_per_host: Optional[int] = None
    nccl_timing: bool = False  # TORCH_NCCL_ENABLE_TIMING=1 (async: start events, elapsed times)
    # async: a launch-bound job (every layer kernel unfused into many launches, past the 1024 a
    # stream holds) with a caching allocator's event queries: its host keeps pace with its GPU
    launch_bound: bool = False


@dataclass
class _RankState:
    proc: subprocess.Popen  # type: ignore[type-arg]
    log: IO[bytes]
    offset: int = 0
    partial: bytes = b""
    loaded: bool = False
    meta: Optional[Dict[str, Any]] = None
    steps: List[Dict[str, Any]] = field(default_factory=list)
    hang: Optional[Dict[str, Any]] = None
    works: List[Dict[str, Any]] = field(default_factory=list)
    error: Optional[Dict[str, Any]] = None
    done: Optional[Dict[str, Any]] = None
    returncode: Optional[int] = None


class StandinJob:
    def __init__(self, cfg: StandinConfig) -> None:
        if cfg.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {cfg.layout!r} (expected one of {', '.join(LAYOUTS)})")
        if cfg.ranks < 1 or cfg.ranks > 64:
            raise ValueError(f"ranks must be 1..64, not {cfg.ranks}")
        if cfg.layout == "pp-dp" and cfg.ranks % 2:
            raise ValueError(f"pp-dp pairs ranks (2i, 2i+1): ranks must be even, not {cfg.ranks}")
        if cfg.steps < 1:
            raise ValueError(f"steps must be >= 1, not {cfg.steps}")
        if cfg.variant not in VARIANTS:
            raise ValueError(f"unknown variant {cfg.variant!r} (expected one of {', '.join(VARIANTS)})")
        if cfg.variant == "async" and cfg.layout != "dp":
            raise ValueError(f"the async variant runs layout dp only, not {cfg.layout!r}")
        if cfg.ranks_per_host is not None and cfg.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, not {cfg.ranks_per_host}")
        self.cfg = cfg
        # parse here so a bad spec fails in the caller, with the spec in the message
        self.faults: List[Fault] = [parse_fault(s, cfg.ranks, cfg.steps, cfg.layout) for s in cfg.injects]
        hangs = [f for f in self.faults if f.kind == "hang"]
        if len(hangs) > 1:
            raise SpecError("at most one hang per job")
        self.job_id = f"standin-{secrets.token_hex(4)}"
        self.run_dir = Path(cfg.run_dir) if cfg.run_dir else Path(tempfile.mkdtemp(prefix="argus-standin-"))
        self.libdir: Optional[Path] = None
        self._ranks: Dict[int, _RankState] = {}
        self._hang_seen: Optional[float] = None
        self._stopped = False

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> StandinJob:
        if self._ranks:
            raise RuntimeError("job already started")
        self.libdir = build(variant=self.cfg.variant)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for pattern in ("rank*.jsonl", "rank*.log", "comm-*.uid", "comm-*.tmp*", "release"):
            for p in self.run_dir.glob(pattern):  # a reused run dir must not feed old ids or truth
                p.unlink()
        base = dict(os.environ)
        blocking = self.cfg.launch_blocking
        if blocking is None:
            blocking = self.cfg.variant == "blocking"
        base.update(
            WORLD_SIZE=str(self.cfg.ranks),
            LOCAL_WORLD_SIZE=str(self.cfg.ranks),
            GROUP_RANK="0",
            TORCHELASTIC_RUN_ID=self.job_id,
            STANDIN_LIBDIR=str(self.libdir),
            PYTHONUNBUFFERED="1",
            CUDA_LAUNCH_BLOCKING="1" if blocking else "0",
        )
        if self.cfg.nccl_timing:
            base["TORCH_NCCL_ENABLE_TIMING"] = "1"
        if self.cfg.launch_bound:
            base["STANDIN_LAUNCH_BOUND"] = "1"
            base["STANDIN_LAUNCH_QUEUE"] = "48"  # pending launches a stream: 2 layers of backward
        script = TRAIN_ASYNC_PY if self.cfg.variant == "async" else TRAIN_PY
        cmd = [sys.executable, str(script), "--layout", self.cfg.layout, "--steps", str(self.cfg.steps)]
        cmd += [a for s in self.cfg.injects for a in ("--inject", s)]
        if self.cfg.gate:
            cmd.append("--gate")
        _LIVE.add(self)
        per_host, hosts = self.per_host, self.hosts
        for r in range(self.cfg.ranks):
            env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
            if per_host:
                env.update(
                    ARGUS_HOST=hosts[r],
                    LOCAL_RANK=str(r % per_host),
                    LOCAL_WORLD_SIZE=str(per_host),
                    GROUP_RANK=str(r // per_host),
                )
            log = open(self.run_dir / f"rank{r}.log", "wb")
            proc = subprocess.Popen(
                cmd,
                cwd=self.run_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._ranks[r] = _RankState(proc, log)
        return self

    def release(self) -> None:
        """Let gated ranks make their first CUDA call."""
        (self.run_dir / "release").touch()

    def wait_loaded(self, timeout: float = 30.0) -> None:
        """Until every rank has both libraries mapped (with gate=True: and is waiting for release)."""
        deadline = time.monotonic() + timeout
        while not all(s.loaded for s in self._ranks.values()):
            self.poll()
            if time.monotonic() > deadline:
                missing = sorted(r for r, s in self._ranks.items() if not s.loaded)
                raise TimeoutError(f"ranks {missing} did not load the libraries within {timeout}s")
            time.sleep(0.02)

    def wait(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Until every rank is done; a hung job is held hang_hold_s after its hang line, then killed.
        Returns truth(). Raises StandinCrashed if a rank dies, TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            if all(s.done is not None for s in self._ranks.values()):
                for s in self._ranks.values():
                    s.returncode = s.proc.wait(timeout=30)
                self.stop()
                return self.truth()
            if self._hang_seen is not None and time.monotonic() - self._hang_seen >= self.cfg.hang_hold_s:
                self.stop()
                return self.truth()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} not done after {timeout}s ({self.steps_done()} steps)")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill every rank (and its process group), reap them, remove the NCCL segments."""
        for s in self._ranks.values():
            if s.proc.poll() is None:
                try:
                    os.killpg(s.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                s.returncode = s.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if not s.log.closed:
                s.log.close()
        if self._ranks and not self._stopped:
            self._read_all()
        for name in self.shm_names():
            try:
                (SHM_DIR / name.lstrip("/")).unlink()
            except FileNotFoundError:
                pass
        self._stopped = bool(self._ranks)
        _LIVE.discard(self)

    def __enter__(self) -> StandinJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------ state

    @property
    def per_host(self) -> Optional[int]:
        """Ranks per simulated host (None: no hosts simulated, ARGUS_HOST left as it is)."""
        if self.cfg.ranks_per_host is not None:
            return self.cfg.ranks_per_host
        if self.cfg.variant == "async":
            return max(1, (self.cfg.ranks + 1) // 2)
        return None

    @property
    def hosts(self) -> Dict[int, str]:
        """rank -> its ARGUS_HOST ({} when no hosts are simulated)."""
        k = self.per_host
        return {r: f"standin-host{r // k}" for r in range(self.cfg.ranks)} if k else {}

    @property
    def pids(self) -> Dict[int, int]:
        return {r: s.proc.pid for r, s in self._ranks.items()}

    def shm_names(self) -> List[str]:
        """The shared-memory segments of this job's communicators, from the unique-id files."""
        names = []
        for p in sorted(self.run_dir.glob("comm-*.uid")):
            raw = p.read_bytes()
            if raw[:16] == ID_MAGIC:
                names.append(raw[16:80].split(b"\0", 1)[0].decode())
        return names

    def poll(self, check: bool = True) -> None:
        """Read new truth lines; with `check`, raise StandinCrashed for a rank that died early."""
        self._read_all()
        if not check:
            return
        for r, s in sorted(self._ranks.items()):
            rc = s.proc.poll()
            if rc is None or s.done is not None or self._stopped:
                continue
            self._read_all()  # lines written just before the exit
            if s.done is None:
                raise StandinCrashed(
                    f"rank {r} (pid {s.proc.pid}) exited with {rc} before finishing "
                    f"({len(s.steps)} steps); log tail:\n{self.log_tail(r)}"
                )

    def steps_done(self) -> int:
        """Steps every rank has finished."""
        self._read_all()
        return min((len(s.steps) for s in self._ranks.values()), default=0)

    def log_tail(self, rank: int, lines: int = 20) -> str:
        try:
            text = (self.run_dir / f"rank{rank}.log").read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def truth(self) -> Dict[str, Any]:
        """What really happened, for checking a diagnosis against. Times: CLOCK_MONOTONIC ns
        (time.monotonic_ns, system-wide) unless named wall."""
        self._read_all()
        faults = []
        for f in self.faults:
            d = f.to_json()
            if f.kind == "hang":
                line = self._ranks[f.ranks[0]].hang if f.ranks[0] in self._ranks else None
                d["hang"] = (
                    {"step": line["step"], "t_ns": line["wall_ns"], "mono_ns": line["mono_ns"]}
                    if line
                    else None
                )
            faults.append(d)
        return {
            "job": self.job_id,
            "variant": self.cfg.variant,
            "hosts": self.hosts,
            "layout": self.cfg.layout,
            "world": self.cfg.ranks,
            "steps": self.cfg.steps,
            "run_dir": str(self.run_dir),
            "pids": self.pids,
            "faults": faults,
            "comms": {r: s.meta["comms"] for r, s in self._ranks.items() if s.meta},
            "step_times": {
                r: [(x["step"], x["start_mono_ns"], x["end_mono_ns"]) for x in s.steps]
                for r, s in self._ranks.items()
            },
            "step_times_wall": {
                r: [(x["step"], x["start_wall_ns"], x["end_wall_ns"]) for x in s.steps]
                for r, s in self._ranks.items()
            },
            # async variant: per rank, every all-reduce with its step and times (see train_async.py)
            "collectives": {
                r: [dict(c, step=x["step"]) for x in s.steps for c in x.get("colls", [])]
                for r, s in self._ranks.items()
            },
            "works": {r: list(s.works) for r, s in self._ranks.items()},
            "done": sorted(r for r, s in self._ranks.items() if s.done is not None),
            "cpu_s": {r: s.done["cpu_s"] for r, s in self._ranks.items() if s.done},
            "errors": {r: s.error for r, s in self._ranks.items() if s.error},
            "returncodes": {r: s.returncode for r, s in self._ranks.items()},
        }

    # ------------------------------------------------------------------------ truth files

    def _read_all(self) -> None:
        for r, s in self._ranks.items():
            self._read(r, s)

    def _read(self, rank: int, s: _RankState) -> None:
        try:
            with open(self.run_dir / f"rank{rank}.jsonl", "rb") as f:
                f.seek(s.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        s.offset += len(chunk)
        data = s.partial + chunk
        *lines, s.partial = data.split(b"\n")  # the last piece may be half a line
        for raw in lines:
            if raw.strip():
                self._line(s, json.loads(raw))

    def _line(self, s: _RankState, d: Dict[str, Any]) -> None:
        kind = d.get("kind")
        if kind == "loaded":
            s.loaded = True
        elif kind == "meta":
            s.meta = d
        elif kind == "step":
            s.steps.append(d)
        elif kind == "hang":
            s.hang = d
            if self._hang_seen is None:
                self._hang_seen = time.monotonic()
        elif kind == "work":
            s.works.append(d)
        elif kind == "error":
            s.error = d
        elif kind == "done":
            s.done = d


def step_durations_ms(
    truth: Dict[str, Any], rank: int, steps: Optional[Tuple[int, int]] = None
) -> List[float]:
    """Durations of one rank's steps in ms, optionally only steps lo <= step < hi."""
    out = []
    for step, t0, t1 in truth["step_times"][rank]:
        if steps is None or steps[0] <= step < steps[1]:
            out.append((t1 - t0) / 1e6)
    return out
