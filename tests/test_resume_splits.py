"""The global batch does not depend on how the devices are split into processes: a run on 4 devices killed as
2 processes x 2 devices, resumed as 1 x 4, killed again and finished as 4 x 1 ends with the parameters of a
2 x 2 run that never stopped, with per-device dropout and with per-example dropout, each split training
through an epoch's padded last batch.

The job is tests/workers/split_job.py (tests/workers/resume_job.py's data: 6 global batches of 8 per epoch,
the last one 4 real examples and 4 padded rows); the per-shard batches themselves are tested in
tests/test_data.py and tests/test_resume.py.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

import spmdcomm as sc

_spec = importlib.util.spec_from_file_location("resume_job", Path(__file__).parent / "workers" / "resume_job.py")
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

MODES = ("per_device", "per_example")  # tests/workers/split_job.py trains one model per mode, in this order
PER_EPOCH = -(-job.EXAMPLES // job.GLOBAL_BATCH)
STEPS = job.EPOCHS * PER_EPOCH
# (processes, devices per process, the step the job stops before, the checkpoint it leaves): every split
# trains one epoch's padded last batch (steps 6, 12 and 18), so a padded row placed elsewhere on any split
# would show in the parameters.
STAGES = [(2, 2, 10, 8), (1, 4, 17, 16), (4, 1, None, STEPS)]
TOLERANCE = 1e-6  # gloo's cross-process sums and XLA's in-process ones may round apart


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_and_resume_across_splits_of_four_devices_ends_like_the_uninterrupted_run(launch, tmp_path):
    assert job.EXAMPLES % job.GLOBAL_BATCH  # every epoch ends in a padded batch: steps 6, 12, 18
    previous = 0
    for processes, devices, stop_at, saved in STAGES:
        assert any(previous < s <= saved for s in range(PER_EPOCH, STEPS + 1, PER_EPOCH)), (previous, saved)
        args = ["--straight"] if previous == 0 else []
        args += [] if stop_at is None else ["--stop-at", stop_at]
        out = launch(
            "split_job.py",
            tmp_path,
            *args,
            processes=processes,
            devices_per_process=devices,
            returncode=0 if stop_at is None else 128 + 9,  # SIGKILL: the last mode kills every process
        )
        for mode in MODES:
            lines = {
                rank: re.findall(
                    rf"^\[rank {rank}\] ((?:RESUMED|STOPPED|KILLING|TRAINED) {mode} .*)$", out.stdout, re.M
                )
                for rank in range(processes)
            }
            if stop_at is None:
                end = f"TRAINED {mode} {STEPS - previous} steps to step {STEPS}"
            else:
                end = f"{'KILLING' if mode == MODES[-1] else 'STOPPED'} {mode} before step {stop_at}"
            assert all(got == [f"RESUMED {mode} from step {previous}", end] for got in lines.values()), out.stdout
            ckpt = tmp_path / f"ckpt-{mode}"
            assert sc.latest_checkpoint_step(ckpt) == saved
            epoch, batch = divmod(saved, PER_EPOCH)
            assert sc.checkpoint_extra(ckpt)["data"] == {
                "epoch": epoch,
                "batch": batch,
                "global_batch_size": job.GLOBAL_BATCH,
            }
        if stop_at is not None:
            assert re.search(r"rank \d \(pid \d+\) was killed by SIGKILL", out.stderr), out.stderr
        previous = saved

    for mode in MODES:
        with (
            np.load(tmp_path / f"params_straight-{mode}.npz") as a,
            np.load(tmp_path / f"params_staged-{mode}.npz") as b,
        ):
            straight, staged = dict(a), dict(b)
        assert straight.keys() == staged.keys() and len(straight) == 4, (mode, straight.keys())
        worst = max(float(np.abs(staged[k] - straight[k]).max()) for k in straight)
        assert worst <= TOLERANCE, (mode, worst)
