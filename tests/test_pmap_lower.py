"""Lowering a backend='pmap' program: one program in a one-process job, a clear error in a multi-process one."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm import P
from spmdcomm.errors import BackendError


def test_one_process_pmap_lowers_to_one_program():
    f = sc.spmd(lambda x: sc.psum(x, "data"), in_specs=P("data"), out_specs=P(), backend="pmap")
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    compiled = f.lower(x).compile()
    np.testing.assert_array_equal(np.asarray(compiled(*f.place((x,)))), x.sum(0, keepdims=True))


@pytest.mark.parametrize("method", ["lower", "trace"])
def test_multi_process_pmap_says_it_has_no_single_program(monkeypatch, method):
    # The program is built for the process count JAX reports; two processes select the multi-process form,
    # which can be built (not run) in this one-process test. A fresh function keeps it out of later tests' cache.
    monkeypatch.setattr(jax, "process_count", lambda *a: 2)

    def total(x):
        return sc.psum(x, "data")

    f = sc.spmd(total, in_specs=P("data"), out_specs=P(), backend="pmap")
    x = np.ones((8, 2), np.float32)
    program = f.program()
    with pytest.raises(BackendError) as info:
        getattr(program, method)(*f.place((x,)))
    message = str(info.value)
    assert message.startswith(f"spmdcomm.total: {method}() needs one program")
    assert "backend='pmap' and 2 processes" in message
    assert "Fix: use backend='shard_map'" in message
    with pytest.raises(BackendError, match=r"spmdcomm.total: lower\(\) needs one program"):
        f.lower(x)
