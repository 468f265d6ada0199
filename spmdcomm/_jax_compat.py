"""Every access spmdcomm makes to JAX internals, behind one small function each.

JAX has no public API for a few things spmdcomm needs: whether the current ``shard_map`` trace checks
varying manual axes, the coordination-service client of a multi-process job, whether the backends have
started, cluster auto-detection, which axis a collective asked for when JAX failed on an unbound one, which
functions run a host callback (for the watchdog, which looks for them in thread stacks), which outputs of a traced
function read an input (for the table schedules' model state), and the ``jax.vmap`` and
second-derivative rules that ``jax.custom_derivatives.linear_call`` lacks (for ring attention's derivative). Those
accesses live here and nowhere else in spmdcomm (one exception, FSDP's ``jax.checkpoint`` policy naming
primitives, is in docs/architecture.md; ``tests/test_architecture.py`` checks both), so a JAX upgrade that moves
one of them breaks exactly one function, which then raises a clear error naming the installed JAX version and the
supported range instead of an ``AttributeError`` deep inside a trace, or (for the axis, which only words an error)
finds nothing. Where a public API exists it is used instead.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Sequence
from types import CodeType, TracebackType
from typing import Any

import jax

from spmdcomm.errors import DistributedError, SpmdError

__all__ = [
    "vary",
    "JAX_MAX_VERSION",
    "JAX_MIN_VERSION",
    "SUPPORTED_JAX",
    "auto_detect_cluster",
    "backends_initialized",
    "check_vma_enabled",
    "collective_axes_in_traceback",
    "coordination_client",
    "is_host_callback_code",
    "jax_version",
    "jax_version_supported",
    "linear_call",
    "outputs_depending_on",
    "varying_axes",
]

# The JAX releases spmdcomm is tested on: JAX_MIN_VERSION inclusive, JAX_MAX_VERSION exclusive. This is
# the one place in the code that states them; the jax and jaxlib bounds in pyproject.toml must match
# (tests/test_jax_compat.py checks that they do).
JAX_MIN_VERSION: tuple[int, int] = (0, 10)
JAX_MAX_VERSION: tuple[int, int] = (0, 12)
SUPPORTED_JAX = f"jax>={'.'.join(map(str, JAX_MIN_VERSION))},<{'.'.join(map(str, JAX_MAX_VERSION))}"


def jax_version() -> tuple[int, ...]:
    """The installed JAX version as integers, e.g. ``(0, 10, 2)``."""
    info = getattr(jax, "__version_info__", None)
    if info is not None:
        return tuple(info)
    return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def jax_version_supported(version: Sequence[int] | None = None) -> bool:
    """Whether ``version`` (default: the installed JAX) lies in the supported range."""
    v = tuple(jax_version() if version is None else version)
    return JAX_MIN_VERSION <= v[:2] < JAX_MAX_VERSION


def check_vma_enabled() -> bool:
    """True inside ``shard_map(check_vma=True)``; False under ``pmap``, ``check_vma=False`` and outside.

    The flag is part of the trace context, so it is read on every call; only the lookup of the flag
    object is cached (this runs on every collective trace).
    """
    flag = _check_vma_flag
    if flag is None:
        flag = _resolve_check_vma_flag()
    return bool(flag.value)


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes over which ``x`` may differ between devices (its type under ``check_vma=True``).

    Values whose type is not an array type (tokens, references) vary over no axis, as JAX itself treats them.
    A ``jax.ShapeDtypeStruct`` (what ``jax.eval_shape`` gives) is read as the array it describes.
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        # jax.typeof asserts on a struct that has both a sharding and a manual-axis record (a mesh with auto axes).
        described = getattr(getattr(x, "manual_axis_type", None), "varying", None)
        if described is not None:
            return frozenset(described)
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    # JAX 0.10 and 0.11 keep the varying axes in the type's manual-axis record; earlier releases had
    # them as the type's `vma` attribute, read second in case that name comes back.
    varying = getattr(getattr(aval, "mat", None), "varying", None)
    if varying is not None:
        return varying
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    if isinstance(aval, jax.core.ShapedArray):
        raise SpmdError(
            _unsupported(
                "jax.typeof(x).mat.varying (nor jax.typeof(x).vma)",
                "find the mesh axes a value varies over inside shard_map",
            )
        )
    return frozenset()


def vary(tree: Any, axes: Sequence[str]) -> Any:
    """``tree`` with every leaf typed as varying over each of the manual ``axes`` (``lax.pcast``), where it is not
    already: what a ``psum`` over those axes, a scan carry that becomes varying, or a per-device gradient needs
    under ``check_vma=True``."""
    from jax import lax

    def one(x: Any) -> Any:
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def outputs_depending_on(fun: Any, x: Any) -> list[bool]:
    """For each leaf of ``fun(x)``, whether its value depends on ``x``: JAX's dead-code elimination of the traced
    program, asked for that output alone, keeps the input or not (loops, conditionals and nested programs
    included). ``x`` may be a tracer of an enclosing trace; ``fun`` is traced once, never run."""
    dce = _private("jax._src.interpreters.partial_eval", "dce_jaxpr")
    if dce is None:
        raise SpmdError(_unsupported("jax._src.interpreters.partial_eval.dce_jaxpr", "find what a traced value reads"))
    program = jax.make_jaxpr(fun)(x).jaxpr
    n = len(program.outvars)
    return [bool(dce(program, [k == i for k in range(n)])[1][0]) for i in range(n)]


def collective_axes_in_traceback(tb: TracebackType | None) -> list[str]:
    """The axis names that JAX's collectives (``lax.psum``, ``pmean``, ...) in traceback ``tb`` were called with.

    JAX's error for a collective over an axis that is not bound (an ``AssertionError`` or ``NameError`` from inside
    the trace) does not say which call asked for it; the frames of ``jax/_src/lax/parallel.py`` in its traceback
    hold the axis in their ``axis_name`` or ``axes`` locals. In the order found, without repeats; empty where no
    such frame is found (a JAX that moved the file or renamed them), and the caller then keeps JAX's own error.
    """
    names: list[str] = []
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith(("lax/parallel.py", "lax\\parallel.py")):
            for value in (frame.f_locals.get("axis_name"), frame.f_locals.get("axes")):
                for a in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(a, str) and a not in names:
                        names.append(a)
        tb = tb.tb_next
    return names


def is_host_callback_code(code: CodeType) -> bool:
    """Whether ``code`` is one of the functions through which JAX runs a host callback (``jax.debug.callback``,
    ``pure_callback``, ``io_callback``) at run time: every callback of a compiled program enters Python through
    ``_wrapped_callback`` of ``jax/_src/callback.py``, an eager one through its primitive's ``*_impl``. Matched by
    file and name (private, JAX 0.10); a JAX that renames them makes this False, and a stalled callback then reads as
    a hang inside the devices."""
    return code.co_name in _CALLBACK_FUNCTIONS and code.co_filename.replace("\\", "/").endswith(_CALLBACK_FILES)


def coordination_client() -> Any | None:
    """JAX's coordination-service client of this job (barriers, a key-value store); None before joining."""
    global_state = _private("jax._src.distributed", "global_state")
    if global_state is None or not hasattr(global_state, "client"):
        raise DistributedError(
            _unsupported(
                "jax._src.distributed.global_state.client",
                "run barriers and exchange values between the processes of a job",
            )
        )
    return global_state.client


def backends_initialized() -> bool:
    """Whether JAX's backends have started in this process (after which it can no longer join a job)."""
    check = _private("jax._src.xla_bridge", "backends_are_initialized")
    if check is None:
        raise DistributedError(
            _unsupported(
                "jax._src.xla_bridge.backends_are_initialized",
                "tell whether this process can still join a multi-process job",
            )
        )
    return bool(check())


def auto_detect_cluster(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_device_ids: Sequence[int] | None,
    *,
    timeout: int,
) -> tuple[str | None, int | None, int | None, Sequence[int] | None]:
    """Fills the settings left as None from the cluster environment (SLURM, Open MPI, Kubernetes, ...).

    Returns ``(coordinator_address, num_processes, process_id, local_device_ids)``, as
    ``jax.distributed.initialize()`` would find them; ``timeout`` is in whole seconds.
    """
    detect = _cluster_detector()
    return detect(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        cluster_detection_method=None,
        initialization_timeout=timeout,
    )


# ------------------------------------------------------------------------------------------------

_CALLBACK_FILES = ("jax/_src/callback.py", "jax/_src/debugging.py")
_CALLBACK_FUNCTIONS = frozenset({"_wrapped_callback", "debug_callback_impl", "pure_callback_impl", "io_callback_impl"})

_check_vma_flag: Any = None  # JAX's check_vma config state, found on first use

_DETECT_PARAMS = frozenset(
    {
        "coordinator_address",
        "num_processes",
        "process_id",
        "local_device_ids",
        "cluster_detection_method",
        "initialization_timeout",
    }
)


def _resolve_check_vma_flag() -> Any:
    global _check_vma_flag
    flag = _private("jax._src.config", "_check_vma")
    if flag is None or not hasattr(flag, "value"):
        raise SpmdError(
            _unsupported("jax._src.config._check_vma", "tell shard_map(check_vma=True) from pmap and check_vma=False")
        )
    _check_vma_flag = flag
    return flag


def _cluster_detector() -> Any:
    detect = getattr(_private("jax._src.clusters", "ClusterEnv"), "auto_detect_unset_distributed_params", None)
    # Checked before the call, so that a changed signature is reported as such rather than as a
    # TypeError that could also come from inside the detection.
    try:
        params = set(inspect.signature(detect).parameters) if detect is not None else set()
    except (TypeError, ValueError):
        params = set()
    if not _DETECT_PARAMS <= params:
        raise DistributedError(
            _unsupported(
                "jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params(coordinator_address, "
                "num_processes, process_id, local_device_ids, cluster_detection_method, initialization_timeout)",
                "detect the cluster's job settings",
                fix="pass coordinator_address, num_processes and process_id to spmdcomm.initialize() (or "
                "start the script with spmdcomm-launch), or install a supported JAX",
            )
        )
    return detect


def linear_call(fun: Any, transpose: Any, residuals: Any, linear: Any) -> Any:
    """``jax.custom_derivatives.linear_call(fun, transpose, residuals, linear)``: ``fun(residuals, linear)``, linear in
    ``linear``, whose transpose (in reverse mode) is ``transpose(residuals, cotangent)``; composing with ``jax.vmap``
    and with derivatives in ``residuals`` too.

    JAX 0.10's primitive has no ``vmap`` rule, and its JVP rule asserts that the residuals have no tangent (a second
    derivative: ``jax.grad`` of ``jax.grad``, ``jax.jacfwd`` of ``jax.grad``). The first call adds both to JAX's
    tables, for this primitive only and without changing what JAX already does: ``vmap`` batches ``fun`` and
    ``transpose`` (every operand batched on its first axis); a tangent of the residuals adds the derivative of ``fun``
    in them, by ``jax.jvp`` of its ops (so reverse mode over that term is ordinary autodiff).
    """
    from jax.custom_derivatives import linear_call as call

    if not _LINEAR_CALL_RULES:
        _add_linear_call_rules()
    return call(fun, transpose, residuals, linear)


_LINEAR_CALL_RULES: list[bool] = []


def _add_linear_call_rules() -> None:
    primitive = _private("jax._src.custom_derivatives", "linear_call_p")
    ad, batching, core = (_module(f"jax._src.{name}") for name in ("interpreters.ad", "interpreters.batching", "core"))
    jvps = getattr(ad, "primitive_jvps", None)
    batchers = getattr(batching, "fancy_primitive_batchers", None)
    if primitive is None or core is None or jvps is None or batchers is None or primitive not in jvps:
        raise SpmdError(
            _unsupported(
                "jax._src.custom_derivatives.linear_call_p with its rule tables in jax._src.interpreters",
                "give ring attention's derivative its vmap and second-derivative rules",
            )
        )
    jax_jvp = jvps[primitive]
    if getattr(jax_jvp, "spmdcomm_rule", False):  # added before (a test may have cleared the record)
        _LINEAR_CALL_RULES.append(True)
        return
    from jax.custom_derivatives import linear_call as call

    def jvp(primals: Any, tangents: Any, **params: Any) -> Any:
        fixed = params["num_callee_consts"] + params["num_res"]
        moving = [i for i, t in enumerate(tangents[:fixed]) if type(t) is not ad.Zero]
        if not moving:
            return jax_jvp(primals, tangents, **params)
        out = primitive.bind(*primals, **params)
        consts, callee = params["num_callee_consts"], params["callee"]
        given = [i for i, t in enumerate(tangents[fixed:]) if type(t) is not ad.Zero]

        def fun(res: Any, lin: Any) -> Any:
            full = [ad.instantiate_zeros(t) if type(t) is ad.Zero else None for t in tangents[fixed:]]
            for i, x in zip(given, lin):
                full[i] = x
            return core.eval_jaxpr(callee.jaxpr, callee.consts, *res, *full)

        def transpose(res: Any, cts: Any) -> Any:
            jaxpr, t_consts = params["transpose_thunk"]()
            grads = core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *t_consts, *res[consts:], *cts)
            return [grads[i] for i in given]

        # The linear inputs with a tangent only: a zero among them would reach the transpose as a known value.
        linear = call(fun, transpose, list(primals[:fixed]), [tangents[fixed + i] for i in given]) if given else None

        def through(*values: Any) -> Any:
            args = list(primals)
            for i, x in zip(moving, values):
                args[i] = x
            return core.eval_jaxpr(callee.jaxpr, callee.consts, *args)

        _, extra = jax.jvp(through, [primals[i] for i in moving], [tangents[i] for i in moving])
        return out, extra if linear is None else [a + b for a, b in zip(linear, extra)]

    def batch(axis_data: Any, args: Any, dims: Any, **params: Any) -> Any:
        if all(d is None for d in dims):
            return primitive.bind(*args, **params), [None] * len(params["callee"].out_avals)
        size, mesh_axis = axis_data.size, axis_data.explicit_mesh_axis
        args = [batching.bdim_at_front(x, d, size, mesh_axis) for x, d in zip(args, dims)]
        callee, _ = batching.batch_jaxpr(params["callee"], axis_data, [True] * len(args), True)
        transpose_thunk = params["transpose_thunk"]

        @functools.cache
        def batched_transpose() -> Any:
            jaxpr, consts = transpose_thunk()
            batched = [False] * len(consts) + [True] * (len(jaxpr.in_avals) - len(consts))
            return batching.batch_jaxpr(jaxpr, axis_data, batched, True)[0], consts

        out = primitive.bind(*args, **{**params, "callee": callee, "transpose_thunk": batched_transpose})
        return out, [0] * len(out)

    jvp.spmdcomm_rule = True  # type: ignore[attr-defined]
    jvps[primitive] = jvp
    batchers.setdefault(primitive, batch)
    _LINEAR_CALL_RULES.append(True)


def _module(name: str) -> Any:
    """JAX's internal module ``name``, or None where the installed JAX lacks it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _private(module: str, name: str) -> Any:
    """JAX's internal ``module.name``, or None where the installed JAX lacks the module or the name."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _unsupported(missing: str, purpose: str, *, fix: str | None = None) -> str:
    versions = SUPPORTED_JAX.removeprefix("jax")
    fix = fix or f"install a supported JAX: pip install 'jax{versions}' 'jaxlib{versions}'"
    return (
        f"spmdcomm supports {SUPPORTED_JAX}; jax {jax.__version__} has no {missing}, which spmdcomm "
        f"needs to {purpose}. Fix: {fix}."
    )
