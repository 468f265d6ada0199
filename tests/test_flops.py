"""sc.explain's work: the matmul and convolution FLOPs of compiled programs, against counts made by hand."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import spmdcomm as sc
from spmdcomm import P
from spmdcomm.explain import Conditional, Work, model_flops
from spmdcomm.explain.flops import count_work

N = jax.device_count()
M, K = 8, 32  # every program multiplies (M, K) activations by (K, K) weights unless it says otherwise
DOT = 2 * M * K * K  # one such matmul
X = np.ones((M, K), np.float32)
W = np.ones((K, K), np.float32)


def xla_flops(fn, *args):
    """XLA's own count (cost analysis) of the jitted ``fn``'s FLOPs."""
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


# --------------------------------------------------------------------------------------------------
# Live programs (jax 0.10.2, XLA:CPU: dots sit in __ynn_fusion fusions, loops carry known_trip_count)


def test_a_matmul_is_two_flops_per_multiply_add_exactly_as_xla_counts_it():
    report = sc.explain(lambda x, w: x @ w[:, :16], X, W)
    assert report.flops == report.flops_total == 2 * M * K * 16 and report.work.bound == "exact"
    assert report.flops == xla_flops(lambda x, w: x @ w[:, :16], X, W)
    assert isinstance(report.work, Work) and report.work.devices == 1


def test_a_batched_einsum_counts_its_batch_dimension():
    a, b = np.ones((3, 4, 5), np.float32), np.ones((3, 5, 6), np.float32)
    assert sc.explain(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), a, b).flops == 2 * 3 * 4 * 6 * 5


def test_a_scan_counts_its_body_once_per_step_where_xla_counts_it_once():
    def f(x, w):
        return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=4)[0]

    report = sc.explain(f, X, W)
    assert report.flops == 4 * DOT and report.work.bound == "exact"
    assert xla_flops(f, X, W) < 2 * DOT  # XLA's cost analysis counts a while body once (and the tanh, a few adds)
    assert "(matmuls and convolutions)" in str(report) and "bound" not in str(report)


def test_nested_loops_multiply():
    def f(x, w):
        return lax.fori_loop(0, 3, lambda i, c: lax.fori_loop(0, 2, lambda j, d: d @ w, c), x)

    assert sc.explain(f, X, W).flops == 3 * 2 * DOT


@pytest.mark.parametrize("remat", [False, True], ids=["saved", "checkpointed"])
def test_rematerialised_work_is_counted(remat):
    # Each of the 4 steps: forward c @ w; backward dL/dc = g @ w.T and dL/dw = c.T @ g; with jax.checkpoint the
    # backward loop recomputes c @ w too (XLA keeps it: the forward and backward loops are separate whiles).
    def loss(w, x):
        body = lambda c, _: (jnp.sin(c @ w), None)  # noqa: E731
        return lax.scan(jax.checkpoint(body) if remat else body, x, None, length=4)[0].sum()

    report = sc.explain(jax.value_and_grad(loss), W, X)
    assert report.flops == 4 * (1 + remat + 2) * DOT


def test_a_cond_counts_its_largest_branch_and_says_it_is_an_upper_bound():
    def f(p, x, w):
        return lax.cond(p > 0, lambda x: (x @ w) @ w, lambda x: x @ w, x)

    report = sc.explain(f, np.float32(1), X, W)
    assert report.flops == 2 * DOT and report.work.bound == "upper"
    (c,) = report.work.conditionals
    assert isinstance(c, Conditional) and (c.runs, c.flops) == (1, (DOT, 2 * DOT))  # (false, true)
    assert str(report).splitlines()[-1].endswith("; an upper bound: 1 conditional(s) at their largest branch")
    weighted = report.work.weighted((0.75, 0.25))
    assert weighted.flops == 1.25 * DOT and weighted.bound == "estimate"
    assert report.work.weighted({c.name: (1, 0)}).flops == DOT
    with pytest.raises(sc.SpmdError, match="not 2 non-negative numbers summing to 1"):
        report.work.weighted((0.5, 0.6))
    with pytest.raises(sc.SpmdError, match="not conditionals of the program"):
        report.work.weighted({"nope": (1, 0)})


def test_a_loop_of_unknown_trip_count_is_counted_once_as_a_lower_bound():
    def f(x, w):
        return lax.while_loop(lambda c: c.sum() < 100, lambda c: jnp.tanh(c @ w), x)

    report = sc.explain(f, X, W)
    assert (report.flops, report.work.unknown_loops, report.work.bound) == (DOT, 1, "lower")
    assert "; a lower bound: 1 loop(s) of unknown trip count counted once" in str(report)


def test_work_is_broken_down_by_named_scope_with_the_backward_pass_under_its_forward_scope():
    def loss(w, x):
        with jax.named_scope("encoder"):
            h = jnp.sin(x @ w)
        with jax.named_scope("head"):
            return (h @ w[:, :16]).sum()

    by_scope = sc.explain(jax.grad(loss), W, X).work.by_scope
    # encoder: the forward x @ w and dL/dw = x.T @ dh (dL/dx is not asked for); head: dL/dh and dL/dw (its forward
    # matmul feeds only the sum, whose gradient needs not its value)
    assert by_scope == {"encoder": 2 * DOT, "head": 2 * (2 * M * K * 16)}


def test_a_convolution_counts_every_window_position():
    a, k = np.ones((2, 8, 8, 3), np.float32), np.ones((3, 3, 3, 4), np.float32)

    def conv(padding):
        return lambda a, k: lax.conv_general_dilated(a, k, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))

    valid = sc.explain(conv("VALID"), a, k)
    assert valid.flops == 2 * (2 * 6 * 6 * 4) * (3 * 3 * 3) == xla_flops(conv("VALID"), a, k)
    same = sc.explain(conv("SAME"), a, k).flops
    assert same == 2 * (2 * 8 * 8 * 4) * (3 * 3 * 3) > xla_flops(conv("SAME"), a, k)  # XLA skips the padding

    def grouped(a, k):  # two groups of 2 input features
        dims = ("NHWC", "HWIO", "NHWC")
        return lax.conv_general_dilated(a, k, (1, 1), "VALID", dimension_numbers=dims, feature_group_count=2)

    a4, k2 = np.ones((2, 8, 8, 4), np.float32), np.ones((3, 3, 2, 4), np.float32)
    assert sc.explain(grouped, a4, k2).flops == 2 * (2 * 6 * 6 * 4) * (3 * 3 * 2) == xla_flops(grouped, a4, k2)


# --------------------------------------------------------------------------------------------------
# Many devices: per device, over the mesh, and against one device


@functools.cache
def data_parallel():
    f = sc.spmd(lambda x, w: x @ w, in_specs=(P("data"), P()), out_specs=P("data"))
    return sc.explain(f, np.ones((N * M, K), np.float32), W), sc.explain(lambda x, w: x @ w, np.ones((N * M, K)), W)


def test_a_data_parallel_matmul_does_an_eighth_per_device_and_the_whole_over_the_mesh():
    spread, one = data_parallel()
    assert (spread.devices, one.devices) == (N, 1)
    assert spread.flops == one.flops / N == DOT and spread.flops_total == one.flops_total == N * DOT
    assert spread.flops_ratio(one) == 1.0 and spread.flops_ratio(N * DOT / 2) == 2.0
    assert str(spread).splitlines()[-1] == (
        f"work: 16.4 KFLOP per device, {N * DOT / 1e3:.1f} KFLOP over {N} device(s) (matmuls and convolutions)"
    )


def test_the_ratio_refuses_a_reference_without_work():
    spread, _ = data_parallel()
    with pytest.raises(sc.SpmdError, match="nothing to compare with"):
        spread.flops_ratio(sc.explain(lambda x: x + 1, X))


def test_a_ddp_train_step_does_the_work_of_one_device():
    from ddp_models import example_batch, init, loss_fn, optimizer

    apply_fn, params, _ = init("mlp")
    batch = example_batch("mlp", N * 4, seed=0)
    step = sc.make_train_step(loss_fn)
    reports = [
        sc.explain(step, sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optimizer("adam"), mesh=mesh), batch)
        for mesh in (sc.data_mesh(), sc.data_mesh(devices=jax.devices()[:1]))
    ]
    assert reports[0].flops_ratio(reports[1]) == 1.0 and reports[0].flops * N == reports[1].flops


# --------------------------------------------------------------------------------------------------
# Hand-written HLO: the forms XLA:CPU does not emit here (GPU library calls, predicate conditionals, fusions)

ENTRY = "HloModule m, num_partitions=2\n"


def hlo(*computations: str) -> str:
    return ENTRY + "\n".join(computations)


FUSED_DOT = """%fused (p0: f32[4,6], p1: f32[6,5]) -> f32[4,5] {
  %p0 = f32[4,6]{1,0} parameter(0)
  %p1 = f32[6,5]{1,0} parameter(1)
  ROOT %d = f32[4,5]{1,0} dot(f32[4,6]{1,0} %p0, f32[6,5]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/transpose(jvp(Net))/Dense_0/dot_general"}
}"""  # noqa: E501 (HLO text prints one instruction per line)
FUSED = 2 * 4 * 5 * 6


def test_fused_dots_in_a_loop_in_a_loop_and_a_call_compose_multiplicatively():
    inner = """%inner (t: (f32[4,6], f32[6,5])) -> (f32[4,6], f32[6,5]) {
  %t = (f32[4,6]{1,0}, f32[6,5]{1,0}) parameter(0)
  %a = f32[4,6]{1,0} get-tuple-element(%t), index=0
  %b = f32[6,5]{1,0} get-tuple-element(%t), index=1
  %f = f32[4,5]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused
  ROOT %r = (f32[4,6]{1,0}, f32[6,5]{1,0}) tuple(%a, %b)
}"""
    outer = """%outer (t: (f32[4,6], f32[6,5])) -> (f32[4,6], f32[6,5]) {
  %t.1 = (f32[4,6]{1,0}, f32[6,5]{1,0}) parameter(0)
  ROOT %w = (f32[4,6]{1,0}, f32[6,5]{1,0}) while(%t.1), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
}"""  # noqa: E501
    entry = """ENTRY %main (x: (f32[4,6], f32[6,5])) -> (f32[4,6], f32[6,5]) {
  %x = (f32[4,6]{1,0}, f32[6,5]{1,0}) parameter(0)
  %w.1 = (f32[4,6]{1,0}, f32[6,5]{1,0}) while(%x), condition=%c, body=%outer, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %k = (f32[4,6]{1,0}, f32[6,5]{1,0}) call(%w.1), to_apply=%outer
}"""  # noqa: E501
    work = count_work(hlo(FUSED_DOT, inner, outer, entry))
    assert work.flops == (5 * 3 + 3) * FUSED and work.total == 2 * work.flops and work.bound == "exact"
    assert work.by_scope == {"Net/Dense_0": work.flops}
    never = entry.replace('{"n":"5"}', '{"n":"0"}')  # a loop that runs no iteration does no work
    assert count_work(hlo(FUSED_DOT, inner, outer, never)).flops == 3 * FUSED


def test_an_op_without_metadata_or_with_a_scope_outside_its_loop_counts_under_the_loop_and_a_lost_one_is_named():
    bare = """%bare (q0: f32[4,6], q1: f32[6,5]) -> f32[4,5] {
  %q0 = f32[4,6]{1,0} parameter(0)
  %q1 = f32[6,5]{1,0} parameter(1)
  ROOT %e = f32[4,5]{1,0} dot(f32[4,6]{1,0} %q0, f32[6,5]{1,0} %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""  # noqa: E501
    body = """%body (t: (f32[4,6], f32[6,5])) -> (f32[4,6], f32[6,5]) {
  %t = (f32[4,6]{1,0}, f32[6,5]{1,0}) parameter(0)
  %a = f32[4,6]{1,0} get-tuple-element(%t), index=0
  %b = f32[6,5]{1,0} get-tuple-element(%t), index=1
  %f = f32[4,5]{1,0} fusion(%a, %b), kind=kOutput, calls=%bare
  %g = f32[4,5]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/Head/dot_general"}
  %h = f32[4,5]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused
  ROOT %r = (f32[4,6]{1,0}, f32[6,5]{1,0}) tuple(%a, %b)
}"""  # noqa: E501
    entry = """ENTRY %main (x: (f32[4,6], f32[6,5])) -> f32[4,5] {
  %x = (f32[4,6]{1,0}, f32[6,5]{1,0}) parameter(0)
  %w = (f32[4,6]{1,0}, f32[6,5]{1,0}) while(%x), condition=%c, body=%body, metadata={op_name="jit(f)/Net/while"}, backend_config={"known_trip_count":{"n":"2"}}
  %a.1 = f32[4,6]{1,0} get-tuple-element(%w), index=0
  %b.1 = f32[6,5]{1,0} get-tuple-element(%w), index=1
  %lost = f32[4,5]{1,0} dot(%a.1, %b.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %s = f32[4,5]{1,0} add(%lost, %lost), metadata={op_name="jit(f)/Net/Dense_0/add"}
}"""  # noqa: E501
    # In the loop (JAX traced its body inside Net): the fused dot without metadata and the dot whose metadata says
    # Head count under Net; the one whose own scope lies inside Net keeps it. The dot left without any scope counts
    # under "", and the scope of the add next to it is named.
    work = count_work(hlo(FUSED_DOT, bare, body, entry))
    assert work.by_scope == {"Net": 2 * 2 * FUSED, "Net/Dense_0": 2 * FUSED, "": FUSED}
    assert work.unscoped_near == ("Net/Dense_0",)


def test_a_predicate_conditional_lists_its_branches_false_first():
    branch = """%{name} (t: (f32[4,6], f32[6,5])) -> f32[4,5] {{
  %t.{name} = (f32[4,6]{{1,0}}, f32[6,5]{{1,0}}) parameter(0)
  %a.{name} = f32[4,6]{{1,0}} get-tuple-element(%t.{name}), index=0
  %b.{name} = f32[6,5]{{1,0}} get-tuple-element(%t.{name}), index=1
  ROOT %f.{name} = f32[4,5]{{1,0}} fusion(%a.{name}, %b.{name}), kind=kOutput, calls=%fused
}}"""
    cheap = """%cheap (t: (f32[4,6], f32[6,5])) -> f32[4,5] {
  ROOT %z = f32[4,5]{1,0} constant(0)
}"""
    entry = """ENTRY %main (p: pred[], x: (f32[4,6], f32[6,5])) -> f32[4,5] {
  %p = pred[] parameter(0)
  %x = (f32[4,6]{1,0}, f32[6,5]{1,0}) parameter(1)
  ROOT %c = f32[4,5]{1,0} conditional(%p, %x, %x), true_computation=%yes, false_computation=%cheap
}"""
    work = count_work(hlo(FUSED_DOT, branch.format(name="yes"), cheap, entry))
    assert work.conditionals == (Conditional("c", "", 1, (0, FUSED)),) and work.flops == FUSED
    assert work.weighted((0.5, 0.5)).flops == FUSED / 2


GEMM = """ENTRY %main (a: f16[16,64], b: f16[64,32]) -> f16[16,32] {
  %a = f16[16,64]{1,0} parameter(0)
  %b = f16[64,32]{1,0} parameter(1)
  %g = (f16[16,32]{1,0}, s8[4194304]{0}) custom-call(f16[16,64]{1,0} %a, f16[64,32]{1,0} %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %r = f16[16,32]{1,0} get-tuple-element(%g), index=0
}"""  # noqa: E501

# A cuDNN convolution's window and dim_labels describe the forward convolution: input (2,8,8,3), kernel (3,3,3,4),
# output (2,6,6,4), whichever pass the call computes.
CUDNN = """ENTRY %main (x: f32[2,8,8,3], k: f32[3,3,3,4], y: f32[2,6,6,4]) -> f32[2,6,6,4] {{
  %x = f32[2,8,8,3]{{3,2,1,0}} parameter(0)
  %k = f32[3,3,3,4]{{3,2,1,0}} parameter(1)
  %y = f32[2,6,6,4]{{3,2,1,0}} parameter(2)
  %c = ({result}, u8[0]{{0}}) custom-call({operands}), window={{size=3x3}}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn${target}"
  ROOT %r = {result} get-tuple-element(%c), index=0
}}"""  # noqa: E501


@pytest.mark.parametrize(
    "target, operands, result",
    [
        ("convForward", "%x, %k", "f32[2,6,6,4]{3,2,1,0}"),
        ("convBackwardInput", "%y, %k", "f32[2,8,8,3]{3,2,1,0}"),
        ("convBackwardFilter", "%x, %y", "f32[3,3,3,4]{3,2,1,0}"),
    ],
)
def test_gpu_library_calls_count_as_the_matmul_or_convolution_they_compute(target, operands, result):
    assert count_work(hlo(GEMM)).flops == 2 * 16 * 32 * 64
    text = CUDNN.format(target=target, operands=operands, result=result)
    assert count_work(hlo(text)).flops == 2 * (2 * 6 * 6 * 4) * (3 * 3 * 3)


def test_model_flops_is_six_per_parameter_and_token_plus_attention():
    assert model_flops(100, 10) == 6_000
    assert model_flops(100, 10, layers=2, context=8, width=4) == 6_000 + 12 * 2 * 8 * 4 * 10
