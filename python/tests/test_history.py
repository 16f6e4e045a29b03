"""The memory history, in the shape of PyTorch's snapshots, on the host
backend: what `torch.cuda._memory_viz` reads, checked as it checks it."""

from __future__ import annotations

import pickle

import pytest
import vmpool

MIB = 1 << 20
BLOCK_STATES = {"active_allocated", "active_awaiting_free", "inactive"}


def _check_shape(snap: dict) -> None:
    assert set(snap) >= {"segments", "device_traces"}
    for seg in snap["segments"]:
        assert {"device", "address", "total_size", "stream", "segment_type", "blocks"} <= set(seg)
        # Blocks tile the segment, in address order (memory_viz's segsum
        # asserts the sizes add up).
        address = seg["address"]
        for block in seg["blocks"]:
            assert block["state"] in BLOCK_STATES
            assert block["address"] == address and block["size"] > 0
            assert 0 <= block["requested_size"] <= block["size"]
            assert block["frames"] == []
            address += block["size"]
        assert address == seg["address"] + seg["total_size"]
    for trace in snap["device_traces"]:
        for e in trace:
            assert {"action", "addr", "size", "stream", "time_us", "frames"} <= set(e)


def test_history_is_off_by_default():
    p = vmpool.alloc(MIB)
    vmpool.free(p)
    assert vmpool.memory_snapshot()["device_traces"] == [[]]


def test_the_snapshot_has_pytorch_s_shape(tmp_path):
    before = vmpool.alloc(MIB)  # allocated before recording: used, of no known allocation
    try:
        _record_and_check(before, tmp_path)
    finally:
        vmpool.record_history(False)
        vmpool.free(before)
        vmpool.empty_cache(0)


def _record_and_check(before, tmp_path):
    vmpool.record_history(True, max_entries=10_000)
    a = vmpool.alloc(3 * MIB)
    b = vmpool.alloc(40 * MIB)
    vmpool.free(a)
    with pytest.raises(vmpool.OutOfMemoryError):
        vmpool.alloc(2 << 30)  # over the host device's memory (1 GiB in these tests)
    vmpool.free(b)
    vmpool.empty_cache(0)
    c = vmpool.alloc(5 * MIB)
    path = tmp_path / "snapshot.pickle"
    vmpool.dump_snapshot(str(path))
    with open(path, "rb") as f:
        snap = pickle.load(f)
    _check_shape(snap)
    trace = snap["device_traces"][0]
    actions = [e["action"] for e in trace]
    assert {"alloc", "free_requested", "free_completed", "segment_map", "segment_unmap", "oom"} <= set(actions)
    allocs = [(e["addr"], e["size"]) for e in trace if e["action"] == "alloc"]
    assert allocs == [(a, 3 * MIB), (b, 40 * MIB), (c, 5 * MIB)]
    freed = [e["addr"] for e in trace if e["action"] == "free_completed"]
    assert freed == [a, b]
    # The maps before an allocation come before it.
    assert actions.index("segment_map") < actions.index("alloc")
    assert [e["size"] for e in trace if e["action"] == "oom"] == [2 << 30]
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)
    # The live allocations are blocks of their own, the older one too.
    blocks = {b["address"]: b for seg in snap["segments"] for b in seg["blocks"]}
    assert blocks[c]["state"] == "active_allocated" and blocks[c]["requested_size"] == 5 * MIB
    assert any(block["address"] <= before < block["address"] + block["size"] for block in blocks.values())
    vmpool.free(c)


def test_the_ring_keeps_the_last_entries():
    vmpool.record_history(True, max_entries=4)
    for _ in range(5):
        vmpool.free(vmpool.alloc(MIB))
    trace = vmpool.memory_snapshot()["device_traces"][0]
    assert len(trace) == 4
    assert [e["action"] for e in trace][-2:] == ["free_requested", "free_completed"]
    vmpool.record_history(False)
    vmpool.free(vmpool.alloc(MIB))
    assert len(vmpool.memory_snapshot()["device_traces"][0]) == 4
    with pytest.raises(ValueError):
        vmpool.record_history(True, max_entries=0)
