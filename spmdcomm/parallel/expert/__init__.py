"""Expert parallelism: its place, empty for now. It lands as the other parallelisms did: its modules here (what it is,
its Linen and NNX layers, its step hooks), and one import line in ``spmdcomm/parallel/__init__.py``."""

__all__: list[str] = []
