"""PhaseTimer (seconds per phase of each step, on a manual clock) and MetricsWriter (JSON lines, TensorBoard)."""

import glob
import json
import os
import struct
import sys
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc


class Clock:
    """A clock that moves only when told to."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_phases_add_up_to_the_step_and_unused_phases_are_zero():
    clock = Clock()
    timer = sc.PhaseTimer(clock=clock)
    clock.now += 0.5  # before the first phase: "other"
    with timer.phase("data"):
        clock.now += 2.0
    with timer.phase("dispatch"):
        clock.now += 0.25
    with timer.phase("devices"):
        clock.now += 4.0
    clock.now += 0.125
    times = timer.end_step(0)
    assert times == {
        **dict.fromkeys(sc.reliability.PHASES, 0.0),
        "data": 2.0,
        "dispatch": 0.25,
        "devices": 4.0,
        "other": 0.625,
    }
    with timer.phase("save"):
        clock.now += 1.5
    assert timer.end_step(1) == {**dict.fromkeys(sc.reliability.PHASES, 0.0), "save": 1.5}


def test_nested_phases_count_for_the_innermost_and_custom_names_are_kept():
    clock = Clock()
    timer = sc.PhaseTimer(clock=clock)
    with timer.phase("sync"):
        clock.now += 1.0
        with timer.phase("save"):
            clock.now += 3.0
        clock.now += 1.0
    with timer.phase("eval"):
        clock.now += 7.0
    times = timer.end_step(0)
    assert (times["sync"], times["save"], times["eval"], times["other"]) == (2.0, 3.0, 7.0, 0.0)
    assert "eval" not in timer.end_step(1)  # a custom phase appears in the steps that used it


def test_a_step_that_ends_inside_a_phase_books_the_time_up_to_then():
    clock = Clock()
    timer = sc.PhaseTimer(clock=clock)
    with timer.phase("devices"):
        clock.now += 1.0
        assert timer.end_step(0)["devices"] == 1.0
        clock.now += 2.0
    assert timer.end_step(1)["devices"] == 2.0


def test_snapshot_tells_another_thread_the_step_phase_and_since_when():
    clock = Clock()
    timer = sc.PhaseTimer(clock=clock)
    first = timer.snapshot()
    assert (first.step, first.phase, first.phase_start, first.step_start) == (None, "other", 100.0, 100.0)
    with timer.phase("data"):
        clock.now += 1.0
        timer.end_step(0)
        clock.now += 2.0
        with timer.phase("dispatch"):
            seen = []
            reader = threading.Thread(target=lambda: seen.append(timer.snapshot()))
            reader.start()
            reader.join()
    (p,) = seen
    assert (p.step, p.phase, p.phase_start, p.step_start) == (0, "dispatch", 103.0, 101.0)
    assert p.thread == threading.get_ident()  # the training thread, whose stack the watchdog prints
    assert sc.reliability.PHASE_DESCRIPTIONS[p.phase] == "dispatching"


@pytest.mark.parametrize("name", ["", 3, None])
def test_a_phase_needs_a_name(name):
    with pytest.raises(
        sc.SpmdError, match=r"^spmdcomm\.PhaseTimer\.phase: name=.* is not a phase name\. Fix: pass one of"
    ):
        with sc.PhaseTimer().phase(name):
            pass


@pytest.mark.parametrize("step", [-1, True, 1.0, "3"])
def test_end_step_needs_a_step_number(step):
    with pytest.raises(sc.SpmdError, match=r"^spmdcomm\.PhaseTimer\.end_step: step=.* is not a step number"):
        sc.PhaseTimer().end_step(step)


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_metrics_are_json_lines_of_floats_appended_per_step(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    values = [
        {"loss": np.float32(0.1), "time/data": 0.25, "examples": np.int64(15)},
        {"loss": jnp.float32(0.05), "time/data": 0.5, "examples": 16},
    ]
    with sc.MetricsWriter(path) as writer:
        for step, metrics in enumerate(values):
            writer.write(step, metrics)
    with sc.MetricsWriter(path) as writer:  # a resumed run appends
        writer.write(2, {"loss": float("nan")})
    got = read_lines(path)
    assert [r["step"] for r in got] == [0, 1, 2]
    for record, metrics in zip(got, values):
        assert {k: v for k, v in record.items() if k not in ("step", "time")} == {
            k: float(np.asarray(v)) for k, v in metrics.items()
        }
    assert got[0]["loss"] == float(np.float32(0.1)) != 0.1  # the float32 value, exactly
    assert np.isnan(got[2]["loss"])
    assert all(isinstance(r["time"], float) for r in got)


def test_process_placeholder_names_this_process(tmp_path):
    with sc.MetricsWriter(str(tmp_path / "m.{process}.jsonl")) as writer:
        writer.write(0, {"x": 1})
    assert read_lines(tmp_path / f"m.{sc.process_index()}.jsonl")[0]["x"] == 1.0


@pytest.mark.parametrize("value", ["0.5", [1.0, 2.0], np.ones(2), None])
def test_a_metric_that_is_not_a_number_is_refused(tmp_path, value):
    with sc.MetricsWriter(tmp_path / "m.jsonl") as writer:
        with pytest.raises(sc.SpmdError, match=r"^spmdcomm\.MetricsWriter\.write: metric 'bad' is .*, not a number"):
            writer.write(0, {"good": 1.0, "bad": value})
    assert read_lines(tmp_path / "m.jsonl") == []  # nothing of the refused record was written


def test_a_writer_needs_somewhere_to_write():
    with pytest.raises(sc.SpmdError, match="was given neither `path` nor `tensorboard_dir`"):
        sc.MetricsWriter()


def test_tensorboard_without_tensorboardx_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes `import tensorboardX` fail
    with pytest.raises(sc.SpmdError, match=r"needs the tensorboardX package.*pip install 'spmdcomm\[tensorboard\]'"):
        sc.MetricsWriter(tensorboard_dir=tmp_path / "tb")


def test_tensorboard_scalars_are_written_through_tensorboardx(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (pip install 'spmdcomm[tensorboard]')")
    from tensorboardX.proto import event_pb2

    values = {0: {"loss": 0.75, "time/devices": 0.125}, 1: {"loss": np.float32(0.5), "time/devices": 0.25}}
    with sc.MetricsWriter(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb.{process}") as writer:
        for step, metrics in values.items():
            writer.write(step, metrics)
    (events_file,) = glob.glob(os.path.join(tmp_path, f"tb.{sc.process_index()}", "events.out.tfevents.*"))
    scalars = {}
    for event in _tf_records(events_file):
        e = event_pb2.Event.FromString(event)
        for v in e.summary.value:
            scalars[e.step, v.tag] = v.simple_value
    expected = {(s, k): np.float32(v) for s, m in values.items() for k, v in m.items()}  # stored as float32
    assert scalars == expected
    assert len(read_lines(tmp_path / "m.jsonl")) == 2


def _tf_records(path):
    """The payloads of a TFRecord file: length (uint64), its CRC, the payload, its CRC."""
    data = Path(path).read_bytes()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        yield data[i + 12 : i + 12 + n]
        i += 12 + n + 4
