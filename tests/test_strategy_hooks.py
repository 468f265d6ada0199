"""The strategy hooks: the one registry of strategy names, and each question the state, the steps and the checkpoints
ask a strategy (whether its gradients are local, its whole parameters, the 0.2 checkpoint layouts)."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import spmdcomm as sc
from spmdcomm.checkpoint._arrays import check_format
from spmdcomm.parallel.data.strategies import BY_NAME, STRATEGIES, resolve_strategy


def test_names_come_from_the_registry_in_order():
    assert STRATEGIES == ("ddp", "zero1", "zero2", "fsdp")
    assert [BY_NAME[name] for name in STRATEGIES] == [sc.DDP, sc.ZeRO1, sc.ZeRO2, sc.FSDP]
    assert [type(resolve_strategy("f", name)) for name in STRATEGIES] == [sc.DDP, sc.ZeRO1, sc.ZeRO2, sc.FSDP]


def test_an_unknown_name_lists_every_registered_one():
    with pytest.raises(sc.SpmdError) as err:
        sc.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1), strategy="zero3")
    message = str(err.value)
    assert message.startswith("spmdcomm.TrainState.create: strategy='zero3' is not a strategy")
    assert all(repr(name) in message.split("Fix:")[1] for name in STRATEGIES)


@pytest.mark.parametrize(
    ("strategy", "local_grads"), [(sc.DDP(), True), (sc.ZeRO1(), True), (sc.ZeRO2(), True), (sc.FSDP(), False)]
)
def test_local_gradient_hook(strategy, local_grads):
    assert strategy.local_grads is local_grads


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_params_are_the_whole_replicated_tree(strategy):
    w = np.arange(24, dtype=np.float32).reshape(8, 3)
    state = sc.TrainState.create(params={"w": w}, tx=optax.sgd(0.1), strategy=strategy)
    full = state.full_params()["w"]
    assert full.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(full), w)
    assert (full is state.params["w"]) is not BY_NAME[strategy].shards_params  # only split parameters move


@pytest.mark.parametrize(
    ("saved", "refused"),
    [
        ({"format": 1, "strategy": "ddp"}, False),
        ({"format": 1}, False),  # before strategies were recorded: DDP's tree
        ({"format": 2, "strategy": "fsdp"}, False),
        ({"format": 1, "strategy": "zero1"}, True),
        ({"format": 1, "strategy": "zero2"}, True),
        ({"format": 1, "strategy": "fsdp"}, True),
        ({"format": 1, "strategy": "zero3"}, True),  # no such strategy: nothing says it holds the model's tree
    ],
)
def test_a_02_checkpoint_is_refused_when_its_strategy_split_state(saved, refused):
    if not refused:
        check_format("ckpt", 3, saved)
        return
    with pytest.raises(sc.SpmdError) as err:
        check_format("ckpt", 3, saved)
    assert str(err.value).startswith("spmdcomm.restore_checkpoint: checkpoint 3 in 'ckpt' was saved by spmdcomm 0.2")
    assert f"strategy {saved['strategy']!r}" in str(err.value) and "Fix: restore it with spmdcomm 0.2" in str(err.value)
