"""The input pipeline across real processes (launcher, 2 processes x 2 devices, 127.0.0.1). The one multi-process
job of the fast tier (``-m "not slow"``): a few seconds, and it smoke-tests the launcher and initialisation."""

import re

import pytest


@pytest.mark.multiprocess
def test_pipeline_across_two_processes_with_two_devices_each(launch):
    out = launch("mp_data.py").stdout
    ok = re.findall(r"^\[rank (\d)\] CHECKS OK (\d+)$", out, re.M)
    assert sorted(r for r, _ in ok) == ["0", "1"] and len({c for _, c in ok}) == 1, out
    assert re.findall(r"^\[rank \d\] STEPS (\d+)$", out, re.M) == ["5", "5"]
