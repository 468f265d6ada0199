"""Every fenced code block of README.md and docs/*.md is checked. A block's kind is its info string and its place:

- ``python`` (docs/*.md): a document's Python blocks run in order in one fresh interpreter on 8 fake CPU devices,
  each block's stdout captured on its own. A block whose first line is ``# NAME.py`` is also written to NAME.py in
  the directory where the document's blocks and commands run.
- ``bash`` (docs/*.md): every command line runs as written in that directory, bounded by a timeout (``python`` is
  this interpreter; ``spmdcomm-launch`` is ``python -m spmdcomm.launch`` where the console script is missing).
- ``text`` directly after a ``python`` or ``bash`` block (only blank lines between) is that block's output and must
  equal what it printed to stdout: exactly, after stripping trailing whitespace per line, with ``...`` matching any
  text as doctest's ELLIPSIS does (timings, addresses). A command's ``[rank i]`` lines are compared grouped by rank
  in rank order (the processes print concurrently), without Gloo's ``[Gloo] ...`` lines (its C++ code leaves them
  unflushed, so they land anywhere). A block that prints and shows no output fails, and so does an output whose
  block prints nothing.
- ``text`` anywhere else is shown, not checked: measured tables, logs of jobs, signatures.
- ``sh``: commands shown, not run (a cluster's, or ones that need files the docs do not hold).

Any other fence (no info string, ``yaml``, ...) fails: give it one of these kinds. README.md has no output blocks:
its Python blocks are doctests (pytest collects README.md with --doctest-glob), holding their output, and its ``bash``
blocks are either the install/test commands, which must be exactly what .ci/run runs, or example commands run here as
written and checked by what they must print (their whole output is not compared).
Every ``spmdcomm.X`` / ``sc.X`` name, and ``Name.attribute`` of a public ``sc.Name``, in code and in backticks
must resolve in the installed package.

Run as a script (``python test_docs.py DOC REQUEST RESULTS``), this file is the interpreter that runs a document's
Python blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import doctest
import functools
import importlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import spmdcomm

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [ROOT / "README.md", *DOCS]
KINDS = ("python", "bash", "text", "sh")
CI_COMMANDS = {
    "pip install -e '.[test]'",
    "ruff check .",
    "ruff format --check .",
    "mypy",
    "python -m pytest -n auto --dist loadfile",
}
DOC_TIMEOUT = 300.0  # seconds for all Python blocks of one document
COMMAND_TIMEOUT = 120.0  # seconds for one command of a bash block

_OPEN = re.compile(r"^```(.*)$")
_NAMED_FILE = re.compile(r"^# (\w+\.py)$")
_RANK = re.compile(r"^\[rank (\d+)\] ")
# A launched rank's line that is empty or Gloo's: whole (``[Gloo] Rank 1 is connected to 3 peer ranks. ...``), or
# its tail when the unflushed C++ output was cut after ``[Gloo] Rank `` (the cut part lands in another line).
_GLOO_OR_BLANK = re.compile(r"\[rank \d+\]( \[Gloo\].*| (Rank )?\d+ is connected to \d+ peer ranks.*)?")
_NAME = re.compile(r"\b(?:spmdcomm|sc)((?:\.[A-Za-z_]\w*)+)")
_ATTRIBUTE = re.compile(r"(?<![\w.])([A-Z]\w*)((?:\.[A-Za-z_]\w*)+)")
_TORCH_NAMES = {"DDP", "FSDP"}  # torch has classes of these names too, named in the PyTorch tables
_CHECKER = doctest.OutputChecker()
_MATCH_FLAGS = doctest.ELLIPSIS | doctest.DONT_ACCEPT_TRUE_FOR_1 | doctest.DONT_ACCEPT_BLANKLINE


@dataclasses.dataclass(frozen=True, eq=False)
class Block:
    """One fenced block: its info string (``kind``), text, the line of its opening fence, and the block just before
    it when only blank lines separate the two (``after``)."""

    path: Path
    kind: str
    body: str
    line: int
    after: Block | None

    def __str__(self) -> str:
        first = next((ln.strip() for ln in self.body.splitlines() if ln.strip()), "")
        return f"{self.path.name}, ```{self.kind} block at line {self.line} ({first[:70]!r})"

    @property
    def output_of(self) -> Block | None:
        """The block whose output this is (a ``text`` block right after a ``python`` or ``bash`` block)."""
        return self.after if self.kind == "text" and self.after and self.after.kind in ("python", "bash") else None


@functools.cache
def parse(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, in order (read once: a block is the same object in every test)."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    previous, i = None, 0
    while i < len(lines):
        opening = _OPEN.match(lines[i])
        if opening is None:
            previous = previous if not lines[i].strip() else None
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"{path.name}: the fence at line {i + 1} is never closed")
        body = "".join(f"{ln}\n" for ln in lines[i + 1 : end])
        previous = Block(path, opening[1].strip(), body, i + 1, previous)
        found.append(previous)
        i = end + 1
    return found


def blocks(path: Path, kind: str) -> list[str]:
    return [b.body for b in parse(path) if b.kind == kind]


def run(argv: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``argv``; fails the test with its whole output on a non-zero exit or after ``timeout`` seconds (kept
    below pytest's 600 s, so that a stuck command is reported with what it printed)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(_report(argv, f"did not end within {timeout:g} s", e.stdout, e.stderr), pytrace=False)
    if proc.returncode:
        pytest.fail(_report(argv, f"exited with status {proc.returncode}", proc.stdout, proc.stderr), pytrace=False)
    return proc


def readme_commands() -> list[str]:
    lines = [ln.split("  #")[0].strip() for b in blocks(ROOT / "README.md", "bash") for ln in b.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_every_block_is_of_a_known_kind(path):
    problems = _kind_problems(path, doctests=path.name == "README.md")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_every_spmdcomm_name_in_the_docs_exists(path):
    names = _mentioned_names(path)
    assert names, path  # the scan finds the names the document mentions
    missing = sorted(name for name in names if not _resolves(name))
    assert not missing, f"{path.relative_to(ROOT)} mentions names that spmdcomm does not have: {missing}"


def test_readme_python_blocks_are_doctests():
    assert blocks(ROOT / "README.md", "python")
    for body in blocks(ROOT / "README.md", "python"):
        assert all(ln.startswith((">>>", "...")) or not ln.startswith(" ") for ln in body.splitlines())
        assert body.lstrip().startswith(">>>"), body[:80]


def test_readme_stays_short():
    # The README keeps the pitch, install, tests, the two quickstarts, the PyTorch table and links; the rest is in
    # docs/. 10 KB is the bound the project set itself.
    size = len((ROOT / "README.md").read_bytes())
    assert size < 10 * 1024, f"README.md is {size} bytes: move detail to docs/ and link to it"


def test_readme_install_and_test_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for cmd in CI_COMMANDS:
        assert cmd in readme_commands(), cmd
        assert cmd in ci, cmd


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in readme_commands() if c not in CI_COMMANDS])
def test_readme_command_runs_as_written(command, tmp_path):
    """The example commands, on a machine without MNIST (they fall back to the bundled digits)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(
        SPMDCOMM_DATA=str(tmp_path / "no-mnist-here"),
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    proc = run(_argv(command), cwd=ROOT, env=env, timeout=450)
    (summary,) = [ln for ln in proc.stdout.splitlines() if '"final_test_accuracy"' in ln]
    summary = json.loads(summary[summary.index("{") :])  # under the launcher, after "[rank 0] "
    assert summary["dataset"] == "digits" and summary["final_test_accuracy"] >= 0.8, summary


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if blocks(d, "python")], ids=lambda p: p.name)
def test_docs_python_blocks_print_what_the_docs_show(doc, tmp_path):
    """Each document's Python blocks, in order, in one interpreter on 8 fake CPU devices; what each block prints
    against the output block that follows it."""
    failures = _python_failures(doc, tmp_path)
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "block",
    [b for d in DOCS for b in parse(d) if b.kind == "bash"],
    ids=lambda b: f"{b.path.name}:{b.line}",
)
def test_docs_commands_print_what_the_docs_show(block, tmp_path):
    """Each command of a docs bash block, as written, in a directory holding the document's ``# NAME.py`` files."""
    every = parse(block.path)
    _write_named_files(every, tmp_path)
    printed = ""
    for command in _commands(block.body):
        proc = run(_argv(command), cwd=tmp_path, env=_env(devices=None), timeout=COMMAND_TIMEOUT)
        printed += _normalise(proc.stdout, launched=True)
    failure = _compare(block, printed, _shown_output(block, every))
    assert failure is None, failure


@pytest.mark.parametrize(
    ("printed", "shown", "launched", "failure"),
    [
        ("50 True  \n\n", "50 True\n", False, None),  # trailing whitespace and blank lines do not count
        ("waited 6.8 ms, 0.68 ms last step\n", "waited ... ms, ... ms last step\n", False, None),
        ("51 True\n", "50 True\n", False, "-50 True\n+51 True\n"),
        ("True\n", "1\n", False, "printed other output than the docs show"),
        (" 1\n", "1\n", False, "printed other output than the docs show"),  # leading whitespace counts
        ("a\n", None, False, "prints, but no ```text block follows it to show that:\na\n"),
        ("", "a\n", False, "prints nothing, but the ```text block at line 7 shows output"),
        ("", None, False, None),
        (
            "[rank 1] b\n[rank 0] a\n[rank 1] [Gloo] Rank 1 is connected\n[rank 1] \n[rank 0] c\n"
            "[rank 0] 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n",
            "[rank 0] a\n[rank 0] c\n[rank 1] b\n",
            True,
            None,
        ),
        ("[rank 0] c\n[rank 0] a\n", "[rank 0] a\n[rank 0] c\n", True, "printed other output"),  # a rank's order counts
    ],
)
def test_what_a_block_prints_is_compared_with_the_output_shown(printed, shown, launched, failure, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Prose.\n\n```python\nprint()\n```\n" + ("" if shown is None else f"\n```text\n{shown}```\n"))
    code = parse(doc)[0]
    got = _compare(code, _normalise(printed, launched=launched), _shown_output(code, parse(doc)))
    if failure is None:
        assert got is None
    else:
        assert failure in got and "doc.md, ```python block at line 3 ('print()')" in got, got


def test_a_text_block_is_an_output_only_right_after_a_block_that_runs(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```python\nx = 1\n```\n\n```text\nout\n```\nProse.\n```text\ntable\n```\n\n```sh\nsrun x\n```\n"
        "```text\nlog\n```\n```bash\nls\n```\n```text\nout\n```\n```\nno kind\n```\n```python\n>>> 1\n```\n"
        "```text\n1\n```\n"
    )
    python, output, table, sh, log, bash, bash_output, bare, doctest_block, after_doctest = parse(doc)
    assert output.output_of is python and bash_output.output_of is bash and after_doctest.output_of is doctest_block
    assert table.output_of is None and log.output_of is None  # after prose; after a command that is not run
    assert _kind_problems(doc, doctests=False) == [f"{bare}: unknown kind ''; use one of {KINDS}"]
    assert _kind_problems(doc, doctests=True)[1:] == [
        f"{b}: README's outputs are not compared; show the output inside the doctest, or separate the block"
        for b in (output, bash_output, after_doctest)
    ]


def test_a_block_that_raises_is_reported_with_the_documents_line(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```python\nprint(1)\n```\n\n```text\n1\n```\n\n```python\nx = 2\nraise ValueError(f'boom {x}')\n```\n\n"
        "```python\nprint('never runs')\n```\n"
    )
    (failure,) = _python_failures(doc, tmp_path)
    assert failure.startswith("doc.md, ```python block at line 9 ('x = 2') raised:"), failure
    assert f'File "{doc}", line 11' in failure and "ValueError: boom 2" in failure, failure


@pytest.mark.parametrize(
    ("name", "exists"),
    [
        ("spmdcomm.make_train_step", True),
        ("spmdcomm.parallel.data.strategies.FSDP", True),  # a module that `import spmdcomm` need not have imported
        ("spmdcomm.TrainState.create", True),
        ("spmdcomm.launch", True),
        ("spmdcomm.ddp", False),
        ("spmdcomm.TrainStep.place", False),
        ("spmdcomm.parallel.data.strategies.NoSuchStrategy", False),
    ],
)
def test_names_resolve_in_the_package(name, exists):
    assert _resolves(name) is exists


def test_names_are_found_in_code_and_backticks(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Call `sc.fit(step, state,\n batches)` or `TrainState.create`, not spmdcomm.outside_backticks; torch's\n"
        "`FSDP.state_dict`, `misc.x`.\n\n```python\nstate = sc.TrainState.create_nnx(model)\nimport spmdcomm.ddp\n```\n"
    )
    assert _mentioned_names(doc) == {
        "spmdcomm.fit",
        "spmdcomm.TrainState.create",
        "spmdcomm.TrainState.create_nnx",
        "spmdcomm.ddp",
    }


@pytest.mark.slow
def test_benchmark_entry_point_runs_and_plots(tmp_path, compile_flags):
    """benchmarks/run_all.py at its smoke setting: every benchmark runs, writes JSON, and each plot is drawn."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = compile_flags  # each benchmark sets its own device count
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        timeout=480,
    )
    names = ("collectives", "prefetch", "train_step", "strategies", "pipeline", "context", "moe", "flops")
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    ops = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    assert {r["op"] for r in results["collectives"]["rows"]} == ops
    assert all(r["time_us"] > 0 for r in results["collectives"]["rows"])
    assert {"io", "cpu"} <= set(results["prefetch"]["loader_vs_step"]) and results["prefetch"]["hidden_transfer"]
    assert results["train_step"]["mlp/ours"] > 0 and results["train_step"]["mlp/hand-written shard_map"] > 0
    memory = results["strategies"]["memory"]
    assert [(r["strategy"], r["devices"]) for r in memory] == [("ddp", 2), ("fsdp", 2), ("jit+NamedSharding fsdp", 2)]
    assert memory[1]["goal_met"] and memory[1]["persistent_bytes vs ddp"] < 0.51
    assert results["strategies"]["speed"]["mlp"]["fsdp"]["samples_per_s"] > 0
    assert "| MLP | fsdp |" in results["strategies"]["markdown"]  # the tables docs/sharded.md shows
    layouts = {r["layout"]: r for r in results["strategies"]["layouts"]}
    assert layouts["fsdp hybrid replica=2 x shard=4"]["goal_met"] and layouts["ddp data=4 x model=2"]["goal_met"]
    assert set(layouts["fsdp hybrid replica=2 x shard=4"]["bytes_over_axis"]) == {"replica", "shard"}
    pipeline = results["pipeline"]
    # The stack's parameters + Adam state per device: whole under DDP, 1/p with 4 stages, 1/(p N) under FSDP.
    assert [r["fraction"] for r in pipeline["stack_memory"]] == [1.0, 0.25, 0.125]
    temps = {r["variant"]: r["temp_bytes"] for r in pipeline["activation_memory"]}
    assert set(temps) >= {"ours GPipe m=4", "ours GPipe m=4 no remat", "ddp data=8", "hand-written GPipe m=4 no remat"}
    assert "jit + NamedSharding stage=4" in temps
    assert all(t > 0 for t in temps.values())
    ours = pipeline["speed"]["ours GPipe m=4 no remat"]
    assert ours["samples_per_s"] > 0 and ours["ratio_vs_handwritten"] > 0 and ours["bubble_formula"] == 1.75
    assert ours["ratio_vs_jit"] > 0  # next to the jax.jit + NamedSharding program
    assert "| data 2 x stage 4 | fsdp |" in pipeline["markdown"]
    context = results["context"]
    assert {r["variant"] for r in context["rows"]} == {
        "no split",
        "data 2 x context 4, ring",
        "data 2 x context 4, all-to-all",
    }
    for r in context["rows"]:
        assert r["tokens_per_s"] > 0 and r["ratio_vs_no_split"] > 0 and r["temp_bytes"] > 0
        if r["algorithm"]:
            assert r["ratio_ring_vs_all_to_all"] > 0 and r["attention_bytes_per_step"] > 0
    assert len(context["errors"]) == 6 and all(e["as_documented"] for e in context["errors"])
    moe = results["moe"]
    rows = {row["variant"]: row for row in moe["rows"]}
    assert set(rows) == {
        "ours dropless",
        "ours dropless buffer",
        "ours capacity 1.25",
        "gshard einsum, per-device groups, capacity 1.25",
        "gshard einsum, one global capacity 1.25",
        "all-gather experts",
    }
    # Every variant equals the one-device layer (the per-device GShard groups: the layer on each device's tokens);
    # the split variants hold 1/8 of the expert parameters per device.
    assert all(row["max_abs_diff_to_one_device"] < 1e-5 and row["tokens_per_s"] > 0 for row in rows.values())
    assert all(row["flops_total"] > 0 for row in rows.values())
    assert rows["ours dropless"]["collective_bytes"]["all-to-all"] > 0
    assert rows["ours dropless"]["executed_expert_flops_vs_routed"] > 0
    assert moe["expert_param_bytes"]["per_device"] * 8 == moe["expert_param_bytes"]["all"]
    # The MoE LM against the dense LMs with its active (MLP k x wider) and its total (E x wider) parameters.
    lm = {row["kind"]: row for row in moe["lm"]}
    assert set(lm) == {"moe", "dense active", "dense total"}
    assert lm["dense active"]["mlp_hidden"] == 2 * lm["moe"]["mlp_hidden"]
    assert abs(lm["dense total"]["params"] / lm["moe"]["params"] - 1) < 0.02  # the router's aside
    for r in lm.values():
        assert r["tokens_per_s"] > 0 and r["flops_total"] > 0 and r["time_vs_dense_active"] > 0
    gshard = {row["variant"]: row for row in moe["lm_gshard"]}
    assert set(gshard) == {"ours", "jit+NamedSharding gshard"} and all(r["tokens_per_s"] > 0 for r in gshard.values())
    # The same function (capacity 1.25 in both): the same loss.
    ours, theirs = gshard["ours"]["loss"], gshard["jit+NamedSharding gshard"]["loss"]
    assert abs(ours - theirs) < 1e-5 * abs(ours)
    flops = {row["layout"]: row for row in results["flops"]["rows"]}
    assert set(flops) == {"one device", "tensor"} and flops["one device"]["vs_model_flops"] == 1.0
    assert flops["tensor"]["vs_one_device"] == 1.0 and flops["tensor"]["bound"] == "exact"
    for name in results:
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def _kind_problems(path: Path, *, doctests: bool) -> list[str]:
    """A line per block of ``path`` of no known kind and, with ``doctests`` (README.md, whose Python blocks are
    doctests and whose commands' output is not compared), per output block."""
    problems = [f"{b}: unknown kind {b.kind!r}; use one of {KINDS}" for b in parse(path) if b.kind not in KINDS]
    if doctests:
        problems += [
            f"{b}: README's outputs are not compared; show the output inside the doctest, or separate the block"
            for b in parse(path)
            if b.output_of is not None
        ]
    return problems


def _python_failures(doc: Path, directory: Path) -> list[str]:
    """Runs the Python blocks of ``doc`` in one fresh interpreter in ``directory``, on 8 fake CPU devices; a line
    per block that raised or printed other than its output block shows, or if the interpreter ended early."""
    every = parse(doc)
    code = [b for b in every if b.kind == "python"]
    request, results = directory / "blocks.json", directory / "results.jsonl"
    request.write_text(json.dumps([{"line": b.line, "body": b.body} for b in code]))
    _write_named_files(every, directory)
    argv = [sys.executable, __file__, str(doc), str(request), str(results)]
    out, err = _run_unchecked(argv, cwd=directory, env=_env(devices=8), timeout=DOC_TIMEOUT)
    outcomes = [json.loads(ln) for ln in results.read_text().splitlines()] if results.exists() else []
    failures = []
    for block, outcome in zip(code, outcomes):
        if outcome["error"] is not None:
            failures.append(f"{block} raised:\n{outcome['error']}")
        else:
            failures.append(_compare(block, _normalise(outcome["stdout"]), _shown_output(block, every)))
    if len(outcomes) < len(code) and not (outcomes and outcomes[-1]["error"]):
        failures.append(_report(argv, f"ended before {code[len(outcomes)]} finished", out, err))
    return [f for f in failures if f]


def _shown_output(block: Block, every: list[Block]) -> Block | None:
    return next((b for b in every if b.output_of is block), None)


def _compare(block: Block, printed: str, shown: Block | None) -> str | None:
    """None when ``printed`` (normalised) is what ``shown`` shows; otherwise what is wrong, with the diff."""
    if shown is None:
        return f"{block} prints, but no ```text block follows it to show that:\n{printed}" if printed else None
    want = _normalise(shown.body)
    if not printed:
        return f"{block} prints nothing, but the ```text block at line {shown.line} shows output"
    if _CHECKER.check_output(want, printed, _MATCH_FLAGS):
        return None
    diff = difflib.unified_diff(
        want.splitlines(keepends=True), printed.splitlines(keepends=True), f"shown at line {shown.line}", "printed"
    )
    return f"{block} printed other output than the docs show (... matches any text):\n{''.join(diff)}"


def _normalise(text: str, *, launched: bool = False) -> str:
    """``text`` with trailing whitespace stripped from every line and trailing blank lines dropped; ``launched``:
    a launcher's output, its ``[rank i]`` lines grouped by rank (stable), and Gloo's lines and blank rank lines
    (where Gloo's unflushed C++ output split a line) dropped."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    if launched:
        lines = [ln for ln in lines if not _GLOO_OR_BLANK.fullmatch(ln)]
        lines.sort(key=lambda ln: int(m[1]) if (m := _RANK.match(ln)) else -1)
    while lines and not lines[-1]:
        lines.pop()
    return "".join(f"{ln}\n" for ln in lines)


def _write_named_files(every: list[Block], directory: Path) -> None:
    """Writes each Python block whose first line is ``# NAME.py`` to ``directory / NAME.py``."""
    for block in every:
        name = _NAMED_FILE.match(block.body.split("\n", 1)[0])
        if block.kind == "python" and name:
            (directory / name[1]).write_text(block.body)


def _commands(body: str) -> list[str]:
    return [ln for ln in body.splitlines() if shlex.split(ln, comments=True)]


def _argv(command: str) -> list[str]:
    """``command`` as an argument list: ``python`` is this interpreter, and ``spmdcomm-launch`` without its console
    script the same launcher through ``python -m``."""
    argv = shlex.split(command, comments=True)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "spmdcomm-launch" and shutil.which("spmdcomm-launch") is None:
        argv[:1] = [sys.executable, "-m", "spmdcomm.launch"]
    return argv


def _env(*, devices: int | None) -> dict[str, str]:
    """This environment on CPU with the repository importable; ``devices`` fake CPU devices, or (None) as many as
    a command asks for (the launcher's ``--devices-per-process``; one otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def _run_unchecked(argv: list[str], *, timeout: float, **kwargs) -> tuple[str, str]:
    """Runs ``argv``, whatever its exit status, and returns its stdout and stderr; fails the test with its output
    after ``timeout`` seconds."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(_report(argv, f"did not end within {timeout:g} s", e.stdout, e.stderr), pytrace=False)
    return proc.stdout, proc.stderr


def _mentioned_names(path: Path) -> set[str]:
    """The ``spmdcomm.X`` / ``sc.X`` names (as ``spmdcomm.X``) and ``Name.attribute`` of public spmdcomm names
    (``TrainState.create``) in the code blocks and code spans of a Markdown file."""
    every = parse(path)
    prose = "\n".join(ln for ln in _outside_blocks(path.read_text(), every))
    code = [b.body for b in every] + re.findall(r"`([^`]+)`", prose)
    names = {f"spmdcomm{m}" for chunk in code for m in _NAME.findall(chunk)}
    names |= {
        f"spmdcomm.{head}{tail}"
        for chunk in code
        for head, tail in _ATTRIBUTE.findall(chunk)
        if head in spmdcomm.__all__ and head not in _TORCH_NAMES
    }
    return names


def _outside_blocks(text: str, every: list[Block]) -> list[str]:
    lines = text.splitlines()
    inside = {i for b in every for i in range(b.line - 1, b.line + b.body.count("\n") + 1)}
    return [ln for i, ln in enumerate(lines) if i not in inside]


def _resolves(name: str) -> bool:
    """Whether the dotted ``name`` is a module or an attribute chain from one."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            return False
    return True


def _run_blocks(doc: str, request: str, results: str) -> int:
    """The child interpreter: runs the blocks of ``request`` (JSON: ``[{"line", "body"}]``) in one namespace,
    writing one JSON line per block to ``results`` (its ``stdout``, and the traceback as ``error`` or null); stops
    after the first block that raises."""
    namespace = {"__name__": "__main__"}
    with open(results, "w") as out:
        for block in json.loads(Path(request).read_text()):
            print(f"running the block at line {block['line']} of {doc}", file=sys.stderr, flush=True)
            code = compile("\n" * block["line"] + block["body"], doc, "exec")  # tracebacks: the document's lines
            printed, error = io.StringIO(), None
            try:
                with contextlib.redirect_stdout(printed):
                    exec(code, namespace)
            except BaseException:  # SystemExit too: a block must not end the interpreter
                error = traceback.format_exc()
            out.write(json.dumps({"stdout": printed.getvalue(), "error": error}) + "\n")
            out.flush()
            if error is not None:
                return 1
    return 0


def _report(argv: list[str], why: str, out: str | bytes | None, err: str | bytes | None) -> str:
    text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (out, err)]
    return f"{shlex.join(argv)}\n{why}\n--- stdout ---\n{text[0]}\n--- stderr ---\n{text[1]}"


if __name__ == "__main__":
    sys.exit(_run_blocks(*sys.argv[1:]))
