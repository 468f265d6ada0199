"""benchmarks/gpu.py, the GPU measurement in one script: its arithmetic, and a ``--tiny`` run on CPU whose JSON
holds every section with results (the same code a GPU run takes, at a size that runs in seconds)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timing import LATE_S

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"


@pytest.fixture
def gpu(monkeypatch):
    """benchmarks/gpu.py as a module (it imports its neighbours by plain name, as a script run from there)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu

    return gpu


def test_peak_table_names_the_specific_parts_first(gpu):
    assert gpu.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu.peak_bf16_flops("NVIDIA H200") == 989e12
    assert gpu.peak_bf16_flops("NVIDIA L40S") == 362e12 and gpu.peak_bf16_flops("NVIDIA L4") == 121e12
    assert gpu.peak_bf16_flops("cpu") is None


def test_model_flops_count_kernels_and_attention(gpu):
    import numpy as np

    params = {  # a 1-layer LM's kernels of width 4 (2 heads of 2) and vocabulary 6; embedding and biases not counted
        "Embed_0": {"embedding": np.zeros((6, 4))},
        "Block_0": {
            "attention": {k: {"kernel": np.zeros((4, 2, 2)), "bias": np.zeros((2, 2))} for k in ("query", "key")},
            "Dense_0": {"kernel": np.zeros((4, 16)), "bias": np.zeros(16)},
        },
        "Dense_1": {"kernel": np.zeros((4, 6))},
    }
    flops = gpu.model_flops(params, layers=1, width=4, sequences=3, positions=5)
    assert flops["kernel_params"] == 16 + 16 + 64 + 24
    assert flops["tokens"] == 15
    assert flops["dense"] == 6 * 120 * 15 and flops["attention"] == 12 * 1 * 5 * 4 * 15
    assert gpu.mfu(2e12, 0.5, 8e12) == 0.5 and gpu.mfu(2e12, 0.5, None) is None


def test_hidden_summary(gpu):
    r = {
        "ms_per_step": {"none": 10.0, "ours": 6.0, "flax": 9.0, "preplaced": 5.0},
        "hidden": {"ours": 0.8, "flax": 0.2},
        "step_ms": 5.0,
        "copy_ms": 4.0,
        "pinned_host": True,
    }
    s = gpu.hidden_summary(r)
    assert s["vs_zero_cost"] == {"none": 0.5, "ours": 5 / 6, "flax": 5 / 9}
    assert s["step_ge_copy"] and not s["goal_met"]


def test_agreement_names_the_leaves_beyond_tolerance(gpu):
    import numpy as np

    want = {"y": np.array([1.0, -4.0]), "grad": np.array([0.5, 0.25])}
    assert gpu._agreement(want, want, 1e-5) == {"max_abs_diff": 0.0, "beyond_tolerance": []}
    # The tolerance scales with the larger of 1 and the leaf's largest value: 3e-5 passes on "y", not on "grad".
    got = {"y": np.array([1.0, -4.0 + 3e-5]), "grad": np.array([0.5, 0.25 + 3e-5])}
    a = gpu._agreement(got, want, 1e-5)
    assert a["beyond_tolerance"] == ["['grad']"] and math.isclose(a["max_abs_diff"], 3e-5, rel_tol=0.05)
    nan = gpu._agreement({"y": np.array([np.nan, 0.0]), "grad": want["grad"]}, want, 1e-5)
    assert nan["beyond_tolerance"] == ["['y']"] and math.isnan(nan["max_abs_diff"])


def test_clean_removes_this_machines_paths(gpu):
    text = f"File {ROOT}/benchmarks/gpu.py, {sys.prefix}/lib/site.py"
    assert gpu._clean(text) == "File ./benchmarks/gpu.py, <python>/lib/site.py"


def test_a_failing_or_slow_section_is_recorded_and_the_others_run(gpu, monkeypatch, tmp_path):
    def fails(size, args, out, deadline):
        out["measured"] = 1
        raise ValueError(f"broke in {ROOT}")

    def hangs(size, args, out, deadline):
        out["measured"] = 2
        time.sleep(60)

    def works(size, args, out, deadline):
        out["measured"] = 3

    for name, fn in (("prefetch", fails), ("train_step", hangs), ("memory", works), ("suite", works)):
        monkeypatch.setitem(gpu.SECTION_FUNCTIONS, name, fn)
    monkeypatch.setattr(gpu, "MIN_SECTION_S", 0.1)
    result = {"budget_s": 3.0, "sections": {}}
    start = time.monotonic()
    gpu.run_sections(["prefetch", "train_step", "memory", "suite"], gpu.TINY, None, result, tmp_path / "gpu.json")
    assert time.monotonic() - start < 3.0 + LATE_S  # the hanging section (60 s) was stopped
    sections = json.loads((tmp_path / "gpu.json").read_text())["sections"]
    assert sections["prefetch"]["status"] == "failed" and sections["prefetch"]["result"] == {"measured": 1}
    assert sections["prefetch"]["error"] == "ValueError: broke in ."  # no machine's paths in committed results
    assert sections["train_step"]["status"] == "timed out" and sections["train_step"]["result"] == {"measured": 2}
    assert sections["memory"]["status"] == "ok" and sections["memory"]["result"] == {"measured": 3}
    assert sections["suite"]["status"] == "ok"
    # Each a share of what was left when it started: never the whole budget, and the hang's share ran out.
    assert all(0 < s["limit_s"] < 3.0 for s in sections.values()), sections

    result = {"budget_s": 0.01, "sections": {}}  # no time for any section: each says so, none runs
    gpu.run_sections(["prefetch", "suite"], gpu.TINY, None, result, tmp_path / "gpu.json")
    assert [s["status"] for s in result["sections"].values()] == ["skipped", "skipped"]


def test_run_parallel_stops_what_outlives_the_deadline(gpu):
    quick = [sys.executable, "-c", "print('done')"]
    stuck = [sys.executable, "-c", "import time; time.sleep(60)"]
    start = time.monotonic()
    (out, code), (_, stuck_code) = gpu._run_parallel([quick, stuck], time.monotonic() + 2.0, parallel=2)
    assert (out.strip(), code) == ("done", 0) and stuck_code == -9
    assert time.monotonic() - start < 2.0 + LATE_S  # the stuck process (60 s) was stopped


@pytest.mark.slow
def test_tiny_run_on_cpu_writes_every_section(tmp_path, compile_flags):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script takes one CPU device
    env["JAX_PLATFORMS"] = "cpu"
    # Compiled as the suite compiles (conftest's fast-compile flags): this run checks that every section runs and
    # writes its results, not their speed.
    env["XLA_FLAGS"] = compile_flags
    # No budget: on a loaded machine any share of one runs out, and a section that runs out of its share is
    # recorded as timed out (tested above), which is not what this run checks. The timeout only ends a hang.
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--peak-tflops", "0.5", "--budget", "inf"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "gpu.json").read_text())
    assert (r["device"], r["platform"], r["device_count"], r["tiny"]) == ("cpu", "cpu", 1, True)
    assert r["jax"] and "several GPUs" in r["untested"]
    sections = r["sections"]
    assert list(sections) == ["prefetch", "train_step", "memory", "mfu", "attention", "moe", "weighted", "suite"]
    for name, entry in sections.items():
        assert entry["status"] == "ok", (name, entry.get("error"), entry.get("traceback"))
        assert entry["seconds"] > 0 and entry["limit_s"] is None

    prefetch = sections["prefetch"]["result"]
    assert list(prefetch["summary"]) == ["1", "2"]
    for mib, summary in prefetch["summary"].items():
        assert set(summary["hidden"]) == {"ours", "ours pageable", "flax"}
        ms = prefetch["batches"][mib]["ms_per_step"]
        copy_cost = ms["none"] - ms["preplaced"]  # NaN hidden fractions only where the copy cost nothing to hide
        assert all(isinstance(v, float) and (math.isfinite(v) or copy_cost <= 0) for v in summary["hidden"].values())
        assert set(summary["vs_zero_cost"]) == {"none", "ours", "ours pageable", "flax"}
        assert summary["pinned_host"] is False  # CPU devices alias aligned memory instead

    speed = sections["train_step"]["result"]["mlp"]
    assert set(speed) == {"ddp", "zero1", "fsdp", "jit+NamedSharding fsdp"}
    assert all(speed[s]["samples_per_s"] > 0 and speed[s]["ratio_vs_jit"] > 0 for s in ("ddp", "zero1", "fsdp"))
    assert set(sections["train_step"]["result"]["goal"]["mlp"]) == {"ddp", "zero1", "fsdp"}

    memory = sections["memory"]["result"]
    assert memory["memory_stats"].startswith("None on cpu")
    assert [(row["model"], row["strategy"]) for row in memory["rows"]] == [
        ("mlp", s) for s in ("ddp", "zero1", "fsdp", "jit")
    ]
    assert all(row["explained_peak_bytes"] > 0 and row["peak_bytes_in_use"] is None for row in memory["rows"])

    attention = sections["attention"]["result"]
    assert list(attention) == ["32"]
    for row in attention.values():
        assert set(row) == {"jax.nn.dot_product_attention", "sc.ring_attention", "sc.all_to_all_attention"}
        assert all(r["ms"] > 0 and r["temp_bytes"] > 0 and r["time_vs_jax_nn"] > 0 for r in row.values()), row

    moe = sections["moe"]["result"]  # CPU: no native ragged all-to-all, said with the library's reason
    assert moe["native"]["available"] is False and "no ragged all-to-all" in moe["native"]["reason"]
    assert moe["native_vs_padded"] is None and moe["config"]["dtype"] == "float32"
    for name in ("layer", "ragged_all_to_all"):
        assert list(moe[name]) == ["padded"]
        run = moe[name]["padded"]
        assert run["ms"] > 0 and run["temp_bytes"] > 0 and math.isfinite(run["tokens_per_s"]), (name, run)
    assert moe["agreement"] == {"ragged_all_to_all padded vs numpy": {"max_abs_diff": 0.0, "beyond_tolerance": []}}

    weighted = sections["weighted"]["result"]
    assert 0 < weighted["padding_fraction"] < 0.5 and weighted["tokens"] > 0
    assert all(math.isfinite(v) for v in weighted["first_loss"].values())
    for name in ("mean", "weighted"):
        assert weighted[name]["step_ms"] > 0 and weighted[name]["samples_per_s"] > 0
    ratio = weighted["weighted"]["samples_per_s"] / weighted["mean"]["samples_per_s"]
    assert math.isfinite(weighted["weighted_vs_mean"]) and math.isclose(weighted["weighted_vs_mean"], ratio)

    mfu = sections["mfu"]["result"]
    if (ROOT / "examples" / "lm").exists():  # once it lands: built and counted, or why not
        # --tiny builds the model and counts its FLOPs; the timing beside the plain jit step is measure_mfu's, the
        # stand-in's below (the GPU run times both).
        examples_lm = mfu["examples_lm"]
        assert isinstance(examples_lm, dict) and examples_lm["model"].startswith("examples/lm"), examples_lm
        flops = examples_lm["model_flops"]
        assert examples_lm["model_flops_per_step"] == flops["dense"] + flops["attention"] and flops["attention"] > 0
    else:
        assert mfu["examples_lm"] == "examples/lm not present"
    assert mfu["peak_flops"] == 0.5e12 and mfu["peak_source"] == "--peak-tflops"
    stand_in = mfu["stand_in"]
    assert stand_in["model_flops_per_step"] == stand_in["model_flops"]["dense"] + stand_in["model_flops"]["attention"]
    assert stand_in["model_flops"]["kernel_params"] == 14336  # 1 block of width 32, vocabulary 64: counted by hand
    # The FLOPs per step are sc.explain's count of the plain jit step; our step does the same matmuls.
    per_step = stand_in["flops_per_step"]
    assert stand_in["flops_bound"] == "exact" and stand_in["ours_vs_jit_flops"] == 1.0
    assert math.isclose(stand_in["flops_vs_model"], per_step / stand_in["model_flops_per_step"])
    for name in ("ours (ddp)", "jax.jit"):
        run = stand_in[name]
        assert run["step_ms"] > 0
        assert math.isclose(run["mfu"], per_step / (run["step_ms"] / 1e3) / 0.5e12)
    assert stand_in["xla_flops_per_step"] > 0

    suite = sections["suite"]["result"]
    assert suite["returncode"] == 0 and suite["counts"] == {"PASSED": 2} and suite["failed"] == []
    assert str(ROOT) not in json.dumps(r)  # committed results carry no machine's paths
    assert (tmp_path / "gpu.png").read_bytes()[:4] == b"\x89PNG"
