"""The NVML channel (argus/gpu.py) against a fake pynvml, and its absence on a machine without a driver."""

from __future__ import annotations

import types
from typing import Any, Dict, List

import pytest

from argus.gpu import GpuMetrics, throttle_names


class NVMLError(Exception):
    pass


class NotSupported(NVMLError):
    pass


def fake_nvml(devices: int = 2, nvlink: bool = True, xids: List[int] = ()) -> Any:  # type: ignore[assignment]
    """A pynvml stand-in: device i has SM clock 1000+i MHz, device 1 is thermally throttled."""
    m = types.SimpleNamespace()
    m.NVMLError = NVMLError
    m.NVML_NVLINK_MAX_LINKS = 4
    state: Dict[str, Any] = {"init": 0, "xids": list(xids), "events": []}
    m.state = state

    def init() -> None:
        state["init"] += 1

    def unsupported(*_a: Any) -> Any:
        raise NotSupported("Not Supported")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: devices
    m.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h[1:]}aaaa"
    m.nvmlDeviceGetClockInfo = lambda h, kind: (1000 if kind == 1 else 2600) + int(h[1:])
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x40 | 0x4 if h == "h1" else 0
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=97, memory=40)
    m.nvmlDeviceGetPowerUsage = lambda h: 612_345
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    m.nvmlDeviceGetTemperature = lambda h, sensor: 71 + int(h[1:])
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=10 << 30, total=80 << 30)
    m.nvmlDeviceGetPcieThroughput = lambda h, c: 1234 if c == 0 else 567
    m.nvmlDeviceGetPcieReplayCounter = unsupported
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=4242)] if h == "h1" else []

    def link_state(h: str, link: int) -> int:
        if not nvlink:
            raise NotSupported("Not Supported")
        return 1 if link < 2 else 0

    m.nvmlDeviceGetNvLinkState = link_state
    m.nvmlDeviceGetNvLinkErrorCounter = lambda h, link, counter: {0: 5, 2: 1}.get(counter, 0)

    def field_values(h: str, ids: List[int]) -> List[Any]:
        val = types.SimpleNamespace(ullVal=1 << 20)
        return [types.SimpleNamespace(nvmlReturn=0, value=val) for _ in ids]

    m.nvmlDeviceGetFieldValues = field_values
    m.nvmlEventSetCreate = lambda: "set"
    m.nvmlEventSetFree = lambda s: None
    m.nvmlDeviceRegisterEvents = lambda h, types_, s: state["events"].append(h)

    def wait(s: str, timeout: int) -> Any:
        if not state["xids"]:
            raise NVMLError("Timeout")
        return types.SimpleNamespace(device="h1", eventData=state["xids"].pop(0))

    m.nvmlEventSetWait_v2 = wait
    return m


def test_metrics_from_every_device() -> None:
    g = GpuMetrics(fake_nvml(xids=[79]))
    assert g.available and g.reason == ""
    s = g.sample()
    assert set(s) == {0, 1}
    d1 = s[1]
    assert d1["sm_clock_mhz"] == 1001 and d1["mem_clock_mhz"] == 2601 and d1["sm_clock_max_mhz"] == 1980
    assert d1["throttle"] == ["sw_power_cap", "hw_thermal"] and s[0]["throttle"] == []
    assert (d1["util_gpu_pct"], d1["util_mem_pct"]) == (97, 40)
    assert d1["power_w"] == pytest.approx(612.345) and d1["power_limit_w"] == 700.0
    assert d1["temp_c"] == 72
    assert (d1["mem_used_bytes"], d1["mem_total_bytes"]) == (10 << 30, 80 << 30)
    assert (d1["pcie_tx_kbps"], d1["pcie_rx_kbps"]) == (1234, 567)
    assert d1["pcie_replays"] is None  # not supported: N/A, not an error
    assert d1["nvlink"] == {
        "links": 2,
        "errors": {"replay": 10, "recovery": 0, "crc_flit": 2, "crc_data": 0},
        "tx_kib": 1 << 20,
        "rx_kib": 1 << 20,
    }
    assert [x["xid"] for x in d1["xid"]] == [79] and s[0]["xid"] == []
    assert g.sample()[1]["xid"] == []  # reported once
    assert d1["uuid"] == "GPU-1aaaa"


def test_no_nvlink_is_none() -> None:
    g = GpuMetrics(fake_nvml(nvlink=False))
    assert g.sample()[0]["nvlink"] is None


def test_ranks_are_mapped_to_devices() -> None:
    g = GpuMetrics(fake_nvml(devices=4))
    assert g.device_of(4242, {}) == 1  # NVML's own process list first
    assert g.device_of(1, {"LOCAL_RANK": "3"}) == 3
    assert g.device_of(1, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,0"}) == 0
    assert g.device_of(1, {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-3"}) == 3  # by UUID prefix
    assert g.device_of(1, {"LOCAL_RANK": "7"}) is None
    g.sample()
    got = g.for_pid(4242)
    assert got is not None and got["device"] == 1 and got["sm_clock_mhz"] == 1001


def test_missing_driver_is_reported_once_and_off() -> None:
    m = fake_nvml()

    def no_lib() -> None:
        raise NVMLError("NVML Shared Library Not Found")

    m.nvmlInit = no_lib
    said: List[str] = []
    g = GpuMetrics(m, say=said.append)
    assert not g.available and "Shared Library Not Found" in g.reason
    assert said == [f"note: GPU metrics off: {g.reason}"]
    assert g.sample() == {} and g.device_of(1, {"LOCAL_RANK": "0"}) is None and g.for_pid(1) is None
    g.close()


def test_real_pynvml_on_this_machine_without_breaking() -> None:
    """Whatever this machine has: a GPU (metrics) or none (a reason, channel off, no exception)."""
    said: List[str] = []
    g = GpuMetrics(say=said.append)
    if g.available:
        s = g.sample()
        assert s and all("sm_clock_mhz" in d for d in s.values())
    else:
        assert g.reason and len(said) == 1 and g.sample() == {}
    g.close()


def test_throttle_names() -> None:
    assert throttle_names(0) == []
    assert throttle_names(0x8 | 0x80) == ["hw_slowdown", "hw_power_brake"]
