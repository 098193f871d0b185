"""Start the simulated multi-rank job, watch it, and write its ground truth.

`SimJob` is used by `argus sim run`, by `argus demo` and by tests (which attach probes to
`job.pids` while it runs). With `gate=True` every rank loads the libraries and then waits for
`job.release()` before its first CUDA call, so a probe can attach before anything happens.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from argus.errors import SimulationFailed, UsageError
from argus.sim.build import build
from argus.sim.faults import Fault, FaultSpecError, parse_all
from argus.sim.workload import PRESETS, Workload

#: the directory this argus is imported from: the checkout, or site-packages when installed
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def child_pythonpath() -> str:
    """PYTHONPATH for the Python processes argus starts (`-m argus...`): they import this same argus
    whatever their interpreter (`--python`) and working directory. `-m` still puts that directory
    first on sys.path: start them where no other user can write (`/`, the demo's own directory)."""
    return os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))


LAYOUTS = ("dp", "tp-dp", "pp-dp")


@dataclass
class SimConfig:
    ranks: int = 8
    steps: int = 50
    layout: str = "dp"
    injects: List[str] = field(default_factory=list)
    preset: str = "default"
    overrides: Dict[str, float] = field(default_factory=dict)
    ranks_per_host: int = 8
    python: str = sys.executable
    run_dir: Optional[str] = None
    hang_hold_s: float = 10.0
    timeout_s: Optional[float] = None
    init_config: bool = False
    gate: bool = False
    extra_env: Dict[str, str] = field(default_factory=dict)
    #: per simulated host index, a command the rank processes of that host are started under (e.g.
    #: `nsenter --net=/run/netns/h1 --`: tests spread the job over network namespaces)
    host_prefix: Dict[int, List[str]] = field(default_factory=dict)
    #: names of the simulated hosts in order (ranks_per_host ranks each); node-<i> past the list
    host_names: List[str] = field(default_factory=list)
    #: Megatron-style CUDA-event timers (forward, backward, optimizer, grad_sync) read with
    #: cuEventElapsedTime; without them (the default) the job is a stock PyTorch DDP job as far as
    #: CUDA sees
    timers: bool = False
    #: TORCH_NCCL_ENABLE_TIMING=1 in every rank's environment: ProcessGroupNCCL's start events and
    #: its watchdog's cuEventElapsedTime reads
    nccl_timing: bool = False

    def host_name(self, index: int) -> str:
        return self.host_names[index] if index < len(self.host_names) else f"node-{index}"

    def workload(self) -> Workload:
        if self.preset not in PRESETS:
            raise UsageError(
                f"unknown workload preset '{self.preset}'", f"choose one of: {', '.join(PRESETS)}"
            )
        w = Workload(**PRESETS[self.preset].to_dict())
        for k, v in self.overrides.items():
            if not hasattr(w, k):
                raise UsageError(f"unknown workload setting '{k}'", f"known: {', '.join(w.to_dict())}")
            setattr(w, k, type(getattr(w, k))(v))
        return w


@dataclass
class RankSteps:
    records: List[dict] = field(default_factory=list)
    meta: Optional[dict] = None
    hang: Optional[dict] = None
    done: bool = False
    offset: int = 0


class SimJob:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.w = cfg.workload()
        self._validate()
        self.run_id = secrets.token_hex(4)
        self.run_dir = Path(cfg.run_dir or tempfile.mkdtemp(prefix=f"argus-sim-{self.run_id}-")).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.run_dir.glob("rank*.jsonl"), *self.run_dir.glob("ready*"), self.run_dir / "go"]:
            stale.unlink(missing_ok=True)  # a reused run dir must not leak a previous run's state
        self.procs: Dict[int, subprocess.Popen] = {}
        self.ranks: Dict[int, RankSteps] = {r: RankSteps() for r in range(cfg.ranks)}
        self.started_ns = 0
        self.hung = False
        self.hang_seen_at: Optional[float] = None

    def _validate(self) -> None:
        c, w = self.cfg, self.w
        if c.ranks < 1 or c.steps < 1:
            raise UsageError("--ranks and --steps must be at least 1", "e.g. --ranks 8 --steps 50")
        if c.layout not in LAYOUTS:
            raise UsageError(f"unknown layout '{c.layout}'", f"choose one of: {', '.join(LAYOUTS)}")
        if c.layout == "tp-dp" and c.ranks % w.tp:
            raise UsageError(f"tp-dp needs --ranks divisible by tp={w.tp}", "e.g. --ranks 8 --set tp=2")
        if c.layout == "pp-dp" and (c.ranks % w.pp or w.layers % w.pp):
            raise UsageError(
                f"pp-dp needs ranks and layers divisible by pp={w.pp}", "e.g. --ranks 8 --set pp=2"
            )
        try:
            self.faults: List[Fault] = parse_all(c.injects, c.ranks, c.steps)
        except FaultSpecError as e:
            raise UsageError(f"bad --inject: {e}", "see `argus sim run --help` for the fault kinds") from None
        if any(f.kind == "bubble" for f in self.faults) and c.layout != "pp-dp":
            raise UsageError("the bubble fault needs --layout pp-dp", "add --layout pp-dp")

    # ---- lifecycle ---------------------------------------------------------------------------------

    @property
    def pids(self) -> Dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def start(self) -> SimJob:
        libs = build()
        config = {
            "layout": self.cfg.layout,
            "steps": self.cfg.steps,
            "workload": self.w.to_dict(),
            "faults": [f.to_dict() for f in self.faults],
            "run_dir": str(self.run_dir),
            "run_id": self.run_id,
            "store": str(self.run_dir / f"store-{self.run_id}"),
            "init_config": self.cfg.init_config,
            "timers": self.cfg.timers,
            "gate": str(self.run_dir / "go") if self.cfg.gate else None,
        }
        cfg_path = self.run_dir / "config.json"
        cfg_path.write_text(json.dumps(config, indent=1))
        rph = self.cfg.ranks_per_host
        pypath = child_pythonpath()
        # the trainer reads TORCH_NCCL_ENABLE_TIMING from its environment, as PyTorch does
        timing = {"TORCH_NCCL_ENABLE_TIMING": "1"} if self.cfg.nccl_timing else {}
        if self.w.launch_queue > 0:  # the simulated driver's setting, read at cuInit
            timing["ARGUS_SIM_LAUNCH_QUEUE"] = str(self.w.launch_queue)
        self.started_ns = time.monotonic_ns()
        atexit.register(self.stop)  # never leave rank processes behind, whatever happens to the caller
        for r in range(self.cfg.ranks):
            env = dict(
                os.environ,
                RANK=str(r),
                LOCAL_RANK=str(r % rph),
                WORLD_SIZE=str(self.cfg.ranks),
                LOCAL_WORLD_SIZE=str(min(rph, self.cfg.ranks)),
                GROUP_RANK=str(r // rph),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT="29500",
                TORCHELASTIC_RUN_ID=f"sim-{self.run_id}",
                ARGUS_SIM_RUN=self.run_id,
                ARGUS_HOST=self.cfg.host_name(r // rph),  # one simulated host per ranks_per_host ranks
                ARGUS_SIM_CONFIG=str(cfg_path),
                ARGUS_SIM_LIBDIR=str(libs.directory),
                PYTHONPATH=pypath,
                **timing,
                **self.cfg.extra_env,
            )
            log = open(self.run_dir / f"rank{r}.log", "w")
            self.procs[r] = subprocess.Popen(
                [*self.cfg.host_prefix.get(r // rph, []), self.cfg.python, "-m", "argus.sim.trainer"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # `-m` puts the working directory first on sys.path: `/`, which only root writes, not
                # the run directory (`argus sim run --run-dir` may name one others can write)
                cwd="/",
                start_new_session=True,
            )
            log.close()
        return self

    def wait_loaded(self, timeout: float = 30.0) -> None:
        """With gate=True: wait until every rank has mapped the libraries and waits for release()."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((self.run_dir / f"ready{r}").exists() for r in self.procs):
                return
            self._check_crash()
            time.sleep(0.02)
        raise SimulationFailed("ranks did not load the simulated libraries in time", self._log_hint())

    def release(self) -> None:
        (self.run_dir / "go").write_text("go")

    def poll(self) -> None:
        """Read new per-rank ground-truth lines."""
        for r, rs in self.ranks.items():
            path = self.run_dir / f"rank{r}.jsonl"
            try:
                with open(path) as f:
                    f.seek(rs.offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind("\n")
            if end < 0:
                continue
            rs.offset += len(data[: end + 1].encode())
            for line in data[: end + 1].splitlines():
                obj = json.loads(line)
                if "meta" in obj:
                    rs.meta = obj["meta"]
                elif "hang" in obj:
                    rs.hang = obj["hang"]
                elif "done" in obj:
                    rs.done = True
                else:
                    rs.records.append(obj)

    def _check_crash(self) -> None:
        for r, p in self.procs.items():
            rc = p.poll()
            if rc not in (None, 0) and not self.hung:
                raise SimulationFailed(f"rank {r} exited with code {rc}", self._log_hint(r))

    def _log_hint(self, rank: int = 0) -> str:
        log = self.run_dir / f"rank{rank}.log"
        tail = log.read_text().strip().splitlines()[-3:] if log.exists() else []
        return f"see {log}" + (f": {' | '.join(tail)}" if tail else "")

    def steps_done(self) -> int:
        return min(len(rs.records) for rs in self.ranks.values())

    def wait(self, on_progress: Optional[Callable[[SimJob], None]] = None) -> None:
        timeout = self.cfg.timeout_s or (120.0 + self.cfg.steps * 10.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.poll()
                if on_progress:
                    on_progress(self)
                if all(p.poll() is not None for p in self.procs.values()):
                    self.poll()
                    self._check_crash()
                    break
                self._check_crash()
                if any(rs.hang for rs in self.ranks.values()):
                    self.hang_seen_at = self.hang_seen_at or time.monotonic()
                    if time.monotonic() - self.hang_seen_at >= self.cfg.hang_hold_s:
                        self.hung = True
                        break
                if time.monotonic() > deadline:
                    raise SimulationFailed(
                        f"the job did not finish within {timeout:.0f} s", "raise --timeout, or lower --steps"
                    )
                time.sleep(0.1)
        finally:
            self.stop()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10  # one bound for all ranks, not 10 s each
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for f in Path("/dev/shm").glob(f"argus-sim-{self.run_id}-*"):
            f.unlink(missing_ok=True)

    # ---- results -----------------------------------------------------------------------------------

    def step_seconds(self) -> Dict[int, List[float]]:
        return {r: [(s["end_ns"] - s["start_ns"]) / 1e9 for s in rs.records] for r, rs in self.ranks.items()}

    def job_step_seconds(self) -> List[float]:
        """Per step, the time the job took: max over ranks."""
        per = self.step_seconds()
        n = min((len(v) for v in per.values()), default=0)
        return [max(per[r][i] for r in per) for i in range(n)]

    def truth(self) -> dict:
        faults = []
        for f in self.faults:
            d = f.to_dict()
            d["onset_step"] = f.step if f.step >= 0 else f.from_step
            for r in d["ranks"]:
                rs = self.ranks[r]
                if rs.hang:
                    d["hang"] = rs.hang
            faults.append(d)
        return {
            "run_id": self.run_id,
            "job": f"sim-{self.run_id}",
            "ranks": self.cfg.ranks,
            "steps": self.cfg.steps,
            "layout": self.cfg.layout,
            "workload": self.w.to_dict(),
            "faults": faults,
            "pids": self.pids,
            "hung": self.hung,
            "run_dir": str(self.run_dir),
            "comms": {r: (rs.meta or {}).get("comms", {}) for r, rs in self.ranks.items()},
            "steps_completed": self.steps_done(),
        }

    def write_outputs(self, truth_path: Optional[str], json_steps: Optional[str]) -> Path:
        tp = Path(truth_path) if truth_path else self.run_dir / "truth.json"
        tp.write_text(json.dumps(self.truth(), indent=1))
        if json_steps:
            Path(json_steps).write_text(
                json.dumps(
                    {
                        "step_seconds": self.job_step_seconds(),
                        "ranks": {str(r): v for r, v in self.step_seconds().items()},
                    }
                )
            )
        return tp


def mean_or_nan(xs: List[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")
