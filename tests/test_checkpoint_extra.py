"""orbax is the optional ``checkpoint`` extra: ``import spmdcomm`` does not load it, and each checkpoint function
without it raises an ImportError naming the function and the extra."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import optax
import pytest

import spmdcomm as sc

ROOT = Path(__file__).resolve().parents[1]


def test_import_spmdcomm_does_not_import_orbax():
    code = "import spmdcomm, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('orbax', 'tensorstore')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("missing", ["orbax", "orbax.checkpoint"])
@pytest.mark.parametrize(
    ("fn", "call"),
    [
        ("save_checkpoint", lambda d, state: sc.save_checkpoint(d, state)),
        ("restore_checkpoint", lambda d, state: sc.restore_checkpoint(d, state, missing_ok=True)),
        ("latest_checkpoint_step", lambda d, state: sc.latest_checkpoint_step(d)),
        ("checkpoint_extra", lambda d, state: sc.checkpoint_extra(d)),
    ],
)
def test_without_orbax_each_function_names_the_extra(monkeypatch, tmp_path, missing, fn, call):
    state = sc.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
    monkeypatch.setitem(sys.modules, missing, None)  # what an environment without orbax imports
    with pytest.raises(ImportError) as err:
        call(tmp_path, state)
    assert str(err.value).startswith(f"spmdcomm.{fn}: checkpoints need orbax-checkpoint, which cannot be imported")
    assert "Fix: pip install 'spmdcomm[checkpoint]'" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_the_extra_is_declared_and_the_test_and_examples_extras_include_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["checkpoint"] == ["orbax-checkpoint>=0.11"]
    assert "spmdcomm[checkpoint]" in extras["test"] and "spmdcomm[checkpoint]" in extras["examples"]
