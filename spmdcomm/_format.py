"""How reports write sizes (:mod:`spmdcomm.explain`, a parallelism's section of it)."""

from __future__ import annotations

import math

__all__ = ["format_bytes"]


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
