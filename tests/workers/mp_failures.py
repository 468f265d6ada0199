"""Worker for tests/test_multiprocess.py: processes that end, and how the job ends with them (the errors of
processes that fall out of step are checked by mp_agreement.py).

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

pid = sc.process_index()


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


{"kill": kill, "raise": raise_}[sys.argv[1]]()
