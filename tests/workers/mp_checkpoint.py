"""Worker for tests/test_checkpoint.py: processes that see a checkpoint differently agree on which one to use.

Run it under the launcher with 2 processes x 2 devices and a directory. Both processes save checkpoints 1 and 2
of a small state (``w`` filled with the step number) into DIR/shared; then each copies that directory to
DIR/<process index>, and process 1 deletes ``default/_METADATA`` of checkpoint 2 in its copy, as a process whose
view of a shared file system differs would see it. Each process then reads its own copy and prints
``LATEST <step>``, ``RESTORED <w> <extra>`` (the newest intact checkpoint), ``WARNED <message>`` for each
:class:`~spmdcomm.checkpoint.checkpoint.CheckpointDamagedWarning`, and ``CAUGHT <message>`` for an explicit ``step=2``.
"""

import os
import shutil
import sys
import warnings

import spmdcomm as sc

sc.initialize(timeout=60)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from spmdcomm.checkpoint.checkpoint import CheckpointDamagedWarning  # noqa: E402

root = sys.argv[1]
pid = sc.process_index()
mesh = sc.data_mesh()


def state(value: float) -> sc.TrainState:
    return sc.TrainState.create(params={"w": np.full(4, value, np.float32)}, tx=optax.sgd(0.1), mesh=mesh)


shared = os.path.join(root, "shared")
for step in (1, 2):
    sc.save_checkpoint(shared, state(float(step)), step=step, extra={"step": step})
sc.barrier("saved")
mine = os.path.join(root, str(pid))
shutil.copytree(shared, mine)
if pid == 1:
    os.remove(os.path.join(mine, "2", "default", "_METADATA"))
sc.barrier("copied")

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", CheckpointDamagedWarning)
    print(f"LATEST {sc.latest_checkpoint_step(mine)}", flush=True)
    restored = sc.restore_checkpoint(mine, state(0.0))
    w = np.asarray(restored.params["w"].addressable_data(0)).tolist()
    print(f"RESTORED {w} {sc.checkpoint_extra(mine)}", flush=True)
for warning in caught:
    print(f"WARNED {warning.message}", flush=True)
try:
    sc.restore_checkpoint(mine, state(0.0), step=2)
except sc.SpmdError as e:
    print(f"CAUGHT {e}", flush=True)
