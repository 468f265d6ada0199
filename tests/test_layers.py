"""The package's layers (docs/architecture.md): every module under spmdcomm/ imports only from its own layer or the
layers below it (imports inside functions included), and no module is over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spmdcomm"

# Bottom to top: (layer name, the modules and packages it holds). A module belongs to the longest entry that is
# its name or a package above it. docs/architecture.md shows the same table.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "spmdcomm.errors",
            "spmdcomm._version",
            "spmdcomm._jax_compat",
            "spmdcomm._ops",
            "spmdcomm._cache",
            "spmdcomm._env",
            "spmdcomm._compile_watch",
            "spmdcomm._moved",
            "spmdcomm._format",
        ),
    ),
    # transport is the bottom of runtime: every module that agrees across processes imports it
    ("runtime", ("spmdcomm.runtime", "spmdcomm.runtime.transport")),
    ("launch", ("spmdcomm.launch",)),
    ("data", ("spmdcomm.data",)),
    ("collectives", ("spmdcomm.collectives",)),
    ("reliability", ("spmdcomm.reliability",)),
    # the parallelisms, each in a folder or module of its own, and the mesh roles they all read
    ("parallel", ("spmdcomm.parallel",)),
    # checkpoints below train: fit saves them; they read a state through its attributes, not its class
    ("checkpoint", ("spmdcomm.checkpoint",)),
    ("train", ("spmdcomm.train",)),
    ("nnx", ("spmdcomm.nnx",)),
    ("explain", ("spmdcomm.explain",)),
    ("package", ("spmdcomm",)),  # spmdcomm/__init__.py: the public names of every layer
]

MAX_LINES = 400
# Modules over MAX_LINES today, with their line counts; each is to be split, and its entry removed then. A listed
# module may shrink but not grow, and one at or under the limit must leave the list.
TOO_LONG: dict[str, int] = {}


def test_every_module_is_in_a_layer():
    stray = [name for name in _modules() if name != "spmdcomm" and _layer(name)[1] == "package"]
    assert stray == [], f"modules in no layer: {stray}; add each to LAYERS here and to docs/architecture.md"


def test_modules_import_only_from_their_layer_or_below():
    known = set(_modules())
    problems = [
        problem
        for name, path in _modules().items()
        for problem in _violations(name, path.read_text(), is_package=path.name == "__init__.py", known=known)
    ]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("spmdcomm.train.loop", "import numpy\nfrom spmdcomm.runtime.sync import barrier\n", []),
        ("spmdcomm.train.loop", "from . import state\nfrom ..runtime import sync\n", []),
        ("spmdcomm", "from spmdcomm.explain import explain\n", []),
        (
            "spmdcomm.runtime.sync",
            "def f():\n    from spmdcomm.train.state import TrainState\n",
            ["spmdcomm.runtime.sync (layer 1, runtime) imports spmdcomm.train.state (layer 8, train)"],
        ),
        (
            "spmdcomm.data.batches",
            "from spmdcomm import train, errors\n",
            ["spmdcomm.data.batches (layer 3, data) imports spmdcomm.train (layer 8, train)"],
        ),
        (
            "spmdcomm.runtime.mesh",
            "from ..explain import report\n",
            ["spmdcomm.runtime.mesh (layer 1, runtime) imports spmdcomm.explain.report (layer 10, explain)"],
        ),
        (
            "spmdcomm.checkpoint.checkpoint",
            "def f():\n    from spmdcomm.train.state import TrainState\n",
            ["spmdcomm.checkpoint.checkpoint (layer 7, checkpoint) imports spmdcomm.train.state (layer 8, train)"],
        ),
        (
            "spmdcomm.errors",
            "import spmdcomm\n",
            ["spmdcomm.errors (layer 0, base) imports spmdcomm (layer 11, package)"],
        ),
    ],
)
def test_an_upward_import_is_named_with_both_layers(module, source, expected):
    known = {"spmdcomm.train.state", "spmdcomm.explain.report", "spmdcomm.runtime.sync", "spmdcomm.errors"}
    problems = _violations(module, source, is_package=False, known=known | set(_modules()))
    assert [p.split(":")[0] for p in problems] == expected
    assert all("docs/architecture.md" in p for p in problems)


def test_modules_stay_under_the_line_limit():
    lines = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in _modules().values()}
    over = {path: n for path, n in lines.items() if n > MAX_LINES and path not in TOO_LONG}
    assert over == {}, f"modules over {MAX_LINES} lines: {over}; split them (docs/architecture.md)"
    grown = {path: (TOO_LONG[path], lines.get(path)) for path in TOO_LONG if lines.get(path, 0) > TOO_LONG[path]}
    assert grown == {}, f"listed modules grew (listed, now): {grown}; split them instead"
    done = [path for path in TOO_LONG if lines.get(path, 0) <= MAX_LINES]
    assert done == [], f"at most {MAX_LINES} lines or gone: remove {done} from TOO_LONG"


# ---------------------------------------------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """Every module under spmdcomm/ by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _layer(module: str) -> tuple[int, str]:
    """(index, name) of the layer holding ``module``: the longest entry of LAYERS that is it or a package above it."""
    matches = [
        (len(entry), index, name)
        for index, (name, entries) in enumerate(LAYERS)
        for entry in entries
        if module == entry or module.startswith(entry + ".")
    ]
    _, index, name = max(matches)
    return index, name


def _violations(module: str, source: str, *, is_package: bool, known: set[str]) -> list[str]:
    """One line per import in ``source`` (of ``module``) of a module from a higher layer."""
    here = _layer(module)
    problems = []
    for imported in sorted(_imported(module, source, is_package=is_package, known=known)):
        there = _layer(imported)
        if there[0] > here[0]:
            problems.append(
                f"{module} (layer {here[0]}, {here[1]}) imports {imported} (layer {there[0]}, {there[1]}): a module "
                "imports only from its own layer or below; move what both need down (docs/architecture.md)"
            )
    return problems


def _imported(module: str, source: str, *, is_package: bool, known: set[str]) -> set[str]:
    """The spmdcomm modules that ``source`` imports, anywhere in it; ``from pkg import name`` counts as
    ``pkg.name`` when that is a module in ``known``."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {name for name in found if name == "spmdcomm" or name.startswith("spmdcomm.")}
