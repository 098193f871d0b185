"""Run `argus probe` as a subprocess against simulated jobs and collect what it printed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from argus.sim.launcher import SimConfig, SimJob
from tests.helpers import REPO_ROOT, argus_env, sigint_as_at_a_terminal


class ProbeProc:
    """`argus probe -p ... --json` in the background, stdout/stderr read by threads."""

    def __init__(
        self,
        pids: Iterable[int],
        *extra: str,
        env: Optional[Mapping[str, str]] = None,
        prefix: Sequence[str] = (),
    ) -> None:
        args = [*prefix, sys.executable, "-m", "argus", "probe", "--json", "-i", "0.5s"]
        for p in pids:
            args += ["-p", str(p)]
        args += list(extra)
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=argus_env(env),
            cwd=str(REPO_ROOT),
            preexec_fn=sigint_as_at_a_terminal,  # tests Ctrl-C it
        )
        self.out: List[str] = []
        self.err: List[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream: object, into: List[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.stderr:
                return
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise AssertionError(
                    f"argus probe exited ({self.proc.returncode}) before '{text}':\n{self.stderr}"
                )
            time.sleep(0.05)
        raise AssertionError(f"no '{text}' from argus probe within {timeout} s:\n{self.stderr}")

    def wait(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return rc

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def steps(self) -> List[dict]:
        return [json.loads(line) for line in self.out if line.strip()]


def by_rank_step(steps: List[dict]) -> Dict[int, Dict[int, dict]]:
    out: Dict[int, Dict[int, dict]] = {}
    for s in steps:
        if s["step"] is not None:
            out.setdefault(s["rank"], {})[s["step"]] = s
    return out


def wait_steps(job: SimJob, n: int, timeout: float = 60.0) -> None:
    """Until every rank of `job` has completed `n` steps."""
    deadline = time.monotonic() + timeout
    while job.steps_done() < n:
        assert time.monotonic() < deadline, f"job did not reach step {n}"
        job.poll()
        time.sleep(0.05)


def probed_run(cfg: SimConfig, *extra: str, env: Optional[Mapping[str, str]] = None) -> tuple:
    """Start a gated job, attach the probe before the first CUDA call, run to the end (the probe's
    environment: this one plus `env`)."""
    cfg.gate = True
    job = SimJob(cfg).start()
    probe: Optional[ProbeProc] = None
    try:
        job.wait_loaded()
        probe = ProbeProc(job.pids.values(), *extra, env=env)
        probe.wait_for("Tracing")
        job.release()
        job.wait()
        rc = probe.wait(timeout=60)
        assert rc == 0, probe.stderr
        return job, probe
    finally:
        job.stop()
        if probe is not None and probe.proc.poll() is None:
            probe.proc.kill()
