"""Byte counts as people read them: one function for every number of bytes rlsched prints.

    format_bytes(3 * 2**20)                                  -> '3.00 MiB'
    need, free = 10 * 2**20, 3 * 2**20
    f"needs {format_bytes(need, like=[free])}, {format_bytes(free, like=[need])} free"
                                                             -> 'needs 10.00 MiB, 3.00 MiB free'

Design decisions (and why):
- **The unit is the largest in which every non-zero number shown together is at least 1.** Numbers a
  person compares (needed vs free vs budget) share one unit, and none reads 0.00 while it is not zero:
  a fixed GiB printed a 10 MiB task against 3 MiB of room as "needs 0.01 GiB, 0.00 free".
- **Binary units** (KiB = 1024 bytes), as device memory and budgets (`memory_budget_gb` is GiB) are counted.
"""

from __future__ import annotations

from collections.abc import Iterable

UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int, *, like: Iterable[int] = (), digits: int = 2) -> str:
    """`n` bytes in the largest unit in which `n` and every number of `like` that is not zero is >= 1 (see the
    module docstring); `digits` decimals, whole bytes below 1 KiB ('512 B')."""
    nonzero = [abs(x) for x in (n, *like) if x]
    smallest = min(nonzero, default=0)
    for unit, scale in UNITS:
        if smallest >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{int(n)} B"
