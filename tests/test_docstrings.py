"""One docstring style for the public API (docs/api.md, "Docstring style"): every public function, class, method
and property of ``sc.__all__``, ``sc.nnx`` and the types kept in their layer has a one-sentence summary, free text
before its sections, the sections in their order, an ``Args:`` (or, for a record, ``Attributes:``) entry for
every parameter in signature order, ``Returns:``/``Yields:`` where it gives something back, and its doctests under
``Examples:``."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterator

import pytest

import spmdcomm as sc
import spmdcomm.nnx

SECTIONS = ("Args", "Attributes", "Returns", "Yields", "Raises", "Examples")
# A line that looks like a section heading ("Note:", "Parameters:", "Example:"): only SECTIONS may be one.
HEADING = re.compile(r"^([A-Z][A-Za-z]*(?: [A-Za-z]+)?):\s*$")
ENTRY = re.compile(r"^  (\*{0,2}\w+)(?: \([^)]*\))?: \S")
# Public names kept in their layer (docs/api.md, "Not at the top level") that are functions or classes.
LAYER_NAMES = {
    "TrainStep": "spmdcomm.train",
    "EvalStep": "spmdcomm.train",
    "Strategy": "spmdcomm.train",
    "Prefetcher": "spmdcomm.data",
    "PrefetchStats": "spmdcomm.data",
    "aligned_empty": "spmdcomm.data",
    "SpmdFunction": "spmdcomm.collectives",
    "Explanation": "spmdcomm.explain",
    "Collective": "spmdcomm.explain",
    "DeviceMemory": "spmdcomm.explain",
    "Work": "spmdcomm.explain",
    "Conditional": "spmdcomm.explain",
    "model_flops": "spmdcomm.explain",
    "Divergence": "spmdcomm.runtime",
    "debug_enabled": "spmdcomm.runtime",
}


def public_objects() -> Iterator[tuple[str, object]]:
    """``(qualified name, object)`` for each public function, class, method and property that spmdcomm defines."""
    named = [(f"sc.{n}", getattr(sc, n)) for n in sc.__all__]
    named += [(f"sc.nnx.{n}", getattr(sc.nnx, n)) for n in sc.nnx.__all__]
    named += [(f"{m}.{n}", getattr(importlib.import_module(m), n)) for n, m in LAYER_NAMES.items()]
    for name, obj in named:
        if not (inspect.isclass(obj) or callable(obj)) or not getattr(obj, "__module__", "").startswith("spmdcomm"):
            continue  # constants, and jax's PartitionSpec
        yield name, obj
        if inspect.isclass(obj) and not issubclass(obj, BaseException | Warning):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr != "__call__":
                    continue
                if isinstance(member, staticmethod | classmethod):
                    member = member.__func__
                code = member.fget if isinstance(member, property) else member
                if inspect.isfunction(code) and code.__module__.startswith("spmdcomm"):  # not flax.struct's replace
                    yield f"{name}.{attr}", member


OBJECTS = dict(public_objects())


def test_the_public_objects_are_found():
    # The walk above must reach every kind it checks: a regression in it would make every test below vacuous.
    assert {"sc.psum", "sc.TrainState", "sc.TrainState.create", "sc.fit", "sc.nnx.SyncBatchNorm"} <= set(OBJECTS)
    assert "sc.P" not in OBJECTS and "sc.STUCK_EXIT_CODE" not in OBJECTS
    assert any(isinstance(o, property) for o in OBJECTS.values())


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_docstring_follows_the_style(name):
    assert style_problems(OBJECTS[name]) == [], f"{name}: see docs/api.md, 'Docstring style'"


CHECKER_CASES = {
    "no-docstring": ("", "no docstring"),
    "no-period": ("Sums x", "summary"),
    "two-line-summary": ("Sums x.\nover devices.", "summary"),
    "follows": ("Sums x.\n\nArgs:\n  x: the value.\n\nReturns:\n  The sum.", None),
    "wrong-arg": ("Sums x.\n\nArgs:\n  y: the value.\n\nReturns:\n  The sum.", "Args names ['y']"),
    "no-args": ("Sums x.\n\nReturns:\n  The sum.", "no Args"),
    "no-returns": ("Sums x.\n\nArgs:\n  x: the value.", "no Returns"),
    "order": ("Sums x.\n\nReturns:\n  The sum.\n\nArgs:\n  x: the value.", "order"),
    "unknown-section": ("Sums x.\n\nArgs:\n  x: the value.\n\nNote:\n  Linear.\n\nReturns:\n  s.", "Note"),
    "text-after": ("Sums x.\n\nArgs:\n  x: the value.\nMore text.\n\nReturns:\n  s.", "after the sections"),
    "doctest-outside": ("Sums x.\n\n>>> f(1)\n1\n\nArgs:\n  x: v.\n\nReturns:\n  s.", "outside Examples"),
    "doctest-inside": ("Sums x.\n\nArgs:\n  x: v.\n\nReturns:\n  s.\n\nExamples:\n  >>> f(1)\n  1", None),
}


@pytest.mark.parametrize("doc, problem", list(CHECKER_CASES.values()), ids=list(CHECKER_CASES))
def test_the_checker_finds_each_kind_of_problem(doc, problem):
    def f(x) -> int:
        return x

    f.__doc__ = doc
    found = style_problems(f)
    if problem is None:
        assert found == []
    else:
        assert any(problem in p for p in found), found


def style_problems(obj: object) -> list[str]:
    """What in ``obj``'s docstring breaks the style; empty when it follows it."""
    doc = inspect.getdoc(obj)
    if not doc:
        return ["no docstring"]
    lines = doc.splitlines()
    problems = []
    if not lines[0].rstrip().endswith(".") or (len(lines) > 1 and lines[1].strip()):
        problems.append(f"the summary must be one line ending in '.', then a blank line: {lines[0]!r}")
    sections = _sections(lines, problems)
    order = [s for s in SECTIONS if s in sections]
    if list(sections) != order:
        problems.append(f"sections out of order: {list(sections)}, the order is {list(SECTIONS)}")
    if sum(">>>" in line for line in lines) != sum(">>>" in line for line in sections.get("Examples", [])):
        problems.append("doctests (>>>) outside Examples:")
    if isinstance(obj, property):
        return problems
    if inspect.isclass(obj):
        if issubclass(obj, BaseException | Warning):
            return problems
        params = _params(obj)
        documented = _entries(sections.get("Args") or sections.get("Attributes") or [])
        if params and documented != params:
            problems.append(f"Args/Attributes names {documented}, the signature {params}")
        return problems
    params = _params(obj)
    documented = _entries(sections.get("Args", []))
    if params and "Args" not in sections:
        problems.append(f"no Args: section for {params}")
    elif documented != params:
        problems.append(f"Args names {documented}, the signature {params}")
    if _gives_back(obj) and not {"Returns", "Yields"} & set(sections):
        problems.append("no Returns: (or Yields:) section")
    return problems


def _sections(lines: list[str], problems: list[str]) -> dict[str, list[str]]:
    """The lines of each section, by heading, in the order they appear."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines[1:]:
        heading = HEADING.match(line)
        if heading:
            title = heading.group(1)
            if title not in SECTIONS:
                problems.append(f"{title}: is not a section (use one of {list(SECTIONS)}, or free text before them)")
            elif title in sections:
                problems.append(f"{title}: appears twice")
            current = title
            sections.setdefault(title, [])
        elif current is not None:
            if line.strip() and not line.startswith("  "):
                problems.append(f"free text after the sections (it goes before Args:): {line!r}")
            sections[current].append(line)
    return sections


def _entries(section: list[str]) -> list[str]:
    return [m.group(1) for m in map(ENTRY.match, section) if m]


def _params(obj: object) -> list[str]:
    """The parameter names a caller passes, as the docstring lists them (``*args``, ``**kwargs``)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    names = [prefix.get(p.kind, "") + p.name for p in signature.parameters.values()]
    return names[1:] if names[:1] in (["self"], ["cls"]) and not inspect.isclass(obj) else names


def _gives_back(fn: object) -> bool:
    """Whether ``fn`` returns (or yields) something: its return annotation is neither ``None`` nor missing-and-a-
    procedure. A missing annotation counts as giving something back, so that it must be declared either way."""
    annotation = inspect.signature(fn).return_annotation
    if isinstance(annotation, str):
        annotation = annotation.replace(" ", "")
        return annotation not in ("None", "Iterator[None]", "Generator[None,None,None]")
    return annotation is not None and annotation is not type(None)


# ---------------------------------------------------------------------------------------------------------------
# What a result holds: each key a step, an evaluation or the loop puts in its result (read from the code that puts it
# there, so that a new key fails here until the docstring names it) appears quoted (``"key"``) in the docstring.


def _keys_in(module: str, function: str, *, sets: bool = False) -> set[str]:
    """The string keys ``function`` of ``module`` (at any depth of nesting) writes: ``d["key"] = ...`` and the keys
    of dict literals; with ``sets``, also the elements of set literals (the reserved names of the train step)."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    keys = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store):
            keys |= {n.slice.value} if isinstance(n.slice, ast.Constant) else set()
        elif isinstance(n, ast.Dict):
            keys |= {k.value for k in n.keys if isinstance(k, ast.Constant)}
        elif sets and isinstance(n, ast.Set):
            keys |= {e.value for e in n.elts if isinstance(e, ast.Constant)}
    return {k for k in keys if isinstance(k, str)}


def _train_metrics() -> set[str]:
    return _keys_in("spmdcomm.train._train_body", "compile_train_step")


def _eval_metrics() -> set[str]:
    return _keys_in("spmdcomm.train.eval_step", "_compile")


def _reserved_aux_names() -> set[str]:
    # The names loss_fn's aux may not use: the step's own metrics, and "tokens" beside a token-weighted loss.
    found = _keys_in("spmdcomm.train._train_body", "compile_train_step", sets=True)
    return found | _keys_in("spmdcomm.train._model_call", "differentiable_loss", sets=True)


def _fit_metrics() -> set[str]:
    from spmdcomm.reliability import PHASES

    return {f"time/{phase}" for phase in PHASES}


# (whose docstring, which part of it, the keys it must name): the part is a section, or "" for the whole docstring.
RESULT_KEYS = {
    "sc.make_train_step": ("sc.make_train_step", "Returns", _train_metrics),
    "train_step module: loss_fn's reserved aux names": ("spmdcomm.train.train_step", "", _reserved_aux_names),
    "sc.make_eval_step": ("sc.make_eval_step", "Returns", _eval_metrics),
    "EvalStep.__call__": ("spmdcomm.train.EvalStep.__call__", "Returns", _eval_metrics),
    "sc.evaluate": ("sc.evaluate", "Returns", _eval_metrics),
    "sc.fit": ("sc.fit", "", _fit_metrics),
}


def test_the_result_keys_are_read_from_the_code():
    # A regression in the reading would make the test below vacuous.
    assert {"examples", "tokens", "skipped", "loss_scale"} <= _train_metrics()
    assert {"loss", "examples", "tokens"} <= _eval_metrics()
    assert {"loss", "examples", "model_state", "skipped", "loss_scale", "tokens"} <= _reserved_aux_names()
    assert {"time/compile", "time/devices"} <= _fit_metrics()


@pytest.mark.parametrize("case", sorted(RESULT_KEYS))
def test_each_key_of_a_result_is_named_in_its_docstring(case):
    name, section, keys = RESULT_KEYS[case]
    obj = OBJECTS[name] if name in OBJECTS else importlib.import_module(name)
    doc = inspect.getdoc(obj) or ""
    text = "\n".join(_sections(doc.splitlines(), [])[section]) if section else doc
    missing = sorted(k for k in keys() if f'"{k}"' not in text)
    assert missing == [], f"{name}'s {section or 'docstring'} does not name {missing}"
