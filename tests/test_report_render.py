"""`argus report` as a person sees it: the picture (Pillow) and the page rendered by a real browser
(headless Chromium, from Debian's `chromium`, installed by scripts/setup.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

from argus.aggregator.config import PhaseInfo
from argus.aggregator.engine import Engine
from argus.tui import report
from tests.aggsynth import Faults, Job, steps

NAMES = PhaseInfo.parse("forward,backward,optimizer,grad_sync")
ONSET = 60


def straggler_report(n_steps: int = 150, resolve_at: int = 0) -> report.ReportData:
    off = tuple(range(resolve_at, n_steps)) if resolve_at else ()
    items = steps(Job(steps=n_steps, faults=Faults(straggler=(3, 1.5, ONSET), straggler_off=off)))
    eng = Engine(None, NAMES)
    for rs in items:
        eng.add(rs)
    eng.flush()
    last = {a.id: a.to_json() for a in eng.transitions}  # the last transition of each, as Redis keeps
    return report.build("synth", items, list(last.values()))


def test_alert_spans_cover_the_whole_time_they_fired() -> None:
    d = straggler_report()
    (sp,) = report.alert_spans(d)
    assert (sp.kind, sp.ranks, sp.firing) == ("straggler", [3], True)
    assert ONSET <= sp.start <= sp.fired <= ONSET + 3 and sp.end == d.steps[-1]  # still firing: to the end
    d = straggler_report(resolve_at=100)
    (sp,) = report.alert_spans(d)
    assert not sp.firing and 100 < sp.end < 115, sp
    head, text = report.caption(d)[0]
    assert head.startswith("straggler - rank 3 (fired at step") and f"resolved at step {sp.end}" in head
    assert "straggler" in text


def test_ticks_are_round_step_numbers() -> None:
    assert report.ticks(0, 149) == list(range(0, 150, 20))
    assert report.ticks(400, 600) == list(range(400, 601, 20))
    assert report.ticks(5, 7) == [5, 6, 7]


def test_the_picture_is_wide_stacked_and_marks_the_straggler(tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "r.png"
    report.png(straggler_report(), str(out))
    img = Image.open(out).convert("RGB")
    w, h = img.size
    assert w >= 1200 and h > w / 2, img.size  # panels stacked, not a strip
    # the straggler's row of the first heatmap is red after the onset, white-yellow before
    d = straggler_report()
    assert "waiting" in d.phases[0] and d.phases[0]["waiting"] > 0  # waiting is its own part of the bar
    reds = sum(1 for x in range(0, w, 4) for y in range(0, h // 3, 2) if _red(img.getpixel((x, y))))
    assert reds > 500, reds


def _red(px: tuple) -> bool:
    r, g, b = px[:3]
    return r > 200 and g < 120 and b < 80


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium (scripts/setup.sh installs it)")
def test_the_page_renders_in_a_browser(tmp_path: Path) -> None:
    from PIL import Image

    page = tmp_path / "r.html"
    page.write_text(report.html_page(straggler_report()))
    shot = tmp_path / "shot.png"
    base: List[str] = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    res = subprocess.run(
        [*base, "--window-size=1440,1400", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50, "blank screenshot"
    w, h = img.size
    assert sum(1 for x in range(0, w, 4) for y in range(0, h // 2, 2) if _red(img.getpixel((x, y)))) > 500
    dom = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "straggler &gt; rank 3" in dom.stdout and "fired at step" in dom.stdout
