"""GPU device metrics from NVML (nvidia-ml-py): the evidence behind a slow GPU or a bad link.

One thin module over `pynvml`: SM and memory clocks and the reasons they are held down, utilisation,
power, temperature, memory, PCIe and NVLink throughput and error counters, and XID events, per
device; `device_of(pid)` maps a rank to its device. Without a driver (or without nvidia-ml-py)
the channel says why once and stays off; every single metric a device does not support is
`None` ("N/A"), never an error.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

# nvmlClocksEventReason* (formerly ClocksThrottleReason*) bits
THROTTLE_REASONS: Dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
NVLINK_ERRORS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}  # NVML_NVLINK_ERROR_DL_*
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
FI_NVLINK_TX, FI_NVLINK_RX = 138, 139  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX (KiB, cumulative)


def throttle_names(mask: int) -> List[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


class GpuMetrics:
    """NVML, initialised once. `available` is False (and `reason` says why) when there is no NVML."""

    def __init__(self, nvml: Any = None, say: Callable[[str], None] = lambda _m: None) -> None:
        self.available = False
        self.reason = ""
        self.nvml: Any = None
        self.handles: List[Any] = []
        self.uuids: List[str] = []
        self.events: Any = None
        self.xids: Dict[int, List[dict]] = {}
        self.last: Dict[int, dict] = {}
        self._nvlinks: Dict[int, List[int]] = {}
        self._dev: Dict[int, Optional[int]] = {}
        try:
            if nvml is None:
                import pynvml  # nvidia-ml-py

                nvml = pynvml
            nvml.nvmlInit()
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no usable driver
            self.reason = f"NVML unavailable: {e}"
        else:
            self.nvml = nvml
            self._open()
        if not self.available:
            say(f"note: GPU metrics off: {self.reason}")

    def _open(self) -> None:
        n = self.nvml
        try:
            count = n.nvmlDeviceGetCount()
            self.handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as e:
            self.reason = f"NVML lists no devices: {e}"
            return
        self.uuids = [_text(self._try(n.nvmlDeviceGetUUID, h)) or "" for h in self.handles]
        self.available = bool(self.handles)
        if not self.available:
            self.reason = "NVML lists no devices"
            return
        try:
            self.events = n.nvmlEventSetCreate()
            for h in self.handles:
                self._try(n.nvmlDeviceRegisterEvents, h, XID_EVENT, self.events)
        except Exception:
            self.events = None  # XID events unsupported (e.g. some virtualised GPUs)

    def _try(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported, _NoPermission, ...: "N/A"
            return None

    # ---- sampling --------------------------------------------------------------------------------

    def sample(self) -> Dict[int, dict]:
        """One reading of every device (index -> metrics); XID events since the last call included."""
        if not self.available:
            return {}
        self._poll_xids()
        out = {i: self._device(i, h) for i, h in enumerate(self.handles)}
        self.last = out
        return out

    def _device(self, index: int, h: Any) -> dict:
        n, t = self.nvml, self._try
        util = t(n.nvmlDeviceGetUtilizationRates, h)
        mem = t(n.nvmlDeviceGetMemoryInfo, h)
        reasons = t(n.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is None:
            reasons = t(n.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        power = t(n.nvmlDeviceGetPowerUsage, h)
        limit = t(n.nvmlDeviceGetEnforcedPowerLimit, h)
        d = {
            "uuid": self.uuids[index] if index < len(self.uuids) else "",
            "sm_clock_mhz": t(n.nvmlDeviceGetClockInfo, h, 1),  # NVML_CLOCK_SM
            "mem_clock_mhz": t(n.nvmlDeviceGetClockInfo, h, 2),  # NVML_CLOCK_MEM
            "sm_clock_max_mhz": t(n.nvmlDeviceGetMaxClockInfo, h, 1),
            "throttle": throttle_names(int(reasons)) if reasons is not None else None,
            "throttle_mask": int(reasons) if reasons is not None else None,
            "util_gpu_pct": getattr(util, "gpu", None),
            "util_mem_pct": getattr(util, "memory", None),
            "power_w": power / 1000.0 if power is not None else None,
            "power_limit_w": limit / 1000.0 if limit is not None else None,
            "temp_c": t(n.nvmlDeviceGetTemperature, h, 0),  # NVML_TEMPERATURE_GPU
            "mem_used_bytes": getattr(mem, "used", None),
            "mem_total_bytes": getattr(mem, "total", None),
            "pcie_tx_kbps": t(n.nvmlDeviceGetPcieThroughput, h, 0),  # NVML_PCIE_UTIL_TX_BYTES
            "pcie_rx_kbps": t(n.nvmlDeviceGetPcieThroughput, h, 1),
            "pcie_replays": t(n.nvmlDeviceGetPcieReplayCounter, h),
            "nvlink": self._nvlink(index, h),
            "xid": self.xids.pop(index, []),
        }
        return d

    def _nvlink(self, index: int, h: Any) -> Optional[dict]:
        n = self.nvml
        links = self._nvlinks.get(index)
        if links is None:
            links = []
            for link in range(int(getattr(n, "NVML_NVLINK_MAX_LINKS", 18))):
                state = self._try(n.nvmlDeviceGetNvLinkState, h, link)
                if state is None:
                    break
                if state:
                    links.append(link)
            self._nvlinks[index] = links
        if not links:
            return None
        errors = {name: 0 for name in NVLINK_ERRORS}
        for link in links:
            for name, counter in NVLINK_ERRORS.items():
                v = self._try(n.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
                errors[name] += int(v or 0)
        out: dict = {"links": len(links), "errors": errors, "tx_kib": None, "rx_kib": None}
        values = self._try(n.nvmlDeviceGetFieldValues, h, [FI_NVLINK_TX, FI_NVLINK_RX])
        if values is not None:
            for key, v in zip(("tx_kib", "rx_kib"), values):
                if getattr(v, "nvmlReturn", 1) == 0:
                    out[key] = int(v.value.ullVal)
        return out

    def _poll_xids(self) -> None:
        if self.events is None:
            return
        for _ in range(64):  # drain what is pending, never block
            try:
                ev = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except Exception:  # NVMLError_Timeout: nothing pending
                return
            try:
                index = self.handles.index(ev.device)
            except ValueError:
                index = -1
            self.xids.setdefault(index, []).append({"xid": int(ev.eventData), "t": time.time()})

    # ---- ranks -> devices ------------------------------------------------------------------------

    def device_of(self, pid: int, environ: Optional[Dict[str, str]] = None) -> Optional[int]:
        """The device a process computes on: NVML's process list, else CUDA_VISIBLE_DEVICES and
        LOCAL_RANK from its environment, else LOCAL_RANK alone."""
        if not self.available:
            return None
        n = self.nvml
        for i, h in enumerate(self.handles):
            procs = self._try(n.nvmlDeviceGetComputeRunningProcesses, h) or []
            if any(getattr(p, "pid", None) == pid for p in procs):
                return i
        env = environ if environ is not None else _environ(pid)
        local = int(env["LOCAL_RANK"]) if env.get("LOCAL_RANK", "").isdigit() else 0
        visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible:
            want = visible[local] if local < len(visible) else visible[0]
            if want.isdigit():
                return int(want) if int(want) < len(self.handles) else None
            for i, u in enumerate(self.uuids):
                if u and u.startswith(want):
                    return i
            return None
        return local if local < len(self.handles) else None

    def for_pid(self, pid: int) -> Optional[dict]:
        """The latest sample of the device `pid` uses, with its index."""
        dev = self._dev.get(pid)
        if dev is None:
            dev = self._dev[pid] = self.device_of(pid)
        if dev is None or dev not in self.last:
            return None
        return {"device": dev, **self.last[dev]}

    def close(self) -> None:
        if self.nvml is not None:
            try:
                if self.events is not None:
                    self.nvml.nvmlEventSetFree(self.events)
                self.nvml.nvmlShutdown()
            except Exception:
                pass


# what a step summary carries of a device sample (RankStep.gpu): numbers only, a few dozen bytes
# on the wire. Throttle reasons travel as NVML's bit mask; `xid` is the last XID of the interval.
COMPACT = {
    "device": "device",
    "sm_clock_mhz": "sm_mhz",
    "sm_clock_max_mhz": "sm_max_mhz",
    "util_gpu_pct": "util_pct",
    "util_mem_pct": "mem_util_pct",
    "power_w": "power_w",
    "power_limit_w": "power_limit_w",
    "temp_c": "temp_c",
    "throttle_mask": "throttle",
    "pcie_replays": "pcie_replays",
}
# reasons that say nothing is wrong: an idle GPU, clocks an administrator set, a display
BENIGN_REASONS = 0x1 | 0x2 | 0x100


def compact(sample: Dict[str, Any]) -> Dict[str, float]:
    """The numbers of one device sample (GpuMetrics.for_pid) a step summary carries."""
    out: Dict[str, float] = {}
    for k, short in COMPACT.items():
        v = sample.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[short] = round(float(v), 1)
    if sample.get("mem_used_bytes") is not None:
        out["mem_used_gib"] = round(float(sample["mem_used_bytes"]) / 2**30, 2)
    xids = sample.get("xid") or []
    if xids:
        out["xids"] = float(len(xids))
        out["xid"] = float(xids[-1].get("xid", 0))
    nv = sample.get("nvlink") or {}
    if nv.get("errors"):
        out["nvlink_errors"] = float(sum(int(v) for v in nv["errors"].values()))
    return out


def trouble(g: Dict[str, float]) -> str:
    """What a compact sample says is wrong with the GPU, in words ("" when nothing): throttle
    reasons that are not benign, XID errors, link errors."""
    parts = []
    mask = int(g.get("throttle", 0)) & ~BENIGN_REASONS
    if mask:
        clock = ""
        if g.get("sm_mhz") and g.get("sm_max_mhz"):
            clock = f" (SM clock {g['sm_mhz']:g} of {g['sm_max_mhz']:g} MHz)"
        parts.append("clocks held down: " + ", ".join(throttle_names(mask)) + clock)
    if g.get("xids"):
        parts.append(f"{g['xids']:g} XID error(s), the last XID {g.get('xid', 0):g}")
    if g.get("nvlink_errors"):
        parts.append(f"{g['nvlink_errors']:g} NVLink error(s)")
    if g.get("pcie_replays"):
        parts.append(f"{g['pcie_replays']:g} PCIe replays")
    return "; ".join(parts)


def _text(v: Any) -> Optional[str]:
    if v is None:
        return None
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _environ(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out: Dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, eq, v = item.partition(b"=")
        if eq:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out
