"""Preemption: a stop request (SIGTERM, or request()) becomes one stop step on every process. In one process here,
and in 2 x 2 jobs on 127.0.0.1 through tests/workers/mp_watchdog.py (a stand-in for fit)."""

import os
import re
import signal
import threading
from pathlib import Path

import pytest

import spmdcomm as sc
from spmdcomm.launch import GRACE_SECONDS
from spmdcomm.reliability import preemption as preemption_module

ROOT = Path(__file__).resolve().parents[1]

STOPPED = re.compile(r"^\[rank (\d)\] STOPPED AT (\d+) \((SIGTERM|request\(\)) on process (\d)\)$", re.M)


def run_until_stopped(preemption, *, request_at=None, steps=50):
    for step in range(steps):
        if preemption.should_stop(step):
            return step
        if step == request_at:
            preemption.request()
    return None


def test_a_single_process_stops_at_the_next_step_after_a_request():
    with sc.Preemption() as preemption:
        assert (preemption.stop_step, preemption.reason) == (None, None)
        assert run_until_stopped(preemption, request_at=6) == 7
        assert (preemption.stop_step, preemption.reason) == (7, "request() on process 0")
        assert preemption.should_stop(7)  # asked again at the same step, the answer stays


def test_no_request_no_stop():
    with sc.Preemption() as preemption:
        assert run_until_stopped(preemption) is None and preemption.stop_step is None


def test_sigterm_requests_the_stop_and_close_restores_the_previous_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with sc.Preemption() as preemption:
        assert signal.getsignal(signal.SIGTERM) != previous
        assert not preemption.should_stop(0)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this (the main) thread before the next line
        assert preemption.should_stop(1) and preemption.reason == "SIGTERM on process 0"
    assert signal.getsignal(signal.SIGTERM) == previous


def test_other_signals_can_request_the_stop():
    with sc.Preemption(signals=(signal.SIGTERM, signal.SIGUSR1)) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop(3) and preemption.reason == "SIGUSR1 on process 0"


def test_a_step_past_the_agreed_stop_step_raises():
    with sc.Preemption() as preemption:
        preemption.request()
        assert preemption.should_stop(4)
        with pytest.raises(sc.DistributedError, match=r"step=6 on process 0 is past the agreed stop step 4"):
            preemption.should_stop(6)


@pytest.mark.parametrize("signals", [(), (signal.SIGKILL,), ("TERM",), (10_000,)])
def test_signals_must_be_catchable_signals(signals):
    with pytest.raises(
        sc.SpmdError, match=r"^spmdcomm\.Preemption: signals=.* is not a non-empty sequence of catchable"
    ):
        sc.Preemption(signals=signals)


@pytest.mark.parametrize("timeout", [0, -1.0, True, "20"])
def test_timeout_must_be_positive_seconds(timeout):
    with pytest.raises(sc.SpmdError, match=rf"^spmdcomm\.Preemption: timeout={re.escape(repr(timeout))} is not a"):
        sc.Preemption(timeout=timeout)


def test_a_failed_agreement_is_reported_inside_the_launchers_default_grace_period():
    """SIGTERM, one poll to see the notice, the agreement's timeout, then the error and the exit (about 1 s; with
    the defaults the error came 11.4 s after the signal and the job ended at 11.7 s): before the launcher's SIGKILL,
    with a margin for a busy machine."""
    assert preemption_module._POLL_SECONDS + preemption_module.DEFAULT_PREEMPTION_TIMEOUT + 1.0 <= GRACE_SECONDS - 5.0


def test_handlers_can_only_be_installed_from_the_main_thread():
    errors = []

    def create():
        try:
            sc.Preemption()
        except sc.SpmdError as e:
            errors.append(str(e))

    thread = threading.Thread(target=create, name="worker")
    thread.start()
    thread.join()
    (message,) = errors
    assert message.startswith("spmdcomm.Preemption: was created in thread 'worker'; Python runs signal handlers")


def stops(out):
    """{rank: (step, reason)} from the workers' STOPPED lines."""
    return {int(r): (int(step), f"{why} on process {p}") for r, step, why, p in STOPPED.findall(out)}


@pytest.mark.multiprocess
def test_a_sigterm_to_one_process_stops_every_process_at_the_same_step(launch):
    res = launch("mp_watchdog.py", "preempt", "self", returncode=sc.PREEMPTED_EXIT_CODE)
    got = stops(res.stdout)
    assert sorted(got) == [0, 1], res.stdout
    (stop,) = {step for step, _ in got.values()}
    assert stop > 5  # process 1 was signalled at step 5; the others learn it through the coordination service
    assert {why for _, why in got.values()} == {"SIGTERM on process 1"}


@pytest.mark.multiprocess
def test_a_process_that_does_not_take_part_is_named(launch):
    res = launch("mp_watchdog.py", "preempt", "lonely", returncode=1)
    (message,) = re.findall(r"^\[rank 0\] CAUGHT (.*)$", res.stdout, re.M)
    assert message.startswith(
        "spmdcomm.Preemption.should_stop: request() on process 0 asked every process to stop, but process(es) [1] "
        "did not report their step within 3 s, so no stop step was agreed (seen on process 0; steps reported: {0: "
    ), message
    assert "Fix: check that every process created its Preemption and is alive" in message


@pytest.mark.multiprocess
def test_a_single_process_job_stops_after_sigterm(launch):
    res = launch("mp_watchdog.py", "preempt", "self", processes=1, returncode=sc.PREEMPTED_EXIT_CODE)
    assert stops(res.stdout) == {0: (6, "SIGTERM on process 0")}


@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_stops_every_process_at_the_same_step(launch):
    """The launcher passes SIGTERM on to every process; they agree on one step and exit with the preempted code."""
    res = launch(
        "mp_watchdog.py", "preempt", "external", grace=30, sigterm_after=r"^READY$", returncode=128 + signal.SIGTERM
    )
    text, err = res.stdout, res.stderr
    got = stops(text)
    assert sorted(got) == [0, 1], text + err
    assert len({step for step, _ in got.values()}) == 1, got
    assert {why for _, why in got.values()} <= {"SIGTERM on process 0", "SIGTERM on process 1"}
    assert "received SIGTERM; stopping all processes" in err


# Every process prints SIGTERM when it gets it, takes SAVE_SECONDS to "save", then exits as fit does; with "fail",
# process 1 exits with status 3 once process 0 has started (a failure, after which the other process cannot save).
SAVING_JOB = """
import os, signal, sys, time
SAVE_SECONDS = 5
rank = int(os.environ["SPMDCOMM_PROCESS_ID"])

def saving(signum, frame):
    print("SIGTERM", flush=True)
    time.sleep(SAVE_SECONDS)
    print("SAVED", flush=True)
    sys.exit(143)

signal.signal(signal.SIGTERM, saving)
open(f"started.{rank}", "w").close()
print("STARTED", flush=True)
if rank == 1 and sys.argv[1] == "fail":
    deadline = time.monotonic() + 60
    while not os.path.exists("started.0") and time.monotonic() < deadline:  # process 0 can take the signal
        time.sleep(0.05)
    sys.exit(3)
time.sleep(120)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["stop", "fail"])
def test_the_grace_period_covers_a_save_after_a_stop_and_not_after_a_failure(launch, tmp_path, how):
    """A stop from outside (SIGTERM to the launcher) leaves every process the whole --grace to save; after a process
    failed, the others are killed within 3 s, since they cannot save without it (and a restart should not wait)."""
    job = tmp_path / "saving_job.py"
    job.write_text(SAVING_JOB)
    if how == "stop":
        res = launch(
            job, how, devices_per_process=None, grace=30, sigterm_after=r"^STARTED$", returncode=sc.PREEMPTED_EXIT_CODE
        )
        assert sorted(re.findall(r"^\[rank (\d)\] SAVED$", res.stdout, re.M)) == ["0", "1"], res.stdout
    else:
        res = launch(job, how, devices_per_process=None, grace=30, returncode=3)
        assert "[rank 0] SIGTERM" in res.stdout, res.stdout  # rank 0 was asked to stop...
        assert "SAVED" not in res.stdout, res.stdout  # ...and SIGKILLed 3 s later, 2 s before its save would end
        assert "rank 1 (pid " in res.stderr and ") exited with status 3; stopping the other 1" in res.stderr
