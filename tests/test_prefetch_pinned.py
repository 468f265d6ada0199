"""prefetch_to_device on GPU and TPU: host leaves staged through the devices' pinned host memory, and the threads
started at once for batches whose copy is real work.

CPU devices report a ``pinned_host`` memory too, so the accelerator path runs here with the platform that prefetch
sees patched to ``"gpu"``: the same code, on memory that XLA:CPU implements. The tests without a patch hold on any
platform, and ``benchmarks/gpu.py`` runs them on a GPU.
"""

import gc
import threading
import time

import jax
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.data import prefetch, prefetch_threads
from spmdcomm.runtime.mesh import platform


def live_threads():
    return [t for t in threading.enumerate() if t.name == "spmdcomm-prefetch"]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    yield
    gc.collect()
    end = time.monotonic() + 10
    while live_threads() and time.monotonic() < end:
        time.sleep(0.01)
    assert not live_threads(), "a prefetch thread outlived its test"


@pytest.fixture
def as_gpu(monkeypatch):
    """Prefetch sees a GPU; ``calls`` collects the memory kinds of every leaf staged in pinned host memory."""
    calls: list[list[str]] = []
    to_pinned = prefetch_threads._to_pinned

    def spy(state, leaves, names):
        out = to_pinned(state, leaves, names)
        calls.append([x.sharding.memory_kind for x in out])
        return out

    monkeypatch.setattr(prefetch_threads, "platform", lambda sharding=None: "gpu")
    monkeypatch.setattr(prefetch_threads, "_to_pinned", spy)
    return calls


def rows_per_batch(nbytes: int) -> int:
    """Rows of a (rows, 256) float32 batch of at least ``nbytes``, a multiple of the device count."""
    n = jax.device_count()
    return -(-nbytes // (256 * 4 * n)) * n


def batches(count: int, rows: int):
    for i in range(count):
        yield {"x": np.full((rows, 256), i, np.float32), "i": np.arange(rows, dtype=np.int32) + 1000 * i}


def check(batch, i: int, rows: int) -> None:
    assert batch["x"].sharding.memory_kind == "device" and batch["i"].sharding.memory_kind == "device"
    assert batch["x"].sharding.spec == sc.P("data")
    np.testing.assert_array_equal(np.asarray(batch["x"]), np.full((rows, 256), i, np.float32))
    np.testing.assert_array_equal(np.asarray(batch["i"]), np.arange(rows) + 1000 * i)


def test_pinned_sharding_only_off_cpu():
    sharding = sc.data_sharding()
    pinned = prefetch_threads.pinned_sharding(sharding)
    has_pinned = all(any(m.kind == "pinned_host" for m in d.addressable_memories()) for d in sharding.device_set)
    if platform(sharding) == "cpu" or not has_pinned:
        assert pinned is None  # CPU keeps its aligned staging, which the devices alias
    else:
        assert pinned.memory_kind == "pinned_host" and pinned.is_equivalent_to(
            sharding.with_memory_kind("pinned_host"), 2
        )


@pytest.mark.parametrize("threads", ["never", "always"])
def test_staged_through_pinned_host_memory(as_gpu, threads):
    rows = rows_per_batch(64 * 1024)
    with sc.prefetch_to_device(batches(5, rows), threads=threads) as it:
        for i, batch in enumerate(it):
            check(batch, i, rows)
    assert i == 4
    # The placing thread stages; the loop's own thread (threads="never") places directly, as device_put does.
    assert as_gpu == ([["pinned_host", "pinned_host"]] * 5 if threads == "always" else [])


def test_large_batches_start_the_threads_at_once_off_cpu(as_gpu):
    rows = rows_per_batch(prefetch.THREAD_BYTES)
    with sc.prefetch_to_device(batches(6, rows)) as it:
        first = next(it)
        assert it.threaded  # the first batch placed in-line showed the copy is worth overlapping
        check(first, 0, rows)
        for i, batch in enumerate(it, 1):
            check(batch, i, rows)
    assert len(as_gpu) == 5 and all(kinds == ["pinned_host", "pinned_host"] for kinds in as_gpu)


def test_small_batches_stay_in_line_while_the_loader_is_free(as_gpu, monkeypatch):
    monkeypatch.setattr(prefetch, "clock", lambda: 0.0)  # a loader that never looks slow, however busy the machine
    rows = jax.device_count()
    with sc.prefetch_to_device(batches(20, rows)) as it:
        assert sum(1 for _ in it) == 20 and not it.threaded
    assert as_gpu == []


def test_switched_off_places_from_host_memory(as_gpu, monkeypatch):
    monkeypatch.setattr(prefetch_threads, "PINNED_HOST", False)
    rows = rows_per_batch(64 * 1024)
    with sc.prefetch_to_device(batches(3, rows), threads="always") as it:
        for i, batch in enumerate(it):
            check(batch, i, rows)
    assert as_gpu == []


def test_masked_batches_off_cpu(as_gpu):
    n = jax.device_count()
    loader = ({"x": np.full((8 * n - 1, 4), i, np.float32)} for i in range(3))
    with sc.prefetch_to_device(loader, multiple_of=n, threads="always") as it:
        out = list(it)
    assert [float(b.data["x"].sum()) for b in out] == [4.0 * i * (8 * n - 1) for i in range(3)]
    assert all(int(b.mask.sum()) == 8 * n - 1 and b.mask.sharding.memory_kind == "device" for b in out)
    assert as_gpu == [["pinned_host", "pinned_host"]] * 3  # the padded rows and the mask


def test_device_leaves_are_not_staged(as_gpu):
    n = jax.device_count()
    on_device = jax.device_put(np.arange(8 * n, dtype=np.float32), sc.data_sharding())
    loader = ({"x": np.full((8 * n, 4), i, np.float32), "d": on_device} for i in range(3))
    with sc.prefetch_to_device(loader, threads="always") as it:
        out = list(it)
    assert all(b["d"] is on_device for b in out)  # already placed as asked: passed on as it is
    assert [float(b["x"].sum()) for b in out] == [32.0 * i * n for i in range(3)]
    assert sorted(as_gpu[0]) == ["device", "pinned_host"]


def test_on_this_platform_large_batches_keep_their_values(monkeypatch):
    """Whatever the platform: on CPU a free loader keeps the loop's thread placing, elsewhere the threads start."""
    monkeypatch.setattr(prefetch, "clock", lambda: 0.0)  # a loader that never looks slow, however busy the machine
    rows = rows_per_batch(2 * prefetch.THREAD_BYTES)
    with sc.prefetch_to_device(batches(4, rows)) as it:
        for i, batch in enumerate(it):
            check(batch, i, rows)
        assert it.threaded == (platform(sc.data_sharding()) != "cpu")
