"""Expert parallelism: its place, empty for now. It lands as a registry entry (``spmdcomm.parallel.registry``): its
config, checks, step context and explain section, its Linen and NNX layers (at most three files here), and one
``register(...)`` line in ``spmdcomm/parallel/__init__.py`` (docs/architecture.md, "How to add a parallelism")."""

__all__: list[str] = []
