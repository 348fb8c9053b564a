"""Tasks of the same shapes compile a program once between them (workers.compiling), through JAX's
persistent cache: real processes, compiling at the same moment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Each process waits until both are ready, then compiles the same program (a few hundred ms of XLA work):
# without the lock both miss the cache; with it one compiles and the other loads.
CHILD = textwrap.dedent("""
    import json, os, sys, time
    import jax, jax.numpy as jnp
    from jax._src import monitoring
    from rlsched.cluster import compile_cache
    from workers.compiling import compile_once

    cache, me, other, locked = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    compile_cache.enable(cache)
    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))

    def f(x):
        for i in range(60):
            x = jnp.tanh(x @ x.T + i) * jnp.cos(x)
        return x.sum()

    lowered = jax.jit(f).lower(jnp.ones((64, 64)))
    open(me, "w").close()
    while not os.path.exists(other):
        time.sleep(0.01)
    del events[:]
    compiled = compile_once(lowered) if locked else lowered.compile()
    mine = list(events)  # this program's compile only
    assert float(compiled(jnp.ones((64, 64)))) == float(jax.jit(f)(jnp.ones((64, 64))))
    print(json.dumps({"hits": mine.count("/jax/compilation_cache/cache_hits"),
                      "misses": mine.count("/jax/compilation_cache/cache_misses")}))
""")


def _two_at_once(tmp_path, locked: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    env["JAX_PLATFORMS"] = "cpu"
    cache = tmp_path / f"cache-{locked}"
    ready = [tmp_path / f"ready-{locked}-{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(cache), str(ready[i]), str(ready[1 - i]),
                               "1" if locked else "0"], env=env, stdout=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def test_two_processes_compiling_one_program_at_once_compile_it_once(tmp_path):
    counts = _two_at_once(tmp_path, locked=True)
    assert sorted(c["hits"] for c in counts) == [0, 1], counts  # the second loaded what the first compiled
    unlocked = _two_at_once(tmp_path, locked=False)  # the reference: what happens without the lock
    assert [c["hits"] for c in unlocked] == [0, 0], unlocked


class Executable:
    """What a build returns, as a JAX executable is: an object a weak reference can point at."""


def test_a_program_asked_for_by_two_roles_at_once_is_built_once():
    """`shared`: roles of one process (threads of a device group's) asking for one key at once build it once,
    and the second gets the first's executable; a build that raises leaves the key to the next caller."""
    import threading

    from workers.compiling import shared

    builds, start = [], threading.Barrier(2)

    def build():
        builds.append(threading.get_ident())
        return Executable()

    got = []
    threads = [threading.Thread(target=lambda: (start.wait(), got.append(shared(("test", "once"), build))))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert got[0][0] is got[1][0] and sorted(b for _, b in got) == [False, True]

    def fails():
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        shared(("test", "fails"), fails)
    assert shared(("test", "fails"), build)[1] is True


def test_a_roles_programs_build_at_once_and_an_error_waits_for_the_others():
    """`shared_at_once`: a role's programs build side by side (each build here waits outside Python's lock, as XLA's
    compile does), in order; an error is raised once every build has ended; a wait for a build another caller
    holds counts in the caller's `waits()`."""
    import threading
    import time

    from workers.compiling import shared, shared_at_once, waits

    spans = {}

    def build(name, seconds=0.4, error=None):
        def run():
            start = time.perf_counter()
            time.sleep(seconds)
            spans[name] = (start, time.perf_counter())
            if error:
                raise RuntimeError(error)
            return Executable()
        return run

    (a, built_a), (b, built_b) = shared_at_once([(("test", "at once", "a"), build("a")),
                                                  (("test", "at once", "b"), build("b"))])
    assert built_a and built_b and a is not b
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1], spans  # they overlapped
    assert shared(("test", "at once", "b"), build("c"))[0] is b  # kept under its key

    spans.clear()
    with pytest.raises(RuntimeError, match="the first failed"):
        shared_at_once([(("test", "at once", "fails"), build("fails", 0.05, "the first failed")),
                        (("test", "at once", "slow"), build("slow", 0.5))])
    assert set(spans) == {"fails", "slow"}  # raised after the slow one had ended

    held = []  # the other caller keeps what it built (the registry holds it only while a caller does)
    other = threading.Thread(target=lambda: held.append(shared(("test", "at once", "held"), build("held", 0.5))))
    other.start()
    time.sleep(0.1)  # the other caller is building it
    with waits() as waited:
        [(executable, built)] = shared_at_once([(("test", "at once", "held"), build("never"))])
    other.join()
    assert not built and executable is held[0][0] and "never" not in spans and waited["seconds"] > 0.2, waited


def test_a_program_goes_with_the_last_caller_that_holds_it():
    """The registry holds executables weakly: a device group's process sees every learning rate of a sweep as a new
    program, and one held for ever keeps its memory maps of JIT code (the process's cap is vm.max_map_count)."""
    import gc

    from workers.compiling import find, programs, shared

    gc.collect()  # what earlier tests dropped (a thread's frame may hold one until collected) goes first
    before = programs()
    first, built = shared(("test", "weak"), Executable)
    second, again = shared(("test", "weak"), Executable)
    assert (built, again) == (True, False) and second is first and find(("test", "weak")) is first
    assert programs() == before + 1
    del first
    gc.collect()
    assert find(("test", "weak")) is second  # the other caller still holds it
    del second
    gc.collect()
    assert find(("test", "weak")) is None and programs() == before
    assert shared(("test", "weak"), Executable)[1] is True  # built again for the next caller


def test_actors_of_like_tasks_in_one_process_share_their_programs(tiny_model_dir):
    """A device group's process holds several tasks' actors. Tasks with the same model and settings (the demo's
    four, a sweep over seeds or data) trace and compile each program once between them: the second actor takes
    the first one's executable and trains exactly as an actor that compiled its own. Another learning rate (a sweep
    over optimizer settings) is another update program, but the same gradient program, taken as it is."""
    import dataclasses

    import numpy as np

    from workers.actor import ActorWorker
    from workers.batch import build_train_batch
    from workers.models import load_pretrained
    from workers.models import params as P
    from workers.train_step import ActorSettings

    settings = ActorSettings(remat="layers", adam_mu_dtype="float32",
                             lr=7e-4, total_steps=3, warmup_steps=0, min_lr_ratio=0.5, weight_decay=0.03,
                             grad_clip=1.0, b1=0.9, b2=0.99, epsilon=0.2, epsilon_high=None, beta=0.0,
                             aggregation="token-mean", temperature=1.0, micro_batch_size=4, mini_batch_size=8,
                             epochs=1, router_aux_loss_coef=None,
                             kl_clamp=None, max_new_tokens=None)  # values no other test uses: nothing shared yet
    rng = np.random.default_rng(3)
    batch = build_train_batch([rng.integers(1, 200, 5).astype(np.int32) for _ in range(8)],
                              [rng.integers(1, 200, int(rng.integers(1, 6))).astype(np.int32) for _ in range(8)],
                              rng.normal(size=8).astype(np.float32), pad_id=0)
    actor = lambda s=settings: ActorWorker(load_pretrained(tiny_model_dir)[0], s)  # noqa: E731
    first, second, own = actor(), actor(), actor()
    # the train step's two programs, the gradient and the update (on-policy, beta 0: no logprobs), and the learning
    # rate's schedule (its metric)
    assert first.prepare(batch.size, batch.tokens.shape[1]) == 3
    assert second.prepare(batch.size, batch.tokens.shape[1]) == 0
    assert [id(p) for p in second._prepared.values()] == [id(p) for p in first._prepared.values()]
    sweep = dataclasses.replace(settings, lr=8e-4, weight_decay=0.0, grad_clip=0.5, warmup_steps=1)
    swept = actor(sweep)
    assert swept.prepare(batch.size, batch.tokens.shape[1]) == 2  # the update and the schedule
    (gradient, update), (swept_gradient, swept_update) = (
        [p for k, p in a._prepared.items() if k[0] in ("train", "update")] for a in (first, swept))
    assert swept_gradient is gradient and swept_update is not update
    alone = actor(sweep)  # one that compiles its own
    assert swept.train(batch, step=1) == alone.train(batch, step=1)
    for name, leaf in P.to_flat(swept.state.params).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(P.to_flat(alone.state.params)[name]))
    # another temperature: the gradient and the update again, the schedule as it was
    assert actor(dataclasses.replace(settings, temperature=0.7)).prepare(batch.size, batch.tokens.shape[1]) == 2

    shared_metrics, own_metrics = second.train(batch, step=1), own.train(batch, step=1)
    assert own._prepared == {}  # it ran its own jitted program
    assert shared_metrics == own_metrics
    mine, theirs = P.to_flat(second.state.params), P.to_flat(own.state.params)
    for name, leaf in mine.items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(theirs[name]))
