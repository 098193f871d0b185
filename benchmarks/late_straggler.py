"""The person on call's case, as they would run it: a straggler there from the start, Argus
attached 5 s in, every command the real one.

    sudo .venv/bin/python -m benchmarks.late_straggler [--attach-after 5] [--trace 40]

1. `argus sim run --ranks 8 --steps 600 --inject straggler:rank=5,factor=1.35` (the default
   preset: ~0.2 s steps; rank 5 is 1.35x slower from step 0);
2. `argus aggregate --redis URL` and, `--attach-after` seconds after the job started,
   `argus probe --all --match argus.sim.trainer --redis URL` for `--trace` seconds;
3. prints every alert transition the aggregator wrote, then `argus diagnose --redis URL --job J`.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from argus.aggregator.service import history  # noqa: E402
from benchmarks._util import env, sigint_default  # noqa: E402
from tests.redisproc import RedisProc  # noqa: E402

NAMES = "forward,backward,optimizer,grad_sync"
SIM_ARGS = ("--inject", "straggler:rank=5,factor=1.35")


def _dur(seconds: float) -> list:
    return ["--json", "-d", f"{seconds}s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attach-after", type=float, default=5.0)
    ap.add_argument("--trace", type=float, default=40.0)
    args = ap.parse_args()
    import redis as redis_py

    argus = [sys.executable, "-m", "argus"]
    with tempfile.TemporaryDirectory(prefix="argus-late-") as d:
        rp = RedisProc(Path(d) / "redis")
        rp.start()
        truth = Path(d) / "truth.json"
        sim = subprocess.Popen(
            [*argus, "sim", "run", "--ranks", "8", "--steps", "600", *SIM_ARGS, "--truth", str(truth)],
            env=env(),
            cwd=REPO,
            preexec_fn=sigint_default,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        agg = subprocess.Popen(
            [*argus, "aggregate", "--redis", rp.url, "--phases", NAMES],
            env=env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(args.attach_after)
        t0 = time.monotonic()
        probe = subprocess.run(
            [*argus, "probe", "--all", "--match", "argus.sim.trainer", "--redis", rp.url, *_dur(args.trace)],
            env=env(),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=args.trace + 120,
        )
        print(f"argus probe attached {args.attach_after:g} s after `argus sim run` started; its stderr:")
        for line in probe.stderr.splitlines()[:12]:
            print(f"  {line}")
        time.sleep(3.0)
        agg.send_signal(signal.SIGTERM)
        out = agg.communicate(timeout=60)[0]
        sim.send_signal(signal.SIGINT)
        try:
            sim.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            sim.kill()
        client = redis_py.Redis.from_url(rp.url)
        jobs = sorted(k.decode().split("{")[1].split("}")[0] for k in client.keys("argus:{*}:steps"))
        print(f"\nargus aggregate printed (traced {time.monotonic() - t0:.0f} s):")
        for line in out.splitlines():
            print(f"  {line}")
        for job in jobs:
            print(f"\nalert transitions of job {job} (from Redis):")
            for _eid, a in history(client, job):
                ident = json.dumps(a.evidence.get("identity"))
                print(f"  {a.state:8} {a.kind:18} ranks {a.ranks} steps {a.steps}  identity {ident}")
            res = subprocess.run(
                [*argus, "diagnose", "--redis", rp.url, "--job", job, "--phases", NAMES],
                env=env(),
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            print(f"\n$ argus diagnose --redis URL --job {job} --phases {NAMES}")
            print(res.stdout + res.stderr)
        client.close()
        rp.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
