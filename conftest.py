"""Repository-wide pytest set-up (tests, doctests in spmdcomm/ and README.md): 8 fake CPU devices.

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
