"""Repository-wide pytest set-up (tests, doctests in spmdcomm/ and README.md): 8 fake CPU devices, and what
``-n auto`` means.

This file runs before anything imports JAX, so the device count takes effect; tests/conftest.py holds the
fixtures. Set XLA_FLAGS yourself to run the suite on another device count.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import spmdcomm as sc  # noqa: E402


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
    with 3.
    """
    count = yield
    return count if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else count + 1
