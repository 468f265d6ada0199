"""explain() on a backend that prints no compiled program: a clear error instead of a TypeError in the parser."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.errors import SpmdError


def test_explain_names_the_missing_program_text(monkeypatch):
    monkeypatch.setattr(jax.stages.Compiled, "as_text", lambda self: None)
    with pytest.raises(SpmdError) as info:
        sc.explain(jax.jit(lambda x: x * 2), np.ones(4, np.float32))
    message = str(info.value)
    assert message.startswith("spmdcomm.explain: the compiled program has no text to read")
    assert "as_text() returned None" in message
    assert "Fix: explain the function on a backend that prints its compiled HLO" in message
