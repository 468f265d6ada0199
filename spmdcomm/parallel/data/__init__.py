"""Data parallelism: the ``Strategy`` interface and its hooks (``strategy``), DDP, ZeRO-1/2 and their registry
``BY_NAME`` (``strategies``), FSDP (``fsdp``), and each leaf's spec, stored shape and the collectives that move split
leaves (``layout``, over ``_specs``, ``_blocks`` and ``_flat``). A new strategy subclasses ``Strategy`` in a module of
its own here and registers itself in ``strategies.BY_NAME``."""

from spmdcomm.parallel.data.fsdp import FSDP
from spmdcomm.parallel.data.layout import TreeLayout
from spmdcomm.parallel.data.strategies import DDP, STRATEGIES, ZeRO1, ZeRO2
from spmdcomm.parallel.data.strategy import ReduceContext, Strategy

__all__ = ["Strategy", "ReduceContext", "TreeLayout", "DDP", "ZeRO1", "ZeRO2", "FSDP", "STRATEGIES"]
