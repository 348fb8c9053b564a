"""Tasks of the same shapes compile a program once between them (workers.compiling), through JAX's
persistent cache: real processes, compiling at the same moment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

# Each process waits until both are ready, then compiles the same program (a few hundred ms of XLA work):
# without the lock both miss the cache; with it one compiles and the other loads.
CHILD = textwrap.dedent("""
    import json, os, sys, time
    import jax, jax.numpy as jnp
    from jax._src import monitoring
    from rlsched import compile_cache
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
