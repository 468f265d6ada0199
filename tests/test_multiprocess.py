"""Real multi-process runs on 127.0.0.1 through the launcher (workers in tests/workers/), each bounded by the
``launch`` fixture's timeout (tests/conftest.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmdcomm.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs,devices", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_every_collective_and_sync_across_processes(launch, tmp_path, nprocs, devices):
    out = launch("mp_collectives.py", tmp_path / "shared.txt", processes=nprocs, devices_per_process=devices).stdout
    counts = re.findall(r"^\[rank (\d)\] CHECKS OK (\d+)$", out, re.M)
    assert sorted(r for r, _ in counts) == [str(r) for r in range(nprocs)]
    assert {c for _, c in counts} == {"48"}


@pytest.mark.multiprocess
def test_out_of_step_processes_raise_instead_of_hanging(launch):
    res = launch("mp_failures.py", "errors", returncode=1)
    out, err = res.stdout, res.stderr
    caught = re.findall(r"^\[rank (\d)\] CAUGHT (\w+): (.*)$", out, re.M)
    by = {(rank, name): msg for rank, name, msg in caught}
    for rank in "01":
        assert "process 0: barrier 'name0' (#1, called at mp_failures.py:" in by[rank, "mismatch"]
        assert "process 1: barrier 'name1' (#1" in by[rank, "mismatch"]
        diff = "Process 1 differs from process 0: args[0]: shape (4, 4) vs (4, 3)"
        assert diff in by[rank, "debug"]
        assert "leaf ['v']: process 1 passed shape (3,)" in by[rank, "host_shapes"]
    assert by["0", "first_main"] == "dataset download failed"
    assert (
        "the main process (process 0) raised inside the block, so process 1 does not run it: "
        "OSError: dataset download failed (at mp_failures.py:"
    ) in by["1", "first_other"]
    # The seed bug: process 0 calls barrier twice, process 1 once.
    ((elapsed, msg),) = re.findall(r"^\[rank 0\] TIMEOUT after ([\d.]+) s: (.*)$", out, re.M)
    assert 3 <= float(elapsed) < 3 + 5
    assert "barrier 'b' (#5, called at mp_failures.py:" in msg
    assert "process(es) [1] did not arrive within 3 s" in msg
    assert "process 1: barrier 'a' (#4, called at mp_failures.py:" in msg
    assert "rank 0 (pid" in err and "exited with status 1" in err


@pytest.mark.multiprocess
def test_killed_process_ends_the_job(launch):
    # The others wait in a barrier with a 120 s timeout: the job ends within the 60 s only if the launcher
    # stops them (the fixture fails the test otherwise).
    res = launch("mp_failures.py", "kill", processes=3, devices_per_process=1, timeout=60, returncode=137)
    out, err = res.stdout, res.stderr
    assert re.findall(r"^\[rank 1\] KILLING [\d.]+$", out, re.M)
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL; stopping the other 2", err)


def test_initialize_fails_cleanly_without_coordinator(tmp_path):
    port = free_port()
    code = f"""
import socket, time
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
    assert 2 <= elapsed < 2 + 3
    assert f"process 1 could not reach the coordinator at 127.0.0.1:{port} within 2 s" in out.stdout
    assert "check that process 0 is running" in out.stdout
    assert "is not available" in out.stdout and "choose a free port" in out.stdout
