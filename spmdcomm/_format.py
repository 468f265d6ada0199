"""How reports write sizes (:mod:`spmdcomm.explain`, a parallelism's section of it), and how a layer names its
collectives for them."""

from __future__ import annotations

import math

__all__ = ["format_bytes", "format_flops", "LAYER_SCOPE"]

#: The prefix of a ``jax.named_scope`` around a layer's collectives (``"sc:" + the layer's path``): the optimised
#: HLO keeps it in each op's name, and :mod:`spmdcomm.explain` attributes the collectives to that layer.
LAYER_SCOPE = "sc:"


def format_bytes(n: int | None) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB with one decimal (``"n/a"`` for None).

    >>> format_bytes(512), format_bytes(1536), format_bytes(None)
    ('512 B', '1.5 KiB', 'n/a')
    """
    if n is None:
        return "n/a"
    if n < 1024:
        return f"{n} B"
    power = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**power:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"


def format_flops(n: float | None) -> str:
    """``n`` floating-point operations in FLOP, KFLOP, MFLOP, GFLOP, TFLOP or PFLOP (powers of 1000), one decimal.

    >>> format_flops(512), format_flops(16384), format_flops(2.5e12), format_flops(None)
    ('512 FLOP', '16.4 KFLOP', '2.5 TFLOP', 'n/a')
    """
    if n is None:
        return "n/a"
    if n < 1000:
        return f"{n:g} FLOP"
    power = min(int(math.log(n, 1000) + 1e-9), 5)
    power += power < 5 and round(n / 1000**power, 1) >= 1000  # 999,999 is 1.0 MFLOP, not 1000.0 KFLOP
    return f"{n / 1000**power:.1f} {('KFLOP', 'MFLOP', 'GFLOP', 'TFLOP', 'PFLOP')[power - 1]}"
