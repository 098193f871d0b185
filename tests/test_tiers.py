"""The tier machinery in conftest.py: ARGUS_REQUIRE_TIERS turns skipped or missing tiers into failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from tests.conftest import tier_problems
from tests.helpers import REPO_ROOT

INNER_TESTS = """
import pytest

@pytest.mark.slow
def test_runs():
    pass

@pytest.mark.slow
def test_skips_at_runtime():
    if {skip!r}:
        pytest.skip("no widget here")
"""


def test_tier_problems_is_pure() -> None:
    assert tier_problems({"bpf"}, {"bpf": 2}, {}) == []
    assert tier_problems({"bpf"}, {}, {}) == ["bpf: no test marked `bpf` ran"]
    assert tier_problems({"redis"}, {"redis": 1}, {"redis": [("t::x", "down")]}) == [
        "redis: skipped t::x: down"
    ]


def _inner_session(
    tmp_path: Path, skip: bool, env: Dict[str, Optional[str]]
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    slow: s\n    bpf: b\n    redis: r\n    gpu: g\n"
    )
    (tmp_path / "test_inner.py").write_text(INNER_TESTS.format(skip=skip))
    full = {k: v for k, v in os.environ.items() if not k.startswith(("ARGUS_", "PYTEST_"))}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    full.update({k: v for k, v in env.items() if v is not None})
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path)]
    return subprocess.run(cmd, capture_output=True, text=True, env=full, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize(
    ("skip", "env", "rc", "expect"),
    [
        (False, {"ARGUS_REQUIRE_TIERS": "slow"}, 0, None),
        (True, {}, 0, None),  # skips are fine when nothing is required
        (True, {"ARGUS_REQUIRE_TIERS": "slow"}, 1, "slow: skipped test_inner.py::test_skips_at_runtime"),
        (False, {"ARGUS_REQUIRE_TIERS": "slow", "ARGUS_SKIP_SLOW": "1"}, 1, "slow tier: ARGUS_SKIP_SLOW=1"),
        (False, {"ARGUS_REQUIRE_TIERS": "slow,gpu"}, 1, "gpu: no test marked `gpu` ran"),
    ],
)
def test_require_tiers_end_to_end(
    tmp_path: Path, skip: bool, env: Dict[str, Optional[str]], rc: int, expect: Optional[str]
) -> None:
    res = _inner_session(tmp_path, skip, env)
    out = res.stdout + res.stderr
    assert res.returncode == rc, out
    if expect is not None:
        assert "ARGUS_REQUIRE_TIERS=" in out and "not met" in out, out
        assert expect in out, out
