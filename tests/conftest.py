"""Shared fixtures. The fake device count (8) is set by the repository's root conftest.py, which pytest loads
before this file and before anything imports JAX.

``examples/mnist`` is appended to ``sys.path``: the example's modules import each other by plain name, as Flax's
examples do, and the tests import them the same way (``import train``, ``import input_pipeline``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import spmdcomm as sc

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"
EXAMPLE = ROOT / "examples" / "mnist"
sys.path.append(str(EXAMPLE))

# Seconds a job may run unless a test says otherwise: well below pytest's 600 s, so that a stuck job fails
# with its output instead of being killed by pytest-timeout.
LAUNCH_TIMEOUT = 150.0


@pytest.fixture(params=[1, 2, 4, 8], ids=lambda n: f"{n}dev")
def mesh(request):
    """A 1-D "data" mesh over the first 1, 2, 4 or 8 devices."""
    if jax.device_count() < request.param:
        pytest.skip(f"needs {request.param} devices")
    return sc.data_mesh(devices=jax.devices()[: request.param])


@pytest.fixture
def launch(tmp_path):
    """``launch(script, *args, processes=2, devices_per_process=2, timeout=..., env=None, returncode=0,
    max_restarts=0)``.

    Runs ``python -m spmdcomm.launch -n PROCESSES [--devices-per-process K] [--max-restarts R] --timeout T
    --grace 2 script *args``
    (a relative ``script`` names one in tests/workers/) in ``tmp_path``, with the repository on ``PYTHONPATH``,
    and returns the ``subprocess.CompletedProcess`` (text output, ``[rank i]``-prefixed). The test fails,
    showing the command and its whole output, when the exit status is not ``returncode`` or the job outlives
    ``timeout`` (the launcher's own ``--timeout`` ends it with status 124; should even that not end it, the
    fixture stops the launcher, the only process it started). ``env`` entries are added to the environment;
    ``devices_per_process=None`` leaves the device count to the script.
    """

    def run(
        script: str | os.PathLike,
        *args: object,
        processes: int = 2,
        devices_per_process: int | None = 2,
        timeout: float = LAUNCH_TIMEOUT,
        env: dict[str, str] | None = None,
        returncode: int = 0,
        max_restarts: int = 0,
    ) -> subprocess.CompletedProcess:
        devices = [] if devices_per_process is None else ["--devices-per-process", str(devices_per_process)]
        restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
        cmd = [sys.executable, "-m", "spmdcomm.launch", "-n", str(processes), *devices, *restarts]
        cmd += ["--timeout", f"{timeout:g}", "--grace", str(_GRACE), str(WORKERS / script), *map(str, args)]
        full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the launcher sets the devices
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        full_env.update(env or {})
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            # The launcher needs `timeout` plus the grace period to end the job itself.
            out, err = proc.communicate(timeout=timeout + _GRACE + 30)
        except subprocess.TimeoutExpired:
            out, err = _stop(proc)
            pytest.fail(_report(cmd, f"did not end within {timeout + _GRACE + 30:g} s", out, err), pytrace=False)
        if proc.returncode != returncode:
            why = f"exited with status {proc.returncode}, expected {returncode}"
            if proc.returncode == 124:
                why += " (124: the launcher's --timeout expired)"
            pytest.fail(_report(cmd, why, out, err), pytrace=False)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    return run


_GRACE = 2  # seconds between the launcher's SIGTERM and SIGKILL


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """Stops a launcher: SIGTERM (it passes it on to its processes, then SIGKILLs them), then SIGKILL (its
    processes die with it through PDEATHSIG). Returns what it wrote."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=_GRACE + 10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def _report(cmd: list[str], why: str, out: str | None, err: str | None) -> str:
    return f"{' '.join(cmd)}\n{why}\n--- stdout ---\n{out or ''}\n--- stderr ---\n{err or ''}"
