"""An installed argus traces: the project's wheel, `pip install`ed (not editable) into a fresh venv made
from the system interpreter as the README says, runs `--help`, `doctor`, `probe --ebpf`, a live
`probe` and `demo` from a directory outside the checkout, with the checkout nowhere on sys.path: the
BPF sources and the simulator's C sources come from the package. And a command whose module cannot
be imported is an `ERROR:` when run, never a missing command.

No network: the wheel is built by this venv's setuptools from a copy of the sources, and pip
(`--no-index`) resolves the wheel's dependencies against this venv's installed packages, which the
fresh venv sees through a directory of links to them (all but this venv's editable argus).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import click
import pytest

from argus import cli as argus_cli
from argus.doctor import Status, check_install
from tests.helpers import REPO_ROOT

SYSTEM_PYTHON = "/usr/bin/python3"  # the only interpreter that imports Debian's bcc


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path
    package: Path  # where the venv imports argus from
    cache: Path  # ARGUS_CACHE_DIR of its commands: the simulator is built there from the package
    home: Path  # a directory outside the checkout, the commands' cwd

    def env(self) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["ARGUS_CACHE_DIR"] = str(self.cache)
        return env

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            [str(self.venv / "bin" / "argus"), *args], capture_output=True, text=True, timeout=timeout,
            cwd=str(self.home), env=self.env(),
        )  # fmt: skip
        assert "Traceback" not in res.stdout + res.stderr, res.stdout[-3000:] + res.stderr[-3000:]
        return res


def _check(cmd: List[str], what: str, timeout: float = 300, **kw: object) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    assert res.returncode == 0, f"{what} failed ({' '.join(cmd)}):\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
    return str(res.stdout)


def _deps_dir(dest: Path) -> Path:
    """Links to everything installed in this venv except its editable argus (its dist-info, its
    finder and the .pth files that only a site directory would run)."""
    dest.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        n = entry.name
        if n.startswith(("argus", "__editable__", "__pycache__")) or n.endswith(".pth"):
            continue
        (dest / n).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("install")
    # build from a copy: the build writes build/ and *.egg-info next to the sources, and the
    # checkout is shared; the copy holds what a clone holds (pyproject.toml, README.md, argus/)
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    shutil.copytree(REPO_ROOT / "argus", src / "argus", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp / "wheels"
    _check(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(wheels), str(src)],
        "building the wheel", cwd=str(tmp),
    )  # fmt: skip
    (wheel,) = wheels.glob("argus_tracer-*.whl")

    venv = tmp / "venv"
    _check([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", str(venv)], "making the venv")
    py = str(venv / "bin" / "python")
    site = _check([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "venv paths")
    Path(site.strip(), "argus-test-deps.pth").write_text(f"{_deps_dir(tmp / 'deps')}\n")
    # not --no-deps: pip checks every dependency the wheel declares is there (an undeclared one
    # would fail the commands below)
    _check(
        [py, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", "-q", str(wheel)],
        "pip install of the wheel", cwd=str(tmp),
    )  # fmt: skip
    home = tmp / "elsewhere"
    home.mkdir()
    where = _check(
        [py, "-c", "import argus; print(argus.__file__)"], "import argus", cwd=str(home),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    return Installed(venv, wheel, Path(where.strip()).parent, tmp / "cache", home)


# --------------------------------------------------------------------------- the wheel and the venv


@pytest.mark.slow
def test_the_wheel_holds_every_bpf_and_simulator_source(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    for sub, pats in (("argus/bpf", ("*.c", "*.h")), ("argus/sim/csrc", ("*.c", "*.h"))):
        files = {f"{sub}/{p.name}" for pat in pats for p in (REPO_ROOT / sub).glob(pat)}
        assert files and files <= names, sorted(files - names)
    assert {
        "argus/bpf/argus.h",
        "argus/bpf/records.h",
        "argus/bpf/cuda.bpf.c",
        "argus/sim/csrc/cuda.c",
    } <= names
    assert not [n for n in names if n.startswith("tests/")], "tests are not package data"


@pytest.mark.slow
def test_the_venv_runs_the_installed_argus_not_the_checkout(installed: Installed) -> None:
    pkg = installed.package
    assert pkg.is_relative_to(installed.venv) and not pkg.is_relative_to(REPO_ROOT), pkg
    assert sorted(p.name for p in (pkg / "bpf").iterdir()) == sorted(
        p.name for p in (REPO_ROOT / "argus/bpf").iterdir()
    )

    helped = installed.run("--help")
    assert helped.returncode == 0, helped.stderr
    for _, _, name in argus_cli.COMMANDS:
        assert f"\n  {name} " in helped.stdout, (name, helped.stdout)
    assert "UNAVAILABLE" not in helped.stdout, helped.stdout

    # doctor may find this machine unfit (12) but never crashes; its own row names the installed copy
    doc = installed.run("doctor", "--json", "--redis", "redis://127.0.0.1:1/0")
    assert doc.returncode in (0, 12), doc.stdout[-2000:] + doc.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(doc.stdout)["checks"]}
    assert rows["argus install"]["status"] == "OK", rows["argus install"]
    assert rows["argus install"]["detail"].startswith(str(pkg)), rows["argus install"]
    table = installed.run("doctor", "--redis", "redis://127.0.0.1:1/0")
    assert table.returncode == doc.returncode, table.stderr
    assert table.returncode == 0 or table.stderr.startswith("ERROR: "), table.stderr

    # the BPF program printed is pasted together from the installed package's files (no root needed)
    ebpf = installed.run("probe", "--ebpf")
    assert ebpf.returncode == 0, ebpf.stderr[-2000:]
    assert f'#line 1 "{pkg / "bpf" / "argus.h"}"' in ebpf.stdout, ebpf.stdout[:2000]
    assert f'#line 1 "{pkg / "bpf" / "cuda.bpf.c"}"' in ebpf.stdout
    assert str(REPO_ROOT) not in ebpf.stdout + doc.stdout + helped.stdout


# --------------------------------------------------------------------------- as root: it traces


def _ranks(job: subprocess.Popen) -> List[int]:
    """The rank processes `argus sim run` started (not another job's)."""
    import psutil

    kids = psutil.Process(job.pid).children(recursive=True)
    return [k.pid for k in kids if "argus.sim.trainer" in " ".join(k.cmdline())]


@pytest.mark.slow
@pytest.mark.bpf
def test_the_installed_probe_traces_the_installed_simulator(installed: Installed, tmp_path: Path) -> None:
    log = tmp_path / "sim.log"
    err = log.open("w")
    job = subprocess.Popen(
        [str(installed.venv / "bin" / "argus"), "sim", "run", "--ranks", "2", "--steps", "400", "-q",
         "--run-dir", str(tmp_path / "sim")],
        stdout=subprocess.DEVNULL, stderr=err, cwd=str(installed.home), env=installed.env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_ranks(job)) < 2 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        assert len(_ranks(job)) == 2, f"the ranks did not start: {log.read_text()[-2000:]}"
        time.sleep(2)  # past the libraries' load
        # the simulator was compiled from the package's C sources, into the cache the test chose
        assert list(installed.cache.glob("sim-*/libcuda.so.1")), list(installed.cache.iterdir())
        args = [a for p in _ranks(job) for a in ("--pid", str(p))]
        probe = installed.run("probe", *args, "-d", "4s", "--json", timeout=120)
        assert probe.returncode == 0, probe.stderr[-2000:]
        steps = [json.loads(x) for x in probe.stdout.splitlines() if x.startswith("{")]
        assert {d["rank"] for d in steps if d.get("step") is not None} == {0, 1}, probe.stderr[-2000:]
    finally:
        job.terminate()
        job.wait(timeout=30)
        err.close()


@pytest.mark.slow
@pytest.mark.bpf
@pytest.mark.redis
def test_the_installed_demo_finds_the_straggler(installed: Installed) -> None:
    # 25 s of job (--seconds): the straggler appears a third of the way in and is alerted on
    demo = installed.run("demo", "--no-tui", "--ranks", "4", "--seconds", "25", timeout=240)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "ALERT straggler ranks [3]" in demo.stdout, demo.stdout[-2000:]


# --------------------------------------------------------------------------- a broken import


def test_a_command_whose_import_fails_is_an_error_when_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "argus.agent.record", None)  # importing it raises ImportError
    group = click.Group("argus")
    broken = argus_cli.register(group)
    assert set(broken) == {"record"} and set(group.commands) == {n for _, _, n in argus_cli.COMMANDS}
    monkeypatch.setitem(argus_cli.cli.commands, "record", group.commands["record"])

    assert argus_cli.main(["--help"]) == 0
    out, _ = capsys.readouterr()
    assert "record" in out and "UNAVAILABLE" in out and "probe" in out
    for args in (["record", "-p", "1", "-d", "1s"], ["record", "--help"]):
        rc = argus_cli.main(args)
        out, err = capsys.readouterr()
        assert rc == 7, (args, out, err)
        lines = err.splitlines()
        assert len(lines) == 2 and lines[0].startswith("ERROR: argus record is unavailable: importing "), err
        assert "argus.agent.record" in lines[0] and lines[1].startswith("HINT: "), err
        assert "Traceback" not in out + err
    # the other commands still run
    assert argus_cli.main(["doctor", "--no-such-flag"]) == 2

    row = check_install("/somewhere/argus", None, broken)
    assert row.status is Status.FAIL and "record" in row.detail and row.fix


def test_a_module_that_does_not_exist_gives_a_stand_in_command() -> None:
    group = click.Group("argus")
    broken = argus_cli.register(group, [("argus.no_such_module_for_test", "ghost_cmd", "ghost")])
    assert "No module named 'argus.no_such_module_for_test'" in broken["ghost"]
    assert group.commands["ghost"].get_short_help_str(200).startswith("UNAVAILABLE: ModuleNotFoundError")


def test_the_checkout_passes_its_own_install_check() -> None:
    from argus.doctor import gather_install

    where, problem, unavailable = gather_install()
    assert Path(where) == REPO_ROOT / "argus" and problem is None and unavailable == {}, (
        problem,
        unavailable,
    )
