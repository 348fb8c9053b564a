"""The scheduler's async logic without Ray: awaited locks, FIFO, leases that expire or die."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from rlsched.scheduling.fencing import Target, Unconfirmed
from rlsched.scheduling.policy import GroupSpec, Policy, PolicyError
from rlsched.scheduling.scheduler import LeaseLost, Scheduler
from rlsched.service.client import render_status


def _scheduler(tasks=("a", "b", "c"), **kw) -> Scheduler:
    policy = Policy({"g0": GroupSpec.colocated()})
    for t in tasks:
        policy.register(t, "g0", 100, 300)
    return Scheduler(policy, **kw)


def test_acquire_is_awaited_fifo_and_phases_overlap():
    async def scenario():
        s = _scheduler()
        order = []
        lease_a = await s.acquire("a", "rollout")
        assert lease_a.resource == "g0/rollout" and lease_a.moves == ()  # everything fits: nothing moves

        async def take(task, phase):
            lease = await s.acquire(task, phase)
            order.append((task, phase))
            return lease

        waiting_b = asyncio.create_task(take("b", "rollout"))
        waiting_c = asyncio.create_task(take("c", "rollout"))
        await asyncio.sleep(0.01)
        assert order == []  # both wait behind a
        with pytest.raises(PolicyError):  # a phase never holds two locks: a must release rollout first
            await s.acquire("a", "train")
        await s.release("a", "rollout")
        await asyncio.sleep(0.01)
        assert order == [("b", "rollout")]  # FIFO: b asked first
        # a trains while b generates: the two slots are independent
        lease = await asyncio.wait_for(s.acquire("a", "train"), 1)
        assert lease.resource == "g0/train"
        await s.release("b", "rollout")
        await asyncio.wait_for(waiting_c, 1)
        assert order == [("b", "rollout"), ("c", "rollout")]
        await waiting_b

    asyncio.run(scenario())


def _role(name: str) -> Target:
    """A role to stop, as the fakes below see it (no process behind it)."""
    return Target(name, None)


class _Fence:
    """The scheduler's `stop` (rlsched.scheduling.fencing.stop) as a recording fake: stopping takes `seconds`, and the
    targets of `problems` (fencing.Unconfirmed) are not confirmed."""

    def __init__(self, seconds=0.05, problems=()):
        self.seconds, self.problems, self.calls = seconds, list(problems), []

    async def __call__(self, targets, on_end=None):
        start = time.monotonic()
        await asyncio.sleep(self.seconds)
        self.calls.append((list(targets), start, time.monotonic()))
        return [p for p in self.problems if p.target in targets]  # what it could not confirm of these


def test_an_expired_lease_fences_its_holder_before_the_next_waiter_gets_the_lock():
    async def scenario():
        fence = _Fence(seconds=0.3)
        s = _scheduler(lease_timeout_s=0.2, stop=fence, let_go_s=5)
        s.register_roles("a", [_role("a's engine"), _role("a's actor")])
        await s.acquire("a", "train")
        await asyncio.sleep(0.1)  # within its lease
        await s.release("a", "train")
        assert s.failed() == {}
        await s.acquire("a", "rollout")  # its first hold of rollout expires like any (compiles are outside locks)
        let_go = []

        async def driver_of_a():  # sees its call fail once its roles are stopped, ends its phase, releases
            while not fence.calls:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            let_go.append(time.monotonic())
            await s.release("a", "rollout")

        a = asyncio.create_task(driver_of_a())
        lease_b = await asyncio.wait_for(s.acquire("b", "rollout"), 3)  # granted once a's lease expires ...
        await a
        assert lease_b.task == "b"
        [(targets, _, fenced_at)] = fence.calls  # ... and a's roles were stopped first
        assert targets == [_role("a's engine"), _role("a's actor")]
        assert s.grant_log[-1][1] == "b" and s.grant_log[-1][0] >= fenced_at  # granted after the fence ended
        assert s.grant_log[-1][0] >= let_go[0]  # and after a's driver let go (its phase ended first)
        assert re.fullmatch(r"lease expired after 0 s in phase rollout \(cluster\.lease_timeout_s=0\.2\)",
                            s.failed()["a"]), s.failed()
        assert s.fenced() == s.failed()
        with pytest.raises(LeaseLost, match="task a was marked failed"):
            await s.acquire("a", "train")

    asyncio.run(scenario())


def test_a_fenced_holder_whose_driver_retires_during_the_stop_still_passes_the_lock():
    """The fenced holder's driver sees its call fail, lets go and retires before the stop returns (a device
    group's process ends its call at once): the lock still passes on to the waiter, right after the stop."""
    async def scenario():
        fence = _Fence(seconds=0.3)
        s = _scheduler(lease_timeout_s=0.1, stop=fence, let_go_s=30)
        s.register_roles("a", [_role("a's engine")])
        await s.acquire("a", "rollout")

        async def driver_of_a():  # its call fails while the roles are still being stopped
            await asyncio.sleep(0.2)
            await s.release("a", "rollout")
            await s.fail("a", "its call failed")
            await s.retire("a")

        a = asyncio.create_task(driver_of_a())
        t0 = time.monotonic()
        lease_b = await asyncio.wait_for(s.acquire("b", "rollout"), 5)  # not let_go_s: a's driver let go already
        await a
        assert lease_b.task == "b" and time.monotonic() - t0 < 3
        assert s.failed()["a"].startswith("lease expired after 0 s in phase rollout"), s.failed()

    asyncio.run(scenario())


def test_a_fence_that_cannot_confirm_the_stop_takes_the_group_out_of_service_until_it_can():
    """a's lease expires and its stop cannot be confirmed (its process was not seen gone): its lock never passes on
    while that process may still run. b, waiting for it, fails with the cause; the group is shown fenced and admits
    no task; the scheduler asks again every recover_s, and once the process is seen gone the group is back in service
    and a new task takes the lock, after that moment, never before."""
    async def scenario():
        engine = _role("a's engine")
        fence = _Fence(problems=[Unconfirmed(engine, "its process was not seen gone 30 s after ray.kill")])
        asked = []

        async def confirm(left):  # the process is seen gone at the third time of asking
            asked.append((list(left), time.monotonic()))
            return left if len(asked) < 3 else []

        s = _scheduler(tasks=("a", "b"), lease_timeout_s=0.1, stop=fence, confirm=confirm, recover_s=0.1,
                       let_go_s=0.1)
        s.register_roles("a", [engine])
        await s.acquire("a", "train")
        with pytest.raises(LeaseLost, match=r"task b failed: device group g0 was taken out of service: task a's fence "
                                            r"could not be confirmed \(lease expired after 0 s in phase train"):
            await asyncio.wait_for(s.acquire("b", "train"), 3)
        assert s.failed()["a"].endswith("; fencing: a's engine: its process was not seen gone 30 s after ray.kill; "
                                        "device group g0 is out of service until they are gone"), s.failed()
        [(group, shown)] = s.fenced_groups().items()
        assert group == "g0" and shown["task"] == "a" and shown["cause"] == s.failed()["a"]
        assert shown["left"] == ["a's engine: its process was not seen gone 30 s after ray.kill"]
        with pytest.raises(PolicyError, match="device group 'g0' is out of service"):
            await s.admit("c", "g0", 100, 300)
        shown = render_status({"tasks": [], "fenced_groups": s.fenced_groups()})  # `rlsched status`'s lines
        assert re.search(r"device group g0 FENCED since \d\d:\d\d:\d\d: out of service until a's engine: its "
                         r"process was not seen gone 30 s after ray.kill \(lease expired .*\); asked \d time\(s\) so "
                         r"far", shown), shown
        while s.fenced_groups():
            await asyncio.sleep(0.02)
        assert [left for left, _ in asked] == [[fence.problems[0]]] * 3  # asked again until it was seen gone
        assert await s.admit("c", "g0", 100, 300) == []
        lease = await asyncio.wait_for(s.acquire("c", "train"), 1)
        assert lease.task == "c" and s.grant_log[-1][0] >= asked[-1][1]  # granted only once the stop was confirmed
        assert [task for _, task, *_ in s.grant_log] == ["a", "c"]  # b never held it
        [span] = [e for e in s.events() if e["name"] == "out_of_service"]
        assert span["task"] == "a" and span["args"]["group"] == "g0" and span["args"]["tries"] == 3

    asyncio.run(scenario())


def test_a_fence_that_cannot_confirm_a_device_group_process_stopped_holds_the_lock_until_it_is_gone(ray_session):
    """Real Ray actors: a's call in a device group's process outlives its lease; the fence ends that process (Ray
    restarts it), but the new one takes 2 s to answer, longer than the stop waits (0.5 s). The trace: b, waiting for
    the lock, fails; the group is fenced until the new process answers from another pid; c then gets the lock, after
    a's call ended (its process died): never two holders of one phase."""
    import functools
    import os

    import ray

    from rlsched.scheduling import fencing

    @ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=4)
    class SlowToComeBack:  # a device group's process as fencing sees it
        def __init__(self, back_s):
            if ray.get_runtime_context().was_current_actor_reconstructed:
                time.sleep(back_s)  # a restarted process takes a while before it answers
            self.busy = False

        def hang(self):  # a's phase: a call that does not end by itself
            self.busy = True
            time.sleep(3600)

        def drop_if_idle(self, key):
            return not self.busy

        def where(self):
            return {"pid": os.getpid()}

    host = SlowToComeBack.remote(2.0)
    pid = ray.get(host.where.remote())["pid"]

    async def scenario():
        s = _scheduler(tasks=("a", "b"), lease_timeout_s=0.3, stop=functools.partial(fencing.stop, timeout_s=0.5),
                       confirm=functools.partial(fencing.confirm, timeout_s=0.5), recover_s=0.2, let_go_s=0.1)
        for task in ("a", "b"):
            s.register_roles(task, [Target("actor", host, f"{task}/actor", pid=pid)])
        await s.acquire("a", "train")
        call_ended = []
        call = asyncio.wrap_future(host.hang.remote().future())
        call.add_done_callback(lambda _: call_ended.append(time.monotonic()))
        with pytest.raises(LeaseLost, match="task b failed: device group g0 was taken out of service"):
            await asyncio.wait_for(s.acquire("b", "train"), 10)
        shown = s.fenced_groups()["g0"]
        assert shown["left"] == [f"actor: its device group's process (pid {pid}) was not seen gone 0.5 s after "
                                 "ray.kill"], shown
        t0 = time.monotonic()
        while s.fenced_groups():
            assert time.monotonic() - t0 < 15, s.fenced_groups()
            await asyncio.sleep(0.05)
        await s.admit("c", "g0", 100, 300)
        lease = await asyncio.wait_for(s.acquire("c", "train"), 1)
        with pytest.raises(ray.exceptions.RayActorError):
            await call  # a's call ended with its process ...
        assert lease.task == "c" and s.grant_log[-1][0] >= call_ended[0]  # ... before c's grant
        assert [task for _, task, *_ in s.grant_log] == ["a", "c"]
        assert s.failed()["b"].startswith("device group g0 was taken out of service: task a's fence could not be "
                                          "confirmed (lease expired after 0 s in phase train")

    asyncio.run(scenario())
    assert ray.get(host.where.remote())["pid"] != pid  # the new process serves the group
    ray.kill(host)


def test_a_watchdog_pass_that_raises_is_kept_and_leases_still_expire(capsys):
    """Failed passes of the lease watchdog (here the policy raising twice) are printed and counted, `health()` shows
    the watchdog failing while they fail in a row and clears once a pass succeeds (a service's `status` shows it),
    and the next passes go on: a later hang still has its lease taken."""
    async def scenario():
        s = _scheduler(lease_timeout_s=0.1, stop=_Fence(), let_go_s=0.1)
        expired, calls, seen = s.policy.expired, [], []

        def broken(now, timeout):
            calls.append(now)
            seen.append(s.health()["watchdog"])  # as the pass starts: what the passes before it left
            if len(calls) <= 2:
                raise RuntimeError(f"injected: the policy failed ({len(calls)})")
            return expired(now, timeout)

        assert s.health() == {"watchdog": None}
        s.policy.expired = broken
        await s.acquire("a", "train")  # held past its lease: the first passes raise, a later one expires it
        await asyncio.wait_for(s.acquire("b", "train"), 3)
        assert s.failed()["a"].startswith("lease expired after 0 s in phase train"), s.failed()
        assert s.state()["watchdog_errors"] == 2
        assert s.state()["watchdog_error"] == "RuntimeError: injected: the policy failed (2)"
        assert seen[0] is None
        assert {k: seen[1][k] for k in ("cause", "failures")} == {"cause": "RuntimeError: injected: the policy "
                                                                           "failed (1)", "failures": 1}
        assert {k: seen[2][k] for k in ("cause", "failures")} == {"cause": "RuntimeError: injected: the policy "
                                                                           "failed (2)", "failures": 2}
        assert seen[2]["since"] == seen[1]["since"]  # failing since the first of the row
        # The third pass succeeded (the one that expired a's lease, or one before it): health is clear again.
        # Whether a fourth pass ran before b's grant depends on the machine's load: only what ran is checked.
        assert all(x is None for x in seen[3:]) and s.health() == {"watchdog": None}

    asyncio.run(scenario())
    assert "the lease watchdog's pass failed (2 so far)" in capsys.readouterr().out


def test_a_dead_holder_releases_and_its_waiters_are_told():
    async def scenario():
        fence = _Fence()
        s = _scheduler(stop=fence)
        s.register_roles("a", [_role("a's engine")])
        await s.acquire("a", "rollout")
        b = asyncio.create_task(s.acquire("b", "rollout"))
        await asyncio.sleep(0.01)

        async def dies():
            raise RuntimeError("ActorDiedError")

        await s.watch("a", [asyncio.ensure_future(dies())])
        assert (await asyncio.wait_for(b, 1)).task == "b"
        assert s.failed() == {"a": "its process died (RuntimeError)"}
        # Its roles (Ray ends them with their owner, in its own time) were stopped before b's grant
        assert [targets for targets, *_ in fence.calls] == [[_role("a's engine")]]
        assert s.grant_log[-1][0] >= fence.calls[0][2]

        c = asyncio.create_task(s.acquire("c", "rollout"))
        await asyncio.sleep(0.01)
        await s.fail("c", "reward function raised")
        with pytest.raises(LeaseLost, match="task c failed: reward function raised"):
            await c

    asyncio.run(scenario())


def test_evictions_are_done_by_the_victims_driver_before_the_grant():
    class FakeDriver:  # the shape of a Ray actor handle: driver.move.remote(role, action) is awaitable
        def __init__(self, log):
            outer = self

            class _Move:
                @staticmethod
                async def remote(role, action):
                    log.append((outer.name, role, action))

            self.move, self.name = _Move, None

    async def scenario():
        # colocated budget 400: a's engine (100) + actor (300) fill it; b's engine (100) must evict.
        policy = Policy({"g0": GroupSpec.colocated(400)})
        policy.register("a", "g0", 100, 300)
        policy.register("b", "g0", 100, 300)  # nothing left: b starts offloaded
        s = Scheduler(policy)
        log = []
        for name in ("a", "b"):
            driver = FakeDriver(log)
            driver.name = name
            s.register_driver(name, driver)
        await s.acquire("a", "rollout")
        await s.release("a", "rollout")
        lease = await asyncio.wait_for(s.acquire("b", "rollout"), 1)
        assert log and all(entry[0] == "a" and entry[2] == "offload" for entry in log)  # a's idle role went first
        assert lease.moves[-1].task == "b" and str(lease.moves[-1].action) == "onload"

    asyncio.run(scenario())


def test_a_victims_next_grant_waits_for_its_eviction_to_be_done():
    """b's grant evicts a's idle actor (a's driver takes 0.3 s to offload it); a then asks for TRAIN, which
    onloads that actor. The policy counts the eviction done when it decides it, so it grants a at once: the
    lease must reach a only after the offload, or the offload lands on the state a's TRAIN uses (on the old
    code: 'NoneType' object has no attribute 'params', once in three CI runs with checkpoints every step)."""

    class SlowDriver:
        def __init__(self, name, log):
            class _Move:
                @staticmethod
                async def remote(role, action):
                    await asyncio.sleep(0.3)
                    log.append((time.monotonic(), name, role, action))

            self.move = _Move

    async def scenario():
        policy = Policy({"g0": GroupSpec.colocated(400)})
        policy.register("a", "g0", 100, 300)
        policy.register("b", "g0", 100, 300)  # b starts offloaded: its engine needs a's idle actor to go
        s = Scheduler(policy)
        log = []
        for name in "ab":
            s.register_driver(name, SlowDriver(name, log))
        await s.acquire("a", "rollout")
        await s.release("a", "rollout")
        b = asyncio.create_task(s.acquire("b", "rollout"))
        await asyncio.sleep(0.01)  # b's grant is decided, a's offload is in flight
        lease_a = await asyncio.wait_for(s.acquire("a", "train"), 2)
        granted_a = time.monotonic()
        assert ("a", "actor", "onload") in [(m.task, str(m.role), str(m.action)) for m in lease_a.moves]
        [(offloaded, *what)] = log
        assert what == ["a", "actor", "offload"] and offloaded <= granted_a
        assert (await b).task == "b"

    asyncio.run(scenario())


def test_an_eviction_that_fails_fails_the_evicted_task_never_the_waiter():
    """a's offload raises (or a has no driver to ask): a is fenced (its processes stopped, which frees its
    bytes) and fails with the cause; b, which waited for the room, gets its lease."""

    class FailingDriver:
        class move:  # noqa: N801 - the shape of a Ray actor method: driver.move.remote(role, action)
            @staticmethod
            async def remote(role, action):
                raise RuntimeError("injected fault: offload call 1 fails")

    async def scenario(drivers):
        fence = _Fence()
        policy = Policy({"g0": GroupSpec.colocated(400)})
        policy.register("a", "g0", 100, 300)
        policy.register("b", "g0", 100, 300)  # b starts offloaded: its engine needs a's idle roles to go
        s = Scheduler(policy, stop=fence)
        for name, driver in drivers.items():
            s.register_driver(name, driver)
        s.register_roles("a", [_role("a's engine"), _role("a's actor")])
        lease = await asyncio.wait_for(s.acquire("b", "rollout"), 2)
        assert lease.task == "b"
        assert list(s.failed()) == ["a"] and [t for t, *_ in fence.calls] == [[_role("a's engine"), _role("a's actor")]]
        assert "b" not in s.failed()
        return s.failed()["a"]

    cause = asyncio.run(scenario({"a": FailingDriver()}))
    assert cause == ("its engine could not be offloaded to make room for task b: RuntimeError: injected fault: "
                     "offload call 1 fails")
    cause = asyncio.run(scenario({}))  # nobody to ask: the same, never a hang
    assert cause == ("its engine could not be offloaded to make room for task b: LeaseLost: no driver registered "
                     "for task a")


def test_a_release_is_answered_before_the_next_acquire_is_sent(ray_session):
    """Ray does not keep one caller's calls to an async actor in order: a release still in flight
    could be served after the acquire sent behind it, which the policy refuses. SchedulerLocks waits
    for the release's answer first (here the release is slow, so a reordering would show)."""
    import ray

    from rlsched.scheduling.scheduler import SchedulerLocks

    @ray.remote(num_cpus=0)
    class SlowReleases:
        def __init__(self):
            self.log = []

        async def release(self, task, phase):
            self.log.append(f"release {phase} start")
            await asyncio.sleep(0.5)
            self.log.append(f"release {phase} end")

        async def acquire(self, task, phase):
            self.log.append(f"acquire {phase}")

        def seen(self):
            return self.log

    actor = SlowReleases.remote()
    locks = SchedulerLocks(actor, "t")
    locks.release("rollout")
    locks.acquire("train")
    assert ray.get(actor.seen.remote()) == ["release rollout start", "release rollout end", "acquire train"]
    ray.kill(actor)


def test_a_failed_tasks_cause_is_the_original_error_through_rays_wrapping(ray_session):
    """A role's error re-raised by its driver reaches the user as its own type and message, with where it
    happened (the notes the driver added), not as Ray's wrapper and its traceback."""
    import ray

    from rlsched.base.errors import cause_of

    @ray.remote(num_cpus=0)
    class Role:
        def rollout(self):
            raise ValueError("max_new_tokens 9 exceeds the engine's 4")

    @ray.remote(num_cpus=0)
    class Driver:
        def run(self, role):
            from rlsched.run.task import _annotate

            try:
                ray.get(role.rollout.remote())
            except Exception as err:
                _annotate(err, "in the engine's rollout()")
                _annotate(err, "task a, step 3")
                raise

    with pytest.raises(ray.exceptions.RayTaskError) as caught:
        ray.get(Driver.remote().run.remote(Role.remote()))
    assert cause_of(caught.value) == ("ValueError: max_new_tokens 9 exceeds the engine's 4 (task a, step 3; "
                                      "in the engine's rollout())")


def test_a_task_arrives_at_a_running_scheduler_and_a_resubmitted_name_starts_afresh():
    """rlsched.service.server: `admit` registers an arriving task; `locks` names holders and waiters with their times;
    a task that was failed and retired is forgotten when a task of its name is admitted again."""
    async def scenario():
        s = _scheduler(tasks=("a",))
        await s.acquire("a", "train")
        assert await s.admit("b", "g0", 100, 300) == []  # fits beside a: created on device, nothing to offload
        waiting = asyncio.create_task(s.acquire("b", "train"))
        await asyncio.sleep(0.05)
        locks = s.locks()
        assert locks["g0/train"]["holder"] == "a" and locks["g0/train"]["held_s"] >= 0.05
        assert [w["task"] for w in locks["g0/train"]["waiting"]] == ["b"]
        assert locks["g0/train"]["waiting"][0]["waited_s"] >= 0.05
        assert locks["g0/rollout"] == {"holder": None, "holders": [], "held_s": None, "waiting": []}
        with pytest.raises(PolicyError, match="is live"):  # a live task's name cannot be taken
            await s.admit("a", "g0", 100, 300)
        await s.fail("a", "cancelled")
        await asyncio.wait_for(waiting, 1)  # its lock passed on
        with pytest.raises(LeaseLost):
            await s.acquire("a", "rollout")
        assert await s.admit("a", "g0", 100, 300) == []
        assert "a" not in s.failed()
        lease = await asyncio.wait_for(s.acquire("a", "rollout"), 1)  # the new "a" takes locks again
        assert lease.task == "a"

    asyncio.run(scenario())


def test_a_base_groups_waiting_rollouts_get_one_shared_hold_and_the_lock_frees_when_all_let_go():
    from rlsched.scheduling.policy import CoBatch
    from workers.rollout.base import Together

    async def scenario():
        policy = Policy({"g0": GroupSpec.colocated()})
        for t in ("lead", "x", "y"):
            policy.register(t, "g0", 10, 10, cobatch=CoBatch("base", 8, 16))
        policy.register("full", "g0", 10, 10)
        s = Scheduler(policy)
        first = await s.acquire("full", "rollout")  # holds the lock while the others queue
        waiting = [asyncio.create_task(s.acquire(t, "rollout")) for t in ("lead", "x", "y")]
        await asyncio.sleep(0.01)
        await s.release("full", "rollout")
        lead, x = await asyncio.wait_for(asyncio.gather(*waiting[:2]), 1)
        assert lead.cohort == x.cohort == ("lead", "x") and lead.hold == x.hold == lead.id
        assert lead.together() == x.together() == Together(lead.id, 2) and first.together() is None
        assert s.locks()["g0/rollout"]["holders"] == ["lead", "x"]
        await s.release("lead", "rollout")
        await asyncio.sleep(0.01)
        assert not waiting[2].done()  # x still holds the hold
        await s.release("x", "rollout")
        alone = await asyncio.wait_for(waiting[2], 1)
        assert alone.cohort == () and alone.together() is None

    asyncio.run(scenario())


def test_a_fence_whose_stop_raises_takes_the_group_out_of_service_and_says_why():
    async def scenario():
        async def broken_stop(targets, on_end=None):
            raise RuntimeError("the GCS is unreachable")

        asked = []

        async def confirm(left):  # the GCS answers again: the role's process is seen gone
            asked.append([str(u) for u in left])
            return []

        s = _scheduler(lease_timeout_s=0.2, stop=broken_stop, confirm=confirm, recover_s=0.3, let_go_s=0.1)
        s.register_roles("a", [_role("a's engine")])
        await s.acquire("a", "rollout")
        with pytest.raises(LeaseLost, match="device group g0 was taken out of service"):  # never a's lock
            await asyncio.wait_for(s.acquire("b", "rollout"), 5)
        assert s.watchdog_errors == 0 and "g0" in s.fenced_groups()
        assert "fencing: a's engine: the stop raised RuntimeError: the GCS is unreachable" in s.failed()["a"]
        assert s.failed()["c"] == s.failed()["b"]  # every task of the group, waiting or not
        while s.fenced_groups():
            await asyncio.sleep(0.02)
        assert asked == [["a's engine: the stop raised RuntimeError: the GCS is unreachable"]]

    asyncio.run(scenario())


def test_a_busy_role_across_hosts_is_stopped_by_ending_the_whole_group_job(ray_session):
    """fencing.stop on a role whose mesh spans two hosts (one target per host, no pid: one JAX job), a call of it still
    running on the second: every host's process is ended, for good, and the stop is confirmed (nothing left)."""
    import ray

    from rlsched.scheduling import fencing

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Host:
        def __init__(self, busy):
            self.busy = busy

        def drop_if_idle(self, key):
            return not self.busy

    hosts = [Host.remote(False), Host.remote(True)]
    ray.get([h.__ray_ready__.remote() for h in hosts])
    told = []
    left = asyncio.run(fencing.stop([Target(f"actor[{i}]", h, "a/actor") for i, h in enumerate(hosts)],
                                    timeout_s=10, on_end=lambda t: told.append(t.role)))
    assert left == [] and told == ["actor[0]", "actor[1]"]
    for h in hosts:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(h.__ray_ready__.remote(), timeout=10)
