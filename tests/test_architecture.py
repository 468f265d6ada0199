"""docs/architecture.md's claims that a scan of the source can check: every access to JAX internals is in
``spmdcomm/_jax_compat.py`` (the exceptions the page names are the only ones), the imports that run at import time
form no cycle, the layer table lists every module, error types live in ``spmdcomm.errors`` (but the ones the page
names), and the module paths the user documentation names are public. The layer order and the line limit are
``tests/test_layers.py``'s."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest
from test_layers import LAYERS, _modules

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
COMPAT = "spmdcomm/_jax_compat.py"

# Modules that walk Python's frames without reading their variables, and why; docs/architecture.md names each. The
# variables of a frame (f_locals, f_globals) and a traceback's frames are read in _jax_compat only.
FRAME_READERS = {
    "spmdcomm/runtime/transport.py": "call_site: the caller's file:line, for messages",
    "spmdcomm/reliability/threads.py": "the stuck thread's stack, printed in the watchdog's table, and the host "
    "callbacks running in the process (frames of JAX's callback functions, by name)",
}
# Names of JAX primitives that JAX's public API (jax.extend.core.primitives) does not export.
INTERNAL_PRIMITIVES = frozenset({"pvary", "pcast", "custom_vjp_call_jaxpr", "copy_p"})
# Modules outside _jax_compat that name such primitives, and why; docs/architecture.md names each.
PRIMITIVE_NAMERS = {"spmdcomm/parallel/data/fsdp.py": "_MOVED, the primitives its jax.checkpoint policy does not keep"}
# Exception types defined outside spmdcomm.errors; docs/architecture.md names each.
ERRORS_ELSEWHERE = {"StuckStepError": "spmdcomm.reliability.watchdog", "Preempted": "spmdcomm.train.loop"}


def _sources() -> dict[str, str]:
    """``{path relative to the repository: source}`` of every module of the package."""
    return {path.relative_to(ROOT).as_posix(): path.read_text() for path in _modules().values()}


# ---------------------------------------------------------------------------------------------------------
# Private JAX access


def jax_internals(source: str) -> list[str]:
    """``line: what`` for each access to JAX internals in ``source``: an import of (or an attribute path to)
    ``jax._src`` or ``jax.interpreters``, a string naming one of them or JAX's ``lax/parallel.py``, or a read of a
    frame's variables (``f_locals``, ``f_globals``, a traceback's ``tb_frame``)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    private = re.compile(r"\bjax\.(_src|interpreters)\b|lax[/\\]+parallel\.py")
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            if node.attr in ("f_locals", "f_globals", "tb_frame"):
                found.append(f"{node.lineno}: .{node.attr}")
            names = [ast.unparse(node)] if node.attr in ("_src", "interpreters") else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names = [node.value] if private.search(node.value) else []
        found += [f"{node.lineno}: {name}" for name in names if private.search(name) or name.endswith("._src")]
    return found


def frame_reads(source: str) -> set[str]:
    """The ways ``source`` gets at Python frames: ``sys._getframe``, ``sys._current_frames``,
    ``inspect.currentframe``, ``f_back``."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in ("_getframe", "_current_frames", "currentframe", "f_back")
    }


def primitive_names(source: str) -> set[str]:
    """The names of JAX-internal primitives (:data:`INTERNAL_PRIMITIVES`) that ``source`` spells as strings."""
    return {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in INTERNAL_PRIMITIVES
    }


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import jax._src.core\n", ["1: jax._src.core"]),
        ("from jax._src import config\n", ["1: jax._src.config"]),
        ("from jax import _src\n", ["1: jax._src"]),
        ("import jax\nx = jax._src.core.Tracer\n", ["2: jax._src"]),
        ("import jax.interpreters.pxla as p\n", ["1: jax.interpreters.pxla"]),
        ("importlib.import_module('jax._src.distributed')\n", ["1: jax._src.distributed"]),
        ("ok = path.endswith('lax/parallel.py')\n", ["1: lax/parallel.py"]),
        ("v = tb.tb_frame.f_locals['axis_name']\n", ["1: .f_locals", "1: .tb_frame"]),
        ('"""Reads jax._src only in _jax_compat."""\nimport jax\nfrom jax import lax, P\n', []),
    ],
)
def test_the_scan_finds_each_kind_of_jax_internal_access(source, expected):
    assert sorted(jax_internals(source)) == expected


def test_jax_internals_are_accessed_in_jax_compat_only():
    found = {path: jax_internals(source) for path, source in _sources().items() if path != COMPAT}
    assert {path: hits for path, hits in found.items() if hits} == {}
    assert jax_internals(_sources()[COMPAT]) != []  # where they are: the scan sees them


def test_frames_are_read_only_where_docs_architecture_says():
    readers = {path for path, source in _sources().items() if path != COMPAT and frame_reads(source)}
    assert readers == set(FRAME_READERS), "add or remove the module here, with why, and in docs/architecture.md"
    text = ARCHITECTURE.read_text()
    assert [path for path in FRAME_READERS if path.removeprefix("spmdcomm/") not in text] == []


def test_internal_primitive_names_are_spelt_only_where_docs_architecture_says():
    import jax.extend.core as jex_core
    import jax.extend.core.primitives as public

    exported = {v.name for v in vars(public).values() if isinstance(v, jex_core.Primitive)}
    assert INTERNAL_PRIMITIVES & exported == set()  # JAX exported one: drop it from INTERNAL_PRIMITIVES
    namers = {path for path, source in _sources().items() if path != COMPAT and primitive_names(source)}
    assert namers == set(PRIMITIVE_NAMERS), "move the names to _jax_compat, or name the module in architecture.md"
    text = ARCHITECTURE.read_text()
    assert [path for path in PRIMITIVE_NAMERS if path.removeprefix("spmdcomm/") not in text] == []


# ---------------------------------------------------------------------------------------------------------
# Imports


def module_level_imports(module: str, source: str, *, is_package: bool, known: set[str]) -> set[str]:
    """The spmdcomm modules ``source`` imports when it is imported: its top-level imports, including those under
    ``if``/``try``, but not those under ``if TYPE_CHECKING:`` or inside functions and classes. ``from pkg import
    name`` counts as ``pkg.name`` when that is a module in ``known``."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)

    visit(ast.parse(source).body)
    return {name for name in found if name.startswith("spmdcomm.") and name != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One list of modules per import cycle of ``graph`` (each cycle once, from its smallest module)."""
    found: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]:
                found.add(tuple(path))
            elif nxt not in path and nxt > path[0]:
                walk([*path, nxt])

    for start in sorted(graph):
        walk([start])
    return [list(c) for c in sorted(found)]


def test_the_cycle_finder_finds_a_cycle_and_ignores_a_type_only_import():
    a = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from spmdcomm.x.b import B\nimport numpy\n"
    b = "from spmdcomm.x import a\n"
    known = {"spmdcomm.x.a", "spmdcomm.x.b"}
    graph = {
        "spmdcomm.x.a": module_level_imports("spmdcomm.x.a", a, is_package=False, known=known),
        "spmdcomm.x.b": module_level_imports("spmdcomm.x.b", b, is_package=False, known=known),
    }
    assert graph == {"spmdcomm.x.a": set(), "spmdcomm.x.b": {"spmdcomm.x.a"}} and cycles(graph) == []
    graph["spmdcomm.x.a"] = module_level_imports("spmdcomm.x.a", "import spmdcomm.x.b\n", is_package=False, known=known)
    assert cycles(graph) == [["spmdcomm.x.a", "spmdcomm.x.b"]]


def test_the_imports_that_run_at_import_time_form_no_cycle():
    modules = _modules()
    known = set(modules)
    graph = {
        name: module_level_imports(name, path.read_text(), is_package=path.name == "__init__.py", known=known)
        for name, path in modules.items()
    }
    # A package's __init__ imports its submodules, and a submodule's import first runs its package's __init__;
    # that edge is Python's own, not a cycle of the code's.
    graph = {name: {m for m in imported if not name.startswith(m + ".")} for name, imported in graph.items()}
    assert cycles(graph) == [], "move what both need into a third module, or import it for annotations only"


def test_no_module_imports_spmdcomm_inside_a_function_but_the_nnx_loaders():
    """An import inside a function hides an arrow the cycle test above cannot see (a loop importing its config
    lazily, the config importing the loop): only ``spmdcomm.nnx`` loads modules on first use, because they import
    ``flax.nnx``."""
    lazy = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("spmdcomm"):
                        lazy.add((name, sub.module))
                    elif isinstance(sub, ast.Import):
                        lazy.update((name, a.name) for a in sub.names if a.name.startswith("spmdcomm"))
    assert lazy == {
        ("spmdcomm.nnx", "spmdcomm.nnx.batchnorm"),
        ("spmdcomm.nnx", "spmdcomm.parallel.pipeline.nnx_stack"),
        ("spmdcomm.nnx", "spmdcomm.parallel.expert.nnx"),
    }


# ---------------------------------------------------------------------------------------------------------
# The layer table, the error types, the module paths users see


def _documented_layers() -> dict[str, tuple[str, set[str]]]:
    """``{layer name: (subpackage, modules)}`` from the table of docs/architecture.md ("The layers, bottom to
    top"): the modules column's backticked names, leaving out parenthetical notes."""
    layers = {}
    for row in re.findall(r"^\| (\d+) (\w+) \| `([^`]+)`.*\| ([^|]*) \|$", ARCHITECTURE.read_text(), flags=re.M):
        _, name, package, modules = row
        while re.search(r"\([^()]*\)", modules):
            modules = re.sub(r"\([^()]*\)", "", modules)
        layers[name] = (package, set(re.findall(r"`([\w.]+)`", modules)))
    return layers


def test_the_layer_table_lists_every_module_of_each_layer():
    documented = _documented_layers()
    assert list(documented) == [name for name, _ in LAYERS if name != "package"]
    modules = _modules()
    on_disk = {
        "base": {m.partition(".")[2] for m, p in modules.items() if m.count(".") == 1 and p.name != "__init__.py"}
    }
    # a layer's modules by their names in its first package; those of another package of the layer, if a layer has
    # one, by their names under spmdcomm, the package itself included
    for name, entries in LAYERS[1:-1]:
        first, *others = entries
        on_disk[name] = {m.removeprefix(first + ".") for m in modules if m.startswith(first + ".")} | {
            m.removeprefix("spmdcomm.")
            for m in modules
            for other in others
            if not other.startswith(first + ".") and (m == other or m.startswith(other + "."))
        }
    assert {name: modules for name, (_, modules) in documented.items()} == on_disk


def test_error_types_live_in_errors_but_the_ones_the_page_names():
    elsewhere = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and name != "spmdcomm.errors":
                cls = getattr(importlib.import_module(name), node.name, None)
                if isinstance(cls, type) and issubclass(cls, BaseException | Warning):
                    elsewhere[node.name] = name
    assert elsewhere == ERRORS_ELSEWHERE
    text = ARCHITECTURE.read_text()
    assert [n for n in ERRORS_ELSEWHERE if f"`{n}`" not in text] == []


USER_DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", *sorted(ROOT.glob("examples/*/README.md"))]


def _documented_paths() -> dict[str, list[str]]:
    """``{dotted path: [files]}`` for each ``spmdcomm.LAYER.NAME...`` the user documentation names in backticks
    (docs/architecture.md, written for developers, aside)."""
    found: dict[str, list[str]] = {}
    for doc in USER_DOCS:
        if doc != ARCHITECTURE:
            for path in re.findall(r"`(spmdcomm(?:\.\w+){2,})`", doc.read_text()):
                found.setdefault(path, []).append(doc.relative_to(ROOT).as_posix())
    return found


def test_the_module_paths_users_read_are_public():
    paths = _documented_paths()
    assert "spmdcomm.data.aligned_empty" in paths  # the scan sees the docs' paths
    private = {}
    for path in paths:
        if any(part.startswith("_") for part in path.split(".")):
            private[path] = "a private module or name"
            continue
        module, _, name = path.rpartition(".")
        try:
            importlib.import_module(path)
        except ImportError:
            parent = importlib.import_module(module)
            if name not in getattr(parent, "__all__", ()):
                private[path] = f"not in {module}.__all__"
    assert private == {}


# Module paths that moved, by old path: each keeps working, with a DeprecationWarning, for one release.
MOVED = {
    "spmdcomm.train.strategy": "spmdcomm.parallel.data.strategy",
    "spmdcomm.train.layout": "spmdcomm.parallel.data.layout",
    "spmdcomm.train.rng": "spmdcomm.parallel.rng",
}


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_a_moved_module_path_warns_and_gives_the_new_modules_names(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        shim = importlib.import_module(old)
    module = importlib.import_module(new)
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    assert shim.__all__ == list(names) and all(getattr(shim, n) is getattr(module, n) for n in names)
