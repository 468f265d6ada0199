"""prefetch_to_device: placement, order, padding, errors, early stop, look-ahead bound, staging and aliasing.

Batches are placed by the loop's own thread while the loader is free and by background threads once it
takes time (``threads="auto"``); ``mode`` passes ``threads="always"`` or ``"never"`` to test both ways, and a
manual clock decides what "takes time" means in the tests of the switch itself.
"""

import gc
import itertools
import threading
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.data import prefetch
from spmdcomm.errors import ShapeError


class Pair(NamedTuple):
    x: np.ndarray
    y: np.ndarray


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "spmdcomm-prefetch"]


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    yield
    if prefetch_threads():  # a dropped loader may still wait for collection; with a large heap a collection is slow
        gc.collect()
    assert wait_until(lambda: not prefetch_threads()), "a prefetch thread outlived its test"


@pytest.fixture(params=["never", "always"], ids=["inline", "threaded"])
def mode(request):
    return request.param


def unaligned(a):
    """A copy of ``a`` whose data starts 16 bytes past a 64-byte boundary."""
    raw = sc.data.aligned_empty(a.nbytes + 16, np.uint8)
    out = raw[16 : 16 + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def batches(n, rows=8):
    for i in range(n):
        yield {"x": np.full((rows, 3), i, np.float32), "i": np.arange(rows) + 100 * i}


def test_order_values_and_placement(mesh, mode):
    n = mesh.shape["data"]
    with sc.prefetch_to_device(batches(6, rows=2 * n), mesh=mesh, threads=mode) as it:
        got = list(it)
        assert it.threaded == (mode == "always")
    assert len(got) == 6
    for i, b in enumerate(got):
        assert b["x"].sharding == sc.data_sharding(mesh=mesh) and b["i"].sharding == sc.data_sharding(mesh=mesh)
        np.testing.assert_array_equal(np.asarray(b["i"]), np.arange(2 * n) + 100 * i)
        for shard in b["i"].addressable_shards:
            d = list(mesh.devices.flat).index(shard.device)
            np.testing.assert_array_equal(np.asarray(shard.data), np.arange(2 * d, 2 * d + 2) + 100 * i)


def test_tuples_namedtuples_and_explicit_sharding(mode):
    mesh = sc.make_mesh({"data": 4, "model": 2})
    sharding = jax.sharding.NamedSharding(mesh, sc.P("data", "model"))
    src = [Pair(np.arange(16.0).reshape(8, 2) + k, np.ones((8, 2))) for k in range(3)]
    with sc.prefetch_to_device(iter(src), sharding=sharding, threads=mode) as it:
        for want, got in zip(src, it, strict=True):
            assert isinstance(got, Pair) and got.x.sharding == sharding
            np.testing.assert_array_equal(np.asarray(got.x), want.x)
            for shard in got.x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want.x[shard.index])
    with sc.prefetch_to_device(iter([(np.zeros(8), np.ones(8))]), threads=mode) as it:
        ((a, b),) = list(it)
        assert float(b.sum()) == 8.0


def test_multiple_of_yields_masked_batches_with_exact_means(mode):
    sizes = [8, 16, 5, 13, 1]
    src = ({"x": np.arange(n, dtype=np.float32) + 1} for n in sizes)
    with sc.prefetch_to_device(src, multiple_of=8, threads=mode) as it:
        for n, b in zip(sizes, it, strict=True):
            assert isinstance(b, sc.MaskedBatch) and b.mask.shape[0] % 8 == 0
            x, m = np.asarray(b.data["x"]), np.asarray(b.mask)
            assert m.sum() == n and (x * m).sum() / m.sum() == (n + 1) / 2


def test_old_pad_to_multiple_keyword_still_pads_with_a_deprecation_warning():
    sizes = [8, 5, 13]
    with pytest.warns(DeprecationWarning) as record:
        it = sc.prefetch_to_device(({"x": np.arange(n, dtype=np.float32)} for n in sizes), pad_to_multiple=8)
    (warning,) = record
    assert str(warning.message) == (
        "spmdcomm.prefetch_to_device: pad_to_multiple= is deprecated and will be removed in the next release; "
        "pass multiple_of=8."
    )
    assert warning.filename == __file__
    with it:
        got = [(np.asarray(b.data["x"]).tolist(), np.asarray(b.mask).tolist()) for b in it]
    want = [(sc.pad_batch({"x": np.arange(n, dtype=np.float32)}, 8)) for n in sizes]
    assert got == [(w.data["x"].tolist(), w.mask.tolist()) for w in want]
    with pytest.raises(sc.SpmdError, match=r"both multiple_of= and its old spelling pad_to_multiple= were given"):
        sc.prefetch_to_device([], multiple_of=8, pad_to_multiple=8)


def test_producer_exception_reraised_with_original_traceback(mode):
    def broken():
        yield {"x": np.zeros(8)}
        raise KeyError("record 17 is corrupt")

    it = sc.prefetch_to_device(broken(), threads=mode)
    next(it)
    with pytest.raises(KeyError, match="record 17 is corrupt") as info:
        next(it)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "broken" in frames
    assert wait_until(lambda: not it.alive)
    with pytest.raises(StopIteration):
        next(it)


def test_shape_error_from_producer_says_how_to_pad(mode):
    it = sc.prefetch_to_device(iter([{"x": np.zeros((7, 2))}]), threads=mode)
    with pytest.raises(ShapeError, match=r"leaf \['x'\]: dimension 0 of size 7 .*multiple_of=8"):
        next(it)


@pytest.mark.parametrize("how", ["break_close", "context", "gc"])
def test_early_stop_ends_the_threads_even_with_a_full_queue(how):

    def endless():
        i = 0
        while True:
            yield {"x": np.full(8, i)}
            i += 1

    if how == "context":
        with sc.prefetch_to_device(endless(), size=3, threads="always") as it:
            next(it)
            assert wait_until(lambda: it._state.queue.qsize() == 3)
    else:
        it = sc.prefetch_to_device(endless(), size=3, threads="always")
        b = next(it)
        assert wait_until(lambda: it._state.queue.qsize() == 3)
        threads = it._state.threads
        assert len(threads) == 2
        if how == "break_close":
            it.close()
        else:
            del it, b
            gc.collect()
        assert wait_until(lambda: not any(t.is_alive() for t in threads))
    assert wait_until(lambda: not prefetch_threads())


@pytest.mark.parametrize("how", ["break_close", "context", "gc"])
def test_early_stop_in_line_closes_the_loader(how):
    closed = []

    def endless():
        try:
            while True:
                yield {"x": np.zeros(8)}
        finally:
            closed.append(True)

    it = sc.prefetch_to_device(endless(), threads="never")
    if how == "context":
        with it:
            next(it)
    else:
        next(it)
        if how == "break_close":
            it.close()
        else:
            del it
            gc.collect()
    assert closed == [True] and not prefetch_threads()


def test_close_stops_a_producer_stuck_in_a_slow_loader():
    release = threading.Event()

    def slow():
        yield {"x": np.zeros(8)}
        release.wait(5)
        yield {"x": np.ones(8)}

    it = sc.prefetch_to_device(slow(), threads="always")
    next(it)
    release.set()
    it.close()
    assert not it.alive


@pytest.mark.parametrize("size", [1, 2, 4])
def test_size_bounds_look_ahead(size, mode):
    ahead = size if mode == "always" else 0
    pulled = []

    def counting():
        for i in range(50):
            pulled.append(i)
            yield {"x": np.full(8, i)}

    with sc.prefetch_to_device(counting(), size=size, threads=mode) as it:
        for consumed in range(1, 6):
            b = next(it)
            assert int(b["x"][0]) == consumed - 1
            assert wait_until(lambda c=consumed: len(pulled) == c + ahead)
            time.sleep(0.05)
            assert len(pulled) == consumed + ahead


class ManualClock:
    """Stands in for ``prefetch.clock``: time moves only when a loader says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_loader_that_takes_time_switches_to_threads_and_keeps_order(monkeypatch):
    clock = ManualClock()
    monkeypatch.setattr(prefetch, "clock", clock)
    slow = 10 * prefetch.INLINE_LOAD_SECONDS

    def loader(n, slow_from):
        for i in range(n):
            clock.now += slow if i >= slow_from else 0.0
            yield {"x": np.full(8, i)}

    with sc.prefetch_to_device(loader(12, 4), size=2) as it:
        got = [int(next(it)["x"][0]) for _ in range(5)]
        assert not it.threaded  # a free loader, then one slow call: the loop's thread still places
        got.append(int(next(it)["x"][0]))
        assert it.threaded  # the second slow call in a row passes SLOW_CALLS (1 + 0.75 > 1.5)
        got += [int(b["x"][0]) for b in it]
        assert it.stats.steps == 12
    assert got == list(range(12))
    with sc.prefetch_to_device(loader(30, 30)) as it:  # never slow: never threaded
        assert sum(1 for _ in it) == 30 and not it.threaded


def test_occasional_slow_loader_calls_do_not_start_threads(monkeypatch):
    clock = ManualClock()
    monkeypatch.setattr(prefetch, "clock", clock)

    def loader():
        for i in range(40):
            clock.now += 10 * prefetch.INLINE_LOAD_SECONDS if i % 4 == 0 else 0.0
            yield {"x": np.full(8, i)}

    # One slow call in 4: the decaying count peaks at 1 / (1 - 0.75**4) = 1.46, below SLOW_CALLS.
    with sc.prefetch_to_device(loader()) as it:
        assert [int(b["x"][0]) for b in it] == list(range(40)) and not it.threaded


def test_stats_count_the_manual_clock(monkeypatch, mode):
    clock = ManualClock()
    monkeypatch.setattr(prefetch, "clock", clock)

    def loader():
        for i in range(3):
            clock.now += 0.5 * (i + 1)
            yield {"x": np.full(8, i)}

    with sc.prefetch_to_device(loader(), size=1, threads=mode) as it:
        for _ in it:
            pass
    if mode == "never":  # the loop's thread waits for each loader call
        assert list(it.stats.waits) == [0.5, 1.0, 1.5] and it.stats.total_wait == 3.0
    assert it.stats.steps == 3 and len(it.stats.waits) == 3


def test_stats_record_every_wait(mode):
    def slow(n):
        for i in range(n):
            time.sleep(0.02)
            yield {"x": np.full(8, i)}

    with sc.prefetch_to_device(slow(4), size=1, threads=mode) as it:
        for _ in it:
            pass
        s = it.stats
    assert s.steps == 4 and len(s.waits) == 4
    assert s.total_wait == pytest.approx(sum(s.waits)) and s.last_wait == s.waits[-1]
    assert s.max_wait == max(s.waits) and s.mean_wait == pytest.approx(s.total_wait / 4)
    assert s.total_wait > 0


def staged_memory(arr):
    """The (start, end) host address range of each device buffer of ``arr``."""
    return [(p, p + s.data.nbytes) for s in arr.addressable_shards for p in [s.data.unsafe_buffer_pointer()]]


def test_staged_leaves_are_aliased_on_cpu():
    """What the ownership rule guards against: JAX 0.10 puts an aligned staging copy on CPU without a copy, so
    the device buffers read the staging memory itself."""
    src = unaligned(np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
    with sc.prefetch_to_device(iter([{"x": src}]), threads="always") as it:
        (b,) = list(it)
        pool = it._state.pool
    assert pool.allocated == 1
    starts = [start for start, _ in staged_memory(b["x"])]
    assert all(p % 64 == 0 for p in starts) and starts == [starts[0] + k * 512 for k in range(8)]
    assert all(p != src.ctypes.data for p in starts)  # the staging copy, not the loader's array
    np.testing.assert_array_equal(np.asarray(b["x"]), src)


@pytest.mark.parametrize("mode_", ["never", "always"])
def test_every_batch_kept_alive_keeps_its_values(mode_):
    """The loop keeps all 50 batches (and a shard of each) to the end; none is overwritten by a later one."""
    rng = np.random.default_rng(0)
    src = [
        {"x": unaligned(rng.standard_normal((64, 16)).astype(np.float32)), "i": np.arange(64, dtype=np.int32) + i}
        for i in range(50)
    ]
    with sc.prefetch_to_device(iter(src), size=3, threads=mode_) as it:
        kept = [(b, b["x"].addressable_shards[3].data) for b in it]
        allocated = it._state.pool.allocated
    assert len(kept) == 50
    for want, (got, shard) in zip(src, kept, strict=True):
        np.testing.assert_array_equal(np.asarray(got["x"]), want["x"])
        np.testing.assert_array_equal(np.asarray(got["i"]), want["i"])
        np.testing.assert_array_equal(np.asarray(shard), want["x"][24:32])
    # Every live batch has staging memory of its own ("i", 32 bytes per device, is not worth staging).
    assert allocated == (50 if mode_ == "always" else 0)
    ranges = sorted(r for b, _ in kept for r in staged_memory(b["x"]))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ranges))  # no two share memory


def test_staging_memory_returns_only_when_its_batch_is_gone():
    src = [{"x": unaligned(np.full((64, 16), i, np.float32))} for i in range(40)]
    with sc.prefetch_to_device(iter(src), size=2, threads="always") as it:
        pool = it._state.pool
        held = next(it)  # kept to the end
        held_memory = staged_memory(held["x"])
        for i, b in enumerate(it, start=1):
            assert float(b["x"][0, 0]) == i
            assert not set(staged_memory(b["x"])) & set(held_memory)
            del b
    # Memory comes back for reuse (JAX drops its references asynchronously, so the count varies a little
    # above the 4 leases out at a time: 2 ahead, the batch in hand and the held one).
    assert pool.allocated < len(src) // 2
    np.testing.assert_array_equal(np.asarray(held["x"]), src[0]["x"])
    shard = held["x"].addressable_shards[0].data
    held_start = held_memory[0][0]
    pool.keep = len(src)  # the pool keeps whatever comes back from now on, so that the check below sees it

    def returned():
        gc.collect()
        return any(raw.ctypes.data == held_start for free in pool.free.values() for raw in free)

    del held
    assert not returned()  # `shard` still reads the memory
    np.testing.assert_array_equal(np.asarray(shard), src[0]["x"][:8])
    del shard
    assert wait_until(returned)  # the last reader is gone: the memory is back in the pool


def test_aligned_leaves_are_aliased_and_unaligned_ones_copied(mode):
    aligned = sc.data.aligned_empty((64, 16), np.float32)
    aligned[...] = 1.0
    loose = unaligned(np.full((64, 16), 2.0, np.float32))
    with sc.prefetch_to_device(iter([{"a": aligned, "u": loose}]), threads=mode) as it:
        b = next(it)
    blocks = [s.data.unsafe_buffer_pointer() for s in b["a"].addressable_shards]
    assert blocks == [aligned.ctypes.data + k * aligned.nbytes // 8 for k in range(8)]  # zero-copy
    loose[...] = 3.0  # allowed: the unaligned leaf was copied
    np.testing.assert_array_equal(np.asarray(b["u"]), np.full((64, 16), 2.0))
    aligned[...] = 4.0  # breaks the contract: the device array aliases the yielded array
    np.testing.assert_array_equal(np.asarray(b["a"]), np.full((64, 16), 4.0))


@pytest.mark.parametrize(
    "shape, dtype", [((256, 3), np.float32), (7, np.int8), ((0, 5), np.float64), ((3, 5, 2), np.complex64)]
)
def test_aligned_empty(shape, dtype):
    x = sc.data.aligned_empty(shape, dtype)
    assert x.ctypes.data % 64 == 0 and x.flags.c_contiguous and x.flags.writeable
    assert x.shape == (shape if isinstance(shape, tuple) else (shape,)) and x.dtype == dtype


def test_staging_buffer_not_reused_while_a_dropped_batch_is_still_being_read():

    @jax.jit
    def slow_sum(x):
        c = jax.lax.fori_loop(0, 40, lambda i, c: jnp.tanh(c @ c), jnp.eye(64) * 0.5)
        return (x * (1.0 + 0.0 * c[0, 0])).sum()  # reads x only after the loop

    src = [unaligned(np.full((64, 16), i, np.float32)) for i in range(12)]
    slow_sum(jnp.asarray(src[0])).block_until_ready()
    results = []
    with sc.prefetch_to_device(iter(src), size=2, threads="always") as it:
        for x in it:
            results.append(slow_sum(x))  # dispatched, then the loop drops x at once
            del x
            if len(results) > 8:
                results[-9].block_until_ready()  # bound the steps in flight
    assert [float(r) for r in results] == [64 * 16 * i for i in range(12)]


def test_bad_arguments():
    with pytest.raises(sc.SpmdError, match="size=0 must be at least 1"):
        sc.prefetch_to_device([], size=0)
    with pytest.raises(sc.SpmdError, match="multiple_of=0"):
        sc.prefetch_to_device([], multiple_of=0)
    with pytest.raises(sc.SpmdError, match=r"threads='sometimes' is not one of \('auto', 'always', 'never'\)"):
        sc.prefetch_to_device([], threads="sometimes")
