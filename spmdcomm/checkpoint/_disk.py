"""The integrity of one checkpoint on disk, read without restoring it: orbax's metadata files, the index of the
array data (OCDBT: the manifest and its B-tree nodes), the data files the index refers to (present and long enough)
and every chunk of every array leaf. Each problem names the file, relative to the step's directory."""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def damage(path: Path) -> list[str]:
    """What is missing or unreadable in the checkpoint at ``path`` (one step's directory); ``[]`` when it is
    intact. Each entry names the file (relative to ``path``) and its problem."""
    problems: list[str] = []
    step_metadata = _read_json(path, _STEP_METADATA, problems)
    if step_metadata is not None and not isinstance(step_metadata.get("custom_metadata") or {}, dict):
        problems.append(f"{_STEP_METADATA} ({_FILES[_STEP_METADATA]}) holds no extra dict")
    item = _read_json(path, _ITEM_METADATA, problems)
    for optional in [_SHARDING, *sorted(f"{_ARRAY_METADATAS}/{p.name}" for p in (path / _ARRAY_METADATAS).glob("*"))]:
        if (path / optional).exists():
            _read_json(path, optional, problems)
    if item is None:
        return problems
    try:
        if not isinstance(item.get("custom_metadata") or {}, dict):
            raise TypeError("custom_metadata is not a dict")
        leaves = list(_array_leaves(item["tree_metadata"]))
    except (KeyError, TypeError, AttributeError) as e:
        problems.append(f"{_ITEM_METADATA} ({_FILES[_ITEM_METADATA]}) does not describe the arrays ({e!r})")
        return problems
    if item.get("use_ocdbt", True):  # every spmdcomm checkpoint; other layouts are checked by restore only
        problems += _array_damage(path / "default", item, leaves)
    return problems


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (at most 300 characters), or its type's name."""
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else type(e).__name__


def innermost(e: BaseException) -> str:
    """The first line of the error at the bottom of ``e``'s chain (orbax wraps tensorstore's, which names the key
    and the problem), with its type."""
    for _ in range(_CHAIN_DEPTH):
        inner = e.__cause__ or e.__context__
        if inner is None:
            break
        e = inner
    return f"{type(e).__name__}: {first_line(e)}"


# How far down an exception chain the cause of a failed read is looked for (the chains are a few links long).
_CHAIN_DEPTH = 10


def _read_json(path: Path, name: str, problems: list[str]) -> dict[str, Any] | None:
    """The JSON object in file ``path/name``, or None after adding its problem to ``problems``."""
    what = _FILES.get(name) or _FILES.get(os.path.dirname(name), "")
    label = f"{name} ({what})" if what else name
    try:
        value = json.loads((path / name).read_bytes())
    except FileNotFoundError:
        problems.append(f"{label} is missing")
        return None
    except OSError as e:
        problems.append(f"{label} is unreadable ({e.strerror})")
        return None
    except ValueError as e:  # also a UnicodeDecodeError
        problems.append(f"{label} is not valid JSON, so truncated or overwritten ({e})")
        return None
    if not isinstance(value, dict):
        problems.append(f"{label} holds a JSON {type(value).__name__}, not an object")
        return None
    return value


def _array_leaves(tree: dict[str, Any]) -> Iterator[str]:
    """The dotted names of the array leaves that orbax's tree metadata lists (the keys of their data)."""
    for entry in tree.values():
        value = entry["value_metadata"]
        if value.get("value_type") in _ARRAY_TYPES and not value.get("skip_deserialize", False):
            yield ".".join(str(key["key"]) for key in entry["key_metadata"])


def _array_damage(item: Path, metadata: dict[str, Any], leaves: list[str]) -> list[str]:
    """What is missing from the array data of ``item`` (OCDBT): its index (the manifest and the B-tree nodes), the
    data files the index refers to (each present and long enough), and for each of ``leaves`` its zarr metadata
    and every chunk. The chunks' bytes are not read: their damage shows when restore decodes them."""
    import tensorstore as ts

    if not (item / "manifest.ocdbt").is_file():
        return [f"{_MANIFEST} ({_FILES[_MANIFEST]}) is missing"]
    base = ts.KvStore.open({"driver": "file", "path": f"{item}/"}).result()
    try:
        versions = ts.ocdbt.dump(base).result()["versions"]
    except Exception as e:  # tensorstore reports a corrupt manifest as ValueError
        return [f"{_MANIFEST} ({_FILES[_MANIFEST]}) is unreadable: {first_line(e)}"]
    root = versions[-1]["root"].get("location") if versions else None  # no location: an empty tree
    entries, problems = _index(base, item, root)
    needed: dict[str, int] = {}  # data file -> the end of the last bytes the index refers to in it
    for entry in entries.values():
        if "indirect_value" in entry:
            file = _relative(entry["indirect_value"])
            needed[file] = max(needed.get(file, 0), _extent(entry["indirect_value"]))
    problems += filter(None, (_file_problem(item, file, end, "array data") for file, end in needed.items()))
    if problems:  # a lost node hides its leaves: listing each of them would bury the cause
        return problems
    metadata_name = "zarr.json" if metadata.get("use_zarr3", False) else ".zarray"
    keys = collections.Counter(key.rsplit(b"/", 1)[0] for key in entries)  # leaf -> its keys: metadata and chunks
    for leaf in leaves:
        key = f"{leaf}/{metadata_name}".encode()
        if key not in entries:
            problems.append(f"leaf {leaf}: its array data is not in {_MANIFEST}'s index (no key {key.decode()})")
        elif metadata_name == ".zarray" and metadata.get("store_array_data_equal_to_fill_value", False):
            problems += _missing_chunks(base, leaf, entries[key], keys[leaf.encode()] - 1)
    return problems


def _index(base: Any, item: Path, root: str | None) -> tuple[dict[bytes, dict[str, Any]], list[str]]:
    """Every key of the OCDBT B-tree below ``root``, with its entry (an inline value or where the value is), and
    the problem of each node that is missing or unreadable."""
    import tensorstore as ts

    entries: dict[bytes, dict[str, Any]] = {}
    problems: list[str] = []
    pending = [] if root is None else [(root, b"")]
    while pending:
        location, prefix = pending.pop()
        problem = _file_problem(item, _relative(location), _extent(location), "a node of the array index")
        if problem is None:
            try:
                node = ts.ocdbt.dump(base, location).result()
            except Exception as e:
                problem = f"default/{_relative(location)} (a node of the array index) is unreadable: {first_line(e)}"
        if problem is not None:
            problems.append(problem)
            continue
        for entry in node["entries"]:
            if "location" in entry:  # an inner node: its keys continue the common prefix of its subtree
                pending.append((entry["location"], prefix + entry.get("subtree_common_prefix", b"")))
            else:
                entries[prefix + entry["key"]] = entry
    return entries, problems


def _missing_chunks(base: Any, leaf: str, entry: dict[str, Any], have: int) -> list[str]:
    """``leaf``'s problem when the index holds fewer than all of its chunks (orbax stores every chunk of a zarr v2
    array); ``entry`` is its ``.zarray`` key's, ``have`` the number of its chunks in the index."""
    import tensorstore as ts

    try:
        raw = (
            entry["inline_value"] if "inline_value" in entry else ts.ocdbt.dump(base, entry["indirect_value"]).result()
        )
        zarray = json.loads(raw)
        expected = math.prod(
            -(-size // max(chunk, 1)) for size, chunk in zip(zarray["shape"], zarray["chunks"], strict=True)
        )
    except Exception as e:
        return [f"leaf {leaf}: its zarr metadata is unreadable ({first_line(e)})"]
    if have < expected:
        return [f"leaf {leaf}: {expected - have} of its {expected} chunks are missing from the array data"]
    return []


def _file_problem(item: Path, file: str, end: int, what: str) -> str | None:
    """The problem of data file ``file`` of ``item`` (missing, or shorter than ``end``, the bytes referred to)."""
    label = f"default/{file} ({what})"
    try:
        size = (item / file).stat().st_size
    except FileNotFoundError:
        return f"{label} is missing"
    except OSError as e:
        return f"{label} is unreadable ({e.strerror})"
    if size < end:
        return f"{label} is truncated: {size} bytes, the index refers to {end}"
    return None


def _relative(location: str) -> str:
    """The data file of an OCDBT location ``KIND:BASE:RELATIVE:OFFSET:LENGTH``, relative to the database."""
    _, base, relative = location.rsplit(":", 2)[0].split(":", 2)
    return f"{base}{relative}"


def _extent(location: str) -> int:
    """The end (offset + length) of the bytes an OCDBT location refers to."""
    offset, length = location.rsplit(":", 2)[1:]
    return int(offset) + int(length)


# Orbax's files in a step's directory, and what each holds.
_STEP_METADATA = "_CHECKPOINT_METADATA"
_ITEM_METADATA = "default/_METADATA"
_SHARDING = "default/_sharding"
_ARRAY_METADATAS = "default/array_metadatas"
_MANIFEST = "default/manifest.ocdbt"
_FILES = {
    _STEP_METADATA: "orbax's step metadata, with the extra dict",
    _ITEM_METADATA: "the arrays' tree, shapes and spmdcomm layout",
    _SHARDING: "the arrays' shardings",
    _ARRAY_METADATAS: "a process's array metadata",
    _MANIFEST: "the index of the array data",
}
# Orbax's type names of the leaves whose data is a zarr array in the OCDBT database.
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
