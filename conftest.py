"""Repository-wide pytest set-up (tests, doctests in spmdcomm/ and README.md): 8 fake CPU devices, and what
``-n auto`` means.

This file runs before anything imports JAX, so the device count takes effect; tests/conftest.py holds the
fixtures. Set XLA_FLAGS yourself to run the suite on another device count.
"""

import importlib.metadata
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite's programs compile fast: without XLA:CPU's backend (LLVM) optimisation and its expensive LLVM passes, and
# with its elemental emitters for fusions instead of the newer MLIR emitters. Compiling is most of the suite's time:
# together they took the suite from 17 to 11 minutes here (measured on jaxlib 0.10; on other versions only the
# optimisation level is set, since XLA ends the process on a flag it does not know). The collectives and buffers
# the tests read (explain, the collective counts) are the same; values agree with optimised programs' within float32
# rounding, and every comparison is with references computed in the same process (the processes tests start take
# the same flags: tests/conftest.py's compile_flags). Set any of these in XLA_FLAGS yourself
# (--xla_backend_optimization_level=2) to run the suite on other programs.
FAST_COMPILE = {"xla_backend_optimization_level": "0"}
if importlib.metadata.version("jaxlib").startswith("0.10."):
    FAST_COMPILE |= {"xla_cpu_use_fusion_emitters": "false", "xla_llvm_disable_expensive_passes": "true"}
for flag, value in FAST_COMPILE.items():
    if flag not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += f" --{flag}={value}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import spmdcomm as sc  # noqa: E402

# The shims of moved module paths (spmdcomm/_moved.py) warn when imported and hold no doctest;
# tests/test_architecture.py imports each of them.
collect_ignore = ["spmdcomm/train/strategy.py", "spmdcomm/train/layout.py", "spmdcomm/train/rng.py"]


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(jax=jax, np=np, sc=sc, jnp=jax.numpy)


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` starts one worker more than pytest-xdist's count (the cores), unless
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` says how many.

    Why: the multi-process tests spend about 90 core-seconds waiting with their cores idle (on a watchdog's or
    barrier's timeout, a grace period, a restart), and one more worker runs other tests meanwhile; the tests
    themselves use the same CPU time either way. On 2 cores the whole suite took 10:35 with 2 workers and 9:50
    with 3; at 2,108 tests, 12:11 with 3 and 12:31 with 4 (no idle core is left to fill by then).
    """
    count = yield
    return count if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else count + 1


# The test files that take longest (seconds of one worker, 2 cores, 3 workers), run first: --dist loadfile hands
# files to the workers in collection order, so short files left for the end fill the workers as they finish
# instead of one long file running alone. The order only changes when a test runs, never what it checks.
LONGEST_FIRST = (
    "test_docs.py",  # 303 s
    "test_lm_example.py",  # 150 s
    "test_expert_parallel.py",  # 110 s
    "test_pipeline.py",  # 105 s
    "test_recovery.py",  # 81 s
    "test_pipeline_1f1b.py",  # 78 s
    "test_example.py",  # 75 s
    "test_watchdog.py",  # 68 s
    "test_resnet_example.py",  # 63 s
    "test_weighted_loss.py",  # 47 s
    "test_multiprocess.py",  # 46 s
    "test_hybrid.py",  # 45 s
    "test_resume_splits.py",  # 44 s
    "test_moe.py",  # 42 s
)


def pytest_collection_modifyitems(items):
    """Runs the files of ``LONGEST_FIRST`` first, in that order; every file's own tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
