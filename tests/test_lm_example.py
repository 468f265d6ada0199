"""The byte-level language model example (examples/lm): its corpus split, packed rows and unigram baseline, its mesh
flags, a tiny run on ``data`` 4 x ``model`` 2 under FSDP that learns, is stopped with ``max_steps`` and resumes from
its checkpoint, a packed run whose token-weighted loss is the same on every layout and one device's, and a mixture of
experts on an expert axis and as a pipeline under each schedule.

The example's modules import each other by plain name (``import train``), as the MNIST example's do, and the MNIST
example's are on ``sys.path`` under the same names (tests/conftest.py): ``_load_example`` imports this example's
with its folder first on the path and puts whatever held those names back afterwards."""

from __future__ import annotations

import functools
import importlib
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import spmdcomm as sc
from spmdcomm.explain import model_flops

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lm"
MODULES = ("input_pipeline", "models", "train")


def _load_example() -> SimpleNamespace:
    """The example's modules, imported without disturbing the modules of the same names already imported."""
    saved = {name: sys.modules.pop(name) for name in MODULES if name in sys.modules}
    sys.path.insert(0, str(EXAMPLE))
    try:
        return SimpleNamespace(**{name: importlib.import_module(name) for name in MODULES})
    finally:
        sys.path.remove(str(EXAMPLE))
        for name in MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


lm = _load_example()
pipeline = lm.input_pipeline
# What the training runs below read: one corpus prefix, whose reading the corpus tests check. Its arrays are
# read-only (np.frombuffer), so the runs can share one read.
_read_once = functools.cache(pipeline.load_corpus)


@pytest.fixture
def corpus_read_once(monkeypatch):
    monkeypatch.setattr(pipeline, "load_corpus", _read_once)


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def test_corpus_is_split_by_file_in_sorted_order_and_capped(tmp_path):
    files = {f"pkg/m{i:02d}.py": bytes([65 + i]) * 10 for i in range(12)}
    files |= {"site-packages/other.py": b"x" * 10, "notes.txt": b"y" * 10, "a.py": b"first\n"}
    _write(tmp_path, files)
    names = pipeline.source_files(tmp_path)
    assert names == ["a.py", *sorted(n for n in files if n.startswith("pkg/"))]  # installed and non-.py files left out
    corpus = pipeline.load_corpus(10_000, val_every=3, root=tmp_path)
    val = names[2::3]
    assert corpus.val_files == tuple(val) and corpus.train_files == tuple(n for n in names if n not in val)
    assert bytes(corpus.train[:6]) == b"first\n" and bytes(corpus.val[:10]) == b"B" * 10  # file 2 is pkg/m01.py
    assert corpus.train.size + corpus.val.size == 6 + 12 * 10
    # The cap: files are read until it is reached, the file that crosses it whole.
    capped = pipeline.load_corpus(20, val_every=3, root=tmp_path)
    assert capped.train_files == tuple(names[:2]) and capped.val_files == (names[2],)
    with pytest.raises(ValueError, match="both splits need bytes"):
        pipeline.load_corpus(1, val_every=3, root=tmp_path)


def test_the_standard_library_corpus_is_deterministic_and_every_tenth_file_validates():
    a, b = pipeline.load_corpus(300_000), pipeline.load_corpus(300_000)
    assert a.train_files == b.train_files and np.array_equal(a.val, b.val) and np.array_equal(a.train, b.train)
    read = sorted(a.train_files + a.val_files)
    assert read == pipeline.source_files(pipeline.stdlib_root())[: len(read)]
    assert a.val_files == tuple(read[9::10]) and not set(a.train_files) & set(a.val_files)
    assert a.train.size + a.val.size >= 300_000 and a.train.dtype == np.uint8


def test_windows_train_at_random_offsets_and_validate_at_fixed_ones():
    stream = np.arange(100, dtype=np.uint8)
    windows = pipeline.train_windows(stream, 9, seed=0)
    rows = windows[np.arange(len(windows))]
    assert len(windows) == 10 and rows.shape == (10, 10)
    assert np.all(np.diff(rows.astype(int), axis=1) == 1)  # consecutive bytes of the stream
    assert np.array_equal(rows, pipeline.train_windows(stream, 9, seed=0)[np.arange(10)])
    assert not np.array_equal(rows, pipeline.train_windows(stream, 9, seed=1)[np.arange(10)])
    val = pipeline.eval_windows(stream, 9, 4)
    assert val[:, 0].tolist() == [0, 30, 60, 90] and val[-1, -1] == 99  # spread from the start to the end
    assert pipeline.eval_windows(stream, 9, 1000).shape == (10, 10)  # no more than fit without overlapping


def test_unigram_baseline_is_the_cross_entropy_of_smoothed_training_frequencies():
    train, val = np.frombuffer(b"aab", np.uint8), np.frombuffer(b"abz", np.uint8)
    total = 3 + 256  # every byte value gets one extra count
    want = -(math.log2(3 / total) + math.log2(2 / total) + math.log2(1 / total)) / 3
    assert pipeline.unigram_bits_per_byte(train, val) == pytest.approx(want, rel=1e-12)
    uniform = np.arange(256, dtype=np.uint8)
    assert pipeline.unigram_bits_per_byte(uniform, val) == pytest.approx(8.0, rel=1e-12)
    assert pipeline.bits(math.log(2) * 3) == pytest.approx(3.0)


def test_packed_rows_hold_whole_documents_padded_at_the_end():
    stream = np.arange(300, dtype=np.int64) % 251  # no byte value repeats within a window
    windows = pipeline.train_windows(stream.astype(np.uint8), 32, seed=0)
    packed = pipeline.Packed(windows, seed=3, shortest=4, longest=16)
    rows = packed[np.arange(len(windows))]
    assert packed[[5, 2]]["segments"].tolist() == rows["segments"][[5, 2]].tolist()  # drawn per row, not per batch
    for r in range(len(windows)):
        seg, pos, real = rows["segments"][r], rows["positions"][r], rows["segments"][r] > 0
        n = real.sum()
        assert real[:n].all() and not real[n:].any() and n > 32 - 16  # padding only at the end, less than a doc
        assert np.all(np.diff(seg[:n]) >= 0) and seg[0] == 1 and np.all(np.diff(seg[:n]) <= 1)
        lengths = np.bincount(seg[:n])[1:]
        assert lengths.min() >= 4 and lengths.max() <= 16, lengths
        assert np.array_equal(pos[:n], np.concatenate([np.arange(k) for k in lengths]))  # restart per document
        window = windows[[r]][0].astype(int)
        assert np.array_equal(rows["inputs"][r][:n], window[:n]) and np.array_equal(
            rows["targets"][r][:n], window[1 : n + 1]
        )  # every target is the next real byte of the stream
        assert not rows["inputs"][r][n:].any() and not rows["targets"][r][n:].any()
    fields = pipeline.packed_bytes(windows, seed=3)
    assert sorted(fields) == sorted(pipeline.Packed.FIELDS) and len(fields["inputs"]) == len(windows)
    real = pipeline.real_targets(fields)
    assert real.size == (fields["segments"][np.arange(len(windows))] > 0).sum()
    with pytest.raises(ValueError, match="must fit windows of 32"):
        pipeline.Packed(windows, seed=0, shortest=8, longest=33)


def test_mesh_flags_name_the_axes_and_the_data_axes_are_the_others():
    assert lm.train.parse_mesh("data=2,stage=2,model=2") == {"data": 2, "stage": 2, "model": 2}
    assert list(lm.train.parse_mesh("replica=2, shard=-1")) == ["replica", "shard"]
    assert lm.train.data_axes(("data", "stage", "model")) == "data"
    assert lm.train.data_axes(("data", "context")) == "data"
    assert lm.train.data_axes(("data", "expert", "model")) == "data"
    assert lm.train.data_axes(("replica", "shard", "model")) == ("replica", "shard")
    for bad in ("data", "data=2,data=2", "data=two", "=4"):
        with pytest.raises(ValueError, match="--mesh"):
            lm.train.parse_mesh(bad)
    with pytest.raises(ValueError, match="no data axis"):
        lm.train.data_axes(("model",))


def test_repeats_and_schedules_need_a_stage_axis():
    mesh = sc.make_mesh({"data": 4, "model": 2})
    with pytest.raises(ValueError, match="--repeats 2: repeats are a pipeline's"):
        lm.train.build_state(lm.train.Config(mesh="data=4,model=2", repeats=2), mesh)
    with pytest.raises(ValueError, match="--schedule zb-h1: schedules are a pipeline's"):
        lm.train.build_state(lm.train.Config(mesh="data=4,model=2", schedule="zb-h1"), mesh)


def test_tensor_parallelism_repeats_no_matmul_of_the_one_device_step():
    """On ``data=4,model=2`` the step's matmul FLOPs summed over the 8 devices are the dense model's
    (``model_flops``: ``6 x kernel parameters x tokens`` plus attention), which is what the one-device step counts:
    the blocks split by heads and MLP units, the tied embedding and head by vocabulary rows. With the table whole
    on every model device (``("vocab", None)``) both model devices computed the whole head, forward and backward:
    1.034 times the one-device work at the example's default size (issue 47)."""
    config = lm.train.Config(width=32, layers=2, heads=4, seq_len=16, batch_size=8, mesh="data=4,model=2")
    tokens = config.batch_size * config.seq_len
    batch = {"inputs": np.zeros((8, 16), np.int32), "targets": np.zeros((8, 16), np.int32)}
    model = lm.train.make_model(config)
    # Zeros of the initial parameters' shapes, boxed with their logical names: explain runs nothing, and the model's
    # own initialisation would cost a compile.
    shapes = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    mesh = sc.make_mesh({"data": 4, "model": 2})
    state = sc.TrainState.create(
        params=params,
        tx=optax.sgd(0.1),  # the example's AdamW multiplies no matrices either, and costs compiles to set up
        apply_fn=model.apply,
        mesh=mesh,
        logical_axis_rules=lm.models.logical_axis_rules(mesh.axis_names),
    )
    assert state.params["embed"]["embedding"].sharding.spec == jax.P("model", None)
    report = sc.explain(sc.make_train_step(lm.models.make_loss_fn()), state, batch)
    leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params))
    kernels = sum(x.size for path, x in leaves if path[-1].key in ("kernel", "embedding"))  # the tied head's too
    dense = model_flops(kernels, tokens, layers=config.layers, context=config.seq_len, width=config.width)
    assert report.work.bound == "exact" and report.flops_total == dense
    head = 6 * tokens * 256 * config.width  # the tied head: logits, their gradient by the input and by the table
    assert report.work.by_scope["Transformer/embed.attend"] * 8 == head


# About 5 s of training on 2 cores: 4.4, 3.9 and 3.8 bits/byte after 10, 20 and 30 steps, the baseline 4.3. One
# block: a second one would repeat every sharding and collective of the first (the pipeline layout below needs two).
TINY = dict(width=64, layers=1, heads=4, seq_len=64, batch_size=32, steps=30, lr=1e-2, warmup_steps=5)
TINY |= dict(corpus_bytes=400_000, eval_windows=64, eval_every=10, mesh="data=4,model=2", strategy="fsdp")


@pytest.mark.slow
@pytest.mark.usefixtures("corpus_read_once")
def test_tiny_run_on_data_and_model_axes_learns_stops_and_resumes(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    stopped = lm.train.train_and_evaluate(lm.train.Config(**TINY, checkpoint_dir=ckpt, save_every=10, max_steps=20))
    assert stopped["step"] == 20 and stopped["mesh"] == {"data": 4, "model": 2}
    assert [r["step"] for r in stopped["evaluations"]] == [10, 20]
    resumed = lm.train.train_and_evaluate(lm.train.Config(**TINY, checkpoint_dir=ckpt, save_every=10))
    assert f"resuming from {ckpt} at step 20" in capsys.readouterr().out
    assert resumed["resumed_from"] == 20 and resumed["step"] == 30
    assert [r["step"] for r in resumed["evaluations"]] == [30]
    curve = [r["val_bits_per_byte"] for r in stopped["evaluations"] + resumed["evaluations"]]
    assert all(map(math.isfinite, curve)) and curve[0] > curve[1] > curve[2], curve
    assert resumed["val_bits_per_byte"] < resumed["unigram_bits_per_byte"], curve


# Packed rows on each layout the issue names, one compile each: about 10 to 20 s a layout on 2 cores. Two blocks, one
# per pipeline stage. Accumulation runs on the context layout: its micro-batch loop is the same code on any mesh
# (spmdcomm/train/_micro.py), and there each micro-batch's rows are split over the context devices as well.
PACKED = dict(TINY, layers=2, steps=4, warmup_steps=2, eval_every=4, eval_windows=32, strategy="ddp", packed=True)
LAYOUTS = {
    "data=8": dict(mesh="data=8"),
    "pipeline": dict(mesh="data=2,stage=2,model=2", microbatches=2),
    "context with accumulation": dict(mesh="data=2,context=4", microbatches=2),
}


@pytest.mark.slow
@pytest.mark.usefixtures("corpus_read_once")
def test_packed_rows_train_the_mean_over_real_bytes_alike_on_every_layout():
    """Rows of documents of different lengths, padded at the end: every step's loss is one device's mean over the
    real target bytes of the global batch, on 8 data devices, on a pipeline of 2 stages with tensor parallelism, and
    with every row split over 4 context devices (whose padding lands on some) in 2 accumulation micro-batches."""
    runs = {name: lm.train.train_and_evaluate(lm.train.Config(**(PACKED | layout))) for name, layout in LAYOUTS.items()}
    reference = runs.pop("data=8")
    for name, run in runs.items():
        np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5, err_msg=name)
        assert run["val_bits_per_byte"] == pytest.approx(reference["val_bits_per_byte"], rel=1e-5), name
        assert run["tokens"] == reference["tokens"], name

    # The reference, on one device: the first steps' batches as the loader draws them, the initial parameters.
    config = lm.train.Config(**PACKED)
    train, _ = lm.train.datasets(config, pipeline.load_corpus(config.corpus_bytes))
    sampler = sc.ShardedSampler(len(train["inputs"]), shard_index=0, num_shards=1, seed=config.seed)
    batches = [{k: v[b.data] for k, v in train.items()} for b in sampler.batches(config.batch_size)][: config.steps]
    assert reference["tokens"] == sum(int((b["segments"] > 0).sum()) for b in batches)
    batch, model = batches[0], lm.train.make_model(config)
    params = nn.meta.unbox(lm.train.init_params(config))
    apply = jax.jit(model.apply)
    logits = apply({"params": params}, batch["inputs"], batch["segments"], batch["positions"])
    # The cross-entropy in one compiled program, the means in NumPy (eagerly, each jnp operation compiles its own).
    ce = np.asarray(jax.jit(optax.softmax_cross_entropy_with_integer_labels)(logits, batch["targets"]), np.float64)
    real = batch["segments"] > 0
    want = float(np.where(real, ce, 0).sum() / real.sum())
    assert reference["losses"][0] == pytest.approx(want, rel=1e-6)
    # The mean of the rows' means is another number (rows hold different numbers of real bytes), though near at
    # the initial parameters (every byte costs about log 256): 2e-4 off, 200 times the tolerance above.
    per_row = float(np.mean(np.where(real, ce, 0).sum(1) / real.sum(1)))
    assert abs(per_row / want - 1) > 1e-4, (per_row, want)
    # Attention stays inside a document: other bytes in every row's first document change only its logits.
    first = batch["segments"] == 1
    changed = np.where(first, (batch["inputs"] + 1) % 256, batch["inputs"])
    again = np.asarray(apply({"params": params}, changed, batch["segments"], batch["positions"]))
    np.testing.assert_allclose(again[~first], np.asarray(logits)[~first], rtol=1e-6, atol=1e-6)
    assert not np.allclose(again[first], np.asarray(logits)[first])


# A mixture of 8 experts, top-2, in the one block: about 8 s a layout on 2 cores.
EXPERTS = dict(TINY, steps=6, warmup_steps=2, eval_every=6, eval_windows=32, strategy="ddp", experts=8, top_k=2)
MOE_MESHES = ("data=8", "data=2,expert=4")
# Top-k routing is discontinuous: a token whose router scores tie to within float rounding may take another expert
# on another layout. After six steps (parameters 4e-7 apart) one of the 2048 validation tokens does, its loss 0.08
# nats apart, the mean 1.1e-5: the validation loss is compared to 1e-4, every step's training loss to 1e-5.
MOE_VAL_RTOL = 1e-4


@pytest.mark.slow
@pytest.mark.usefixtures("corpus_read_once")
def test_a_mixture_of_experts_trains_the_same_curve_on_an_expert_axis_as_on_data_8():
    """--experts 8 --top-k 2: on data=2,expert=4 (the experts split over expert, the batch over both) every step's
    loss and the validation bits per byte are data=8's, where every device holds every expert."""
    runs = {mesh: lm.train.train_and_evaluate(lm.train.Config(**(EXPERTS | {"mesh": mesh}))) for mesh in MOE_MESHES}
    reference = runs.pop("data=8")
    for mesh, run in runs.items():
        np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5, err_msg=mesh)
        assert run["val_bits_per_byte"] == pytest.approx(reference["val_bits_per_byte"], rel=MOE_VAL_RTOL), mesh
    assert reference["experts"] == 8 and reference["active_parameters"] < reference["parameters"]
    assert reference["losses"][-1] < reference["losses"][0]


# The MoE blocks as a pipeline: two blocks, one per stage, 2 micro-batches; about 20 to 30 s a layout on 2 cores.
# Micro-batch i holds the rows of stage i of each (data, expert) replica: rows 0-7 and 16-23, then 8-15 and 24-31.
# Two data replicas accumulating 2 micro-batches cut the batch the same way.
MOE_STAGES = dict(EXPERTS, layers=2, steps=4, eval_every=4, microbatches=2)
MOE_PIPELINES = {
    "data=2,model=4, accumulating": dict(mesh="data=2,model=4"),
    **{s: dict(mesh="data=2,stage=2,expert=2", schedule=s) for s in ("gpipe", "1f1b", "zb-h1")},
}


@pytest.mark.slow
@pytest.mark.usefixtures("corpus_read_once")
def test_moe_blocks_in_a_pipeline_train_as_accumulating_the_same_micro_batches_under_every_schedule():
    """--experts 8 with the blocks a pipeline on data=2,stage=2,expert=2 (the experts split over expert, the batch
    over data, stage and expert), under GPipe, 1F1B and ZB-H1: each layer routes one micro-batch at a time, so its
    load-balancing loss is per micro-batch (the loss sums the layers' means over the micro-batches). Every step's loss
    and the validation bits per byte are those of 2 data replicas accumulating the same 2 micro-batches. (data=8's
    curve is another by the balance of each half batch in place of the whole one's: 5e-6 apart at the first step,
    up to 5e-5 over six.)"""
    runs = {
        name: lm.train.train_and_evaluate(lm.train.Config(**(MOE_STAGES | layout)))
        for name, layout in MOE_PIPELINES.items()
    }
    reference = runs.pop("data=2,model=4, accumulating")
    for name, run in runs.items():
        np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5, err_msg=name)
        assert run["val_bits_per_byte"] == pytest.approx(reference["val_bits_per_byte"], rel=MOE_VAL_RTOL), name
    assert reference["losses"][-1] < reference["losses"][0]
