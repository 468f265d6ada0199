"""The public API (docs/api.md): ``sc.__all__`` is exactly the documented list, in its order and groups, every name
in it exists, and the names that left the top level are importable from their layer only. The names are listed
once, in spmdcomm/__init__.pyi, which type checkers read and ``spmdcomm/__init__.py`` parses for ``__all__``."""

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spmdcomm as sc

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
STUB = ROOT / "spmdcomm" / "__init__.pyi"
# The names that left the top level, and the layer that keeps each (docs/api.md, last section).
REMOVED = {
    "TrainStep": "spmdcomm.train",
    "EvalStep": "spmdcomm.train",
    "Strategy": "spmdcomm.train",
    "STRATEGIES": "spmdcomm.train",
    "DEFAULT_MAX_IN_FLIGHT": "spmdcomm.train",
    "Prefetcher": "spmdcomm.data",
    "PrefetchStats": "spmdcomm.data",
    "aligned_empty": "spmdcomm.data",
    "SpmdFunction": "spmdcomm.collectives",
    "REDUCE_OPS": "spmdcomm.collectives",
    "Explanation": "spmdcomm.explain",
    "Collective": "spmdcomm.explain",
    "DeviceMemory": "spmdcomm.explain",
    "COLLECTIVE_KINDS": "spmdcomm.explain",
    "PHASES": "spmdcomm.reliability",
    "PHASE_DESCRIPTIONS": "spmdcomm.reliability",
    "Divergence": "spmdcomm.runtime",
    "debug_enabled": "spmdcomm.runtime",
}


def test_all_is_the_documented_list_in_its_order():
    documented = [name for _, names in _documented_groups() for name in names]
    assert len(documented) == len(set(documented)), "docs/api.md lists a name twice"
    assert documented == list(sc.__all__)


def test_the_documented_groups_are_the_groups_of_init():
    assert [title for title, _ in _documented_groups()] == _init_groups()


def test_the_count_at_the_top_is_the_number_of_names():
    assert re.search(r"gives \*\*(\d+) names\*\*", API.read_text()).group(1) == str(len(sc.__all__))


def test_the_counts_per_group_are_the_sizes_of_the_groups():
    sentence = re.search(r"The groups hold (.+?) names\.", API.read_text(), flags=re.S).group(1)
    counts = [int(n) for n in re.findall(r"(\d+)\s+\(", sentence)]
    assert counts == [len(names) for _, names in _documented_groups()]
    assert sum(counts) == len(sc.__all__)


def test_every_public_name_exists():
    assert [name for name in sc.__all__ if not hasattr(sc, name)] == []


def test_the_stub_lists_each_name_once_as_an_explicit_reexport():
    imports = _stub_imports()
    # A stub exports ``from M import NAME as NAME`` only (PEP 484; mypy needs the same name on both sides).
    assert [(module, name) for module, name, alias in imports if alias != name] == []
    names = [name for _, name, _ in imports]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    public = [name for module, name, _ in imports if module != "spmdcomm" and not name.startswith("_")]
    assert public == list(sc.__all__)


def test_each_public_name_is_the_object_its_stub_line_imports():
    lines = {name: module for module, name, _ in _stub_imports()}
    assert [n for n in sc.__all__ if getattr(sc, n) is not getattr(importlib.import_module(lines[n]), n)] == []


def test_every_public_function_and_class_is_defined_in_the_public_module_its_stub_line_names():
    lines = {name: module for module, name, _ in _stub_imports()}
    private = [(n, lines[n]) for n in sc.__all__ if any(part.startswith("_") for part in lines[n].split("."))]
    assert private == []
    defined = {n: getattr(sc, n) for n in sc.__all__ if inspect.isclass(getattr(sc, n)) or callable(getattr(sc, n))}
    elsewhere = {
        n: obj.__module__
        for n, obj in defined.items()
        if obj.__module__.startswith("spmdcomm") and obj.__module__ != lines[n]
    }
    assert elsewhere == {}
    warnings = (sc.CheckpointDamagedWarning, sc.ReplicatedReductionWarning, sc.MissingLogicalRuleWarning)
    assert [w.__module__ for w in warnings] == ["spmdcomm.errors"] * 3  # with the other warnings and errors


def test_the_subpackages_are_attributes_and_the_stub_names_each_one():
    on_disk = {p.name for p in (ROOT / "spmdcomm").iterdir() if (p / "__init__.py").exists()}
    # spmdcomm.explain is a subpackage, but sc.explain is the function: the public name wins.
    assert set(sc._SUBPACKAGES) == on_disk - set(sc.__all__) and "explain" in on_disk
    assert [n for n in sc._SUBPACKAGES if getattr(sc, n) is not importlib.import_module(f"spmdcomm.{n}")] == []


@pytest.mark.parametrize(
    "source, fact",
    [
        ("from spmdcomm.errors import AxisError\n", "the import of 'AxisError' has no 'as NAME'"),
        ("from m import a as a\nfrom n import a as a\n", ":2: the import of 'a' repeats"),
        ("import spmdcomm.errors as errors\n", ":1: expected one 'from MODULE import NAME as NAME' per line"),
        ("from m import a as a, b as b\n", ":1: expected one"),
        ("from . import nnx as nnx\n", ":1: expected one"),
        ("X = 1\n", ":1: expected one"),
    ],
)
def test_the_stub_refuses_a_line_a_type_checker_would_read_differently(source, fact):
    with pytest.raises(ImportError) as info:
        sc._read_stub(source)
    assert "__init__.pyi" in str(info.value) and fact in str(info.value)


def test_the_stub_reader_tells_names_subpackages_and_private_names_apart():
    source = '"""Doc."""\nfrom spmdcomm._version import __version__ as __version__\n'
    source += "# a group\nfrom m.n import a as a\nfrom jax import P as P\nfrom spmdcomm import nnx as nnx\n"
    assert sc._read_stub(source) == ({"a": ("m.n", "a"), "P": ("jax", "P")}, ("nnx",))


def test_a_name_missing_from_its_module_is_an_import_error_not_a_missing_attribute():
    # hasattr() would turn an AttributeError from the lazy loader into "spmdcomm has no psum".
    with pytest.raises(ImportError, match=r"__init__.pyi names spmdcomm.errors.NoSuchError, which does not exist"):
        sc._load("spmdcomm.errors", "NoSuchError")


def test_the_explain_function_keeps_its_name_when_the_subpackage_is_imported_first():
    # ``import spmdcomm.explain.report as r`` reads the attribute ``spmdcomm.explain``, the function: import from the
    # subpackage with ``from`` (docs/architecture.md).
    code = (
        "import spmdcomm.explain; import spmdcomm as sc; from spmdcomm.explain import Explanation; "
        "from spmdcomm.explain import report as r; print(sc.explain is r.explain, Explanation is r.Explanation)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_removed_name_is_not_an_attribute_but_stays_in_its_layer(name):
    assert not hasattr(sc, name)
    layer = importlib.import_module(REMOVED[name])
    assert name in layer.__all__ and getattr(layer, name) is not None
    assert f"`{name}`" in API.read_text()  # the page says where it went


IMPORTED = "import sys; print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))"


@pytest.mark.parametrize(
    "code, loaded",
    [
        # The launcher (python -m spmdcomm.launch imports the package first) starts, watches and restarts processes:
        # it starts no JAX, which would cost every job about a second of CPU.
        ("import spmdcomm.launch.cli, spmdcomm.launch.supervisor", "[]"),
        ("import spmdcomm", "[]"),
        # The first public name loads the layers, and every name is then a plain attribute.
        (
            "import spmdcomm as sc; sc.psum; assert sc.__dict__['Loader'] is sc.Loader",
            "['flax', 'jax', 'optax']",
        ),
        ("from spmdcomm import P; import spmdcomm.nnx", "['flax', 'jax', 'optax']"),
    ],
)
def test_the_layers_load_on_the_first_public_name(code, loaded):
    out = subprocess.run([sys.executable, "-c", f"{code}; {IMPORTED}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == loaded


def test_an_unknown_name_is_an_attribute_error_and_dir_lists_the_public_names():
    with pytest.raises(AttributeError, match="no attribute 'psun'"):
        sc.psun  # noqa: B018
    assert set(sc.__all__) <= set(dir(sc)) and "nnx" in dir(sc)


def _documented_groups() -> list[tuple[str, list[str]]]:
    """``(heading, names)`` for each ``## heading`` of docs/api.md that lists ``- `sc.name`: why`` lines."""
    groups = []
    for section in re.split(r"^## ", API.read_text(), flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        names = re.findall(r"^- `sc\.(\w+)`: \S", body, flags=re.M)
        if names:
            groups.append((title.strip(), names))
    return groups


def _init_groups() -> list[str]:
    """The ``# comment`` headings of the stub's groups of public names, in order: a comment line right above an
    import (the subpackages' group, ``from spmdcomm import LAYER``, is not in ``__all__``)."""
    lines = STUB.read_text().splitlines()
    return [
        line.removeprefix("# ")
        for line, after in zip(lines, lines[1:])
        if line.startswith("# ") and after.startswith("from ") and not after.startswith("from spmdcomm import ")
    ]


def _stub_imports() -> list[tuple[str, str, str | None]]:
    """``(module, name, as-name)`` of each ``from ... import`` of the stub, read independently of the package."""
    return [
        (node.module, alias.name, alias.asname)
        for node in ast.parse(STUB.read_text()).body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
