"""A service that lives for weeks does not grow: two minutes of benchmarks/soak.py (submit / cancel / finish cycles
of tiny tasks on a real service), its verdict checked: the service's RSS and every record it keeps flat after the
warm-up (its bounds lowered so the soak reaches them), every finished task's outputs complete, every task ended as
its kind should, and no process left after `rlsched down`."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_two_minutes_of_submit_cancel_finish_cycles_leave_the_service_flat(tmp_path):
    from benchmarks import soak

    results = soak.main(["--minutes", "2", "--cycles", "1000", "--out", str(tmp_path)])
    samples = results["samples"]
    assert len(samples) >= 12, f"only {len(samples)} cycles in 2 minutes"
    kinds = {s["kind"] for s in samples}
    assert kinds == set(soak.KINDS), kinds
    assert results["wrong"] == [], results["wrong"]
    assert results["left"] == [] and results["incomplete"] == []
    grown = {name: f for name, f in results["flat"].items() if not f["flat"]}
    assert not grown, grown
    # Each bound was reached (the records are flat because they are bounded, not because the soak was short).
    last = samples[-1]["sizes"]
    assert last["requests"] == soak.LIMITS["requests"] and last["grant log"] == soak.LIMITS["grants"], last
    assert results["ok"] and (tmp_path / "soak.png").is_file()
