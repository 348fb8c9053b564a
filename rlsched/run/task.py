"""One task: its lifecycle (start, resume, close) and its one step loop.

`TaskDriver.step` reads as docs/design.md's "One step of one task": draw prompts -> compile the engine's
programs for them and the actor's for the batch they will make, if new, the two at once (outside any lock) ->
hold ROLLOUT (onload the engine if asked; sync + verify + generate) -> score rewards and pad the batch on the
host -> hold TRAIN (onload the actor if asked; advantages, updates, publish v+1; the metrics line; a checkpoint
when due). The same loop runs everywhere; what differs is plugged in:

    TaskDriver(spec, FreeLocks(task))                        # --in-process: always-free locks, roles here
    TaskDriver(spec, SchedulerLocks(scheduler, task), sites=where)   # a Ray actor per task, roles as
                                                                        # Ray actors in the device group
Design decisions (and why):
- **The driver holds no weights and never imports JAX.** Weights stay in the roles and travel actor ->
  engine through the task's comm channel; the driver forwards a message. On a TPU host a process that
  touched JAX would claim the chips.
- **One call per role per phase** (rlsched.run.roles): each returns its spans and its memory probe, so a
  step costs two role round trips and two lock acquisitions, nothing else.
- **Every move goes through `memory.Residency`**, which updates this task's pool, mirrors it into the
  scheduler's, and records an onload/offload span. Moves come from our own grant (inside `hold`) or
  from the scheduler evicting an idle role for another task (`move`, on another thread of the driver's
  actor); one lock serialises them.
- **A lock hold is one span named after the phase** (ROLLOUT / TRAIN) on the lock's resource, and every
  finer span of the phase carries the same resource, so the trace shows the lock exactly.
- **The metrics line and the checkpoint are written inside the TRAIN hold**: the actor's state is
  resident and nobody can evict it mid-save, and the line of step N is on disk before checkpoint N, so a
  resumed run never lacks a line.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from rlsched.base.errors import RoleDied, TaskError
from rlsched.cluster.group_process import GroupProcesses, GroupProcessRole
from rlsched.cluster.ray_cluster import RoleSites
from rlsched.cluster.rolegroup import RoleGroup
from rlsched.config.spec import TaskSpec
from rlsched.observe.timeline import STARTUP, Timeline
from rlsched.observe.tracking import make_trackers, read_metrics
from rlsched.run.evaluation import EvalWork, eval_line, evaluated
from rlsched.run.export import export_final
from rlsched.run.phases import HostWork, check_model_path, progress_line, step_metrics
from rlsched.run.roles import ActorRole, EngineRole, PhaseResult, RemoteRole, channel_for, spawn
from rlsched.scheduling.memory import MemoryPool, Residency
from rlsched.scheduling.policy import Phase, Role
from workers.compiling import at_once  # JAX-free: threads


class TaskDriver:
    def __init__(self, spec: TaskSpec, locks, *, sites: RoleSites | None = None, resume: bool = False,
                 echo=None, initial_moves=(), channel: str | None = None):
        self.spec, self.name, self.locks = spec, spec.name, locks
        self.sites, self.resume, self.echo = sites, resume, echo or _print_flushed
        self.timeline = Timeline("driver", task=spec.name)
        self.channel = channel_for(spec, sites, channel)
        self.roles: dict[Role, Any] = {}
        self.residency: dict[Role, Residency] = {}
        self.memory: dict[Role, dict[str, int]] = {Role.ACTOR: {}, Role.ENGINE: {}}  # last probe of each role
        self.where: dict[str, str] = {}  # phase and resource of the lock held now
        self.step_done = 0
        self.places: dict[str, dict[str, Any]] = {}  # role -> {"pid", "devices"}: which process holds what (poll)
        self.saved_step = 0  # the last step with a checkpoint (0: none)
        self._latest: dict[str, float] = {}  # the last step's reward and time, for `poll`
        self._step_seconds: list[float] = []
        # What this task does now, as `poll` shows it: the phase's words and the lock held or waited for, set in
        # one assignment so that a reader on another thread sees the two of one moment (rlsched status's columns)
        self._doing: dict[str, Any] = {"phase": None, "lock": None}
        self._resources: dict[str, str] = {}  # phase -> the lock's resource, once granted (named while waiting)
        self._stop = threading.Event()  # request_stop: end after the step in progress
        self.tracker = None
        self._initial_moves = list(initial_moves)  # offloads the policy decided at registration
        self._started = threading.Event()
        self._moving = threading.Lock()
        self._closed = False
        self.restarts: list[str] = []  # why each role restart happened ("step 4: its engine process died ...")
        self._charged = 0  # restarts that count against max_restarts (not those a fence of another task caused)
        self._prepared: set[tuple[int, int]] = set()  # batch shapes the actor has compiled for
        self.eval: EvalWork | None = None  # the held-out evaluation's host side (tasks[i].eval)
        self._evaluated = -1  # the last step whose weights were evaluated (0: the starting weights)
        self._loader_start: dict | None = None  # the data position before the first step (a restart without
                                                # a checkpoint goes back to it)

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the roles (the actor first: it makes the model when a preset asks), resume from the last
        checkpoint if asked, publish the weights, and do the offloads the policy asked for at registration. A span
        `start` (phase STARTUP) holds it; the roles' own (imports, devices, load_model, ...) come with their first
        results."""
        started = self.timeline.now()
        try:
            m = self.spec.config.model
            path = check_model_path(self.spec)
            made = (path / "config.json").is_file()
            if self.spec.announces_model and m.init_preset is not None and not made:
                self.echo(f"[{self.name}] creating a random {m.init_preset} Qwen3 at {path}")
            # The tokenizer, the prompts and the reward (host work, no device) load while the roles are built, where
            # the model's files exist already (else the actor makes them first)
            host = _in_background(self._host_work) if made else None
            actor = self.roles[Role.ACTOR] = spawn(ActorRole, self.spec, channel=self.channel, sites=self.sites,
                                                   take_port=self.locks.take_port)
            if not made and isinstance(actor, RemoteRole | GroupProcessRole):
                actor.wait_built()  # its build (in the background) makes the model, which the engine then loads
            # Once the model exists, the engine is built beside the actor: a role in another process (its own or
            # its device group's) is built in the background from its spawn, and its first call waits for it
            if (path / "config.json").is_file():
                host = host or _in_background(self._host_work)
                self._spawn_engine()
            meta, self.published = actor.start(self.resume)  # what the engine must hold
            self.host = host.result() if host is not None else self._host_work()
            self.eval = EvalWork.of(self.spec, self.host) if self.spec.config.eval is not None else None
            if Role.ENGINE not in self.roles:  # the actor made the model: now the engine can load it
                self._spawn_engine()
            self.tracker = make_trackers(self.spec.tracking, run_dir=self.spec.dir, experiment=self.spec.experiment,
                                         task=self.name, hparams=self.spec.config.model_dump(mode="json"))
            self._register_fence_targets()
            self._resume_from(meta)
            self._loader_start = self.host.loader.state()
            self.places = {str(role): r.where() for role, r in self.roles.items()}
            self.echo(f"[{self.name}] " + ", ".join(_place_text(role, p) for role, p in self.places.items()))
            for role, p in self.places.items():
                if "members" in p:  # a role across hosts: which node each member ran on, in the trace
                    now = self.timeline.now()
                    self.timeline.add_span("role_group", now, now, role=role, hosts=[m["host"] for m in p["members"]],
                                           nodes=[m["node_id"] for m in p["members"]],
                                           pids=[m["pid"] for m in p["members"]], coordinator=p["coordinator"],
                                           guarded=[m["guarded"] for m in p["members"]])
            pool = MemoryPool(self.name)
            self.residency = {role: Residency(pool, self.name, str(role), onload=w.onload, offload=w.offload,
                                              timeline=self.timeline, resident=True, sizes=w.memory(),
                                              on_change=self._report_memory)
                              for role, w in self.roles.items()}
            for role, action in self._initial_moves:
                self._move(role, action)
        finally:
            self.timeline.add_span("start", started, self.timeline.now(), phase=STARTUP)
            self._started.set()

    def _host_work(self) -> HostWork:
        with self.timeline.span("host_work", phase=STARTUP):  # the tokenizer, the prompt loader, the reward
            return HostWork(self.spec, self.echo)

    def _register_fence_targets(self) -> None:
        """Tell the scheduler what it stops before passing on this task's lock or memory, if it must fence it."""
        targets = []
        for r in self.roles.values():
            if isinstance(r, RemoteRole | GroupProcessRole | RoleGroup):
                target = r.fence_target()
                targets += target if isinstance(target, list) else [target]  # a group: one per member
        self.locks.register_roles(targets)

    def _spawn_engine(self) -> None:
        self.roles[Role.ENGINE] = spawn(EngineRole, self.spec, channel=self.channel, sites=self.sites,
                   take_port=self.locks.take_port)

    def _resume_from(self, meta: dict[str, Any] | None) -> None:
        if not self.resume:
            return
        if meta is None:
            self.echo(f"[{self.name}] --resume: no checkpoint in {self.spec.checkpoint_dir}; starting fresh")
            self.tracker.truncate_after(0)  # rows of steps that were never saved are replayed
            return
        self.host.loader.load_state(meta["loader"])
        self.step_done = self.saved_step = int(meta["step"])
        self.tracker.truncate_after(self.step_done)  # lines written after the checkpoint are replayed
        if self.eval is not None and evaluated(read_metrics(self.spec.dir / "metrics.jsonl"), self.step_done):
            self._evaluated = self.step_done  # its weights' evaluation is on file: not run again
        self.echo(f"[{self.name}] resumed after step {self.step_done} (weights v{meta['version']})")

    def run(self, until: int | None = None) -> list[dict[str, Any]]:
        """Start, run the remaining steps (or stop after step `until`), close; returns this call's metrics.
        A role that dies is restarted (`max_restarts`) and the lost steps redone; any other failure is reported
        to the locks (the scheduler frees this task's lease) and raised."""
        history: dict[int, dict[str, Any]] = {}  # step -> its metrics
        try:
            self.start()
            last = self.spec.config.steps if until is None else min(until, self.spec.config.steps)
            while self.step_done < last and not self._stop.is_set():
                n, position = self.step_done + 1, self.host.loader.state()
                try:
                    if self._eval_due():  # the weights of the step done (0: before the first), before step n
                        self.evaluate(self.step_done)
                    history[n] = self.step(n)
                except BaseException as err:
                    _annotate(err, f"task {self.name}, step {n}")  # where, beside what (the error's own message)
                    if not self._restart_after(err, n, position):
                        raise
                    history = {k: v for k, v in history.items() if k <= self.step_done}  # redone from there
                    continue
                if len(history) == 1 and not self.restarts:  # the first step of this run
                    self.echo(self.memory_vs_plan(n))
            if self._stop.is_set():
                self.save_on_stop()
            elif self._eval_due():  # after the last step
                self.evaluate(self.step_done)
        except BaseException as err:
            self.close(exit_code=1)  # roles stopped first: their memory is really free when the scheduler hears
            with contextlib.suppress(Exception):  # the scheduler may be gone too; the error below says why
                self.locks.fail(f"{type(err).__name__}: {err}")
            raise
        self.close()
        self.export_final()  # after close: the last checkpoint's files are on disk
        return [history[k] for k in sorted(history)]

    # ---- restarts -------------------------------------------------------------------------------------

    def _restart_after(self, err: BaseException, n: int, position: dict) -> bool:
        """If `err` is a role's death and restarts are left, replace that role and put the task back where the
        redo starts (a dead engine: step `n`, whose prompts were drawn at data `position`; a dead actor: its
        last checkpoint). False when the error is not for a restart (it is raised, with a note on why not)."""
        died = _role_death(err)
        if died is None:
            return False
        limit = self.spec.config.max_restarts
        lost = self._lost_with(died)
        if not lost:
            if limit:
                err.add_note("not restarted: the device group's processes span hosts and form one JAX job, which a "
                             "new process cannot rejoin; max_restarts restarts roles within one host")
            return False
        if self.locks.revoked() is not None:  # the scheduler stopped our roles itself: it took the task's lease
            return False
        collateral = self._collateral(died)
        if collateral is None and self._charged >= limit:
            if limit:
                err.add_note(f"after {limit} restart(s) (max_restarts={limit}): " + "; ".join(self.restarts))
            return False
        self._charged += collateral is None
        cause = f"{died}" if collateral is None else f"{collateral}: {died}"
        self.restarts.append(f"step {n}: {cause}")
        what = " and ".join(map(str, lost))
        count = "not counted against max_restarts: this task did not cause it" if collateral else \
            f"{self._charged} of max_restarts={limit}"
        self.echo(f"[{self.name}] step {n}: {cause}; restarting its {what} ({count})")
        for role in lost:  # the actor first: where it goes back to decides where the engine's redo starts
            with self.timeline.span("restart", role=str(role), step=n, cause=cause, charged=collateral is None):
                try:
                    self._replace(role)
                except BaseException as again:  # the new process died before the task went on: the next death,
                    if _role_death(again) is None:  # counted and reported like any (every cause in its note)
                        raise
                    _annotate(again, f"task {self.name}, step {n}, restarting its {role}")
                    if self._restart_after(again, n, position):
                        return True
                    raise
        if Role.ACTOR not in lost:
            self.host.loader.load_state(position)  # the step is redone with the same prompts, the same weights
        pids = ", ".join(f"{role} pid {self.places[str(role)]['pid']}" for role in lost)
        self.echo(f"[{self.name}] {what} restarted ({pids}); going on from step {self.step_done + 1}")
        return True

    def _collateral(self, died: RoleDied) -> str | None:
        """Why the device-group process behind `died` was ended to fence another task (rlsched.scheduling.fencing), or
        None: its own death, or one this task caused."""
        if not died.shared:
            return None
        role = Role(died.role)
        return self.locks.collateral(self.roles[role].handle, self.places[str(role)]["pid"])

    def _lost_with(self, died: RoleDied) -> list[Role]:
        """The roles of this task that died with `died`'s process, the actor first: its role alone, or every role
        of this task a device group's process held (both, when colocated). None when that host cannot come back
        (a group across hosts: rlsched.cluster.group_process)."""
        role = Role(died.role)
        if not died.shared:
            return [role]
        dead = self.roles[role]
        if not isinstance(dead, GroupProcessRole) or isinstance(self.sites.processes[str(role)], GroupProcesses):
            return []
        return [r for r in (Role.ACTOR, Role.ENGINE)
                if isinstance(self.roles.get(r), GroupProcessRole) and self.roles[r].handle == dead.handle]

    def _replace(self, role: Role) -> None:
        """A new process for `role`, put where the dead one was (on device or on host). A new actor restores the
        last checkpoint (or starts as the task did, without one) and the steps after it are redone; a new engine
        gets the actor's weights at its next ROLLOUT (sync and verify, as every engine does)."""
        cls = ActorRole if role is Role.ACTOR else EngineRole
        with self._moving:  # an eviction waits for the new process, then moves it
            with contextlib.suppress(Exception):  # make sure nothing of the old one is left (it may be gone)
                self.roles[role].terminate()
            self.roles[role] = fresh = spawn(cls, self.spec, channel=self.channel, sites=self.sites,
                   take_port=self.locks.take_port)
            if role is Role.ACTOR:
                meta, self.published = fresh.start(True)  # the latest complete checkpoint, if any
                if meta is None:
                    self.host.loader.load_state(self._loader_start)
                    self.step_done = self.saved_step = 0
                else:
                    self.host.loader.load_state(meta["loader"])
                    self.step_done = self.saved_step = int(meta["step"])
                self.tracker.truncate_after(self.step_done)  # the lines of the steps redone are written again
                self._prepared.clear()  # a new process has compiled nothing
            self.residency[role].replace_worker(onload=fresh.onload, offload=fresh.offload, sizes=fresh.memory(),
                                                cause="restart")
            self._register_fence_targets()
            self.places[str(role)] = fresh.where()

    def close(self, exit_code: int = 0) -> None:
        """Finish the trackers (a non-zero exit code marks them failed), close the roles and end the
        processes of those that run in one, then tell the lock provider. Each close runs even if an earlier
        one raised; what fails is said, never hidden. Idempotent."""
        with self._moving:  # an eviction either completes before the roles go, or finds them gone
            if self._closed:
                return
            self._closed = True
        closes = [("trackers", lambda: self.tracker and self.tracker.finish(exit_code))]
        for role, r in self.roles.items():
            closes.append((f"{role} close", r.close))
            if isinstance(r, RemoteRole | GroupProcessRole | RoleGroup):
                closes.append((f"{role} process", r.terminate))
        closes.append(("locks", self.locks.close))
        for what, close in closes:
            try:
                close()
            except Exception as err:  # noqa: BLE001 - a dead role cannot close; go on with the rest
                self.echo(f"[{self.name}] {what} failed: {type(err).__name__}: {err}")

    # ---- one step -----------------------------------------------------------------------------------

    def step(self, n: int) -> dict[str, Any]:
        """One GRPO step; returns its metrics line."""
        t = _Clock()
        prompts = self.host.next_prompts()  # host work stays outside the locks
        t.mark("compile_rollout")
        # Compile before the lock, not in it: the engine's programs for these prompts, and the actor's for the batch
        # their rollout will make (its shape is the prompts'), the two at once
        self.prepare({Role.ENGINE: (prompts.ids, self.host.sampling_params(n)),
                      **self._actor_shapes(self.host.train_shape(prompts))})
        t.mark("ask_rollout")
        with self.hold(Phase.ROLLOUT) as lease:
            t.mark("rollout")
            # In a hold shared with its base group's tasks, the engine runs all their rows at once (lease.together)
            rollout = self.call(Role.ENGINE, "rollout", self.published, prompts.ids, self.host.sampling_params(n),
                                lease.together())
        t.mark("score")
        with self.timeline.span("reward"):
            rewards, reward_errors = self.host.score(prompts, rollout.value)
        batch = self.host.train_batch(prompts, rollout.value)  # padding; the actor adds the advantages
        t.mark("compile_train")
        self.prepare(self._actor_shapes((batch.size, batch.tokens.shape[1])))  # compiled above, unless a shape
        t.mark("ask_train")                                                      # other than foreseen
        with self.hold(Phase.TRAIN) as lease:
            t.mark("train")
            # advantages, updates, publish v+1; in a hold shared with tasks of the same update program, the
            # optimizer steps of all of them run as one (lease.together)
            train = self.call(Role.ACTOR, "train", batch, rewards, n, lease.together())
            self.published = train.message
            t.mark("end")
            metrics = step_metrics(rollout.value, rewards, reward_errors, train.value, self.published.version, {
                "time/rollout_s": t["rollout", "score"], "time/reward_s": t["score", "compile_train"],
                # the programs' compiles (a no-op round trip once the shapes were seen), apart from any phase
                "time/compile_s": t["compile_rollout", "ask_rollout"] + t["compile_train", "ask_train"],
                "time/train_s": t["train", "end"], "time/step_s": t["start", "end"],
                "time/lock_wait_s": t["ask_rollout", "rollout"] + t["ask_train", "train"],
                "time/end_unix": time.time()})
            metrics.update(prompts.metrics)  # data/skipped_too_long, data/truncated (data.too_long)
            # the update's tokens: prompt + completion (what it learns from), and rows x padded length (what its
            # programs compute; a FLOP count for the device's utilisation, benchmarks/gpu.py)
            metrics["train/tokens"] = int(batch.attention_mask.sum())
            metrics["train/padded_tokens"] = int(batch.tokens.size)
            metrics["fault/restarts"] = len(self.restarts)  # those a fence of another task caused included
            metrics["fault/restarts_charged"] = self._charged
            self.record(n, metrics, train.value)
            self.checkpoint_if_due(n)
        return metrics

    def _eval_due(self) -> bool:
        """Whether the weights of the step done are to be evaluated now (and were not yet): the starting ones
        with eval.before, every eval.every steps, and the last step's always."""
        e, n = self.spec.config.eval, self.step_done
        if e is None or self._evaluated == n:
            return False
        return (n == 0 and e.before) or (n > 0 and bool(e.every) and n % e.every == 0) or n == self.spec.config.steps

    def evaluate(self, n: int) -> dict[str, Any]:
        """Score the weights of step `n` on the held-out problems: the engine generates under the ROLLOUT lock like
        any generation (brought up to the published weights first); the rewards are scored on the host, and the
        metrics join step n's row in metrics.jsonl (a row of their own, merged by step when read)."""
        t0 = time.perf_counter()
        params = self.eval.sampling_params(n)
        # compile before the lock, not in it; before the first step, the actor's programs for its batch at the same
        # time where its shape is known without its prompts (grpo.prompt_padding "max")
        first = self._actor_shapes(self.host.train_shape()) if n == 0 else {}
        self.prepare({Role.ENGINE: (self.eval.prompts.ids, params), **first})
        # (the span's arguments are read once the lock is held: self.where names it)
        with self.hold(Phase.ROLLOUT) as lease, self.timeline.span("eval", step=n, problems=len(self.eval.prompts.ids),
                                                                  **self.where):
            # a co-batched hold's other tasks do not wait for these rows: the engine withdraws from it first
            output = self.call(Role.ENGINE, "evaluate", self.published, self.eval.prompts.ids, params,
                               lease.together())
        with self.timeline.span("reward", step=n, eval=True):
            metrics = self.eval.score(output.value)
        metrics["time/eval_s"] = time.perf_counter() - t0
        self.tracker.log(n, metrics)
        self._evaluated = n
        self.echo(eval_line(self.name, n, metrics, metrics["time/eval_s"]))
        return metrics

    @contextlib.contextmanager
    def hold(self, phase: Phase):
        """Hold `phase`'s lock; first perform the moves the grant asks of this task (onload, offload)."""
        asked = self.timeline.now()
        self._doing = {"phase": f"waiting for {phase}",
                       "lock": {"phase": str(phase), "resource": self._resources.get(str(phase)), "holds": False,
                                "since": asked}}
        try:
            lease = self.locks.acquire(phase)
        finally:
            self._doing = {"phase": None, "lock": None}
        self.where = {"phase": str(phase), "resource": lease.resource}
        granted = self.timeline.now()
        self._resources[str(phase)] = lease.resource
        self._doing = {"phase": f"{phase} ({lease.resource})",
                       "lock": {"phase": str(phase), "resource": lease.resource, "holds": True, "since": granted}}
        self.timeline.add_span("lock_wait", asked, granted, **self.where)
        try:
            with self.timeline.span(str(phase).upper(), **self.where):
                for m in lease.moves:
                    if m.task == self.name:
                        self._move(str(m.role), str(m.action))
                yield lease
        finally:
            self.where = {}
            self._doing = {"phase": None, "lock": None}
            self.locks.release(phase)

    def call(self, role: Role, method: str, *args) -> PhaseResult:
        """A phase's one call on `role`: its spans join our timeline on the lock held, its probe is kept."""
        try:
            result = getattr(self.roles[role], method)(*args)
        except BaseException as err:
            _annotate(err, f"in the {role}'s {method}()")
            raise
        held = self.where
        self.timeline.extend([{**e, **{k: v for k, v in held.items() if e.get(k) is None}} for e in result.events])
        self.memory[role] = result.memory
        return result

    def _actor_shapes(self, shape: tuple[int, int] | None) -> dict[Role, tuple[int, int]]:
        """{ACTOR: shape} for `prepare` if the actor has not compiled for train batches of `shape` (rows, length)."""
        return {} if shape is None or shape in self._prepared else {Role.ACTOR: shape}

    def prepare(self, wanted: dict[Role, tuple]) -> None:
        """Have each role of `wanted` compile its next phase's programs for these shapes (the arguments of its
        `prepare`) now, before a lock is asked for: no task compiles while it holds a lock, and tasks compile at
        once, each in its own role processes. The roles compile at once too, each on a thread of ours (a remote
        role in its own process; one in this process compiles outside Python's lock, in XLA): a step waits for its
        longest compile, not for the sum (an engine's generate and an actor's train programs are each tens of
        seconds at a real size on a GPU). A round trip that does nothing once the shapes were seen."""
        if not wanted:
            return
        self._doing = {"phase": "compiling", "lock": None}
        try:
            outcomes = at_once([(self._prepare_role, role, args) for role, args in wanted.items()],
                               f"compile-{self.name}")
        finally:
            self._doing = {"phase": None, "lock": None}
        for events, err in outcomes:
            if err is None:
                self.timeline.extend(events)
        for (role, args), (_, err) in zip(wanted.items(), outcomes, strict=True):
            if err is None and role is Role.ACTOR:
                self._prepared.add(args)
        errors = [err for _, err in outcomes if err is not None]
        if errors:
            raise errors[0]  # the first role's (each annotated with its role); every compile had ended

    def _prepare_role(self, role: Role, args: tuple) -> list[dict]:
        try:
            _, events = self.roles[role].prepare(*args)
        except BaseException as err:
            _annotate(err, f"in the {role}'s prepare()")
            raise
        return events

    def record(self, n: int, metrics: dict[str, Any], train: dict[str, float]) -> None:
        """The metrics line (with the memory each role held after its phase) and the progress line."""
        self._latest = {"reward": metrics["reward/mean"], "step_s": metrics["time/step_s"]}
        self._step_seconds.append(metrics["time/step_s"])
        if train["skipped"]:
            self.echo(f"[{self.name}] step {n}: non-finite loss or gradient in {train['skipped']:.0f} "
                      "optimizer step(s); those updates were skipped, the params are unchanged")
        self.tracker.log(n, {**metrics, **self.memory[Role.ACTOR], **self.memory[Role.ENGINE]})
        self.step_done = n
        if n % self.spec.config.log_every == 0 or n == self.spec.config.steps:
            self.echo(progress_line(self.name, n, self.spec.config.steps, metrics))

    def checkpoint_if_due(self, n: int) -> None:
        """Save step `n` when `checkpoint_every` says so (staggered by the task's offset), at the last step (unless
        checkpoint_every is 0 without `export_final`), or when the run is stopping."""
        every, last = self.spec.config.checkpoint_every, n == self.spec.config.steps
        due = last if every is None else every and ((n + self.spec.checkpoint_offset) % every == 0 or last)
        if due or self._stop.is_set() or (last and self.spec.config.export_final):
            self._save(n)

    def export_final(self) -> None:
        """`export_final: true` and every step done: the last checkpoint as a Hugging Face model in
        tasks/<task>/final/ (rlsched.run.export, in a child process: this driver never imports JAX)."""
        if self.spec.config.export_final and self.step_done == self.spec.config.steps:
            self.echo(export_final(self.spec.dir, self.step_done))

    def _save(self, n: int) -> None:
        """Checkpoint step `n` (the caller holds the TRAIN lock: the actor's state is resident while it is copied
        to host; the files are written in the background, rlsched.run.checkpoints)."""
        with self.timeline.span("checkpoint", step=n):
            self.roles[Role.ACTOR].save(n, {"step": n, "loader": self.host.loader.state(), "task": self.name})
        self.saved_step = n

    # ---- stopping on request ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Finish the step in progress, save a checkpoint there and end (rlsched.run.stopping). Any thread."""
        self._stop.set()

    def save_on_stop(self) -> None:
        """The stop came between two steps: save the last completed one, under the TRAIN lock (the actor's
        state must be resident and nobody may evict it mid-save), unless it is saved already."""
        if self.step_done > 0 and self.saved_step != self.step_done:
            with self.hold(Phase.TRAIN):
                self._save(self.step_done)
        self.echo(f"[{self.name}] stopped after step {self.step_done} of {self.spec.config.steps}"
                  + (f"; checkpoint {self.saved_step} saved" if self.saved_step else "; no step to save"))

    def poll(self) -> dict[str, Any]:
        """For the command that shows the run (rlsched.observe.progress): the lines echoed since the last poll and this
        task's row: state, step/steps, last reward and step time, mean step time, phase ("compiling", the lock's
        phase held, or "waiting for" it) and that lock ({phase, resource, holds, since: unix seconds}, or None), both
        of one moment; and which process holds each role on which device ids ("roles", for summary.json)."""
        drain = getattr(self.echo, "drain", None)
        if self._closed:
            state = "stopped" if self._stop.is_set() and self.step_done < self.spec.config.steps else "ended"
        else:
            state = ("stopping" if self._stop.is_set() else "running") if self._started.is_set() else "starting"
        doing = self._doing  # the phase and the lock of one moment
        times = self._step_seconds
        return {"lines": drain() if drain else [], "state": state, "step": self.step_done, "pid": os.getpid(),
                "steps": self.spec.config.steps, "phase": doing["phase"], "lock": doing["lock"], **self._latest,
                "mean_step_s": sum(times) / len(times) if times else None, "roles": self.places,
                "restarts": list(self.restarts)}

    # ---- memory moves ---------------------------------------------------------------------------------

    def move(self, role: str, action: str) -> None:
        """Offload (device -> host) or onload one of this task's roles, asked by the scheduler to evict an
        idle role for another task. Waits until the roles exist."""
        self._started.wait()
        if not self.residency:
            raise TaskError(f"task {self.name}: its roles did not start, so its {role} cannot {action}")
        self._move(role, action)

    def _move(self, role: str, action: str) -> None:
        with self._moving:
            if self._closed:  # the roles are stopped: nothing of ours is on a device any more
                if action == "offload":
                    return
                raise TaskError(f"task {self.name} has ended; its {role} cannot {action}")
            r = self.residency[Role(role)]
            try:
                (r.offload if action == "offload" else r.onload)(**self.where)
            except RoleDied:
                if action == "offload":
                    r.lost()  # its bytes went with its process: as good as offloaded; the next call on it restarts it
                    return
                r.resident = True  # the policy counts it on device from now on: its replacement is created there
                raise

    def memory_vs_plan(self, n: int) -> str:
        """What each role held per device by kind after its phase of step `n`, beside `rlsched plan`'s numbers."""
        from rlsched.config.plan import measured_vs_plan, planned_bytes

        measured = {str(role): {key.rsplit("/", 1)[1]: v for key, v in probe.items() if f"/{role}/held/" in key}
                    for role, probe in self.memory.items()}
        return measured_vs_plan(self.name, n, measured, planned_bytes(self.spec.config, self.spec.index))

    def _report_memory(self, task: str, role: str, sizes: dict[str, int]) -> None:
        self.locks.report_memory(role, sizes)

    # ---- for the experiment and for tools -------------------------------------------------------------

    def lifeline(self) -> None:
        """Never returns while this process lives: the scheduler awaits it to learn of our death."""
        threading.Event().wait()

    def events(self) -> list[dict]:
        """This task's timeline (driver and roles), for the experiment's trace."""
        return self.timeline.events()

    def role_handles(self) -> dict[str, Any]:
        """{"engine": handle, "actor": handle} of this task's role actors (for tools and fault tests)."""
        self._started.wait()
        return {str(role): r.handle for role, r in self.roles.items() if isinstance(r, RemoteRole | GroupProcessRole)}


def _place_text(role: str, place: dict[str, Any]) -> str:
    """'actor on devices [0, 1] (pid 7)', or for a role across hosts its members' hosts and pids."""
    if "members" not in place:
        return f"{role} on devices {place['devices']} (pid {place['pid']})"
    members = ", ".join(f"{m['host']} pid {m['pid']}" for m in place["members"])
    return f"{role} on {len(place['members'])} hosts, {len(place['devices'])} devices ({members})"


def _annotate(err: BaseException, note: str) -> None:
    """Add `note` to the original error: a role's error reaches us wrapped by Ray (a RayTaskError whose `cause`
    is the role's own exception), and Ray carries on only the cause when it wraps it again."""
    while getattr(err, "cause", None) is not None and isinstance(err.cause, BaseException) and err.cause is not err:
        err = err.cause
    err.add_note(note)


def _role_death(err: BaseException) -> RoleDied | None:
    """The RoleDied behind `err` (raised here, or carried as a Ray error's cause), if that is what it is."""
    while err is not None and not isinstance(err, RoleDied):
        inner = getattr(err, "cause", None) or err.__cause__
        err = inner if isinstance(inner, BaseException) and inner is not err else None
    inner = getattr(err, "cause", None)  # a RoleDied raised in a host comes wrapped by Ray (its traceback in str)
    return inner if isinstance(inner, RoleDied) else err


def _print_flushed(line: str) -> None:
    # Not `print` as a default: a Ray actor class is pickled with its defaults, and a test harness may
    # have swapped builtins.print for another object by then.
    print(line, flush=True)


class _Clock:
    """Named instants of a step (`mark`); `clock[a, b]` is the seconds from mark a to mark b."""

    def __init__(self):
        self._marks = {"start": time.perf_counter()}

    def mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter()

    def __getitem__(self, span: tuple[str, str]) -> float:
        return self._marks[span[1]] - self._marks[span[0]]


def _in_background(work):
    """`work()` on a thread of its own, now: a future whose `result()` is its value or raises its error."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-work")
    try:
        return pool.submit(work)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the work
