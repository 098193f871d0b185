"""Launch windows (argus/agent/launchwin.py): when the launch probes are attached, which steps they
covered whole. Pure: the session attaches and detaches (tests/test_probe.py checks it on the
simulated job)."""

from __future__ import annotations

import pytest

from argus.agent.launchwin import ATTACH, DETACH, LaunchWindows, parse
from argus.schema import RankStep

MS = 1_000_000


def test_parse() -> None:
    assert parse("3/30") == (3, 30)
    assert parse(" 1 / 10 ") == (1, 10)
    assert parse("all") is None and parse("5/5") is None
    for bad in ("0/10", "4/3", "3", "x/y", "3/30/2", ""):
        with pytest.raises(ValueError):
            parse(bad)


def test_a_window_covers_whole_steps_then_rests_in_proportion() -> None:
    w = LaunchWindows(on=2, period=6)
    assert w.tick(0) == ATTACH  # the first window opens at once
    w.opened(5 * MS)
    assert w.tick(50 * MS) is None and w.tick(2000 * MS) is None  # no step time known: stays open
    w.observe([100 * MS, 100 * MS, 110 * MS])
    assert not w.sampled(0, 100 * MS)  # running at the attach
    assert w.sampled(100 * MS, 200 * MS)  # open window: anything that started after the attach
    w2 = LaunchWindows(on=2, period=6)
    w2.observe([100 * MS] * 3)
    w2.opened(5 * MS)
    # close by the clock after the step running at the attach and 2 whole ones, whatever the lag
    # with which steps are reported
    assert w2.tick(300 * MS) is None
    assert w2.tick(310 * MS) == DETACH
    w2.closed(320 * MS)
    assert w2.windows == [(5 * MS, 320 * MS)]
    assert w2.sampled(100 * MS, 300 * MS) and not w2.sampled(250 * MS, 350 * MS)
    # on for 315 ms, so off for 4/2 x 315 ms: about 2 of 6 steps' time
    assert w2.next_open_ns == 320 * MS + 630 * MS
    assert w2.tick(949 * MS) is None and w2.tick(950 * MS) == ATTACH


def test_a_stuck_job_does_not_hold_the_window_open() -> None:
    w = LaunchWindows(on=1, period=2, max_open_ns=1000 * MS)
    w.opened(0)
    assert w.tick(999 * MS) is None
    assert w.tick(1000 * MS) == DETACH
    w.closed(1000 * MS)
    assert w.next_open_ns == 2000 * MS


def _step(start_ms: int, dur_ms: int, wait_ms: int) -> RankStep:
    """A step on the agent's monotonic clock (no clock offset), its launches waiting `wait_ms`."""
    ph = {"host_wait": (5 + wait_ms) * MS, "host_other": (dur_ms - 5 - wait_ms) * MS}
    return RankStep("j", 0, "h", 1, 0, start_ms * MS, dur_ms * MS, phases=ph, launch_wait_ns=wait_ms * MS)


def test_a_launch_bound_job_holds_the_window_open_and_then_rests_as_after_one_window() -> None:
    """Launches that waited for a full queue for 10% of a step or more: the host's time follows its
    GPU, and that wait is measured only while the launch probes are attached; so the window stays
    open while the steps keep saying so, and closes, resting as after one window, when they stop."""
    w = LaunchWindows(on=2, period=6)
    w.observe([100 * MS] * 3)
    w.opened(5 * MS)
    t = 10
    for _ in range(50):  # 5 s of launch-bound steps, each reported a step after it ended
        s = _step(t, 100, 40)
        w.label([s])
        assert s.launches_sampled and s.launch_wait_ns == 40 * MS
        t += 100
        assert w.tick((t + 100) * MS) is None
    assert w.tick((t + 2900) * MS) is None  # a step reported late: drains come every 1 s
    assert w.tick((t + 3000) * MS) == DETACH  # no launch-bound step for 3 s
    w.closed((t + 3000) * MS)
    assert w.next_open_ns == (t + 3000 + 600) * MS  # 2 x (2 + 1) steps, not 2 x the 8 s held
    # outside a window a step's part of its launch waits is dropped: host time as if none measured
    part = _step(t + 3100, 100, 30)
    w.label([part])
    assert not part.launches_sampled and part.launch_wait_ns == 0
    assert part.phases == {"host_wait": 5 * MS, "host_other": 95 * MS}
    # a step whose launches hardly waited does not hold the window
    w2 = LaunchWindows(on=2, period=6)
    w2.observe([100 * MS] * 3)
    w2.opened(5 * MS)
    w2.label([_step(10, 100, 5), _step(110, 100, 5)])
    assert w2.tick(320 * MS) == DETACH
