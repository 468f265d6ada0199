"""No page or docstring repeats a claim that a change (recorded in CHANGELOG.md) made false.

Each entry of ``RETIRED`` is a sentence as it once stood, a pattern that finds it (and its rewordings), and the
words of the CHANGELOG entry that retired it. README.md, docs/*.md, benchmarks/README.md and every module of
spmdcomm (docstrings and comments) are read with their line breaks joined, so a sentence is found across lines.
CHANGELOG.md itself is history and is not read. When a change makes a documented sentence false, add it here
with the change's CHANGELOG words: the test then finds every place that still says it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "spmdcomm").rglob("*.py")),
]

# name: (the sentence as it stood, a pattern for it, the words of the CHANGELOG entry that made it false)
RETIRED = {
    "pipeline: table schedules refuse a context or expert axis": (
        "a context or expert axis (any axis besides the data and stage axes that splits the batch: its collectives "
        "would run inside the loop's per-stage branches)",
        r"collectives would run inside the loop's per-stage branches|they refuse a context or expert axis",
        "**Every axis under the table schedules.**",
    ),
    "pipeline: sown values reach the loss under GPipe only": (
        "a stack whose block sows values (which only GPipe hands back, `[L, m, ...]`)",
        r"which only GPipe hands back|GPipe only: the table schedules raise",
        "What the stack's blocks sow (a MoE layer's",
    ),
    "pipeline: table schedules refuse model state outside the stack": (
        'Refused with an error naming `schedule="gpipe"`: a model state updated outside the stack',
        r"naming `schedule=\"gpipe\"`: a model state updated outside|with model state updated outside the stack \||"
        r"model state only inside the stack|refusal left: the table schedules with model state",
        "**Model state outside the stack under the table schedules**",
    ),
    "sharded: no pipeline": (
        "There is no pipeline parallelism: nothing schedules micro-batches over stages of a model.",
        r"there is no pipeline parallelism",
        "- **Pipeline parallelism** (`docs/pipeline.md`)",
    ),
    "sharded: undivided leaves stay whole": (
        "Leaves that no dimension divides stay whole on every device (a 10-entry bias on 8 devices): no padding,",
        r"leaves that no dimension divides stay whole",
        "stored padded on the dimension padding grows least",
    ),
    "pipeline: table schedules need a per-row mean loss": (
        "The last two: model state only inside the stack, a per-row mean loss.",
        r"a per-row mean loss\.",
        "The table schedules run BatchNorm and token-weighted losses",
    ),
    "pipeline: ZB-H1 recomputes cotangents": (
        "ZB-H1's weight gradient recomputes the cotangents inside each layer, which this does not count",
        r"ZB-H1's weight gradient recomputes",
        "ZB-H1 recomputes nothing",
    ),
    "pipeline: 1F1B's limit v (p - s)": (
        "a F while fewer than ``v (p - s)`` micro-batch chunks are in flight on stage ``s``",
        r"`+v \(p - s\)`+",
        "1F1B's stage `s` keeps `v p - s` chunks, ZB-H1's every stage `v p`",
    ),
    "eval: every metric weighted by examples": (
        "Each metric is weighted by the block's real-example count, so padded rows never count.",
        r"each metric is weighted by the block's real-example count",
        "`sc.evaluate` weighs each token-weighted metric by its own weight",
    ),
    "train: the loss is a mean": (
        "``loss`` is a float scalar: the MEAN over the block's real examples",
        r"loss`+ is a float scalar: the mean",
        "`loss_fn` (and any `aux` metric, and `metric_fn`) may return `sc.weighted(total, weight)`",
    ),
    "attention: the ring refuses forward mode": (
        "`ring_attention`: a custom VJP that runs the ring again ...; `jax.jvp` and `jax.linear_transpose` raise",
        r"ring_attention`?: a custom VJP|custom VJP, so not `?jax\.jvp",
        "`sc.ring_attention` now takes `jax.jvp`, `jax.linearize` and second derivatives",
    ),
    "attention: the all-to-all's KV heads must divide": (
        "The heads (and KV heads under grouped-query attention) must divide the context size.",
        r"\(and KV heads under grouped-query attention\) must divide|heads or KV heads that (the context size|`?c`?) "
        r"does not divide|heads and KV heads must divide|needs `n` to divide `h` and `h_kv`",
        "repeating each KV head `n / gcd(kv_heads, n)` times before the swap",
    ),
    "attention: the kernels' layout is contiguous by default": (
        'The layout is `"contiguous"` by default, what `P(None, axis)` gives a sequence stored in order',
        r'layout is `?"contiguous"`? by default|``"contiguous"`` \(default',
        "default to `layout=None`: inside a train or eval step whose `sc.ContextParallel` splits",
    ),
    "ddp: float16 skips at any device count": (
        "those of a single-device DynamicScale program on the whole batch, masked or not, at any device count",
        r"masked or not, at any device count",
        "a float16 weight gradient summed over one device's rows can overflow",
    ),
    "experts: explain does not say each layer's compute path": (
        "`sc.explain`'s expert section does not say which compute path each layer takes",
        r"does not say which compute path",
        "**`sc.explain`'s expert section says each MoE layer's compute path and its experts' FLOPs.**",
    ),
}


def _text(path: Path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split())


def test_the_sources_are_found():
    names = {p.name for p in SOURCES}
    assert {"README.md", "sharded.md", "pipeline.md", "train_step.py", "eval_step.py"} <= names


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_the_pattern_finds_the_retired_sentence(name):
    sentence, pattern, _ = RETIRED[name]
    assert re.search(pattern, sentence, flags=re.I)


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_the_changelog_records_the_change(name):
    assert RETIRED[name][2] in _text(CHANGELOG)


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_no_page_or_docstring_repeats_the_retired_claim(name):
    pattern = re.compile(RETIRED[name][1], flags=re.I)
    found = [str(p.relative_to(ROOT)) for p in SOURCES if pattern.search(_text(p))]
    assert found == [], f"{found} still say what {RETIRED[name][2]!r} (CHANGELOG.md) made false"
