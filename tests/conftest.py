"""Shared fixtures. The fake device count (8) is set by the repository's root conftest.py, which pytest loads
before this file and before anything imports JAX.

``examples/mnist`` is appended to ``sys.path``: the example's modules import each other by plain name, as Flax's
examples do, and the tests import them the same way (``import train``, ``import input_pipeline``).
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import pytest
from ddp_models import BATCHES, run_reference
from jax.sharding import Mesh

import spmdcomm as sc

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"
EXAMPLE = ROOT / "examples" / "mnist"
sys.path.append(str(EXAMPLE))

# One XLA compilation cache per test session, shared with the processes the tests start (through the
# environment): compiling dominates the suite's time on CPU, and many tests build programs XLA has already
# compiled in this session (a new step function for the same model and mesh, a worker script launched again,
# the examples' runs). A cache hit returns the executable the same program compiled to, so no result changes;
# a fresh directory, removed at exit, so that no run reads another run's entries. Under pytest-xdist the
# controller loads this file first and its workers inherit its environment: they share its directory, and only the
# controller removes it.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("SPMDCOMM_TEST_XLA_CACHE"):
    XLA_CACHE = os.environ["SPMDCOMM_TEST_XLA_CACHE"]
else:
    XLA_CACHE = tempfile.mkdtemp(prefix="spmdcomm-tests-xla-cache-")
    atexit.register(shutil.rmtree, XLA_CACHE, ignore_errors=True)
    os.environ["SPMDCOMM_TEST_XLA_CACHE"] = XLA_CACHE
os.environ["JAX_COMPILATION_CACHE_DIR"] = XLA_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the default (1 s) would skip most programs
jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture
def compile_flags() -> str:
    """This session's XLA_FLAGS without the device count (the root conftest.py's fast-compile flags): for a process a
    test starts on its own device count, to compile as the suite does (its bits compared with the test's, or its
    run only checked to complete)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))


# Seconds a job may run unless a test says otherwise: well below pytest's 600 s, so that a stuck job fails
# with its output instead of being killed by pytest-timeout.
LAUNCH_TIMEOUT = 400.0


@pytest.fixture(params=[1, 2, 4, 8], ids=lambda n: f"{n}dev")
def mesh(request) -> Mesh:
    """A 1-D "data" mesh over the first 1, 2, 4 or 8 devices."""
    return _first_devices(request.param)


# The shard_map backend runs on every device count; the pmap backend on one. Since JAX 0.10 jax.pmap is
# jit(shard_map), so the collectives are the same programs and what the pmap backend adds is its own plumbing
# (blocks to pmap's leading axis and back, the mesh's devices): 4 of the 8 devices puts that on a sub-mesh.
# The fast tier (-m "not slow") keeps shard_map on all 8 devices.
BACKEND_MESHES = [
    pytest.param(("shard_map", 1), marks=pytest.mark.slow, id="shard_map-1dev"),
    pytest.param(("shard_map", 2), marks=pytest.mark.slow, id="shard_map-2dev"),
    pytest.param(("shard_map", 4), marks=pytest.mark.slow, id="shard_map-4dev"),
    pytest.param(("shard_map", 8), id="shard_map-8dev"),
    pytest.param(("pmap", 4), marks=pytest.mark.slow, id="pmap-4dev"),
]


@pytest.fixture(params=BACKEND_MESHES)
def backend_mesh(request) -> tuple[str, Mesh]:
    """``(backend, mesh)`` for each entry of ``BACKEND_MESHES``: a 1-D "data" mesh over the first n devices."""
    backend, n = request.param
    return backend, _first_devices(n)


@pytest.fixture(scope="session")
def reference_run() -> Callable[[str, str], tuple[Any, Any, list[float]]]:
    """``reference_run(kind, opt)``: ``ddp_models.run_reference(kind, opt, BATCHES[kind])``, computed once per
    session: the one-device run that many equivalence tests compare with (its results are immutable arrays)."""
    return functools.cache(lambda kind, opt: run_reference(kind, opt, BATCHES[kind]))


@pytest.fixture
def launch(tmp_path):
    """``launch(script, *args, processes=2, devices_per_process=2, timeout=..., env=None, returncode=0,
    max_restarts=0, grace=2, sigterm_after=None)``.

    Runs ``python -m spmdcomm.launch -n PROCESSES [--devices-per-process K] [--max-restarts R] --timeout T
    --grace 2 script *args``
    (a relative ``script`` names one in tests/workers/) in ``tmp_path``, with the repository on ``PYTHONPATH``,
    and returns the ``subprocess.CompletedProcess`` (text output, ``[rank i]``-prefixed). The test fails,
    showing the command and its whole output, when the exit status is not ``returncode`` or the job outlives
    ``timeout`` (the launcher's own ``--timeout`` ends it with status 124; should even that not end it, the
    fixture stops the launcher, the only process it started). ``env`` entries are added to the environment;
    ``devices_per_process=None`` leaves the device count to the script. ``sigterm_after`` (a regular
    expression) sends the launcher SIGTERM, as a scheduler would, once every rank has printed a line matching
    it (after its ``[rank i] `` prefix); a job that ends first, or never gets there, fails the test.
    """
    return _launcher(tmp_path)


@pytest.fixture(scope="module")
def module_launch(tmp_path_factory):
    """``launch`` for module-scoped fixtures: one job whose output several tests check (one launch per group of
    checks), run in a fresh directory of its own. A failed job fails each of those tests with its output."""
    return _launcher(tmp_path_factory.mktemp("job"))


_GRACE = 2  # seconds between the launcher's SIGTERM and SIGKILL


def _launcher(cwd: Path) -> Callable[..., subprocess.CompletedProcess]:
    """The ``launch`` fixture's function, running jobs in ``cwd``."""

    def run(
        script: str | os.PathLike,
        *args: object,
        processes: int = 2,
        devices_per_process: int | None = 2,
        timeout: float = LAUNCH_TIMEOUT,
        env: dict[str, str] | None = None,
        returncode: int = 0,
        max_restarts: int = 0,
        grace: float = _GRACE,
        sigterm_after: str | None = None,
    ) -> subprocess.CompletedProcess:
        devices = [] if devices_per_process is None else ["--devices-per-process", str(devices_per_process)]
        restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
        cmd = [sys.executable, "-m", "spmdcomm.launch", "-n", str(processes), *devices, *restarts]
        cmd += ["--timeout", f"{timeout:g}", "--grace", f"{grace:g}", str(WORKERS / script), *map(str, args)]
        full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the launcher sets the devices
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        full_env.update(env or {})
        proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        limit = timeout + grace + 30  # the launcher needs `timeout` plus the grace period to end the job itself
        try:
            if sigterm_after is None:
                out, err = proc.communicate(timeout=limit)
            else:
                out, err = _sigterm_when_every_rank_printed(proc, cmd, re.compile(sigterm_after), processes, limit)
        except subprocess.TimeoutExpired:
            out, err = _stop(proc)
            pytest.fail(_report(cmd, f"did not end within {limit:g} s", out, err), pytrace=False)
        if proc.returncode != returncode:
            why = f"exited with status {proc.returncode}, expected {returncode}"
            if proc.returncode == 124:
                why += " (124: the launcher's --timeout expired)"
            pytest.fail(_report(cmd, why, out, err), pytrace=False)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    return run


def _first_devices(n: int) -> Mesh:
    """A 1-D "data" mesh over the first ``n`` devices; skips the test where there are fewer."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    return sc.data_mesh(devices=jax.devices()[:n])


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """Stops a launcher: SIGTERM (it passes it on to its processes, then SIGKILLs them), then SIGKILL (its
    processes die with it through PDEATHSIG). Returns what it wrote."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=_GRACE + 10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def _sigterm_when_every_rank_printed(
    proc: subprocess.Popen, cmd: list[str], pattern: re.Pattern[str], processes: int, limit: float
) -> tuple[str, str]:
    """Reads the launcher's output as it comes; sends it SIGTERM once every rank printed a line matching
    ``pattern``; returns everything it wrote."""
    lines: queue.Queue[str] = queue.Queue()
    out: list[str] = []
    err: list[str] = []

    def read(stream, into, notify):
        for line in stream:
            into.append(line)
            if notify:
                lines.put(line)

    readers = [
        threading.Thread(target=read, args=(proc.stdout, out, True), daemon=True),
        threading.Thread(target=read, args=(proc.stderr, err, False), daemon=True),
    ]
    for reader in readers:
        reader.start()
    waiting, deadline = {str(r) for r in range(processes)}, time.monotonic() + limit
    while waiting and proc.poll() is None and time.monotonic() < deadline:
        try:
            match = re.match(r"\[rank (\d+)\] (.*)$", lines.get(timeout=1))
        except queue.Empty:
            continue
        if match and pattern.search(match[2]):
            waiting.discard(match[1])
    if waiting:
        _stop(proc)
        for reader in readers:
            reader.join(10)
        why = f"rank(s) {sorted(waiting)} never printed a line matching {pattern.pattern!r}"
        pytest.fail(_report(cmd, why, "".join(out), "".join(err)), pytrace=False)
    proc.send_signal(signal.SIGTERM)  # the launcher, the only process this fixture started
    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    for reader in readers:
        reader.join(10)
    proc.stdout.close()
    proc.stderr.close()
    return "".join(out), "".join(err)


def _report(cmd: list[str], why: str, out: str | None, err: str | None) -> str:
    return f"{' '.join(cmd)}\n{why}\n--- stdout ---\n{out or ''}\n--- stderr ---\n{err or ''}"
