"""Byte counts as printed to people (rlsched.base.units.format_bytes), against strings worked out by hand."""

from __future__ import annotations

from rlsched.base.units import format_bytes

KiB, MiB, GiB = 2**10, 2**20, 2**30


def test_one_number_takes_the_largest_unit_it_fills():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.00 KiB"
    assert format_bytes(1536) == "1.50 KiB"  # 1536 / 1024
    assert format_bytes(3 * MiB + MiB // 4) == "3.25 MiB"
    assert format_bytes(20 * GiB) == "20.00 GiB"
    assert format_bytes(GiB - 1) == "1024.00 MiB"  # 1073741823 / 1048576 = 1023.999999, rounded at 2 decimals
    assert format_bytes(789_760, digits=1) == "771.2 KiB"  # 789760 / 1024 = 771.25 -> 771.2 (half to even)


def test_numbers_printed_together_share_a_unit_in_which_none_reads_zero():
    # The PENDING reason that read "needs 0.01 GiB per device, 0.00 free": 10.5 MiB needed, 3 MiB free of 20 MiB
    need, free, budget = 10 * MiB + MiB // 2, 3 * MiB, 20 * MiB
    shown = (need, free, budget)
    assert [format_bytes(n, like=shown) for n in shown] == ["10.50 MiB", "3.00 MiB", "20.00 MiB"]
    # The smallest decides: 512 KiB free beside a 20 GiB budget reads in KiB (20 GiB = 20971520 KiB)
    shown = (512 * KiB, 20 * GiB)
    assert [format_bytes(n, like=shown) for n in shown] == ["512.00 KiB", "20971520.00 KiB"]
    # Zero is zero in the others' unit; it does not drag them down to bytes
    assert [format_bytes(n, like=(0, 2 * GiB)) for n in (0, 2 * GiB)] == ["0.00 GiB", "2.00 GiB"]
    # Below 1 KiB, whole bytes
    assert [format_bytes(n, like=(100, 5 * MiB)) for n in (100, 5 * MiB)] == ["100 B", "5242880 B"]
