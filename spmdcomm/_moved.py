"""Old module paths that keep working for one release: a module that moved leaves behind a shim that re-exports the
new module's names and warns once, when it is imported."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(old: str, new: str) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` for the shim module ``old``: the names of module ``new``, looked up there on use."""
    warnings.warn(
        f"{old} moved to {new}; import from {new} (or the public name from spmdcomm). The old path goes in the next "
        "release.",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)

    def __getattr__(name: str) -> Any:
        return getattr(module, name)

    # what ``from old import *`` gave: the module's __all__, or else its names without a leading underscore
    names = getattr(module, "__all__", None) or [name for name in vars(module) if not name.startswith("_")]
    return list(names), __getattr__
