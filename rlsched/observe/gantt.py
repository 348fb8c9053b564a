"""timeline.png: a Gantt chart of a run, from its timeline events (rlsched.observe.timeline), and `rlsched timeline`'s
table beside it (`report`).

One row per (task, resource) and one host row per task; lock holds (ROLLOUT / TRAIN) are outlined
boxes with their finer spans filled inside, one colour per span name; lock waits are hatched on the
host row, beside the work done there outside the locks (reward; compile: a role's programs for new
shapes, built before its lock is asked for, a colour and a legend entry of its own; startup: the task's start and
its roles' construction, one colour); memory counters
("memory/<pool>", bytes by task) are stacked underneath on the same time axis. Readable for 1-4 tasks:
rows are labelled, seconds run along x, a legend names colours.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rlsched.base.errors import UsageError
from rlsched.observe.timeline import STARTUP, format_summary, read_trace, summarize
from rlsched.rundir.files import write_atomic

COLOURS = {
    "generate": "#4C72B0", "sync_weights": "#DD8452", "receive": "#DD8452", "swap": "#C44E52", "verify": "#937860",
    "train": "#55A868", "logprobs": "#8C8C8C", "update": "#55A868", "publish": "#8172B3", "onload": "#DA8BC3",
    "offload": "#CCB974", "onload_reference": "#DA8BC3", "offload_reference": "#CCB974", "reward": "#64B5CD",
    "lock_wait": "#FFFFFF",
    "compile": "#E8A33D", "checkpoint": "#2F4B7C", "startup": "#B7A8D6",
}
LOCK_EDGE = {"ROLLOUT": "#1F3A93", "TRAIN": "#1E7A34"}


def report(run_dir: str | Path, *, render: bool = True) -> str:
    """`rlsched timeline RUN_DIR`: the per-task table of a run; re-renders timeline.png if asked."""
    run_dir = Path(run_dir)
    events = read_trace(run_dir / "timeline.json")
    if render:
        plot_gantt(events, run_dir / "timeline.png", title=run_dir.name)
    return format_summary(summarize(events))


def plot_gantt(events: list[dict[str, Any]], path: str | Path, *, title: str | None = None) -> Path:
    """Draw the chart (`draw_gantt`) and write it to `path` as a PNG, atomically."""
    fig = draw_gantt(events, title=title)  # first: it picks the file-only backend before pyplot is used
    import matplotlib.pyplot as plt

    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return write_atomic(path, png.getvalue())


def draw_gantt(events: list[dict[str, Any]], *, title: str | None = None):
    """The chart as a matplotlib Figure (the caller closes it): its first axes hold the rows and the legend."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = [e for e in events if e.get("kind") == "span"]
    counters = [e for e in events if e.get("kind") == "counter" and e["name"].startswith("memory/")]
    if not spans:
        raise UsageError("no spans to draw: the timeline is empty")
    t0, t1 = min(e["start"] for e in spans), max(e["end"] for e in spans)
    tasks = sorted({e["task"] for e in spans if e["task"] is not None})
    rows: list[tuple[str, str]] = []
    for task in tasks:
        resources = sorted({e["resource"] for e in spans if e["task"] == task and e["resource"]})
        rows += [(task, r) for r in resources] + [(task, "host")]
    index = {row: i for i, row in enumerate(rows)}

    pools = sorted({c["name"] for c in counters})
    panels = max(1, len(pools))  # one memory panel per pool: stacking two pools would read as one total
    fig, axes = plt.subplots(1 + panels, 1, figsize=(12, 1.2 + 0.55 * len(rows) + 1.6 * panels), sharex=True,
                             gridspec_kw={"height_ratios": [max(2, len(rows))] + [1.6] * panels})
    ax, mems = axes[0], list(axes[1:])
    used, bars = set(), {}  # (how it is drawn, row, name) -> its (x, width) bars: one artist each, not one a span
    for e in sorted(spans, key=lambda e: (e["name"] not in LOCK_EDGE, e["start"])):  # lock boxes first, below
        if e["task"] is None:
            continue
        row = index[(e["task"], e["resource"] or "host")]
        x, w = e["start"] - t0, max(e["end"] - e["start"], 1e-4)
        if e["name"] in LOCK_EDGE:
            key = ("lock", row, e["name"])
        elif e["name"] == "lock_wait":
            key = ("wait", index[(e["task"], "host")], e["name"])
            used.add("lock_wait")
        elif e.get("phase") == STARTUP:  # a task's start and its roles' (imports, devices, the model): one colour
            key = ("span", index[(e["task"], "host")], "startup")
            used.add("startup")
        else:
            key = ("span", row, e["name"])
            used.add(e["name"] if e["name"] in COLOURS else "other")
        bars.setdefault(key, []).append((x, w))
    # A long run has tens of thousands of spans: an artist per span took minutes to draw (1,000 steps of two tasks:
    # ~2 min); an artist per (row, name) draws the same boxes at once.
    for (how, row, name), xs in bars.items():  # insertion order: lock boxes first, below the spans
        if how == "lock":
            ax.broken_barh(xs, (row - 0.42, 0.84), facecolors="none", edgecolors=LOCK_EDGE[name], linewidth=1.2)
        elif how == "wait":
            ax.broken_barh(xs, (row - 0.3, 0.6), facecolors="white", edgecolors="#999999", hatch="///",
                           linewidth=0.5)
        else:
            ax.broken_barh(xs, (row - 0.3, 0.6), facecolors=COLOURS.get(name, "#BBBBBB"), edgecolors="none")
    ax.set_yticks(range(len(rows)), [f"{t} · {r}" for t, r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(facecolor="none", edgecolor=c, label=f"{n} lock held") for n, c in LOCK_EDGE.items()]
    if "lock_wait" in used:
        legend.append(Patch(facecolor="white", edgecolor="#999999", hatch="///", label="lock wait"))
    legend += [Patch(color=COLOURS[n], label=n) for n in COLOURS if n in used and n != "lock_wait"]
    legend += [Patch(color="#BBBBBB", label="other")] if "other" in used else []
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "rlsched timeline")

    for pool, mem in zip(pools, mems, strict=False):
        series = sorted((c for c in counters if c["name"] == pool), key=lambda c: c["ts"])
        names = sorted({k for c in series for k in c["values"]})
        series.append({**series[-1], "ts": max(t1, series[-1]["ts"])})  # a level holds until the next change
        xs = [c["ts"] - t0 for c in series]
        ys = [[c["values"].get(n, 0.0) / 2**20 for c in series] for n in names]
        mem.stackplot(xs, *ys, step="post", labels=names, alpha=0.7)
        mem.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        mem.set_ylabel(f"{pool.removeprefix('memory/')}\nMiB", fontsize=8)
    if not pools:
        mems[0].text(0.5, 0.5, "no memory counters recorded", ha="center", va="center", transform=mems[0].transAxes)
    for mem in mems:
        mem.grid(alpha=0.3)
    mems[-1].set_xlabel("seconds since the run started")
    fig.tight_layout()
    return fig
