"""The launcher, on small plain-Python scripts (no JAX in the children, so each test is fast). The tests that wait
out a timeout or an escalation to SIGKILL are slow-tier tests."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spmdcomm as sc
from spmdcomm import launch as launcher
from spmdcomm.errors import DistributedError, SpmdError

# The children are forked from this (JAX-using) test process; they exec Python at once.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")

ROOT = Path(__file__).resolve().parents[1]


PRELUDE = """import os, signal, sys, time
rank = int(os.environ['SPMDCOMM_PROCESS_ID'])
def all_started(n):  # marks this rank as started, then waits for the first n ranks
    here = os.path.dirname(os.path.abspath(__file__))
    open(os.path.join(here, f'started{rank}'), 'w').close()
    while not all(os.path.exists(os.path.join(here, f'started{r}')) for r in range(n)):
        time.sleep(0.05)
"""


def script(tmp_path, body, name="child.py"):
    path = tmp_path / name
    path.write_text(PRELUDE + body)
    return str(path)


def test_env_prefix_and_device_count(tmp_path, capsys):
    path = script(
        tmp_path,
        "print(rank, *[os.environ[v] for v in ("
        "'SPMDCOMM_NUM_PROCESSES', 'SPMDCOMM_COORDINATOR', 'SPMDCOMM_LOCAL_RANK',"
        "'XLA_FLAGS', 'JAX_PLATFORMS')], sys.argv[1:])\n",
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"}
    env.pop("JAX_PLATFORMS", None)
    assert launcher.launch([path, "a", "--b"], 3, devices_per_process=2, env=env) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        assert line.startswith(f"[rank {rank}] {rank} 3 127.0.0.1:")
        assert f" {rank} --foo --xla_force_host_platform_device_count=2 cpu ['a', '--b']" in line
    assert len({ln.split()[4] for ln in lines}) == 1  # one coordinator address for all


def test_gpus_per_process_assigns_disjoint_local_devices(tmp_path, capsys):
    path = script(tmp_path, "print(rank, os.environ['SPMDCOMM_LOCAL_DEVICE_IDS'])\n")
    assert launcher.main(["-n", "3", "--gpus-per-process", "2", path]) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == ["[rank 0] 0 0,1", "[rank 1] 1 2,3", "[rank 2] 2 4,5"]


def test_initialize_reads_local_device_ids(monkeypatch):
    from spmdcomm.runtime import distributed as runtime

    monkeypatch.setenv(runtime.ENV_LOCAL_DEVICE_IDS, "2,3")
    monkeypatch.setenv(runtime.ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(runtime.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(runtime.ENV_PROCESS_ID, "1")
    assert runtime._settings(None, None, None, None, 1.0) == ("127.0.0.1:1", 2, 1, [2, 3])


def test_module_form_and_argument_errors(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymod.py").write_text("import sys\nprint('module', sys.argv[1:])\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert launcher.main(["-n", "2", "-m", "mymod", "x"]) == 0
    assert capsys.readouterr().out.count("module ['x']") == 2
    with pytest.raises(SystemExit):
        launcher.main(["-n", "2"])
    with pytest.raises(SpmdError, match=r"^spmdcomm.launch: -n \(nprocs\) must be at least 1, got 0\. Fix: pass -n N"):
        launcher.launch(["x.py"], 0)
    with pytest.raises(SpmdError, match=r"--devices-per-process \(devices_per_process\) must be at least 1"):
        launcher.launch(["x.py"], 2, devices_per_process=0)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # the command line reports a usage error, no traceback
        launcher.main(["-n", "2", "--gpus-per-process", "0", "x.py"])
    assert exit_.value.code == 2
    assert "--gpus-per-process (gpus_per_process) must be at least 1, got 0" in capsys.readouterr().err


def test_failure_stops_the_others_and_names_the_rank(launch, tmp_path):
    # The others report the SIGTERM that stops them; rank 1 fails once all three run, and the
    # others would sleep past the job's timeout (status 124) if the launcher did not stop them.
    path = script(
        tmp_path,
        "signal.signal(signal.SIGTERM, lambda *_: (print('SIGTERM', flush=True), sys.exit(0)))\n"
        "all_started(3)\n"
        "if rank == 1:\n    sys.exit(3)\n"
        "time.sleep(600)\n",
    )
    res = launch(path, processes=3, devices_per_process=None, timeout=60, returncode=3)
    assert sorted(res.stdout.splitlines()) == ["[rank 0] SIGTERM", "[rank 2] SIGTERM"]
    assert "rank 1 (pid " in res.stderr and ") exited with status 3; stopping the other 2" in res.stderr


@pytest.mark.slow
def test_killed_rank_and_sigterm_escalation(launch, tmp_path):
    # Rank 0 ignores SIGTERM (as JAX's preemption handler effectively does) and would sleep past the job's
    # timeout: the job ends in time (with rank 1's status, not 124) only if the launcher sends it SIGKILL.
    path = script(
        tmp_path,
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "all_started(2)\n"
        "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n",
    )
    res = launch(path, devices_per_process=None, timeout=60, returncode=128 + signal.SIGKILL)
    assert "rank 1 (pid " in res.stderr and ") was killed by SIGKILL; stopping the other 1" in res.stderr


def test_timeout(tmp_path, capsys):
    path = script(tmp_path, "time.sleep(60)\n")
    assert launcher.launch([path], 2, timeout=0.5, grace=0.5) == 124
    assert "timed out: the timeout of 0.5 s expired with rank(s) 0, 1 still running" in capsys.readouterr().err


# Every process prints its attempt's restart count and coordinator address first, in one write: the launcher runs
# its children unbuffered and stops the others when one fails, which could cut a line printed in pieces.
ATTEMPT = """attempt = int(os.environ['SPMDCOMM_RESTART_COUNT'])
sys.stdout.write(f"attempt {attempt} {os.environ['SPMDCOMM_COORDINATOR']}\\n")
sys.stdout.flush()
"""


def attempts(out):
    """{restart count: coordinator address}, from the ``attempt`` lines every rank printed."""
    seen = {}
    for line in out.splitlines():
        _, rank, word, attempt, address = line.replace("]", "").split()
        assert word == "attempt"
        seen.setdefault(int(attempt), set()).add(address)
    assert all(len(addresses) == 1 for addresses in seen.values()), seen  # one address per attempt
    return {attempt: addresses.pop() for attempt, addresses in seen.items()}


def test_restart_after_a_failure(tmp_path, capsys):
    # Attempt 0: rank 1 exits 3 once both run, and rank 0 would sleep past the timeout unless stopped.
    path = script(
        tmp_path,
        ATTEMPT + "if attempt == 0:\n    all_started(2)\n    if rank == 1:\n        sys.exit(3)\n    time.sleep(600)\n",
    )
    assert launcher.main(["-n", "2", "--max-restarts", "1", "--timeout", "60", "--grace", "1", path]) == 0
    out, err = capsys.readouterr()
    ports = attempts(out)
    assert sorted(ports) == [0, 1]
    assert ports[0] != ports[1] and all(a.startswith("127.0.0.1:") for a in ports.values())
    log = [ln for ln in err.splitlines() if ln.startswith("spmdcomm-launch: ")]
    assert len(log) == 2, err
    assert re.fullmatch(
        r"spmdcomm-launch: rank 1 \(pid \d+\) exited with status 3; stopping the other 1 running process\(es\)\.",
        log[0],
    )
    assert log[1] == f"spmdcomm-launch: restart 1 of 1: starting 2 process(es), coordinator {ports[1]}."


def test_restarts_run_out_and_exit_with_the_failure(tmp_path, capsys):
    path = script(tmp_path, ATTEMPT + "sys.exit(5)\n")
    assert launcher.main(["-n", "2", "--max-restarts", "2", "--timeout", "60", path]) == 5
    out, err = capsys.readouterr()
    ports = attempts(out)
    assert sorted(ports) == [0, 1, 2] and len(set(ports.values())) == 3  # a fresh port for every attempt
    assert err.count("exited with status 5") == 3
    assert "restart 1 of 2: " in err and "restart 2 of 2: " in err and "restart 3" not in err
    assert err.rstrip().endswith("spmdcomm-launch: all 2 restart(s) used; exiting with status 5.")


def test_killed_rank_is_restarted(tmp_path, capsys):
    path = script(
        tmp_path,
        ATTEMPT + "if attempt == 0:\n    all_started(2)\n    if rank == 1:\n        os.kill(os.getpid(), "
        "signal.SIGKILL)\n    time.sleep(600)\n",
    )
    assert launcher.launch([path], 2, max_restarts=3, timeout=60, grace=1) == 0
    out, err = capsys.readouterr()
    assert sorted(attempts(out)) == [0, 1]
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL; stopping the other 1 ", err)
    assert "restart 1 of 3: starting 2 process(es)" in err and "restart 2" not in err


@pytest.mark.slow
def test_timeout_applies_per_attempt(tmp_path, capsys):
    # Attempt 0 outlives its timeout; attempt 1 gets a whole timeout of its own and finishes.
    path = script(tmp_path, ATTEMPT + "if attempt == 0:\n    time.sleep(600)\n")
    assert launcher.launch([path], 2, max_restarts=1, timeout=8, grace=0.5) == 0
    out, err = capsys.readouterr()
    assert sorted(attempts(out)) == [0, 1]
    assert "timed out: the timeout of 8 s expired with rank(s) 0, 1 still running" in err
    assert "restart 1 of 1" in err


def test_fixed_coordinator_restarts_on_a_fresh_port(tmp_path, capsys):
    port = launcher.free_port()
    path = script(tmp_path, ATTEMPT + "sys.exit(attempt == 0)\n")
    assert launcher.launch([path], 2, coordinator=f"127.0.0.1:{port}", max_restarts=1, timeout=60) == 0
    ports = attempts(capsys.readouterr().out)
    assert ports[0] == f"127.0.0.1:{port}" and ports[1].startswith("127.0.0.1:") and ports[1] != ports[0]


def test_restart_options_errors(capsys):
    with pytest.raises(SpmdError, match=r"--max-restarts \(max_restarts\) must be at least 0, got -1\. Fix: pass"):
        launcher.launch(["x.py"], 2, max_restarts=-1)
    with pytest.raises(SpmdError, match=r"--coordinator \(coordinator\) must be HOST:PORT, got 'localhost'"):
        launcher.launch(["x.py"], 2, coordinator="localhost")
    with pytest.raises(SystemExit) as exit_:
        launcher.main(["-n", "2", "--max-restarts", "-1", "x.py"])
    assert exit_.value.code == 2
    assert "--max-restarts (max_restarts) must be at least 0, got -1" in capsys.readouterr().err


def test_restart_count(monkeypatch):
    monkeypatch.delenv("SPMDCOMM_RESTART_COUNT", raising=False)
    assert sc.restart_count() == 0
    monkeypatch.setenv("SPMDCOMM_RESTART_COUNT", "2")
    assert sc.restart_count() == 2
    monkeypatch.setenv("SPMDCOMM_RESTART_COUNT", "two")
    with pytest.raises(DistributedError, match=r"^spmdcomm.restart_count: environment variable SPMDCOMM_RESTART_"):
        sc.restart_count()


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGKILL, marks=pytest.mark.slow)], ids=["sigterm", "sigkill"]
)
def test_launcher_signal_leaves_no_process(tmp_path, sig):
    # SIGTERM is passed on to the children and is a stop, not a failure: with restarts allowed, none happens.
    # SIGKILL of the launcher kills them through PDEATHSIG.
    pids = tmp_path / "pids"
    path = script(tmp_path, f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\ntime.sleep(60)\n")
    cmd = [sys.executable, "-m", "spmdcomm.launch", "-n", "2", "--grace", "1", "--max-restarts", "2", path]
    cmd += ["--timeout", "60"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not pids.exists() or len(pids.read_text().split()) < 2):
            time.sleep(0.1)
        children = [int(p) for p in pids.read_text().split()]
        assert len(children) == 2
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == (128 + sig if sig == signal.SIGTERM else -sig)
        deadline = time.monotonic() + 10
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, children))
        assert len(pids.read_text().split()) == 2  # no process was started again
        if sig == signal.SIGTERM:
            err = proc.stderr.read()
            assert "received SIGTERM; stopping all processes (a stop, not a failure: no restart)." in err
            assert "restart 1" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.mark.slow
def test_sigterm_while_a_failed_attempt_stops_is_not_restarted(tmp_path):
    # Rank 1 fails; rank 0 notes the launcher's SIGTERM and keeps running through the grace period, during which
    # the launcher itself gets SIGTERM: the job ends with 128 + SIGTERM instead of restarting.
    path = script(
        tmp_path,
        ATTEMPT + f"signal.signal(signal.SIGTERM, lambda *_: open({str(tmp_path / 'term')!r}, 'w').close())\n"
        "all_started(2)\nif rank == 1:\n    sys.exit(3)\ntime.sleep(600)\n",
    )
    cmd = [sys.executable, "-m", "spmdcomm.launch", "-n", "2", "--grace", "3", "--max-restarts", "2", path]
    cmd += ["--timeout", "60"]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (tmp_path / "term").exists():
            time.sleep(0.05)
        assert (tmp_path / "term").exists()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM
        assert sorted(attempts(out)) == [0]
        assert "exited with status 3" in err and "received SIGTERM" in err and "restart 1" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_initialize_ends_a_failed_process_at_once_only_when_asked(tmp_path, launch):
    # The default hook skips JAX's exit handler (its shutdown barrier would wait for the other processes);
    # exit_on_uncaught_error=False leaves Python's own exit, and its atexit handlers, in place.
    # "mixed": process 0 asks for the hook, process 1 does not.
    body = (
        "import atexit, os, sys\nimport spmdcomm as sc\n"
        "mine = 'yes' if sys.argv[1] == 'mixed' and os.environ['SPMDCOMM_PROCESS_ID'] == '0' else sys.argv[1]\n"
        "sc.initialize(exit_on_uncaught_error=mine == 'yes')\n"
        "atexit.register(print, 'ATEXIT RAN', flush=True)\n"
        "print('HOOK', sys.excepthook is not sys.__excepthook__, flush=True)\n"
        "if len(sys.argv) > 2:\n    raise RuntimeError('uncaught')\n"
    )
    path = script(tmp_path, body, name="init.py")
    # A script that ends normally exits normally either way: one job, a process of each kind.
    out = launch(path, "mixed", devices_per_process=1).stdout
    assert "[rank 0] HOOK True" in out and "[rank 1] HOOK False" in out, out
    assert out.count("ATEXIT RAN") == 2, out
    for flag, hooked in [("yes", True), ("no", False)]:
        failed = launch(path, flag, "raise", devices_per_process=1, returncode=1)
        assert "RuntimeError: uncaught" in failed.stderr, failed.stderr
        assert failed.stdout.count("ATEXIT RAN") == (0 if hooked else 2), failed.stdout
