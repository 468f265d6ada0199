"""Worker for tests/test_checkpoint_async.py: asynchronous saves that fail on one process of two.

``mp_async_save.py DIR TIMEOUT``: both processes save checkpoints 1 to 5 of a small state with
``save_checkpoint(DIR, ..., asynchronous=True, timeout=...)`` and wait for each, while faults are injected:

- checkpoint 2: process 1's background write fails (its data: a full disk's ``OSError``);
- checkpoint 3: process 0's background write fails at the final rename that completes the checkpoint;
- checkpoint 4, saved with ``timeout=TIMEOUT``: process 1's write takes TIMEOUT + 3 s (a stalled disk that ignores
  orbax's timeout).

Checkpoints 1 and 5 are not touched; every save but checkpoint 4's has a timeout of 60 s. For each save every
process prints ``SAVE <step> <seconds> OK`` or ``SAVE <step> <seconds> CAUGHT <message>`` (seconds from the call of
save_checkpoint to the end of ``wait()``), then ``LATEST <step>``, the newest complete checkpoint.
"""

import errno
import sys
import time
from pathlib import Path

import spmdcomm as sc

sc.initialize(timeout=60)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from orbax.checkpoint._src.path import atomicity  # noqa: E402

from spmdcomm.checkpoint import _async  # noqa: E402

root, TIMEOUT = Path(sys.argv[1]), float(sys.argv[2])
me = sc.process_index()
mesh = sc.data_mesh()
# (step, process) -> the fault of that process's write of that checkpoint
FAULTS = {(2, 1): "write", (3, 0): "rename", (4, 1): "stall"}
saving = {"step": 0}


class Failing:
    """A write that fails when orbax waits for it, as tensorstore's does on a full disk."""

    def result(self, timeout=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    def cancel(self):
        return None


class Stalled:
    """A write that ends TIMEOUT + 3 s after orbax starts waiting for it, whatever timeout orbax gives."""

    def result(self, timeout=None):
        time.sleep(TIMEOUT + 3.0)

    def cancel(self):
        return None


original_save = ocp.StandardCheckpointHandler.async_save


async def async_save(self, *args, **kwargs):
    futures = list(await original_save(self, *args, **kwargs) or [])
    fault = FAULTS.get((saving["step"], me))
    if fault == "write":
        futures.append(Failing())
    elif fault == "stall":
        futures.append(Stalled())
    return futures


ocp.StandardCheckpointHandler.async_save = async_save


def failing_rename(original):
    async def finalize(self, *args, **kwargs):
        if FAULTS.get((saving["step"], me)) == "rename":
            raise OSError(errno.ENOSPC, "No space left on device")
        return await original(self, *args, **kwargs)

    return finalize


for cls in vars(atomicity).values():  # the rename that completes a checkpoint (on process 0)
    if isinstance(cls, type) and "finalize" in vars(cls):
        cls.finalize = failing_rename(vars(cls)["finalize"])


def state(value: float) -> sc.TrainState:
    return sc.TrainState.create(params={"w": np.full(4096, value, np.float32)}, tx=optax.sgd(0.1), mesh=mesh)


for step in range(1, 6):
    saving["step"] = step
    saved = state(float(step))  # made before the clock starts: its placement waits for every process
    start = time.monotonic()
    try:
        limit = TIMEOUT if step == 4 else 60.0
        sc.save_checkpoint(root, saved, step=step, asynchronous=True, timeout=limit).wait()
        outcome = "OK"
    except sc.SpmdError as e:
        outcome = f"CAUGHT {e}"
    print(f"SAVE {step} {time.monotonic() - start:.2f} {outcome}", flush=True)
    try:  # the next save would raise a failed save's error once more: it was raised here already
        _async.wait_for_save_in_flight()
    except sc.SpmdError:
        pass
    print(f"LATEST {sc.latest_checkpoint_step(root)}", flush=True)
