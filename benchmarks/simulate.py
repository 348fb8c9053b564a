"""Discrete-event simulator: N GRPO tasks on device groups, scheduled by the real `rlsched.scheduling.policy.Policy`.

    python -m benchmarks.simulate [--profile tiny_cpu | --from-metrics RUN/tasks/T/metrics.jsonl]
                                  [--tasks 1,2,4,8,16,32,64] [--placement disaggregated] [--steps 20]
                                  [--budget-gb X] [--groups G] [--measured 1=9.8,2=11.0] [--out DIR]

It answers "how much do I gain by running N tasks together?" beyond the N this machine can run, from
per-phase seconds measured by a bench run (`--from-metrics`) or published by others (`PUBLISHED`).

Design decisions (and why):
- **The same policy.** The simulator does what `rlsched.scheduling.scheduler.Scheduler` does: `request` a phase,
  `grant` with the clock, execute the grant's moves, `release`. Only the clock differs: a heap of
  events and a simulated time instead of asyncio and `time.monotonic`. Grant order, head-of-line
  blocking, LRU eviction and memory admission are therefore the scheduler's own, never re-modelled.
- **One step, as the TaskDriver runs it**: request ROLLOUT -> moves -> weight sync if the actor
  published a newer version (not on step 1: the engine starts with the actor's initial weights) ->
  generate -> release -> score rewards on the host (no lock) -> request TRAIN -> moves -> train and
  publish v+1 -> release. Deterministic: every step of a task costs the same; no jitter.
- **Lock round trips are four messages** of `lock_rtt_s / 4`: request (task -> scheduler), grant
  (scheduler -> task), release (task -> scheduler), ack (scheduler -> task). The lock is held from grant
  to release, so a hold is rtt/2 + moves + work, and a task alone pays one rtt per phase. This is how
  the driver measures, too: `time/lock_wait_s` holds the acquire's round trip and the onloads,
  `time/rollout_s` / `time/train_s` the release's round trip; `profile_from_metrics` undoes that.
- **Moves are charged to the grantee's hold**, in the order the policy lists them (evictions first,
  the grantee's onload last), at the profile seconds of the task whose role moves: the scheduler
  waits for the evictions before it hands the lease over, and the holder onloads before it works.
  An eviction never slows the victim (it holds no lease on that role: it is idle by definition).
- **Colocated contention.** A colocated group's rollout and train slots share the same devices; while
  both are working, each progresses at `shared_speed` of its solo speed (processor sharing; 0.5 =
  saturated devices time-sliced, no gain from overlap; 1.0 = no contention). Moves and messages don't
  contend. Disaggregated pools never contend.
- **Memory.** Each task registers with the policy as the experiment does (`resident=True`: roles
  created on device; what does not fit is offloaded at once, charged before its first request).
  `budget_bytes` is per pool, as `cluster.memory_budget_gb`: the colocated group's one pool, or each of
  a disaggregated group's two. After every grant the pools' used bytes are checked against their budget.

Not modelled (on purpose): compile/warm-up steps (profiles are steady state; `measured_makespan`
cuts the warm-up out of measured runs too), per-step jitter, host CPU contention between concurrent
reward scorers (each task's driver is its own process), bandwidth shared by concurrent moves, the
transient second parameter copy during a weight swap (docs/design.md, "What the design answers"), failures and
lease expiry.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlsched.scheduling.policy import Action, Move, Phase, Placement, Policy, Role

GiB = 2**30  # budgets and bytes, as rlsched's cluster.memory_budget_gb


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseProfile:
    """What one step of one task costs, per part of the step (seconds), and what its roles weigh (bytes)."""

    rollout_s: float  # generation under the ROLLOUT lock, weight sync excluded
    reward_s: float = 0.0  # host scoring between the phases, under no lock
    host_s: float = 0.0  # the driver's other work each step, under no lock (prompts, batches, metrics; compiles)
    train_s: float  # under the TRAIN lock: logprobs, advantages, GRPO updates, publishing v+1
    sync_s: float = 0.0  # weight sync actor -> engine inside ROLLOUT, paid when the engine is behind the actor
    engine_onload_s: float = 0.0  # host -> device of the engine (weights + KV cache), when a grant asks for it
    engine_offload_s: float = 0.0  # device -> host of the engine: an eviction, or its own task's other phase
    actor_onload_s: float = 0.0  # host -> device of the actor (params, optimizer state, reference)
    actor_offload_s: float = 0.0
    lock_rtt_s: float = 0.003  # one acquire + one release round trip to the scheduler (benchmarks.multitask)
    engine_bytes: int = 0  # what the policy accounts for the engine in its pool; 0: never under pressure
    actor_bytes: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_bytes"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"PhaseProfile.{field.name} must be a non-negative int of bytes, got {value!r}")
            elif not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"PhaseProfile.{field.name} must be a finite number of seconds >= 0, got {value!r}")

    def move_s(self, role: Role, action: Action) -> float:
        return getattr(self, f"{Role(role)}_{Action(action)}_s")

    @property
    def rollout_hold_s(self) -> float:
        """The ROLLOUT lock's hold in steady state with nothing to move: grant + sync + generate + release."""
        return self.rollout_s + self.sync_s + self.lock_rtt_s / 2

    @property
    def train_hold_s(self) -> float:
        return self.train_s + self.lock_rtt_s / 2

    @property
    def step_s(self) -> float:
        """One steady step of a task alone, nothing moving: both phases, rewards, two lock round trips."""
        return self.rollout_s + self.sync_s + self.reward_s + self.host_s + self.train_s + 2 * self.lock_rtt_s


# ---- published and example profiles ---------------------------------------------------------------------
#
# field_7b: docs/performance.md "The simulator's field profiles", one 7B task's run (4 GPUs, tp=4), seconds by
# phase over the whole run. The
# notes give run totals, not the number of steps; we assume 10 steps (FIELD_STEPS) and divide. Speedup,
# efficiency and busy fractions don't depend on that choice once there are a few steps; absolute steps/s do,
# and 10 simulated steps add back up to the published run's 753 s. Their three phases map onto our two:
#   sync_s           = update 6.3 (it runs under the ROLLOUT lock here)
#   rollout_s        = rollout 451.1;   train_s = train 110.8;   reward_s = 0 (not reported apart)
#   engine_onload_s  = pre-update 17.2 + post-update 65.1 + pre-rollout 14.1 = 96.4: everything it took to
#                      bring the engine from host to "ready with new weights" besides the sync itself
#   engine_offload_s = post-rollout 64.3;  actor_onload_s = pre-train 9.8;  actor_offload_s = post-train 14.2
# Switch costs then sum to 184.7 s = 24.5 % of 753.0, the notes' "~25 %". They offloaded every phase, so a
# budget that holds one role but not both (e.g. --budget-gb 200 colocated) reproduces the run; with room
# for both, nothing moves. Bytes: engine 114 GiB (the notes' "offload 121 GB -> 7 GB" on 4 GPUs); actor
# 16 bytes/param x 7.6e9 params (bf16 params and grads + fp32 master, Adam m and v: the ZeRO paper's
# count, not a measurement).
#
# field_4b: the notes give only the 4B task's total alone without offload (659.0 s), so its per-phase
# split is borrowed from the 7B run: sync + rollout + train (568.2 s without switches) scaled to 659.0 s,
# and switch seconds and engine bytes scaled by parameter count (4.0e9 / 7.6e9; moves are transfers).
# An assumption, stated as one: compare the 2-task projection with the notes' 878.9 / 967.3 s, don't fit.
#
# tiny_cpu: this machine, benchmarks/results/multitask (tiny addition task, disaggregated, solo medians
# of two tasks after warm-up): rollout 0.062 s and train 0.111 s as measured include the release's half
# round trip (1.4 ms), removed here; lock round trip p50 2.8 ms. Sync is inside rollout_s (that run did
# not time it apart). Bytes: rlsched.run.experiment.estimate_bytes of configs/demo_addition.yaml. Move seconds
# are unmeasured (0): time a colocated run with a budget and use --from-metrics for real ones.
FIELD_STEPS = 10
_7B_PARAMS, _4B_PARAMS = 7.6e9, 4.0e9
_4B_TIME, _4B_SIZE = 659.0 / (6.3 + 451.1 + 110.8), _4B_PARAMS / _7B_PARAMS

PUBLISHED: dict[str, PhaseProfile] = {
    "field_7b": PhaseProfile(
        rollout_s=451.1 / FIELD_STEPS, train_s=110.8 / FIELD_STEPS, sync_s=6.3 / FIELD_STEPS,
        engine_onload_s=(17.2 + 65.1 + 14.1) / FIELD_STEPS, engine_offload_s=64.3 / FIELD_STEPS,
        actor_onload_s=9.8 / FIELD_STEPS, actor_offload_s=14.2 / FIELD_STEPS,
        engine_bytes=114 * GiB, actor_bytes=int(16 * _7B_PARAMS)),
    "field_4b": PhaseProfile(
        rollout_s=451.1 * _4B_TIME / FIELD_STEPS, train_s=110.8 * _4B_TIME / FIELD_STEPS,
        sync_s=6.3 * _4B_TIME / FIELD_STEPS,
        engine_onload_s=(17.2 + 65.1 + 14.1) * _4B_SIZE / FIELD_STEPS,
        engine_offload_s=64.3 * _4B_SIZE / FIELD_STEPS,
        actor_onload_s=9.8 * _4B_SIZE / FIELD_STEPS, actor_offload_s=14.2 * _4B_SIZE / FIELD_STEPS,
        engine_bytes=int(114 * GiB * _4B_SIZE), actor_bytes=int(16 * _4B_PARAMS)),
    "tiny_cpu": PhaseProfile(rollout_s=0.060, reward_s=0.0027, train_s=0.110, lock_rtt_s=0.0028,
                             engine_bytes=11_275_520, actor_bytes=2_369_280),
}


def profile_from_metrics(rows: Sequence[dict], *, warmup: int = 2, lock_rtt_s: float | None = None,
                         engine_bytes: int = 0, actor_bytes: int = 0) -> PhaseProfile:
    """A profile from one task's metrics.jsonl rows: the median of each time after `warmup` steps (compile).

    Feed a run of the task *alone*: with one task, `time/lock_wait_s` is the two acquires' round trips
    plus the task's own moves, so the round trip can be read from it (or pass `lock_rtt_s`, e.g. the
    p50 benchmarks.multitask measures). The driver's `time/rollout_s` and `time/train_s` include the
    release's round trip (rtt/2), which the simulator adds back itself. Optional per-step keys:
    `time/sync_s` (the weight sync inside rollout), `time/onload_s`, `time/offload_s` (this task's moves);
    the rows don't say which role moved, so move seconds are split between engine and actor by bytes
    (transfers take time in proportion to bytes), evenly when the bytes are unknown. `host_s`: what a step's cycle
    (one `time/end_unix` to the next) holds besides its phases, rewards and lock waits (the driver sampling prompts,
    building the batch, writing metrics; 0 where the rows carry no end times): a task alone then steps at its
    measured rate, where without it the simulator ran it 14-16 % fast at a tiny task's 25 ms steps on this CPU.
    """
    rows = list(rows)
    steady = rows[warmup:]
    if not steady:
        raise ValueError(f"profile_from_metrics: {len(rows)} row(s), all within warmup={warmup}; run more steps")
    for key in ("time/rollout_s", "time/reward_s", "time/train_s", "time/lock_wait_s"):
        missing = [i for i, r in enumerate(steady, warmup) if key not in r]
        if missing:
            raise ValueError(f"profile_from_metrics: row(s) {missing[:5]} lack {key!r}; is this a metrics.jsonl "
                             "written by rlsched's TaskDriver?")

    def med(fn) -> float:
        return statistics.median(float(fn(r)) for r in steady)

    onload, offload = med(lambda r: r.get("time/onload_s", 0.0)), med(lambda r: r.get("time/offload_s", 0.0))
    if lock_rtt_s is None:
        lock_rtt_s = max(0.0, med(lambda r: r["time/lock_wait_s"] - r.get("time/onload_s", 0.0)
                                  - r.get("time/offload_s", 0.0)))
    share = engine_bytes / (engine_bytes + actor_bytes) if engine_bytes and actor_bytes else 0.5
    host = 0.0
    if warmup >= 1 and all("time/end_unix" in r for r in rows[warmup - 1:]):
        parts = ("time/rollout_s", "time/reward_s", "time/train_s", "time/lock_wait_s")
        host = max(0.0, statistics.median(rows[i]["time/end_unix"] - rows[i - 1]["time/end_unix"]
                                          - sum(rows[i][k] for k in parts) for i in range(warmup, len(rows))))
    return PhaseProfile(
        rollout_s=max(0.0, med(lambda r: r["time/rollout_s"] - r.get("time/sync_s", 0.0)) - lock_rtt_s / 2),
        reward_s=med(lambda r: r["time/reward_s"]), host_s=host,
        train_s=max(0.0, med(lambda r: r["time/train_s"]) - lock_rtt_s / 2),
        sync_s=med(lambda r: r.get("time/sync_s", 0.0)),
        engine_onload_s=onload * share, actor_onload_s=onload * (1 - share),
        engine_offload_s=offload * share, actor_offload_s=offload * (1 - share),
        lock_rtt_s=lock_rtt_s, engine_bytes=engine_bytes, actor_bytes=actor_bytes)


# ---- results ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SimEvent:
    time: float  # simulated seconds
    kind: str  # request | grant | move | work | release | step
    task: str  # the task it concerns (for a move: the task whose role moves)
    phase: str | None = None
    resource: str | None = None  # e.g. "g0/rollout"
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)  # grant: pools' used bytes; move: role...


@dataclasses.dataclass(frozen=True)
class SimResult:
    n_tasks: int
    placement: str
    groups: int
    steps: tuple[int, ...]  # per task
    makespan_s: float  # until the last task's last step ends
    finish_s: tuple[float, ...]  # per task: when its last step ended
    steps_per_s: float  # all tasks' steps / makespan
    sequential_s: float  # each task alone, one after the other (same placement and budget)
    speedup: float  # sequential_s / makespan_s
    bound_steps_per_s: float  # ideal_bound: nothing moves, no contention beyond shared_speed
    efficiency: float  # steps_per_s / bound_steps_per_s
    utilisation: dict[str, float]  # resource id -> fraction of the makespan its lock was held
    lock_wait_s: float  # all tasks: time queued at the scheduler (request arrived -> granted)
    task_lock_wait_s: tuple[float, ...]
    moves: int  # onloads + offloads, the ones at registration included
    onloads: int
    offloads: int
    switch_s: float  # seconds spent moving
    peak_used: dict[str, int]  # pool -> most bytes the policy accounted after any grant
    budgets: dict[str, int | None]
    events: tuple[SimEvent, ...] = dataclasses.field(repr=False, default=())

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "events"}
        out = json.loads(json.dumps(out))  # tuples -> lists, JSON-safe
        if events:
            out["events"] = [dataclasses.asdict(e) for e in self.events]
        return out


# ---- the simulation ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Work:
    remaining: float  # seconds left at full speed
    speed: float = 1.0
    since: float = 0.0
    token: int = 0  # the live work_end event's; older ones in the heap are stale


class _Sim:
    """The scheduler's loop on a simulated clock. Single use: build, `run()`, read the fields."""

    def __init__(self, profiles: Sequence[PhaseProfile], steps: Sequence[int], placement: str,
                 budget_bytes: int | None, groups: int, shared_speed: float):
        from rlsched.scheduling.policy import GroupSpec

        self.placement = Placement(placement)
        spec = (GroupSpec.colocated(budget_bytes) if self.placement is Placement.COLOCATED
                else GroupSpec.disaggregated(budget_bytes, budget_bytes))
        self.group_names = [f"g{i}" for i in range(groups)]
        self.policy = Policy(dict.fromkeys(self.group_names, spec))
        width = len(str(len(profiles) - 1))
        self.tasks = [f"t{i:0{width}d}" for i in range(len(profiles))]
        self.profile = dict(zip(self.tasks, profiles, strict=True))
        self.steps = dict(zip(self.tasks, steps, strict=True))
        self.group = {t: self.group_names[i % groups] for i, t in enumerate(self.tasks)}
        self.shared_speed = shared_speed
        self.heap: list[tuple[float, int, str, str, int]] = []
        self.seq = itertools.count()
        self.tokens = itertools.count(1)
        self.now = 0.0
        self.events: list[SimEvent] = []
        self.active: dict[str, dict[str, _Work]] = {g: {} for g in self.group_names}  # group -> task -> work
        self.next_phase = dict.fromkeys(self.tasks, Phase.ROLLOUT)
        self.done_steps = dict.fromkeys(self.tasks, 0)
        self.actor_version = dict.fromkeys(self.tasks, 0)
        self.engine_version = dict.fromkeys(self.tasks, 0)  # engines start with the actor's initial weights
        self.requested_at: dict[str, float] = {}
        self.granted_at: dict[str, float] = {}
        self.work_s: dict[str, float] = {}  # task -> work of the phase it was granted
        self.finish = dict.fromkeys(self.tasks, 0.0)
        self.lock_wait = dict.fromkeys(self.tasks, 0.0)
        self.held = {r.id: 0.0 for r in self.policy.resources()}
        self.onloads = self.offloads = 0
        self.switch_s = 0.0
        self.peak_used = dict.fromkeys(self.policy.pools(), 0)

    def leg(self, task: str) -> float:
        return self.profile[task].lock_rtt_s / 4  # one message between task and scheduler

    def push(self, at: float, kind: str, task: str, token: int = 0) -> None:
        heapq.heappush(self.heap, (at, next(self.seq), kind, task, token))

    def log(self, kind: str, task: str, phase: Phase | None = None, at: float | None = None, **detail) -> None:
        resource = None if phase is None else self.policy.resource(task, phase).id
        self.events.append(SimEvent(self.now if at is None else at, kind, task, phase and str(phase), resource,
                                    detail))

    def run(self) -> _Sim:
        for task in self.tasks:
            p = self.profile[task]
            moves = self.policy.register(task, self.group[task], p.engine_bytes, p.actor_bytes)
            self.push(self.execute(moves, task, 0.0) + self.leg(task), "request", task)
        while self.heap:
            self.now, _, kind, task, token = heapq.heappop(self.heap)
            getattr(self, f"on_{kind}")(task, token)
        return self

    def execute(self, moves: Sequence[Move], grantee: str, start: float) -> float:
        """Perform `moves` one after the other from `start`; returns their total seconds."""
        total = 0.0
        for m in moves:
            seconds = self.profile[m.task].move_s(m.role, m.action)
            self.log("move", m.task, at=start + total, role=str(m.role), action=str(m.action), seconds=seconds,
                     grantee=grantee)
            total += seconds
            if m.action is Action.ONLOAD:
                self.onloads += 1
            else:
                self.offloads += 1
        self.switch_s += total
        return total

    # ---- event handlers ----------------------------------------------------------------------------------

    def on_request(self, task: str, _token: int) -> None:
        phase = self.next_phase[task]
        self.policy.request(task, phase, self.now)
        self.requested_at[task] = self.now
        self.log("request", task, phase)
        self.dispatch()

    def dispatch(self) -> None:
        for grant in self.policy.grant(self.now):
            task, p = grant.task, self.profile[grant.task]
            used = {pool: self.policy.used_bytes(pool) for pool in self.policy.pools()}
            for pool, n in used.items():
                budget = self.policy.budget(pool)
                if budget is not None and n > budget:
                    raise AssertionError(f"policy granted {grant} with pool {pool} at {n} > budget {budget} bytes")
                self.peak_used[pool] = max(self.peak_used[pool], n)
            self.lock_wait[task] += self.now - self.requested_at[task]
            self.granted_at[task] = self.now
            self.log("grant", task, grant.phase, used=used, moves=len(grant.moves))
            start = self.now + self.leg(task)  # the grant reaches the task
            moving = self.execute(grant.moves, task, start)
            if grant.phase is Phase.ROLLOUT:
                stale = self.engine_version[task] != self.actor_version[task]
                self.engine_version[task] = self.actor_version[task]
                self.work_s[task] = p.rollout_s + (p.sync_s if stale else 0.0)
            else:
                self.work_s[task] = p.train_s
            self.push(start + moving, "work_start", task)

    def on_work_start(self, task: str, _token: int) -> None:
        group = self.group[task]
        self.settle(group)
        self.active[group][task] = _Work(self.work_s[task], since=self.now)
        self.reschedule(group)
        self.log("work", task, self.next_phase[task], seconds=self.work_s[task])

    def on_work_end(self, task: str, token: int) -> None:
        group = self.group[task]
        work = self.active[group].get(task)
        if work is None or work.token != token:
            return  # rescheduled since: its speed changed
        self.settle(group)
        del self.active[group][task]
        self.reschedule(group)
        if self.next_phase[task] is Phase.TRAIN:
            self.actor_version[task] += 1  # published v+1 at the end of TRAIN
        self.push(self.now + self.leg(task), "release", task)

    def on_release(self, task: str, _token: int) -> None:
        phase = self.next_phase[task]
        self.policy.release(task, phase, self.now)
        self.held[self.policy.resource(task, phase).id] += self.now - self.granted_at[task]
        self.log("release", task, phase)
        self.dispatch()
        ack = self.now + self.leg(task)
        if phase is Phase.ROLLOUT:
            self.next_phase[task] = Phase.TRAIN
            # the driver's other work is charged here too: no lock is held, so where in the step it falls does not
            # change when the task asks for its next lock
            self.push(ack + self.profile[task].reward_s + self.profile[task].host_s + self.leg(task), "request", task)
        else:
            self.push(ack, "step", task)

    def on_step(self, task: str, _token: int) -> None:
        self.done_steps[task] += 1
        self.log("step", task, step=self.done_steps[task])
        if self.done_steps[task] == self.steps[task]:
            self.finish[task] = self.now
        else:
            self.next_phase[task] = Phase.ROLLOUT
            self.push(self.now + self.leg(task), "request", task)

    # ---- colocated contention: processor sharing ---------------------------------------------------------

    def settle(self, group: str) -> None:
        for work in self.active[group].values():
            work.remaining -= (self.now - work.since) * work.speed
            work.since = self.now

    def reschedule(self, group: str) -> None:
        active = self.active[group]
        shared = self.placement is Placement.COLOCATED and len(active) > 1
        for task, work in active.items():
            work.speed, work.token = (self.shared_speed if shared else 1.0), next(self.tokens)
            self.push(self.now + max(work.remaining, 0.0) / work.speed, "work_end", task, work.token)


def _per_task(value, n_tasks: int, what: str) -> list:
    if isinstance(value, PhaseProfile | int):
        return [value] * n_tasks
    value = list(value)
    if len(value) != n_tasks:
        raise ValueError(f"{what}: got {len(value)} values for n_tasks={n_tasks}; give one, or one per task")
    return value


def simulate(profile_or_profiles: PhaseProfile | Sequence[PhaseProfile], n_tasks: int, *,
             placement: str = "disaggregated", steps: int | Sequence[int] = 20, budget_bytes: int | None = None,
             groups: int = 1, shared_speed: float = 0.5) -> SimResult:
    """Simulate `n_tasks` tasks (one profile for all, or one each) on `groups` device groups, tasks dealt to
    groups round-robin. `budget_bytes` is per pool (None: unlimited). See the module docstring."""
    if n_tasks < 1 or groups < 1:
        raise ValueError(f"simulate: need n_tasks >= 1 and groups >= 1, got n_tasks={n_tasks}, groups={groups}")
    if not 0 < shared_speed <= 1:
        raise ValueError(f"simulate: shared_speed must be in (0, 1], got {shared_speed!r}")
    profiles = _per_task(profile_or_profiles, n_tasks, "profiles")
    steps = _per_task(steps, n_tasks, "steps")
    if any(s < 1 for s in steps):
        raise ValueError(f"simulate: every task needs steps >= 1, got {steps}")
    sim = _Sim(profiles, steps, placement, budget_bytes, groups, shared_speed).run()
    solo: dict[tuple[PhaseProfile, int], float] = {}
    for p, s in zip(profiles, steps, strict=True):
        if (p, s) not in solo:
            solo[(p, s)] = max(_Sim([p], [s], placement, budget_bytes, 1, shared_speed).run().finish.values())
    sequential = sum(solo[(p, s)] for p, s in zip(profiles, steps, strict=True))
    makespan = max(sim.finish.values())
    rate = sum(steps) / makespan
    bound = ideal_bound(profiles, n_tasks, groups=groups, placement=placement, shared_speed=shared_speed)
    return SimResult(
        n_tasks=n_tasks, placement=str(Placement(placement)), groups=groups, steps=tuple(steps),
        makespan_s=makespan, finish_s=tuple(sim.finish.values()), steps_per_s=rate, sequential_s=sequential,
        speedup=sequential / makespan, bound_steps_per_s=bound, efficiency=rate / bound,
        utilisation={r: held / makespan for r, held in sim.held.items()},
        lock_wait_s=sum(sim.lock_wait.values()), task_lock_wait_s=tuple(sim.lock_wait.values()),
        moves=sim.onloads + sim.offloads, onloads=sim.onloads, offloads=sim.offloads, switch_s=sim.switch_s,
        peak_used=sim.peak_used, budgets={pool: sim.policy.budget(pool) for pool in sim.policy.pools()},
        events=tuple(sim.events))


def ideal_bound(profile_or_profiles: PhaseProfile | Sequence[PhaseProfile], n_tasks: int, *, groups: int = 1,
                placement: str = "disaggregated", shared_speed: float = 0.5) -> float:
    """Upper bound on aggregate steps/s when every task does the same number of steps and nothing moves.

    Per group, one round (each of its n tasks one step) needs sum(R) on the rollout slot and sum(T) on the
    train slot (R, T: lock holds, sync and round trips included), and no task goes faster than alone
    (step = R + reward + T + rtt). Identical tasks: min(1/max(R, T), n/step) steps/s. Colocated, the two
    slots share devices: their work (without messages) is also done at most at 2 * shared_speed at once.
    A steady-state bound: a short run can beat it by a hair, as step 1 needs no weight sync.
    """
    profiles = _per_task(profile_or_profiles, n_tasks, "profiles")
    total = 0.0
    for g in range(groups):
        mine = profiles[g::groups]
        if not mine:
            continue
        round_s = max(sum(p.rollout_hold_s for p in mine), sum(p.train_hold_s for p in mine),
                      max(p.step_s for p in mine))
        if Placement(placement) is Placement.COLOCATED:
            work = sum(p.rollout_s + p.sync_s + p.train_s for p in mine)
            round_s = max(round_s, work / (2 * shared_speed))
        total += len(mine) / round_s
    return total


# ---- projection, validation, report -------------------------------------------------------------------------

def project(profile: PhaseProfile, tasks: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), **kwargs) -> list[dict]:
    """One row per task count: simulate(profile, n, **kwargs) summarised for `format_table`."""
    rows = []
    for n in tasks:
        r = simulate(profile, n, **kwargs)
        busy = {p: [u for res, u in r.utilisation.items() if res.endswith(f"/{p}")] for p in Phase}
        rows.append(dict(
            tasks=n, makespan_s=r.makespan_s, steps_per_s=r.steps_per_s, speedup=r.speedup,
            bound_steps_per_s=r.bound_steps_per_s, efficiency=r.efficiency,
            rollout_busy=statistics.mean(busy[Phase.ROLLOUT]), train_busy=statistics.mean(busy[Phase.TRAIN]),
            lock_wait_per_task_s=r.lock_wait_s / n, moves=r.moves, switch_s=r.switch_s))
    return rows


def format_table(rows: Sequence[dict]) -> str:
    lines = ["| tasks | makespan (s) | steps/s | speedup vs sequential | bound steps/s | efficiency "
             "| rollout busy | train busy | lock wait/task (s) | moves | switch (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tasks']} | {r['makespan_s']:.4g} | {r['steps_per_s']:.4g} | {r['speedup']:.2f}x "
                     f"| {r['bound_steps_per_s']:.4g} | {r['efficiency']:.0%} | {r['rollout_busy']:.0%} "
                     f"| {r['train_busy']:.0%} | {r['lock_wait_per_task_s']:.3g} | {r['moves']} "
                     f"| {r['switch_s']:.3g} |")
    return "\n".join(lines)


def measured_makespan(task_rows: Sequence[Sequence[dict]], *, warmup: int = 2) -> tuple[float, int]:
    """(seconds, steps per task) of a bench run's steady window, to compare with simulate(..., steps=steps).

    `task_rows`: each task's metrics.jsonl rows of one run (1 task alone, or N together). The window
    opens when the first task starts its step `warmup + 1` (end_unix - step_s of that row) and closes
    when the last task ends its last step, so compile steps are left out as the profile leaves them out.
    """
    if not task_rows or any(len(rows) <= warmup for rows in task_rows):
        raise ValueError(f"measured_makespan: every task needs more than warmup={warmup} rows, got "
                         f"{[len(rows) for rows in task_rows]}")
    start = min(rows[warmup]["time/end_unix"] - rows[warmup]["time/step_s"] for rows in task_rows)
    end = max(rows[-1]["time/end_unix"] for rows in task_rows)
    return end - start, min(len(rows) for rows in task_rows) - warmup


def validate(measured: dict[int, float], profile: PhaseProfile, *, steps: int, tolerance: float = 0.10,
             **kwargs) -> dict[str, Any]:
    """Simulated vs measured makespan per task count. rel_error = (simulated - measured) / measured.

    `measured`: {n_tasks: seconds} over the same number of steps per task, e.g. from `measured_makespan`.
    `kwargs` go to `simulate` (placement, budget_bytes, groups, shared_speed): match the bench run's."""
    rows = []
    for n, seconds in sorted(measured.items()):
        simulated = simulate(profile, n, steps=steps, **kwargs).makespan_s
        rows.append(dict(tasks=n, measured_s=seconds, simulated_s=simulated,
                         rel_error=(simulated - seconds) / seconds))
    worst = max(abs(r["rel_error"]) for r in rows)
    return dict(rows=rows, max_abs_rel_error=worst, tolerance=tolerance, within_tolerance=worst <= tolerance)


def format_validation(result: dict[str, Any]) -> str:
    lines = ["| tasks | measured (s) | simulated (s) | error |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['tasks']} | {r['measured_s']:.4g} | {r['simulated_s']:.4g} | {r['rel_error']:+.1%} |"
              for r in result["rows"]]
    verdict = "within" if result["within_tolerance"] else "NOT within"
    lines.append(f"\nworst error {result['max_abs_rel_error']:.1%}: {verdict} the {result['tolerance']:.0%} goal")
    return "\n".join(lines)


# ---- CLI -----------------------------------------------------------------------------------------------------

def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _measured(text: str) -> dict[int, float]:
    try:
        return {int(n): float(s) for n, s in (item.split("=") for item in text.split(",") if item.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N=SECONDS pairs like 1=9.8,2=11.0, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulate", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--profile", choices=sorted(PUBLISHED), default="tiny_cpu")
    source.add_argument("--from-metrics", type=Path, metavar="METRICS_JSONL",
                        help="a task's metrics.jsonl from a run of it alone (see profile_from_metrics)")
    p.add_argument("--warmup", type=int, default=2, help="--from-metrics: steps left out as compile warm-up")
    p.add_argument("--lock-rtt-ms", type=float, help="--from-metrics: lock round trip, else read from the rows")
    p.add_argument("--engine-gb", type=float, help="engine bytes in GiB (overrides the profile's)")
    p.add_argument("--actor-gb", type=float, help="actor bytes in GiB (overrides the profile's)")
    p.add_argument("--tasks", type=_ints, default=(1, 2, 4, 8, 16, 32, 64))
    p.add_argument("--placement", choices=[str(x) for x in Placement], default="disaggregated")
    p.add_argument("--steps", type=int, default=20, help="steps per task")
    p.add_argument("--budget-gb", type=float, help="memory budget per pool in GiB (default: unlimited)")
    p.add_argument("--groups", type=int, default=1, help="device groups; tasks are dealt to them round-robin")
    p.add_argument("--shared-speed", type=float, default=0.5,
                   help="colocated: speed of each of two phases working at once on the same devices")
    p.add_argument("--measured", type=_measured, metavar="N=SECONDS,...",
                   help="measured makespans over --steps steps per task, to validate against")
    p.add_argument("--out", type=Path, help="write results.json and report.md here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_metrics is not None:
        from rlsched.observe.tracking import read_metrics

        rtt = None if args.lock_rtt_ms is None else args.lock_rtt_ms / 1e3
        profile, source = profile_from_metrics(read_metrics(args.from_metrics), warmup=args.warmup,
                                               lock_rtt_s=rtt), str(args.from_metrics)
    else:
        profile, source = PUBLISHED[args.profile], f"published profile {args.profile}"
    sizes = {f"{role}_bytes": int(gb * GiB) for role, gb in (("engine", args.engine_gb), ("actor", args.actor_gb))
             if gb is not None}
    profile = dataclasses.replace(profile, **sizes)
    budget = None if args.budget_gb is None else int(args.budget_gb * GiB)
    kwargs = dict(placement=args.placement, budget_bytes=budget, groups=args.groups, shared_speed=args.shared_speed)
    rows = project(profile, args.tasks, steps=args.steps, **kwargs)
    budget_text = "unlimited" if budget is None else f"{args.budget_gb:g} GiB per pool"
    parts = [f"Profile: {source}; {args.placement}, {args.groups} group(s), {args.steps} steps per task, "
             f"memory budget {budget_text}.", "",
             "Per step (s): " + ", ".join(f"{f.name} {getattr(profile, f.name):.4g}"
                                          for f in dataclasses.fields(profile) if f.name.endswith("_s")),
             f"Bytes: engine {profile.engine_bytes / GiB:.3g} GiB, actor {profile.actor_bytes / GiB:.3g} GiB.", "",
             format_table(rows), "",
             "speedup: sequential (each task alone, back to back) / makespan. bound: ideal_bound (nothing "
             "moves). busy: fraction of the makespan the lock was held, mean over groups."]
    results: dict[str, Any] = dict(profile=dataclasses.asdict(profile), source=source, rows=rows,
                                   args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    if args.measured:
        check = validate(args.measured, profile, steps=args.steps, **kwargs)
        results["validation"] = check
        parts += ["", "## Validation against measured makespans", "", format_validation(check)]
    report = "\n".join(parts)
    if args.out is None:
        print(report)
    else:
        from benchmarks.common import save_results

        save_results(args.out, "Multi-task scheduling simulation", results, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
