"""Worker for tests/test_watchdog.py: a stand-in for ``fit`` that drives a PhaseTimer, a Watchdog and a
Preemption around a step with a device collective over every process's devices.

``mp_watchdog.py stuck TIMEOUT``: the last process sleeps forever in the "data" phase of step 3 (a data loader
that never returns); the others block inside the step's collective. Every process must print the watchdog's
table and exit with STUCK_EXIT_CODE.

``mp_watchdog.py stuck-once TIMEOUT``: stuck as above on the first attempt only; a restarted job
(``--max-restarts``) runs 10 steps and prints ``DONE``.

``mp_watchdog.py unreachable TIMEOUT``: the same, but the last process's watchdog cannot reach the coordination
service (its calls never return, as in a network partition): it must still print its own row and exit.

``mp_watchdog.py preempt self|external``: steps run until the processes agree to stop. ``self``: process 1 (or
the only process) sends itself SIGTERM at step 5. ``external``: every process prints ``READY`` at step 3 and the
test sends SIGTERM to the launcher, which passes it on. Each process prints ``STOPPED AT <step> (<reason>)`` and
exits with PREEMPTED_EXIT_CODE, as fit does after saving its checkpoint.

``mp_watchdog.py preempt lonely``: only process 0 creates a Preemption (timeout 3 s) and asks to stop; it must
raise BarrierTimeoutError naming process 1 (printed as ``CAUGHT <message>``) and exit 1.
"""

import os
import signal
import sys
import time

import spmdcomm as sc

sc.initialize(timeout=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import spmdcomm.reliability.watchdog  # noqa: E402

mode, arg = sys.argv[1], sys.argv[2]
stuck = mode in ("stuck", "unreachable") or (mode == "stuck-once" and sc.restart_count() == 0)
me, last = sc.process_index(), sc.process_count() - 1
total = sc.spmd(lambda x: sc.psum(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
rows = np.ones(jax.local_device_count(), np.float32)


class _Unreachable:
    """A coordination client whose calls never return."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: time.sleep(1e9)


def step(timer, i):
    with timer.phase("data"):
        if stuck and i == 3 and me == last:
            print(f"SLEEPING at step {i}", flush=True)
            time.sleep(1e9)
        batch = rows * (i + 1)
    with timer.phase("dispatch"):
        out = total(batch)
    with timer.phase("devices"):
        assert np.asarray(out.addressable_data(0)).tolist() == [(i + 1) * jax.device_count()]
    timer.end_step(i)


def watched(timeout):
    if mode == "unreachable" and me == last:
        spmdcomm.reliability.watchdog.coordination_client = lambda fn: _Unreachable()
    timer = sc.PhaseTimer()
    with sc.Preemption(), sc.Watchdog(timer, timeout=timeout, interval=0.5):
        for i in range(10 if mode == "stuck-once" else 10_000):
            step(timer, i)
    if stuck:
        raise AssertionError("the watchdog did not end the process")
    print(f"DONE after attempt {sc.restart_count()}", flush=True)


def preempted(how):
    timer = sc.PhaseTimer()
    with sc.Preemption() as preemption:
        for i in range(100_000):
            if preemption.should_stop(i):
                print(f"STOPPED AT {i} ({preemption.reason})", flush=True)
                sys.exit(sc.PREEMPTED_EXIT_CODE)
            if how == "self" and i == 5 and me == min(1, last):
                os.kill(os.getpid(), signal.SIGTERM)
            if how == "external" and i == 3:
                print("READY", flush=True)
            step(timer, i)
            time.sleep(0.02)
    raise AssertionError("no stop was agreed")


def lonely():
    if me != 0:
        time.sleep(120)
    with sc.Preemption(timeout=3) as preemption:
        preemption.request()
        try:
            for i in range(100_000):
                preemption.should_stop(i)
                time.sleep(0.01)
        except sc.BarrierTimeoutError as e:
            print(f"CAUGHT {e}", flush=True)
            raise  # uncaught after initialize: the process exits 1 at once (spmdcomm.runtime)


if mode == "preempt" and arg == "lonely":
    lonely()
elif mode == "preempt":
    preempted(arg)
else:
    watched(float(arg))
