"""What a role across hosts does differently, in a real two-process JAX job (jax.distributed, gloo, two CPU
processes of 2 devices each, one mesh of 4):
- the multihost guard (workers.multihost): what a role writes once is written by process 0 only, and a run file
  written from process 1 fails at once with the file named; the task's checkpoints (each process's orbax shards)
  stay writable by every process;
- offload / onload (workers.offload) of arrays no process holds whole: every process frees its own shards and
  gets them back exactly, through pinned host memory and through the numpy fallback.
tests/test_hosts.py runs whole tasks across hosts (with the guard on in every member but 0)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

JOIN = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import jax

    port, index, run, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index,
                               initialization_timeout=60, coordinator_bind_address=f"127.0.0.1:{port}")
    from jax.experimental import multihost_utils
""")

GUARD = JOIN + textwrap.dedent("""
    from workers import multihost
    from workers.models.presets import init_model

    task = run / "tasks" / "t"
    (task / "checkpoints").mkdir(parents=True, exist_ok=True)  # the way to a shared directory: every process
    seen = {"process": jax.process_index(), "devices": len(jax.devices()),
            "guarded": multihost.guard_run_files([run], shared=[task / "checkpoints"])}

    def attempt(name, fn):  # what the guard says about one write: "ok" or its error
        try:
            fn()
            seen[name] = "ok"
        except multihost.RunFileWriteError as err:
            seen[name] = "refused: " + str(err)

    # Guarded: every process reaches it, one writes.
    if multihost.is_primary():
        (task / "metrics.jsonl").write_text(f"written by {index}\\n")
    # Each process's own shard of the task's checkpoints: every process writes by design.
    attempt("shard", lambda: (task / "checkpoints" / f"shard.{index}").write_text(str(index)))
    # Forgotten guards, each kind of write: appending to a run file, a real worker writing a model, a rename.
    attempt("append", lambda: open(task / "metrics.jsonl", "a").close())
    attempt("model", lambda: init_model(run / "model", preset="tiny"))
    attempt("rename", lambda: (task / "checkpoints" / f"shard.{index}").rename(task / f"moved.{index}"))
    attempt("mkdir", lambda: (task / "logs").mkdir())
    attempt("rmtree", lambda: __import__("shutil").rmtree(run / "tasks" / "other"))
    attempt("outside", lambda: (out.parent / f"scratch.{index}").write_text("not a run file"))
    multihost_utils.sync_global_devices("done")
    out.write_text(json.dumps(seen))
""")

OFFLOAD = JOIN + textwrap.dedent("""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from workers import multihost, offload as O

    mesh = Mesh(np.array(jax.devices()), ("x",))  # 4 devices, 2 in each process
    w = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    b = np.float32([1.5, -2.0, 3.25, 0.0])
    tree = {"w": multihost.global_array(w, NamedSharding(mesh, P("x"))),  # 8 rows on each device
            "b": multihost.global_array(b, NamedSharding(mesh, P()))}    # whole on every device
    seen = {"process": jax.process_index(), "devices": len(jax.devices()),
            "spans": not tree["w"].is_fully_addressable}
    own = sum(s.data.nbytes for x in tree.values() for s in x.addressable_shards)
    for mode in ("pinned_host", "numpy"):
        if mode == "numpy":  # a backend without pinned host memory
            O._host_kind = lambda leaves: None
        before = O.device_bytes()
        off = O.offload(tree)
        freed = before - O.device_bytes()
        tree = O.onload(off)
        seen[mode] = {"kind": off.memory_kind, "freed": freed, "own": own, "back": O.device_bytes() - before,
                      "w": multihost.host_value(tree["w"]).tolist(), "b": multihost.host_value(tree["b"]).tolist(),
                      "same_layout": tree["w"].sharding == NamedSharding(mesh, P("x"))}
    multihost_utils.sync_global_devices("done")
    out.write_text(json.dumps(seen))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp_path: Path, code: str, run: Path) -> tuple[dict, dict]:
    """Run `code` as processes 0 and 1 of one JAX job; what each wrote to its json."""
    script = tmp_path / "member.py"
    script.write_text(code)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": str(ROOT)}
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(i), str(run), str(tmp_path / f"{i}.json")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    first, second = (json.loads((tmp_path / f"{i}.json").read_text()) for i in (0, 1))
    assert (first["process"], second["process"], first["devices"]) == (0, 1, 4)  # one job of 4 devices
    return first, second


def test_only_process_0_writes_run_files_and_a_forgotten_guard_fails_naming_the_file(tmp_path):
    run = tmp_path / "runs" / "exp"
    (run / "tasks" / "other").mkdir(parents=True)
    first, second = _job(tmp_path, GUARD, run)

    assert not first["guarded"] and second["guarded"]
    assert (run / "tasks" / "t" / "metrics.jsonl").read_text() == "written by 0\n"  # guarded: process 0 alone
    for name in ("append", "model", "rename", "mkdir", "rmtree"):
        assert first[name] == "ok", (name, first[name])
        assert second[name].startswith("refused: process 1 of a role across hosts wrote "), (name, second[name])
    assert str(run / "tasks" / "t" / "metrics.jsonl") in second["append"] and "is_primary()" in second["append"]
    assert f"{run}{os.sep}" in second["model"]  # init_model's own first write is what the guard stopped
    assert (run / "model" / "config.json").is_file()  # process 0's model is whole
    # Shards are every process's own; anything outside the run directory is not the guard's business.
    assert first["shard"] == second["shard"] == "ok" and first["outside"] == second["outside"] == "ok"


def test_offload_across_processes_frees_each_processs_shards_and_onload_restores_them(tmp_path):
    first, second = _job(tmp_path, OFFLOAD, tmp_path)
    w = [[float(3 * r + c) for c in range(3)] for r in range(32)]
    for seen in (first, second):
        assert seen["spans"]  # no process holds w whole
        for mode in ("pinned_host", "numpy"):
            moved = seen[mode]
            # This process's shards: w's 8 rows x 3 float32 on each of its 2 devices, b whole on both.
            assert moved["kind"] == mode and moved["own"] == 2 * 8 * 3 * 4 + 2 * 4 * 4, moved
            assert moved["freed"] == moved["own"] and moved["back"] == 0, moved  # freed, then all back
            assert moved["w"] == w and moved["b"] == [1.5, -2.0, 3.25, 0.0] and moved["same_layout"], moved
