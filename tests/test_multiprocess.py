"""Real multi-process runs on 127.0.0.1 through the launcher (workers in tests/workers/).

Each launcher run is bounded by the launcher's own --timeout and by a subprocess timeout above it.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmdcomm.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def launch(tmp_path, nprocs, devices, *args, job_timeout=150):
    cmd = [
        sys.executable,
        "-m",
        "spmdcomm.launch",
        "-n",
        str(nprocs),
        "--devices-per-process",
        str(devices),
        "--timeout",
        str(job_timeout),
        "--grace",
        "2",
        *map(str, args),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count
    start = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=job_timeout + 30, cwd=tmp_path)
    return out.returncode, out.stdout, out.stderr, time.monotonic() - start


@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs,devices", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_every_collective_and_sync_across_processes(tmp_path, nprocs, devices):
    rc, out, err, _ = launch(tmp_path, nprocs, devices, WORKERS / "mp_collectives.py", tmp_path / "shared.txt")
    assert rc == 0, out + err
    counts = re.findall(r"^\[rank (\d)\] CHECKS OK (\d+)$", out, re.M)
    assert sorted(r for r, _ in counts) == [str(r) for r in range(nprocs)]
    assert {c for _, c in counts} == {"48"}


@pytest.mark.multiprocess
def test_out_of_step_processes_raise_instead_of_hanging(tmp_path):
    rc, out, err, _ = launch(tmp_path, 2, 2, WORKERS / "mp_failures.py", "errors")
    assert rc == 1, out + err
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
def test_killed_process_ends_the_job(tmp_path):
    rc, out, err, _ = launch(tmp_path, 3, 1, WORKERS / "mp_failures.py", "kill")
    ended = time.time()
    assert rc == 128 + 9, out + err
    (killed,) = re.findall(r"^\[rank 1\] KILLING ([\d.]+)$", out, re.M)
    assert ended - float(killed) < 10
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
