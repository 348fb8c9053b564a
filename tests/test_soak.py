"""A service that lives for weeks does not grow: two minutes of benchmarks/soak.py (submit / cancel / finish cycles
of tiny tasks on a real service, its roles in one device group's process as on GPU/TPU, a resident task training
there all along, a sweep of learning rates, the last cancelled tasks left unforgotten), its verdict checked: the
service's RSS, the device group process's RSS, programs and memory maps and every record the service keeps flat after
the warm-up (its bounds lowered so the soak reaches them), the resident's timeline whole though its events went to
disk meanwhile, every finished task's outputs complete, every task ended as its kind should, and no process left
after `rlsched down`."""

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
    assert {"group_rss", "group_maps", "group_programs", "records/scheduler events"} <= results["flat"].keys()
    assert results["resident_trace"]["ok"] and results["resident_trace"]["twice"] == 0, results["resident_trace"]
    # Each bound was reached (the records are flat because they are bounded, not because the soak was short).
    last = samples[-1]["sizes"]
    assert last["requests"] == soak.LIMITS["requests"] and last["grant log"] == soak.LIMITS["grants"], last
    # Cancelled tasks stay listed until forgotten or summarised: the soak leaves the last KEEP_CANCELLED unforgotten,
    # and the service lists limits["unfinished"] of them at most (older ones go to its history.jsonl)
    assert max(s["cancelled_listed"] for s in samples) == min(soak.KEEP_CANCELLED, soak.LIMITS["unfinished"], sum(
        s["state"] == "CANCELLED" for s in samples)), [s["cancelled_listed"] for s in samples]
    assert results["ok"] and (tmp_path / "soak.png").is_file()
