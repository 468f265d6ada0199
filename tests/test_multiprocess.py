"""Real multi-process runs on 127.0.0.1 through the launcher (workers in tests/workers/), each bounded by the
``launch`` fixture's timeout (tests/conftest.py). The jobs are slow-tier tests; the two tests of processes that
disagree read one job (mp_agreement.py). The fast tier keeps the single process that finds no coordinator."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from timing import LATE_S

from spmdcomm.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.slow
# Several devices in each process, and one device in each of more than two processes (3: an odd count, where a
# 4th process would only add its start and compilations).
@pytest.mark.parametrize("nprocs,devices", [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_every_collective_and_sync_across_processes(launch, tmp_path, nprocs, devices):
    out = launch("mp_collectives.py", tmp_path / "shared.txt", processes=nprocs, devices_per_process=devices).stdout
    counts = re.findall(r"^\[rank (\d)\] CHECKS OK (\d+)$", out, re.M)
    assert sorted(r for r, _ in counts) == [str(r) for r in range(nprocs)]
    assert {c for _, c in counts} == {"48"}


@pytest.fixture(scope="module")
def disagreement(module_launch) -> tuple[str, str, dict[tuple[str, str], str]]:
    """mp_agreement.py's job, run once for the two tests below: ``(stdout, stderr, {(rank, name): message})``
    of the ``CAUGHT <name>: <message>`` lines."""
    res = module_launch("mp_agreement.py", returncode=1)
    caught = re.findall(r"^\[rank (\d)\] CAUGHT (\w+): (.*)$", res.stdout, re.M)
    return res.stdout, res.stderr, {(rank, name): msg for rank, name, msg in caught}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_out_of_step_processes_raise_instead_of_hanging(disagreement):
    out, err, by = disagreement
    for rank in "01":
        # Both are at the same sync point (the same count), under different names.
        assert re.search(
            r"as their #(\d+): process 0: barrier 'name0' \(#\1, called at mp_agreement.py:\d+\); "
            r"process 1: barrier 'name1' \(#\1, ",
            by[rank, "mismatch"],
        ), by[rank, "mismatch"]
        assert by[rank, "debug"].startswith(
            "spmdcomm.<lambda>: process(es) [1] passed inputs to the spmd debug check that differ from process 0's "
            f"(seen on process {rank}): process 1: args[0] is shape (4, 4), dtype float32, sharding None "
            "(process 0: shape (4, 3), dtype float32, sharding None). Fix: "
        ), by[rank, "debug"]
        assert (
            "process 1: ['v'] is shape (3,) dtype float64 (process 0: shape (2,) dtype float64)"
            in by[rank, "host_shapes"]
        )
    assert by["0", "first_main"] == "dataset download failed"
    assert (
        "the main process (process 0) raised inside the block, so process 1 does not run it: "
        "OSError: dataset download failed (at mp_agreement.py:"
    ) in by["1", "first_other"]
    # The seed bug: process 0 calls barrier twice, process 1 once; process 0 names the call process 1 is at.
    ((elapsed, msg),) = re.findall(r"^\[rank 0\] BARRIER TIMEOUT after ([\d.]+) s: (.*)$", out, re.M)
    assert 3 <= float(elapsed) < 3 + LATE_S
    ((ours, theirs),) = re.findall(
        r"barrier 'b' \(#(\d+), called at mp_agreement.py:.*process 1: barrier 'after join' \(#(\d+), called at ",
        msg,
    )
    assert int(ours) == int(theirs) + 1, msg
    assert "process(es) [1] did not arrive within 3 s" in msg
    assert "rank 0 (pid" in err and "exited with status 1" in err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_agreement_across_processes_names_who_differs_and_who_is_missing(disagreement):
    out, err, caught = disagreement
    for rank in "01":
        oks = re.findall(rf"^\[rank {rank}\] OK (.*)$", out, re.M)
        assert len(oks) == 9 and "divergence on process 1's devices" in oks, out
    for rank in "01":
        msg = caught[rank, "description"]
        assert msg.startswith(
            "spmdcomm.TrainState.create: process(es) [1] passed parameter trees that differ from process 0's "
            f"(seen on process {rank}): process 1 has \"['w']: (4,) float32\", process 0 has \"['w']: (3,) float32\"."
        ), msg
        assert msg.endswith("Fix: build it the same way everywhere.")
        msg = caught[rank, "tree_shapes"]
        assert "process(es) [1] passed trees (structure, shapes, dtypes) for a broadcast from process 0" in msg
        assert "process 1: ['w'] is shape (4,) dtype float32 (process 0: shape (3,) dtype float32)." in msg
        msg = caught[rank, "diverged"]
        assert re.search(r"leaf \['w'\]: the copy on device \d+ \(process 1\) differs from the first device's", msg)
        assert "copy; 2 (leaf, device) pairs differ in all." in msg
        msg = caught[rank, "replica_leaves"]
        assert "process(es) [1] passed replicated leaves that differ from process 0's" in msg
        assert "process 1: ['extra'] only on process 1." in msg
    # join_batches: process 1 left after one step; process 0 names it after its 3 s timeout.
    ((elapsed, msg),) = re.findall(r"^\[rank 0\] JOIN TIMEOUT after ([\d.]+) s: (.*)$", out, re.M)
    assert 3 <= float(elapsed) < 3 + LATE_S
    assert "spmdcomm.join_batches: join_batches step (#2, called at " in msg
    assert "process(es) [1] did not arrive within 3 s" in msg
    assert "process 1: join_batches step (#1, called at " in msg
    # broadcast_tree: process 1 never calls it, so process 0 names it instead of entering the device broadcast.
    ((elapsed, msg),) = re.findall(r"^\[rank 0\] TIMEOUT after ([\d.]+) s: (.*)$", out, re.M)
    assert 3 <= float(elapsed) < 3 + LATE_S
    assert "check trees (structure, shapes, dtypes) for a broadcast from process 0 (#" in msg
    assert "called at mp_agreement.py:" in msg and "process(es) [1] did not arrive within 3 s" in msg
    assert "process 1: barrier 'after join' (#" in msg
    assert "[rank 1] DONE" in out and "rank 0 (pid" in err and "exited with status 1" in err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_process_ends_the_job(launch):
    # The others wait in a barrier with a 120 s timeout: the job ends within the 60 s only if the launcher
    # stops them (the fixture fails the test otherwise).
    res = launch("mp_failures.py", "kill", processes=3, devices_per_process=1, timeout=60, returncode=137)
    out, err = res.stdout, res.stderr
    assert re.findall(r"^\[rank 1\] KILLING [\d.]+$", out, re.M)
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL; stopping the other 2", err)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_uncaught_exception_ends_the_job_at_once(launch):
    # The job's timeout (60 s) is far below JAX's 5-minute shutdown barrier: a status 124 here means the
    # failing process waited at that barrier instead of exiting.
    res = launch("mp_failures.py", "raise", timeout=60, returncode=1)
    assert "RuntimeError: loss is NaN" in res.stdout + res.stderr
    assert re.search(r"rank 1 \(pid \d+\) exited with status 1; stopping the other 1", res.stderr)


def test_initialize_fails_cleanly_without_coordinator(tmp_path):
    port = free_port()
    code = f"""
import socket, time
import jax  # imported before the clock starts: the bound below is on the wait, not on importing JAX
import spmdcomm as sc
start = time.monotonic()
try:
    sc.initialize("127.0.0.1:{port}", 2, 1, timeout=2)
except sc.CoordinatorError as e:
    print("ELAPSED", time.monotonic() - start)
    print("ERROR", e)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); s.listen()
    try:
        sc.initialize(f"127.0.0.1:{{s.getsockname()[1]}}", 2, 0, timeout=2)
    except sc.CoordinatorError as e:
        print("BUSY", e)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    elapsed = float(re.search(r"^ELAPSED (\S+)$", out.stdout, re.M).group(1))
    assert 2 <= elapsed < 2 + LATE_S
    assert f"process 1 could not reach the coordinator at 127.0.0.1:{port} within 2 s" in out.stdout
    assert "check that process 0 is running" in out.stdout
    assert "is not available" in out.stdout and "choose a free port" in out.stdout
