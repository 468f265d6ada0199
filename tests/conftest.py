"""Shared fixtures. The fake device count (8) is set by the repository's root conftest.py, which pytest loads
before this file and before anything imports JAX."""

import jax
import pytest

import spmdcomm as sc


@pytest.fixture(params=[1, 2, 4, 8], ids=lambda n: f"{n}dev")
def mesh(request):
    """A 1-D "data" mesh over the first 1, 2, 4 or 8 devices."""
    if jax.device_count() < request.param:
        pytest.skip(f"needs {request.param} devices")
    return sc.data_mesh(devices=jax.devices()[: request.param])
