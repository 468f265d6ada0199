"""Worker for tests/test_multiprocess.py: the ways processes fall out of step, and what they report.

``mp_failures.py errors``: 2 processes. Mismatched barrier names, an exception inside
main_process_first, a debug-mode shape mismatch and a host_all_reduce shape mismatch must each
raise the right error on every process (printed as ``CAUGHT <name>: <message>``); then the seed
bug: process 0 calls ``barrier`` twice, process 1 once, so process 0 must time out naming process 1
and exit 1.

``mp_failures.py raise``: process 1 raises an uncaught exception while process 0 waits for it in a
barrier; process 1 must exit with status 1 at once (not at JAX's shutdown barrier) so that the launcher
stops the job.

``mp_failures.py kill``: process 1 kills itself with SIGKILL while the others wait in a barrier
with a long timeout; the launcher must end them. Process 1 prints ``KILLING <time>`` first.
"""

import os
import signal
import sys
import time

import spmdcomm as sc

sc.initialize(timeout=60)

import numpy as np  # noqa: E402
from checks import expect  # noqa: E402

pid = sc.process_index()


def enter_first():
    with sc.main_process_first(timeout=30):
        if sc.is_main_process():
            raise OSError("dataset download failed")


def debug_call():
    sc.set_debug(True)
    try:
        f = sc.spmd(lambda b: sc.psum(b, "data"), in_specs=sc.P("data"), out_specs=sc.P())
        f(np.zeros((4, 3 + pid), np.float32))
    finally:
        sc.set_debug(False)


def errors():
    expect("mismatch", sc.ProcessMismatchError, lambda: sc.barrier(f"name{pid}", timeout=30))
    if pid == 0:
        expect("first_main", OSError, enter_first)
    else:
        expect("first_other", sc.RemoteProcessError, enter_first)
    expect("debug", sc.ProcessMismatchError, debug_call)
    expect(
        "host_shapes",
        sc.ProcessMismatchError,
        lambda: sc.host_all_reduce({"v": np.zeros(2 + pid)}, op="sum", timeout=30),
    )
    sc.barrier("a", timeout=30)
    if pid == 0:
        start = time.monotonic()
        try:
            sc.barrier("b", timeout=3)
        except sc.BarrierTimeoutError as e:
            print(f"TIMEOUT after {time.monotonic() - start:.2f} s: {e}", flush=True)
            sys.exit(1)
    print("DONE", flush=True)


def kill():
    if pid == 1:
        time.sleep(1.0)
        print(f"KILLING {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    sc.barrier("never complete", timeout=120)


def raise_():
    # Process 1 dies of an uncaught exception while process 0 waits for it (here in a barrier with a long
    # timeout, as in host-side work). Without spmdcomm's exit hook, process 1 would then wait at JAX's
    # shutdown barrier for process 0 (up to 5 minutes) and the job would end only at the launcher's timeout.
    f = sc.spmd(lambda x: sc.psum(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
    f(np.ones(sc.local_device_count(), np.float32))
    if pid == 1:
        raise RuntimeError("loss is NaN")
    sc.barrier("never complete", timeout=120)


{"errors": errors, "kill": kill, "raise": raise_}[sys.argv[1]]()
