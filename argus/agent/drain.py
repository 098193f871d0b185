"""Reading the BPF aggregation maps: every channel's per-epoch counts, handed over once each epoch
is complete, then deleted.

Every high-rate count is keyed by (tgid, epoch, ...) (docs/architecture.md, "Epochs"). An epoch
gets no more increments once it was already closed at the previous drain (a thread that read the
epoch counter just before the sync closed it may still add to it until then), so a drain hands
over the epochs below `final` and deletes them; the entries of epochs below `final_before` (handed
over at an earlier drain) that still appear are late increments of no step: deleted.
"""

from __future__ import annotations

import ctypes
import errno
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Set, Tuple, TypeVar

from argus.probes.records import DROP_NAMES, SampleKey, SampleVal

T = TypeVar("T")


def final_epochs(bpf: Any, targets: Mapping[int, Any]) -> Dict[int, int]:
    """Per target pid: the first epoch not yet complete. Epochs closed before the previous drain
    get no more updates; an exited process's are all complete. Advances each target's `seen_epoch`."""
    cur = {int(k.value): int(v.value) for k, v in bpf["epochs"].items()}
    final: Dict[int, int] = {}
    for pid, t in targets.items():
        now = cur.get(pid, 0)
        final[pid] = min(t.seen_epoch, now) if t.alive else now + 1
        t.seen_epoch = now
    return final


# Entries read per BPF_MAP_LOOKUP_BATCH call. bcc's own batch helpers size their buffers to the
# map's max_entries (megabytes zeroed per call for the 65,536-entry maps): a chunk is enough.
BATCH_CHUNK = 1024
_no_batch: Set[int] = set()  # map fds whose kernel refused batch operations (before 5.6): per key


def entries(tbl: Any) -> List[Tuple[Any, Any]]:
    """Every (key, value) of a hash map: a few BPF_MAP_LOOKUP_BATCH calls, not three syscalls and
    three ctypes objects per entry as bcc's `items()` (the drains read thousands a second)."""
    fd = getattr(tbl, "map_fd", None)
    if fd is None or fd in _no_batch:  # (a plain mapping: the unit tests')
        return list(tbl.items())
    from bcc.libbcc import lib

    out: List[Tuple[Any, Any]] = []
    token = ctypes.c_uint32(0)
    chunk = BATCH_CHUNK
    first = True
    while True:
        keys = (tbl.Key * chunk)()
        vals = (tbl.Leaf * chunk)()
        cnt = ctypes.c_uint32(chunk)
        res = lib.bpf_lookup_batch(
            fd,
            None if first else ctypes.byref(token),
            ctypes.byref(token),
            ctypes.byref(keys),
            ctypes.byref(vals),
            ctypes.byref(cnt),
        )
        err = ctypes.get_errno()
        n = cnt.value
        if res != 0 and err == errno.ENOSPC and n == 0 and chunk < tbl.max_entries:
            chunk *= 4  # one bucket holds more than a chunk: rare, retry the same batch bigger
            continue
        if res != 0 and err != errno.ENOENT:
            if first:  # the kernel has no batch operations for this map: per key from now on
                _no_batch.add(fd)
                return list(tbl.items())
            return out  # what was read; the rest stays in the map for the next drain
        out.extend(zip(_objects(tbl.Key, keys, n), _objects(tbl.Leaf, vals, n)))
        first = False
        if res != 0:  # ENOENT: that was the last of them
            return out


def _objects(kind: Any, arr: Any, n: int) -> List[Any]:
    """The first n elements as ctypes objects, like bcc's `items()` gives: a structure array's
    elements are already views into it; a plain type's (u64) come back as ints, wrapped again."""
    got = arr[:n]
    return [kind(x) for x in got] if issubclass(kind, ctypes._SimpleCData) else got


def delete(tbl: Any, keys: List[Any]) -> None:
    """Delete these keys (one BPF_MAP_DELETE_BATCH call); a key already gone is no error."""
    if not keys:
        return
    fd = getattr(tbl, "map_fd", None)
    if fd is not None and fd not in _no_batch:
        from bcc.libbcc import lib

        arr = (tbl.Key * len(keys))(*keys)
        cnt = ctypes.c_uint32(len(keys))
        if lib.bpf_delete_batch(fd, ctypes.byref(arr), ctypes.byref(cnt)) == 0:
            return
        if ctypes.get_errno() == errno.ENOENT:
            keys = keys[cnt.value :]  # stopped at a key not there: it and the rest one by one
    for k in keys:
        try:
            del tbl[k]
        except KeyError:
            pass


def take(
    tbl: Any,
    owners: Mapping[int, T],
    final: Mapping[int, int],
    final_before: Mapping[int, int],
    on: Callable[[T, Any, Any], None],
    seen: Optional[Callable[[T, Any], object]] = None,
) -> None:
    """The one drain of a map keyed by (tgid, epoch, ...): `on(owner, key, value)` for each entry
    of an epoch in [final_before, final) of its process, then every such entry, and every entry of
    a process no longer tracked or of an epoch already handed over, is deleted. `seen(owner, key)`
    sees every entry of a tracked process first, complete or not (to name stacks while the process
    is alive). Per entry (thousands a drain): nothing but the comparisons and the callback."""
    done: List[Any] = []
    for k, v in entries(tbl):
        tgid = k.tgid
        owner = owners.get(tgid)
        end = final.get(tgid)
        if owner is None or end is None:
            done.append(k)  # a process we no longer track
            continue
        if seen is not None:
            seen(owner, k)
        e = k.epoch
        if e < final_before[tgid]:
            done.append(k)  # a late increment of an epoch already handed over
        elif e < end:
            on(owner, k, v)
            done.append(k)
    delete(tbl, done)


# The CUDA, CUDA runtime and NCCL channels' maps: (map, the channel whose unit holds it (None: every
# native channel's), what a tracker takes from an entry)
COUNT_MAPS: Tuple[Tuple[str, Optional[str], Callable[[Any, Any, Any], None]], ...] = (
    ("launches", "cuda", lambda t, k, v: t.tracker.add_launches(k.epoch, k.func, v.value)),
    ("hists", "cuda", lambda t, k, v: t.tracker.add_hist(k.epoch, k.slot, v.value)),
    ("mem", "cuda", lambda t, k, v: t.tracker.add_mem(k.epoch, k.kind, v.count, v.bytes)),
    ("epoch_syncs", "cuda", lambda t, k, v: t.tracker.add_sync(k.epoch, v)),
    ("colls", "nccl", lambda t, k, v: t.tracker.add_colls(k, v)),
    ("errors", None, lambda t, k, v: t.tracker.add_error(k.epoch, k.call, k.result, v.value)),
    ("call_counts", None, lambda t, k, v: t.tracker.add_call(k.epoch, k.call, v.value)),
)


def drain_counts(
    bpf: Any,
    targets: Mapping[int, Any],
    final: Mapping[int, int],
    final_before: Mapping[int, int],
    channels: Collection[str],
) -> None:
    """Every count map of the native channels loaded into each target's tracker."""
    for name, channel, on in COUNT_MAPS:
        if channel is None or channel in channels:
            take(bpf[name], targets, final, final_before, on)


def read_drops(bpf: Any, targets: Mapping[int, Any], totals: Dict[str, int]) -> None:
    """Records the BPF side lost: the totals by kind, and per process (its tracker says them in its
    next summary). Per-process entries exist only where records were lost: a handful."""
    drops = bpf["drops"]
    for i, name in DROP_NAMES.items():
        v = int(drops[ctypes.c_int(i)].value)
        if v:
            totals[name] = v
    by_pid = bpf["drops_by_pid"]
    gone: List[Any] = []
    for k, v in by_pid.items():
        lost = targets.get(k.tgid)
        if lost is None:
            gone.append(k)
        elif k.slot in DROP_NAMES:
            lost.tracker.drops_total[DROP_NAMES[k.slot]] = int(v.value)
    for k in gone:
        try:
            del by_pid[k]
        except KeyError:
            pass


# ---- sampled collectives (nccl.bpf.c `coll_sample`) ---------------------------------------------


def ask_samples(bpf: Any, pid: int, asks: List[Tuple[int, int, int]]) -> None:
    """Have BPF record only every stride-th collective of these communicators of `pid`
    ((handle, stride, phase): RankTracker.take_samples)."""
    if not asks:
        return
    tbl = bpf["coll_sample"]
    for handle, stride, phase in asks:
        key = tbl.Key.from_buffer_copy(bytes(SampleKey(tgid=pid, pad=0, comm=handle)))
        tbl[key] = tbl.Leaf.from_buffer_copy(bytes(SampleVal(stride=stride, phase=phase)))


def read_samples(bpf: Any, targets: Mapping[int, Any]) -> None:
    """The latest collective of each sampled communicator, recorded or not: a tracker's `last_seq`
    (which a hung rank shows to say how far it got) would otherwise lag by up to a stride."""
    for k, v in bpf["coll_sample"].items():
        t = targets.get(k.tgid)
        if t is not None and v.last_seq:
            t.tracker.saw_seq(k.comm, int(v.last_seq))


def forget_samples(bpf: Any, pid: int) -> None:
    """A process's sampling state and held stream waits (keyed by process and communicator or
    stream, so not removed with the process's own entries)."""
    for name in ("coll_sample", "waits_held"):
        try:
            tbl = bpf[name]
        except KeyError:  # no such map without its channel
            continue
        for k in [k for k in tbl.keys() if k.tgid == pid]:
            try:
                del tbl[k]
            except KeyError:
                pass
