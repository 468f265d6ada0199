"""Repository-wide pytest set-up (tests, doctests in spmdcomm/ and README.md): 8 fake CPU devices, and what
``-n auto`` means.

This file runs before anything imports JAX, so the device count takes effect; tests/conftest.py holds the
fixtures. Set XLA_FLAGS yourself to run the suite on another device count.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite's programs compile without XLA:CPU's backend (LLVM) optimisation: compiling is most of the suite's time,
# and this takes a quarter off its CPU time. The HLO (what explain and the collective counts read) and its buffers
# are the same; values agree with optimised programs' within float32 rounding, and every comparison is with
# references computed in the same process (the processes tests start take their own flags). Add
# --xla_backend_optimization_level=2 to XLA_FLAGS to run the suite on optimised programs.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
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
    "test_docs.py",  # 210 s
    "test_hybrid.py",  # 180 s
    "test_recovery.py",  # 117 s
    "test_tree_sharding.py",  # 105 s
    "test_example.py",  # 99 s
    "test_autodiff.py",  # 95 s
    "test_sharded.py",  # 87 s
    "test_batchnorm.py",  # 84 s
    "test_resnet_example.py",  # 78 s
    "test_rng.py",  # 67 s
    "test_ddp_equivalence.py",  # 53 s
    "test_ddp.py",  # 50 s
    "test_multiprocess.py",  # 49 s
    "test_resume_splits.py",  # 44 s
)


def pytest_collection_modifyitems(items):
    """Runs the files of ``LONGEST_FIRST`` first, in that order; every file's own tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
