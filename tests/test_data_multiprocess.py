"""The input pipeline across real processes (launcher, 2 processes x 2 devices, 127.0.0.1)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_pipeline_across_two_processes_with_two_devices_each(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "spmdcomm.launch",
        "-n",
        "2",
        "--devices-per-process",
        "2",
        "--timeout",
        "150",
        "--grace",
        "2",
        str(ROOT / "tests" / "workers" / "mp_data.py"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    ok = re.findall(r"^\[rank (\d)\] CHECKS OK (\d+)$", out.stdout, re.M)
    assert sorted(r for r, _ in ok) == ["0", "1"] and len({c for _, c in ok}) == 1, out.stdout
    assert re.findall(r"^\[rank \d\] STEPS (\d+)$", out.stdout, re.M) == ["5", "5"]
