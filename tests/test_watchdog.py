"""The watchdog: which processes it names, its table, and real stuck jobs on 127.0.0.1 (tests/workers/mp_watchdog.py,
a stand-in for fit whose last process sleeps forever in the data phase of step 3). The jobs wait out the watchdog's
timeout: slow-tier tests."""

import re
import threading
import time

import jax
import numpy as np
import optax
import pytest
from timing import LATE_S

import spmdcomm as sc
from spmdcomm.reliability.phases import Progress
from spmdcomm.reliability.threads import HostCallbacks, stack_of
from spmdcomm.reliability.verdicts import (
    ProcessState,
    compiling_process,
    describe_stuck,
    format_table,
    overdue,
    stuck_processes,
    verdict_of,
)

TIMEOUT = 5  # the watchdog's, in the jobs below
# A row of the table: process, host, last step, phase, seconds in phase, mark.
ROW = re.compile(
    r"^\[rank (\d)\] (\d+)\s+(\S+)\s+(\S+)\s+(.+?)\s{2,}([\d.?]+)(?:\s{2,}(<- stuck.*|waiting for .*))?$", re.M
)


STALL = 2.0  # stalled_after below: half a 4 s timeout


def state(process, step, phase, seconds=1.0, callback=None):
    return ProcessState(process, "host", step, phase, seconds, None, callback)


@pytest.mark.parametrize(
    "states,n,stuck",
    [
        # a process behind the others, busy with its own work: the cause
        ({0: state(0, 5, "devices"), 1: state(1, 4, "data")}, 2, [1]),
        # a dispatch that lasts waits (behind devices that wait for a peer): never the cause by itself
        ({0: state(0, 4, "devices"), 1: state(1, 4, "dispatch")}, 2, [0, 1]),
        # a checkpoint save is collective: one process saving step 8 waits for the one whose data never came
        ({0: state(0, 7, "data"), 1: state(1, 7, "save")}, 2, [0]),
        ({0: state(0, 7, "save"), 1: state(1, 7, "save")}, 2, [0, 1]),
        # everyone waits: a hang inside the devices or a barrier names all of them, whatever their steps
        ({0: state(0, 4, "devices"), 1: state(1, 4, "sync"), 2: state(2, 6, "devices")}, 3, [0, 1, 2]),
        # working ones that just began (no stall yet): those behind
        ({0: state(0, 0, "data"), 1: state(1, None, "other"), 2: state(2, None, "devices")}, 3, [1]),
        # a process without a report comes first; the waiting ones are its victims
        ({0: state(0, 4, "devices"), 1: state(1, 4, "devices")}, 3, [2]),
        ({0: state(0, 4, "devices"), 1: state(1, 4, "data", 5.0)}, 3, [2, 1]),
        ({}, 2, [0, 1]),
        # a compilation past its allowance is the process's own work
        ({0: state(0, 4, "devices"), 1: state(1, 4, "compile")}, 2, [1]),
    ],
)
def test_stuck_processes_are_the_ones_that_stopped_in_their_own_work_never_waiting_ones(states, n, stuck):
    assert stuck_processes(states, n, stalled_after=STALL) == stuck


def interleavings():
    """The states the watchdog reads when rank ``r`` of 2 stalls in a host callback or in its data source, in
    every interleaving of the healthy rank (blocked in the next dispatch, fetching metrics, in a save, or just
    back from a phase of its own), with the stalled rank's training thread anywhere the loop can be."""
    cases = []
    for r in (0, 1):
        o = 1 - r
        # the healthy rank: (last step relative to the stalled one's, phase, seconds in it)
        healthy = [(-1, "dispatch", 4.2), (0, "dispatch", 4.1), (1, "devices", 4.0), (0, "save", 3.9), (0, "data", 0.1)]
        healthy += [(2, "devices", 3.5), (-1, "hooks", 0.3), (0, "other", 0.01)]
        for d, phase, seconds in healthy:
            other = state(o, 10 + d, phase, seconds)
            # a callback that does not return, seen from each phase the stalled rank's training thread waits in
            for own in ("devices", "dispatch", "save", "data", "other"):
                busy = own not in ("devices", "dispatch", "save")
                cases.append(
                    pytest.param(
                        {r: state(r, 10, own, 0.2 if busy else 4.3, callback=4.1), o: other},
                        [r],
                        id=f"callback-{own}-on-{r}-other-{phase}{d:+d}",
                    )
                )
            cases.append(
                pytest.param({r: state(r, 10, "data", 4.2), o: other}, [r], id=f"data-on-{r}-other-{phase}{d:+d}")
            )
    # both ranks stalled: both named, whichever is ahead
    cases += [
        pytest.param(
            {0: state(0, 9, "devices", 4.0, 4.0), 1: state(1, 11, "dispatch", 4.0, 3.2)}, [0, 1], id="two-cbs"
        ),
        pytest.param({0: state(0, 10, "data", 4.0), 1: state(1, 12, "data", 2.5)}, [0, 1], id="two-data"),
        pytest.param({0: state(0, 10, "data", 4.0), 1: state(1, 10, "devices", 4.0, 3.0)}, [0, 1], id="data-and-cb"),
        # a callback that just began is no stall (the step's callbacks run all the time); the stalled data is
        pytest.param({0: state(0, 10, "data", 4.2), 1: state(1, 11, "devices", 4.0, 0.4)}, [0], id="cb-just-began"),
        # nobody stopped in their own work (a hang inside the devices): all of them, whatever their steps
        pytest.param({0: state(0, 10, "dispatch", 4.2), 1: state(1, 11, "devices", 4.1)}, [0, 1], id="device-hang"),
        pytest.param({0: state(0, 10, "devices", 4.2), 1: state(1, 10, "devices", 4.1)}, [0, 1], id="all-wait"),
        # ...unless one behind works, if only for a moment
        pytest.param({0: state(0, 10, "data", 0.5), 1: state(1, 10, "dispatch", 4.1)}, [0], id="brief-data"),
    ]
    return cases


@pytest.mark.parametrize("states,stuck", interleavings())
def test_the_rank_that_stalled_in_a_callback_or_its_data_is_named_in_every_interleaving(states, stuck):
    assert stuck_processes(states, 2, stalled_after=STALL) == stuck


def test_the_table_says_what_each_process_does_for_how_long_and_whom_the_waiting_ones_wait_for():
    states = {0: state(0, 10, "dispatch", 4.2), 1: state(1, 11, "devices", 4.3, callback=4.1)}
    stuck = stuck_processes(states, 2, stalled_after=STALL)
    assert format_table(states, 2, stuck=stuck).splitlines() == [
        "process  host  last step  doing                                     seconds  verdict",
        "0        host  10         dispatching                               4.2      waiting for process 1",
        "1        host  11         in a host callback (waiting for devices)  4.1      <- stuck: a host callback has "
        "run 4.1 s",
    ]
    assert describe_stuck(1, states) == (
        "process 1 (in a host callback (waiting for devices) for 4.1 s, last completed step 11)"
    )
    assert verdict_of(0, {0: state(0, 1, "devices")}, [0]).startswith("<- stuck: waits with the others")
    assert verdict_of(1, {0: state(0, 1, "data", 3.0)}, [0, 2]) == "waiting for processes 0, 2"


def progress(step, phase, *, phase_start=0.0, step_start=0.0, compile_end=None):
    return Progress(step, phase, phase_start, 0.0, step_start, 0, compile_end, None)


TIMEOUTS, COMPILE = (20.0, 5.0), 60.0  # (first step, later steps), compilation


@pytest.mark.parametrize(
    "p,now,late",
    [
        (progress(3, "devices"), 4.9, None),
        (progress(3, "devices"), 6.0, "completed no step for 6.0 s after the last completed step (timeout 5 s)"),
        # the step's time counts from the end of its compilation...
        (progress(3, "devices", compile_end=3.0), 7.9, None),
        (progress(3, "data", compile_end=3.0), 8.5, "completed no step for 5.5 s after its last compilation ended"),
        # ...not from one before the step began
        (progress(3, "data", step_start=2.0, compile_end=1.0), 7.5, "completed no step for 5.5 s after the last"),
        # a compilation has its own allowance, from the start of the phase
        (progress(3, "compile", phase_start=1.0), 60.9, None),
        (progress(3, "compile", phase_start=1.0), 62.0, "compiled for 61.0 s (compile timeout 60 s)"),
        # the first step: first_step_timeout, from the watchdog's start
        (progress(None, "data"), 19.0, None),
        (progress(None, "data"), 21.0, "completed no step for 21.0 s after the watchdog started (timeout 20 s)"),
        (progress(None, "dispatch", compile_end=30.0), 49.0, None),
    ],
)
def test_a_step_is_late_past_its_timeout_counted_after_compilation_and_a_compilation_past_its_own(p, now, late):
    got = overdue(p, now, TIMEOUTS, COMPILE)
    assert got == late if late is None else got.startswith(late), got


def compiled(process, seconds_ago, phase="devices"):
    return ProcessState(process, "host", 4, phase, 1.0, seconds_ago)


@pytest.mark.parametrize(
    "states,holder",
    [
        ([state(0, 4, "devices"), state(1, 4, "compile", seconds=30.0)], 1),  # compiling, within its allowance
        ([state(0, 4, "devices"), state(1, 4, "compile", seconds=61.0)], None),  # past it: its own timeout fires
        ([compiled(0, None), compiled(1, 4.0)], 1),  # just compiled: its step may take a timeout after that
        ([compiled(0, None), compiled(1, 6.0)], None),
        ([compiled(0, 1.0, phase="compile")], 0),  # a compile phase's "compiled" is the previous compilation's
        ([state(0, 4, "data"), state(1, 4, "devices")], None),
    ],
)
def test_a_process_that_compiles_or_just_compiled_holds_the_others_up_legitimately(states, holder):
    assert compiling_process(states, TIMEOUTS[1], COMPILE) == holder


def test_table_has_one_aligned_row_per_process_and_marks_the_stuck_ones():
    states = {0: ProcessState(0, "node-a", 12, "devices", 10.25), 2: ProcessState(2, "b", None, "eval", 3.0)}
    assert format_table(states, 3, stuck=[1]) == (
        "process  host    last step  doing                seconds  verdict\n"
        "0        node-a  12         waiting for devices  10.2     waiting for process 1\n"
        "1        ?       ?          no report            ?        <- stuck\n"
        "2        b       none       eval                 3.0      waiting for process 1"
    )
    assert "1        ?       ?          unknown" in format_table(states, 3, stuck=[], absent="unknown")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"timeout": 0}, "timeout=0 is not a positive number of seconds"),
        ({"timeout": True}, "timeout=True is not a positive number of seconds"),
        ({"timeout": 10, "interval": -1}, "interval=-1 is not a positive number of seconds"),
        ({"timeout": 10, "first_step_timeout": "5"}, "first_step_timeout='5' is not a positive number of seconds"),
        ({"timeout": 10, "compile_timeout": 0}, "compile_timeout=0 is not a positive number of seconds"),
        ({"timeout": 10, "on_stuck": "abort"}, "on_stuck='abort' is not 'exit', 'raise' or a callable"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(sc.SpmdError, match=rf"^spmdcomm\.Watchdog: {re.escape(message)}\. Fix: pass "):
        sc.Watchdog(sc.PhaseTimer(), **kwargs)


def test_the_watchdog_watches_a_phase_timer():
    with pytest.raises(sc.SpmdError, match=r"^spmdcomm\.Watchdog: timer is a dict, not a PhaseTimer"):
        sc.Watchdog({}, timeout=10)


def test_a_host_callback_that_runs_is_found_in_its_thread_and_timed_from_when_it_was_first_seen():
    release = threading.Event()
    ran = jax.jit(lambda x: (jax.debug.callback(lambda _: release.wait(GIVE_UP), x), x + 1)[1])
    watch = HostCallbacks()
    release.set()
    ran(np.float32(0)).block_until_ready()  # compiled; the callback returned at once
    assert watch.sample() is None
    release.clear()
    caller = threading.Thread(target=lambda: ran(np.float32(1)).block_until_ready())
    caller.start()
    deadline = time.monotonic() + GIVE_UP
    while (first := watch.sample()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first is not None, "the running callback was not found"
    time.sleep(0.05)
    assert watch.sample() == first  # the same callback: its start does not move
    assert "release.wait(GIVE_UP)" in stack_of(first.thread)
    release.set()
    caller.join()
    assert watch.sample() is None


def test_fit_passes_the_watchdog_settings_and_refuses_them_without_a_watchdog():
    state = sc.TrainState.create(params={"c": np.float32(0.0)}, tx=optax.sgd(0.1))
    step = sc.make_train_step(lambda params, batch, **_: sc.masked_mean((batch - params["c"]) ** 2, _["mask"]))
    batches = [np.ones(8, np.float32)] * 2
    with pytest.raises(sc.SpmdError, match=r"^spmdcomm\.fit: watchdog_first_step_timeout is the first step's"):
        sc.fit(step, state, batches, watchdog_first_step_timeout=60)
    with pytest.raises(sc.SpmdError, match=r"^spmdcomm\.Watchdog: interval=0 is not a positive number"):
        sc.fit(step, state, batches, watchdog_timeout=60, watchdog_interval=0)
    with pytest.raises(sc.SpmdError, match=r"^spmdcomm\.Watchdog: first_step_timeout=-1 is not a positive number"):
        sc.fit(step, state, batches, watchdog_timeout=60, watchdog_first_step_timeout=-1)
    _, history = sc.fit(
        step, state, batches, watchdog_timeout=60, watchdog_first_step_timeout=600, watchdog_interval=0.1
    )
    assert len(history) == 2


# ---- in-process: on_stuck="raise" and a callable (the process goes on) ------------------------------------------

STUCK_AFTER = 0.3  # the watchdog's timeout in the tests below (seconds)
GIVE_UP = 30.0  # a bound on every wait below, far above what firing takes


def stuck_in_data_phase(timer, until=lambda: False, steps=2):
    """``steps`` steps, then a data phase that completes no step: returns when ``until()`` or after GIVE_UP
    seconds."""
    for i in range(steps):
        with timer.phase("dispatch"):
            pass
        timer.end_step(i)
    deadline = time.monotonic() + GIVE_UP
    with timer.phase("data"):
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)  # Python runs between the sleeps: an asynchronous exception arrives here


def test_on_stuck_raise_raises_in_the_training_thread_and_the_process_goes_on(capfd):
    timer = sc.PhaseTimer()
    with pytest.raises(sc.StuckStepError) as info:
        with sc.Watchdog(timer, timeout=STUCK_AFTER, interval=0.05, on_stuck="raise") as watchdog:
            stuck_in_data_phase(timer)
    message = str(info.value)
    assert re.match(
        rf"^spmdcomm\.Watchdog: process 0 completed no step for [\d.]+ s after the last completed step "
        rf"\(timeout {STUCK_AFTER:g} s\)\. Stuck: process 0 "
        rf"\(waiting for data for [\d.]+ s, last completed step 1\)\.\n",
        message,
    ), message
    assert re.search(r"^0 +\S+ +1 +waiting for data +[\d.]+ +<- stuck: waiting for data for [\d.]+ s$", message, re.M)
    assert info.value.stuck == [0] and isinstance(info.value, sc.DistributedError)
    err = capfd.readouterr().err
    assert "Process 0 raises StuckStepError in its training thread (on_stuck='raise')." in err
    assert f"exits with status {sc.STUCK_EXIT_CODE}" not in err
    assert all(not t.is_alive() for t in watchdog._threads)


def test_on_stuck_callable_gets_the_error_once_and_the_loop_decides():
    got = []
    fired = threading.Event()

    def on_stuck(error):
        got.append((error, threading.get_ident()))
        fired.set()

    timer = sc.PhaseTimer()
    with sc.Watchdog(timer, timeout=STUCK_AFTER, interval=0.05, on_stuck=on_stuck) as watchdog:
        stuck_in_data_phase(timer, until=fired.is_set)
        time.sleep(5 * 0.05)  # more intervals pass: the watchdog fired once and stopped
    assert fired.is_set(), "the watchdog never called on_stuck"
    ((error, thread),) = got
    assert type(error) is sc.StuckStepError and error.stuck == [0]
    assert re.search(r"Stuck: process 0 \(waiting for data for [\d.]+ s, last completed step 1\)\.", str(error))
    assert thread != threading.get_ident()  # called from the watchdog's thread, not the training thread
    assert all(not t.is_alive() for t in watchdog._threads)


def slow_to_compile(seconds, until=lambda: False):
    """An spmd function whose trace (so its compilation) takes ``seconds``, or until ``until()``."""

    def body(x):
        deadline = time.monotonic() + seconds
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
        return sc.psum(x, "data")

    return sc.spmd(body, in_specs=sc.P("data"), out_specs=sc.P())


COMPILE_SECONDS = 4 * STUCK_AFTER  # longer than the step timeout: an alarm before compilation was known


def test_a_compilation_longer_than_the_timeout_is_no_stall_and_a_stall_after_it_is_named():
    timer = sc.PhaseTimer()
    x = np.ones(8, np.float32)
    with pytest.raises(sc.StuckStepError) as info:
        with sc.Watchdog(timer, timeout=STUCK_AFTER, interval=0.05, on_stuck="raise"):
            for i, fn in enumerate([slow_to_compile(COMPILE_SECONDS), slow_to_compile(COMPILE_SECONDS)]):
                with timer.phase("dispatch"):
                    fn(x)  # the first step compiles; the second step compiles again (a new program)
                times = timer.end_step(i)
                assert times["compile"] >= COMPILE_SECONDS and times["dispatch"] < COMPILE_SECONDS, times
            with timer.phase("dispatch"):
                fn(x)  # cached: no compilation
            assert timer.end_step(2)["compile"] == 0.0
            with timer.phase("dispatch"):
                slow_to_compile(COMPILE_SECONDS)(x)  # compiles, then the data source stalls: named
            stuck_in_data_phase(timer, steps=0)
    message = str(info.value)
    assert re.match(
        r"^spmdcomm\.Watchdog: process 0 completed no step for [\d.]+ s after its last compilation ended "
        rf"\(timeout {STUCK_AFTER:g} s\)\. Stuck: process 0 "
        rf"\(waiting for data for [\d.]+ s, last completed step 2\)\.\n",
        message,
    ), message


def test_a_compilation_past_its_own_allowance_is_named_as_compiling():
    fired = threading.Event()
    got = []
    timer = sc.PhaseTimer()
    with sc.Watchdog(
        timer,
        timeout=STUCK_AFTER,
        compile_timeout=2 * STUCK_AFTER,
        interval=0.05,
        on_stuck=lambda e: (got.append(e), fired.set()),
    ):
        with timer.phase("dispatch"):
            slow_to_compile(GIVE_UP, until=fired.is_set)(np.ones(8, np.float32))
    assert fired.is_set(), "the watchdog never fired"
    ((error,),) = [got]
    assert re.match(
        rf"^spmdcomm\.Watchdog: process 0 compiled for [\d.]+ s \(compile timeout {2 * STUCK_AFTER:g} s\)\. "
        r"Stuck: process 0 \(compiling for [\d.]+ s, last completed step none\)\.\n",
        str(error),
    ), error
    assert re.search(r"^0 +\S+ +none +compiling +[\d.]+ +<- stuck: compiling for [\d.]+ s$", str(error), re.M), error


def test_train_and_eval_steps_report_their_compilations_inside_the_loops_phases():
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    state = sc.TrainState.create(params={"w": np.ones(3, np.float32)}, tx=optax.sgd(0.1), mesh=mesh)
    loss = lambda params, batch, **_: sc.masked_mean((batch @ params["w"]) ** 2, _["mask"])
    step, evaluate = sc.make_train_step(loss), sc.make_eval_step(lambda p, b, **kw: {"loss": loss(p, b, **kw)})
    timer, compiled = sc.PhaseTimer(), []
    for i, (rows, phase) in enumerate([(4, "dispatch"), (4, "dispatch"), (6, "dispatch"), (4, "hooks"), (4, "hooks")]):
        with timer.phase(phase):
            if phase == "dispatch":
                state, _ = step(state, np.ones((rows, 3), np.float32))
            else:
                evaluate(state, np.ones((rows, 3), np.float32))
        times = timer.end_step(i)
        compiled.append(times["compile"] > 0)
        assert timer.snapshot().phase == "other" and times[phase] > 0, times  # the loop's phase resumed
    # the first call, a new batch shape, the first eval call
    assert compiled == [True, False, True, True, False]
    # outside any phase block nothing is reported (and nothing breaks)
    step(state, np.ones((8, 3), np.float32))
    assert timer.end_step(5)["compile"] == 0.0


def tables(out):
    """{rank: {process: (host, step, phase, seconds, stuck)}} from each rank's printed table."""
    found = {}
    for rank, process, host, step, phase, seconds, mark in ROW.findall(out):
        found.setdefault(int(rank), {})[int(process)] = (host, step, phase, seconds, mark.startswith("<- stuck"))
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_process_names_the_stuck_one_and_the_job_exits_with_the_stuck_code(launch):
    res = launch("mp_watchdog.py", "stuck", TIMEOUT, returncode=sc.STUCK_EXIT_CODE)
    out, err = res.stdout, res.stderr
    assert re.search(r"^\[rank 1\] SLEEPING at step 3$", out, re.M)
    found = tables(err)
    assert sorted(found) == [0, 1], err  # every process printed one table...
    for rank in (0, 1):
        assert len(re.findall(rf"^\[rank {rank}\] spmdcomm\.Watchdog: ", err, re.M)) == 1, err  # ...once
        rows = found[rank]
        _, step, phase, seconds, stuck = rows[1]
        assert (step, phase, stuck) == ("2", "waiting for data", True), rows
        # Detected at the timeout after entering the phase (the table's own figure; idle: within timeout + 1 s).
        assert TIMEOUT <= float(seconds) < TIMEOUT + LATE_S, rows
        # Process 0 waits inside the step's device collective, a victim: its watchdog thread acted all the same.
        _, step, phase, _, stuck = rows[0]
        assert (step, phase, stuck) == ("2", "waiting for devices", False), rows
    assert re.search(r"^\[rank 0\] spmdcomm\.Watchdog: process 0 completed no step for [\d.]+ s", err, re.M) or (
        re.search(r"^\[rank 1\] spmdcomm\.Watchdog: process 1 completed no step for [\d.]+ s", err, re.M)
    )
    assert re.search(
        r"Stuck: process 1 \(waiting for data for [\d.]+ s, last completed step 2\)\. Every process exits", err
    )
    # The stuck process shows where its training thread is.
    assert re.search(r"^\[rank 1\]\s+time\.sleep\(1e9\)$", err, re.M), err
    assert "exited with status 75" in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_single_stuck_process_reports_and_exits(launch):
    res = launch("mp_watchdog.py", "stuck", TIMEOUT, processes=1, returncode=sc.STUCK_EXIT_CODE)
    rows = tables(res.stderr)[0]
    assert list(rows) == [0]
    _, step, phase, seconds, stuck = rows[0]
    assert (step, phase, stuck) == ("2", "waiting for data", True)
    assert TIMEOUT <= float(seconds) < TIMEOUT + LATE_S


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_that_cannot_reach_the_coordination_service_still_exits(launch):
    res = launch("mp_watchdog.py", "unreachable", TIMEOUT, returncode=sc.STUCK_EXIT_CODE)
    err = res.stderr
    found = tables(err)
    # Process 1's watchdog calls never return: it prints its own row and exits all the same.
    assert found[1][1][1:3] == ("2", "waiting for data") and found[1][0][2:] == ("unknown", "?", False), found
    assert "Stuck: unknown (the coordination service did not answer within 2 s, so the other processes' state" in err
    # Process 0 never received process 1's state: it names it as the process without a report.
    assert found[0][1] == ("?", "?", "no report", "?", True), found
    assert "[rank 0] spmdcomm.Watchdog: process 0 completed no step" in err
    assert "Stuck: process 1 (no report)." in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_launcher_restarts_a_job_the_watchdog_ended(launch):
    res = launch("mp_watchdog.py", "stuck-once", TIMEOUT, max_restarts=1)
    assert "Stuck: process 1 (waiting for data for " in res.stderr
    assert re.search(r"exited with status 75.*\n(.*\n)*.*restart 1 of 1", res.stderr), res.stderr
    assert sorted(re.findall(r"^\[rank (\d)\] DONE after attempt 1$", res.stdout, re.M)) == ["0", "1"]


def attempts(err):
    """Per attempt of tests/workers/blame_job.py, its plan entry and the lines its processes printed."""
    found = []
    for line in err.splitlines():
        started = re.match(r"^\[rank 0\] PLAN \d+ (\S+)$", line)
        if started:
            found.append((started.group(1), []))
        elif found:
            found[-1][1].append(line)
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fit_names_the_rank_stalled_in_a_host_callback_or_its_data_and_not_the_rank_that_waits(launch, tmp_path):
    # One job, restarted once: rank 0 stalls in a jax.debug.callback inside its step, then in its data source
    # (test_every_process_names_the_stuck_one... stalls rank 1's data). Before the fix, the callback stall named the
    # waiting rank, whose next dispatch blocks behind the collective, in 8 runs of 10.
    res = launch("blame_job.py", tmp_path / "ckpt", "--plan", "callback:0:5,data:0:6", max_restarts=1, returncode=75)
    runs = attempts(res.stderr)
    assert [entry for entry, _ in runs] == ["callback:0:5", "data:0:6"], res.stderr
    for (entry, lines), doing in zip(runs, ["in a host callback", "waiting for data"]):
        text = "\n".join(lines)
        headlines = re.findall(r"^\[rank (\d)\] spmdcomm\.Watchdog: .*? Stuck: (.*?)\. Every process", text, re.M)
        assert sorted(rank for rank, _ in headlines) == ["0", "1"], text
        for _, named in headlines:
            assert re.fullmatch(rf"process 0 \({doing}.* for [\d.]+ s, last completed step \d+\)", named), text
        for rank, rows in tables(text).items():
            assert rows[0][2].startswith(doing) and rows[0][4], (entry, rank, rows)
            assert not rows[1][4], (entry, rank, rows)
        assert re.search(r"^\[rank 1\] 1 .*  waiting for process 0$", text, re.M), text
    # The stalled process shows where its callback runs.
    assert re.search(
        r"^\[rank 0\] Host callback of process 0:\n(\[rank 0\] .*\n)*?\[rank 0\]\s+time\.sleep\(1e9\)", res.stderr, re.M
    )
