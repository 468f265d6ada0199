"""The public API (docs/api.md): ``sc.__all__`` is exactly the documented list, in its order and groups, every name
in it exists, and the names that left the top level are importable from their layer only."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spmdcomm as sc

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
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


def test_every_public_name_exists():
    assert [name for name in sc.__all__ if not hasattr(sc, name)] == []


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
    """The ``# comment`` headings inside ``__all__`` of spmdcomm/__init__.py, in order."""
    source = (ROOT / "spmdcomm" / "__init__.py").read_text()
    block = source[source.index("__all__ = [") :]
    return re.findall(r"^    # (.+)$", block[: block.index("\n]")], flags=re.M)
