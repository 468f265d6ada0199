"""The package version, in one place.

Kept free of imports so that building the package (``pyproject.toml`` reads this attribute) and
tools that only want the version never import JAX.
"""

__version__ = "0.2.0"
