"""A stand-in for nvidia-ml-py's `pynvml`, put first on an agent's PYTHONPATH by tests so that its
NVML channel (argus/gpu.py) reads devices on a machine without a GPU. Written from NVML's API
documentation, not from the simulator: the agent cannot tell it from the real module.

Eight devices. `FAKE_NVML_THROTTLED=I` makes device I hold its SM clock at 1095 of 1980 MHz for
hardware slowdown (NVML's clocks-event reason 0x8); `FAKE_NVML_XID=I:CODE` reports one XID event
on device I. Per-process device lists are unsupported (as in many containers), so the agent maps
a rank to its device by LOCAL_RANK.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, List

NVML_NVLINK_MAX_LINKS = 18
_DEVICES = 8
_THROTTLED = int(os.environ.get("FAKE_NVML_THROTTLED", "-1"))
_xid_dev, _, _xid_code = os.environ.get("FAKE_NVML_XID", "").partition(":")
_pending_xids: List[Any] = [(int(_xid_dev), int(_xid_code))] if _xid_code else []


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


def _unsupported(*_a: Any) -> Any:
    raise NVMLError_NotSupported("Not Supported")


def _index(h: Any) -> int:
    return int(h.index)


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return _DEVICES


def nvmlDeviceGetHandleByIndex(i: int) -> Any:
    return SimpleNamespace(index=i)


def nvmlDeviceGetUUID(h: Any) -> str:
    return f"GPU-fa4e{_index(h):04d}-0000-0000-0000-000000000000"


def nvmlDeviceGetClockInfo(h: Any, kind: int) -> int:
    if kind == 1:  # NVML_CLOCK_SM
        return 1095 if _index(h) == _THROTTLED else 1980
    return 2619


def nvmlDeviceGetMaxClockInfo(h: Any, kind: int) -> int:
    return 1980 if kind == 1 else 2619


def nvmlDeviceGetCurrentClocksEventReasons(h: Any) -> int:
    return 0x8 if _index(h) == _THROTTLED else 0


def nvmlDeviceGetUtilizationRates(h: Any) -> Any:
    return SimpleNamespace(gpu=97, memory=41)


def nvmlDeviceGetPowerUsage(h: Any) -> int:
    return 402_000 if _index(h) == _THROTTLED else 655_000  # mW


def nvmlDeviceGetEnforcedPowerLimit(h: Any) -> int:
    return 700_000


def nvmlDeviceGetTemperature(h: Any, sensor: int) -> int:
    return 64 + _index(h)


def nvmlDeviceGetMemoryInfo(h: Any) -> Any:
    return SimpleNamespace(used=61 << 30, total=80 << 30)


def nvmlDeviceGetPcieThroughput(h: Any, counter: int) -> int:
    return 2048


nvmlDeviceGetPcieReplayCounter = _unsupported
nvmlDeviceGetComputeRunningProcesses = _unsupported
nvmlDeviceGetNvLinkState = _unsupported  # a PCIe-only box: no NVLink rows


def nvmlEventSetCreate() -> Any:
    return SimpleNamespace()


def nvmlEventSetFree(s: Any) -> None:
    pass


def nvmlDeviceRegisterEvents(h: Any, types: int, s: Any) -> None:
    pass


def nvmlEventSetWait_v2(s: Any, timeout_ms: int) -> Any:
    if not _pending_xids:
        raise NVMLError_Timeout("Timeout")
    dev, code = _pending_xids.pop(0)
    return SimpleNamespace(device=nvmlDeviceGetHandleByIndex(dev), eventData=code)
