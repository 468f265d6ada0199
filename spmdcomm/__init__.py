"""spmdcomm: torch.distributed-style collectives, syncs, a DDP train step and device prefetch for JAX.

``__all__`` holds what ordinary use needs (docs/api.md says why each name is there). Types that the library builds
for you and tables of its constants stay in their layer, for annotations and tools: e.g.
``spmdcomm.train.TrainStep`` (what ``make_train_step`` returns), ``spmdcomm.data.Prefetcher``,
``spmdcomm.collectives.SpmdFunction``, ``spmdcomm.collectives.REDUCE_OPS``.
"""

# The public names are listed once, in __init__.pyi beside this file: one ``from MODULE import NAME as NAME`` line
# each. Type checkers read that stub; this module reads it at import to build ``__all__``, ``__dir__`` and the lazy
# ``__getattr__`` (PEP 562). The layers load on the first use of a public name, not at ``import spmdcomm``: the
# launcher (``python -m spmdcomm.launch``, which imports this package first) then starts no JAX.

import ast
import importlib
import sys
import types
from pathlib import Path
from typing import Any

from spmdcomm._version import __version__ as __version__  # written in _version.py only

_STUB = Path(__file__).with_name("__init__.pyi")


def _read_stub(source: str) -> tuple[dict[str, tuple[str, str]], tuple[str, ...]]:
    """``({public name: (module, attribute)}, subpackages)`` from the stub's ``from M import A as NAME`` lines.

    ``from spmdcomm import LAYER as LAYER`` names a subpackage; names starting with ``_`` are this module's own
    (``__version__``). Anything else in the stub is refused, so that the type checker and ``__all__`` cannot
    disagree about a name.
    """
    public: dict[str, tuple[str, str]] = {}
    subpackages: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
            continue
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and len(node.names) == 1):
            raise ImportError(f"{_STUB.name}:{node.lineno}: expected one 'from MODULE import NAME as NAME' per line")
        (alias,) = node.names
        if alias.asname is None or alias.asname in public or alias.asname in subpackages:
            problem = "has no 'as NAME' (a type checker would not export it)" if alias.asname is None else "repeats"
            raise ImportError(f"{_STUB.name}:{node.lineno}: the import of {alias.name!r} {problem}")
        if node.module == __name__:
            subpackages.append(alias.asname)
        elif not alias.asname.startswith("_"):
            public[alias.asname] = (node.module, alias.name)
    return public, tuple(subpackages)


_PUBLIC, _SUBPACKAGES = _read_stub(_STUB.read_text(encoding="utf-8"))
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    """Imports the modules of every public name on the first use of one (PEP 562); they are plain attributes then."""
    if name in _PUBLIC:
        found = {n: _load(module, attr) for n, (module, attr) in _PUBLIC.items()}
        globals().update(found)
        return found[name]
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load(module: str, attr: str) -> Any:
    """``module.attr``; an ImportError, not an AttributeError that ``hasattr`` would hide, when it is missing."""
    try:
        return getattr(importlib.import_module(module), attr)
    except AttributeError:
        raise ImportError(f"{_STUB.name} names {module}.{attr}, which does not exist: fix the stub's line") from None


def __dir__() -> list[str]:
    """The public names, the subpackages and the module's dunder attributes (not the helpers of this file)."""
    return sorted(set(__all__) | set(_SUBPACKAGES) | {n for n in globals() if n.startswith("__")})


class _Package(types.ModuleType):
    """This package's module type: a public name keeps its value when a subpackage of that name is imported.

    Importing ``spmdcomm.explain`` binds the subpackage to the package's attribute ``explain``, which is the public
    function ``sc.explain``; the binding is dropped here, so ``sc.explain`` stays the function whatever was imported
    first (``from spmdcomm.explain import Explanation`` finds the subpackage in ``sys.modules``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PUBLIC and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
