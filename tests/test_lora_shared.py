"""LoRA tasks of one base group share the base in one process (workers.shared_base): their actors read the same
device arrays, counted once; one engine per base group serves each task's adapter from its slot
(workers.rollout.shared_engine); each task computes and generates what it would alone."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from workers import shared_base
from workers.actor import ActorWorker
from workers.batch import build_train_batch
from workers.models import load_pretrained
from workers.models import lora as L
from workers.models import params as P
from workers.models import sharding as S
from workers.offload import device_bytes, per_device_bytes
from workers.rollout.adapter_engine import AdapterEngine
from workers.rollout.base import EngineOffloadedError, SamplingParams
from workers.rollout.jax_sampler import JaxSampler
from workers.rollout.shared_engine import groups, open_view
from workers.train_step import ActorSettings

SPEC = L.LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "o", "down"))
OTHER = L.LoraSpec(rank=2, alpha=4.0, targets=("k", "up"))  # another rank and targets in the same group
SETTINGS = ActorSettings(remat="layers", adam_mu_dtype="float32",
                         lr=1e-2, total_steps=4, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0,
                         b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.04, aggregation="token-mean",
                         temperature=1.0, micro_batch_size=4, mini_batch_size=8, epochs=1, router_aux_loss_coef=None,
                         kl_clamp=None, max_new_tokens=None)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, n=1, seed=0)
SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=7)


def _mesh():
    return S.mesh({}, jax.devices()[:1])


def _adapter(cfg, spec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 0.3, s).astype(np.float32) for n, s in L.adapter_shapes(cfg, spec).items()}


def _batch():
    rng = np.random.default_rng(0)
    return build_train_batch([rng.integers(1, 200, 6) for _ in range(8)], [rng.integers(1, 200, 4) for _ in range(8)],
                             np.tile([0.0, 1.0, 0.5, 1.0], 2).astype(np.float32), pad_id=0)


def _tokens(output) -> list[list[int]]:
    return [[int(t) for t in s.token_ids] for s in output.samples]


def _same(got, want) -> None:
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got.samples, want.samples, strict=True):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def test_two_lora_actors_of_one_key_share_the_base_and_offload_only_their_adapters(tiny_model_dir):
    batch = _batch()
    alone = ActorWorker(load_pretrained(tiny_model_dir)[0], SETTINGS, lora=SPEC, seed=3)  # its own base
    alone.train(batch, step=1)
    want = {"policy": alone.logprobs(batch), "ref": alone.logprobs(batch, reference=True)}

    before = device_bytes()
    a = ActorWorker(None, SETTINGS, lora=SPEC, seed=3, mesh=_mesh(),
                    base=shared_base.acquire(tiny_model_dir, dtype=None, mesh=_mesh()))
    b = ActorWorker(None, SETTINGS, lora=SPEC, seed=4, mesh=_mesh(),
                    base=shared_base.acquire(tiny_model_dir, dtype=None, mesh=_mesh()))
    key = shared_base.base_key(tiny_model_dir, None, _mesh())
    assert shared_base.held()[key] == 2
    assert all(x is y for x, y in zip(jax.tree.leaves(a.base), jax.tree.leaves(b.base), strict=True))  # same arrays
    base = a.shared_bytes()
    assert base == per_device_bytes(a.base) > 0 and b.shared_bytes() == base
    # Each reports its adapter and moments only; the process's live bytes hold the base once
    ma = a.memory_bytes()
    assert b.memory_bytes() == ma  # the same adapter shapes
    assert ma["params"] == per_device_bytes(a.state.params) < base // 10
    assert sum(ma.values()) + 4 == per_device_bytes(a.state)  # (+ the int32 step count of its TrainState)
    assert device_bytes() - before == base + per_device_bytes(a.state) + per_device_bytes(b.state)

    a.train(batch, step=1)
    b.train(batch, step=1)  # a different seed: a different adapter, on the same base
    np.testing.assert_array_equal(a.logprobs(batch), want["policy"])  # what it computes alone, bit for bit
    np.testing.assert_array_equal(a.logprobs(batch, reference=True), want["ref"])
    b_policy = b.logprobs(batch)
    assert not np.array_equal(b_policy, want["policy"])

    a.offload()  # moves a's adapter state only: the base stays for b
    assert a.memory_bytes() == {"params": 0, "opt": 0, "ref": 0}
    assert all(not x.is_deleted() for x in jax.tree.leaves(b.base))
    np.testing.assert_array_equal(b.logprobs(batch), b_policy)
    b.train(batch, step=2)  # b trains on while a is offloaded
    a.onload()
    np.testing.assert_array_equal(a.logprobs(batch), want["policy"])

    a.release()
    assert shared_base.held()[key] == 1  # b still holds it: the base survives the first release
    b.logprobs(batch)
    leaves = jax.tree.leaves(b.base)
    b.release()
    b.release()  # idempotent
    assert key not in shared_base.held() and all(x.is_deleted() for x in leaves)  # the last release frees it


def test_a_lease_dropped_without_release_gives_the_base_back(tiny_model_dir):
    lease = shared_base.acquire(tiny_model_dir, dtype="float32", mesh=_mesh())
    key = lease.key
    assert shared_base.held()[key] == 1
    del lease  # a role a fence dropped: garbage collection releases its lease
    import gc

    gc.collect()
    assert key not in shared_base.held()


@pytest.mark.slow
def test_two_engine_views_each_generate_what_their_task_would_alone(tiny_model_dir):
    kw = dict(max_prompt_len=16, max_new_tokens=8)
    one = open_view(tiny_model_dir, dtype=None, mesh=_mesh(), spec=SPEC, max_batch_size=64, **kw)
    two = open_view(tiny_model_dir, dtype=None, mesh=_mesh(), spec=OTHER, max_batch_size=64, **kw)
    assert one.group is two.group and len(groups()) == 1 and (one.slot_index, two.slot_index) == (0, 1)
    base = one.group.lease.params
    assert all(x is y for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(one.sampler._state), strict=True))
    cfg = one.config
    first, second = _adapter(cfg, SPEC, 1), _adapter(cfg, OTHER, 2)
    one.update_weights(first, 1, checksum=P.checksum(first))
    two.update_weights(second, 1, checksum=P.checksum(second))
    assert one.memory_bytes()["params"] == sum(x.nbytes for x in first.values())  # its adapter, not the base

    # Each alone: a task's own engine (its own base copy, its adapter in slot 0 of one)
    def alone(spec, adapter):
        engine = AdapterEngine(JaxSampler.from_pretrained(tiny_model_dir, **kw), spec)
        engine.update_weights(adapter, 1)
        return engine.generate(PROMPTS, GREEDY), engine.generate(PROMPTS, SAMPLED)

    want_one, want_two = alone(SPEC, first), alone(OTHER, second)
    _same(one.generate(PROMPTS, GREEDY), want_one[0])
    _same(one.generate(PROMPTS, SAMPLED), want_one[1])
    _same(two.generate(PROMPTS, GREEDY), want_two[0])
    assert _tokens(want_one[0]) != _tokens(want_two[0])  # the two adapters differ in what they generate

    newer = _adapter(cfg, OTHER, 3)  # the other task's adapter changes: the first generates as before
    two.update_weights(newer, 2, checksum=P.checksum(newer))
    _same(one.generate(PROMPTS, GREEDY), want_one[0])
    assert one.weight_version == 1 and two.weight_version == 2

    # A view's offload moves its adapter only; the other view and the base stay and generate as before
    want_two_new = two.generate(PROMPTS, GREEDY)
    one.offload()
    assert one.offloaded and one.memory_bytes()["params"] == 0
    with pytest.raises(EngineOffloadedError):
        one.generate(PROMPTS, GREEDY)
    _same(two.generate(PROMPTS, GREEDY), want_two_new)
    assert all(not x.is_deleted() for x in jax.tree.leaves(base))
    one.onload()
    assert one.weight_checksum == P.checksum(first)
    _same(one.generate(PROMPTS, GREEDY), want_one[0])

    # A sync that landed nothing (or something else) fails and keeps the slot's adapter
    with pytest.raises(P.WeightMismatchError, match="keeping v1"):
        one.update_weights(_adapter(cfg, SPEC, 9), 5, checksum=P.checksum(first))
    assert one.weight_version == 1 and one.weight_checksum == P.checksum(first)

    key = one.group.lease.key
    one.close()
    assert shared_base.held()[key] == 1 and len(groups()) == 1
    _same(two.generate(PROMPTS, GREEDY), want_two_new)
    two.close()
    assert key not in shared_base.held() and not groups() and all(x.is_deleted() for x in jax.tree.leaves(base))


# ---- through the command line ---------------------------------------------------------------------------------


def _cli(*args, timeout=900):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "rlsched.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _lora_run(out, model_dir, tasks: str, in_process=False):
    """The two tasks through `rlsched train`; in_process: as `rlsched train --in-process` runs them, each alone
    in this process one after the other (no base shared, no hold shared), without a CLI and a Ray of its own."""
    from pathlib import Path

    from rlsched.run.experiment import train

    config = Path(__file__).parent.parent / "configs" / "demo_multitask.yaml"
    sets = [f"experiment.output_dir={out}", "cluster.processes=per_device_group", "cluster.placement=colocated"]
    for i in (0, 1):  # both tasks on one base: the same directory, dtype and mesh (seeds 0 and 1, their own data)
        sets += [f"tasks.{i}.{s}" for s in (f"model.path={model_dir}", "model.init_preset=null", "lora.rank=8",
                                            "lora.targets=[q,v,down]", "steps=3", "checkpoint_every=0",
                                            "grpo.prompts_per_step=4", "grpo.num_generations=4",
                                            "grpo.mini_batch_size=8", "rollout.max_batch_size=16", "eval=null")]
    if in_process:
        results = train(config, overrides=sets, tasks=tasks.split(","), in_process=True, echo=lambda *_: None)
        assert {r["status"] for r in results.values()} == {"ok"}, results
        return "", next(out.glob("demo-*"))
    done = _cli("train", str(config), "--tasks", tasks, *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, next(out.glob("demo-*"))


@pytest.mark.slow
def test_two_lora_tasks_on_one_base_compute_what_each_computes_alone_with_the_base_held_once(tmp_path,
                                                                                             tiny_model_dir):
    import re

    from rlsched.observe.tracking import read_metrics

    both, run = _lora_run(tmp_path / "both", tiny_model_dir, "addition,subtraction")
    assert "roles held by 1 device-group process(es)" in both
    metrics = {t: read_metrics(run / "tasks" / t / "metrics.jsonl") for t in ("addition", "subtraction")}
    _, alone_run = _lora_run(tmp_path / "alone", tiny_model_dir, "addition,subtraction", in_process=True)
    for task in ("addition", "subtraction"):
        alone = read_metrics(alone_run / "tasks" / task / "metrics.jsonl")
        assert [m["step"] for m in metrics[task]] == [m["step"] for m in alone] == [1, 2, 3]
        for got, want in zip(metrics[task], alone, strict=True):
            keys = [k for k in want if not k.startswith(("time/", "mem/"))]  # rewards, losses, ... all but timings
            assert {"loss", "grad_norm"} <= set(keys) and [k for k in keys if "reward" in k], sorted(want)
            for k in keys:
                assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-6), (task, got["step"], k)
    # The base is held once in the device group's process: both tasks' actors and engines read one copy
    last = {t: metrics[t][-1] for t in metrics}
    base = last["addition"]["mem/actor/held/base"]
    assert base > 0 and all(last[t][f"mem/{r}/held/base"] == base for t in last for r in ("actor", "engine"))
    for t in last:  # every live array of the process, probed after each task's phases: its four roles read one
        live = last[t]["mem/actor/device0/bytes_in_use"]  # base (own copies would hold four: >= 4 x base)
        assert base < live < 2 * base, (t, live, base)
    for line in [x for x in both.splitlines() if "measured / planned" in x]:  # true: base + adapter as planned
        pairs = re.findall(r"([\d.]+ \w+) / ([\d.]+ \w+)", line)
        assert "(base shared)" in line and pairs and all(m == p for m, p in pairs), line


def test_the_plan_and_admission_count_a_base_group_s_base_once(tiny_model_dir):
    """Two LoRA tasks on one base in a device group's process: `rlsched plan` shows each role's adapter and one
    `base` row; the scheduler's budget holds the base once and each task registers its adapter's bytes only.
    per_role (a copy per process) counts the base in every role, as before."""
    from pathlib import Path

    from rlsched.config.loading import load_config
    from rlsched.config.plan import ITEMSIZE, actor_bytes, device_plan, engine_bytes, param_bytes, resident_bytes
    from rlsched.run.experiment import build_policy, lora_bases, train_cohorts
    from workers.models import lora as L
    from workers.models.config import ModelConfig

    demo = Path(__file__).parent.parent / "configs" / "demo_multitask.yaml"
    overrides = [f"tasks.{i}.{k}" for i in (0, 1) for k in (f"model.path={tiny_model_dir}", "model.init_preset=null",
                                                            "lora.rank=8", "actor.cobatch=true")]
    overrides += ["cluster.memory_budget_gb=1"]
    cfg = load_config(demo, overrides)
    model = ModelConfig.from_dir(tiny_model_dir)
    base = param_bytes(model.param_shapes(), cfg.tasks[0].actor.mesh.as_dict(), kv_heads=model.num_key_value_heads,
                       itemsize=ITEMSIZE["float32"])
    adapter = L.adapter_bytes(model, L.LoraSpec(8, 16.0, ("q", "k", "v", "o")))
    plan = device_plan(cfg)
    rows = {(r.task, r.role): r.bytes for r in plan.roles}
    assert rows[("addition,subtraction", "base")] == {"params": base}  # one copy for both tasks' actors and engines
    for task in ("addition", "subtraction"):
        assert rows[(task, "actor")]["params"] == rows[(task, "engine")]["params"] == adapter
    full = {role: resident_bytes({"actor": actor_bytes(t, model), "engine": engine_bytes(t, model)})[role]
            for role in ("actor", "engine") for t in cfg.tasks[:1]}
    assert plan.per_device[0] == base + sum(sum(b.values()) for (t, r), b in rows.items() if r != "base")
    (batch,) = plan.rollout_batches  # their rollouts share holds: `rlsched plan` says which, and up to how many rows
    g = cfg.tasks[0].grpo
    assert batch.tasks == ["addition", "subtraction"] and batch.rows == [g.prompts_per_step * g.num_generations] * 2
    assert "co-batched rollout: addition, subtraction on one base" in plan.render()
    (update,) = plan.train_batches  # one update program (same settings and adapter): their TRAINs share holds too
    assert update.tasks == ["addition", "subtraction"]
    assert update.rows == [cfg.tasks[0].batch_plan().micro_batch_size] * 2
    assert update.capacity == cfg.tasks[0].actor.max_cobatch_rows
    assert "co-batched train: addition, subtraction, one update program" in plan.render()
    # each actor compiles the update of a hold of both before its first lock (TaskSpec.train_cohort)
    assert train_cohorts(cfg, lora_bases(cfg)) == {"addition": 2, "subtraction": 2}
    narrow = load_config(demo, [*overrides, *(f"tasks.{i}.actor.max_cobatch_rows={update.rows[0]}" for i in (0, 1))])
    # a hold is full with one task's rows
    assert train_cohorts(narrow, lora_bases(narrow)) == {"addition": 1, "subtraction": 1}
    # a sweep over the optimizer's settings and the run's length is one program too (each member's values its input)
    sweep = device_plan(load_config(demo, [*overrides, "tasks.1.optim.lr=1e-4", "tasks.1.optim.weight_decay=0.1",
                                           "tasks.1.optim.warmup_ratio=0.2", "tasks.1.steps=50"]))
    assert [b.tasks for b in sweep.train_batches] == [["addition", "subtraction"]]
    other_loss = device_plan(load_config(demo, [*overrides, "tasks.1.grpo.epsilon=0.3"]))
    assert [b.tasks for b in other_loss.train_batches] == [["addition"], ["subtraction"]]
    default = [o for o in overrides if not o.endswith("actor.cobatch=true")]  # off unless asked for
    assert device_plan(load_config(demo, default)).train_batches == []
    assert "co-batched train" not in other_loss.render() and len(other_loss.rollout_batches) == 1

    snap = build_policy(cfg)[0].snapshot()
    assert snap["pools"]["g0/shared"]["budget"] == 2**30 - base
    assert snap["tasks"]["addition"]["bytes"] == {"engine": full["engine"] - base, "actor": full["actor"] - base}
    # their engines are slots of one sampler: their rollouts may share a hold (rlsched.scheduling.policy.CoBatch)
    assert snap["tasks"]["addition"]["cobatch"] == snap["tasks"]["subtraction"]["cobatch"]
    assert snap["tasks"]["addition"]["cobatch"].keys() == {"rollout", "train"}
    alone = build_policy(load_config(demo, [*overrides, "tasks.1.rollout.cobatch=false",
                                            "tasks.1.actor.cobatch=false"]))[0].snapshot()
    assert alone["tasks"]["addition"]["cobatch"].keys() == {"rollout", "train"}
    assert "cobatch" not in alone["tasks"]["subtraction"]

    per_role = load_config(demo, [*overrides, "cluster.processes=per_role"])
    assert not any(r.role == "base" for r in device_plan(per_role).roles)
    snap = build_policy(per_role)[0].snapshot()
    assert snap["pools"]["g0/shared"]["budget"] == 2**30 and snap["tasks"]["addition"]["bytes"] == full
    assert "cobatch" not in snap["tasks"]["addition"]  # an engine per process: nothing to share a run of


def _demo_lora(out, tasks=None, steps=3):
    """configs/demo_lora.yaml through `rlsched train`; tasks: one task as `rlsched train --tasks T --in-process`
    runs it, alone in this process (without a CLI and a Ray of its own: the reference to compare against)."""
    import subprocess
    import sys
    from pathlib import Path

    from rlsched.run.experiment import train

    base = out.parent / "models" / "base"  # one preset base for every run of the test
    sets = [f"experiment.output_dir={out}"] + [f"tasks.{i}.{k}" for i in range(8)
                                               for k in (f"model.path={base}", f"steps={steps}")]
    demo = Path(__file__).parent.parent / "configs" / "demo_lora.yaml"
    if tasks:
        results = train(demo, overrides=sets, tasks=[tasks], in_process=True, echo=lambda *_: None)
        assert results[tasks]["status"] == "ok", results
        return base, out / "demo-lora" / "tasks", ""
    done = subprocess.run([sys.executable, "-m", "rlsched.cli", "train", str(demo),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return base, out / "demo-lora" / "tasks", done.stdout


@pytest.mark.slow
def test_eight_lora_tasks_roll_out_together_on_one_base_and_each_computes_what_it_computes_alone(tmp_path):
    """configs/demo_lora.yaml through the CLI: eight LoRA tasks start at once on one preset base that none of them
    finds made (one creates it, the others wait for it: none replaces it while another reads it); every task reads
    the one base of the device group's process; their rollouts share holds (several tasks' rows in one program run)
    while each trains alone (actor.cobatch is off by default); and a task among its seven neighbours, co-batched,
    computes what it computes alone (rewards, losses: 1e-6)."""
    from rlsched.observe.tracking import read_metrics

    names = ("add-9", "sub-9", "add-19", "sub-19", "add-49", "sub-49", "add-99", "sub-99")
    import re

    base, tasks, printed = _demo_lora(tmp_path / "all")
    assert sorted(p.name for p in base.parent.iterdir() if not p.name.startswith(".")) == ["base"]
    metrics = {t: read_metrics(tasks / t / "metrics.jsonl") for t in names}
    held = {m[-1][f"mem/{r}/held/base"] for m in metrics.values() for r in ("actor", "engine")}
    assert len(held) == 1 and held.pop() > 0  # every role of every task reads one base
    together = [m["rollout/cobatched"] for ms in metrics.values() for m in ms]
    assert len(together) == 24 and max(together) > 1, together  # holds were shared, rows run together
    assert re.search(r"rollout \d+\.\d+ \([2-8] tasks\) reward", printed), printed[-2000:]  # and the user sees it
    assert {m["train/cobatched"] for ms in metrics.values() for m in ms} == {1}  # each update alone, by default
    _, alone, _ = _demo_lora(tmp_path / "alone", tasks="add-19")
    alone = read_metrics(alone / "add-19" / "metrics.jsonl")
    assert [m["rollout/cobatched"] for m in alone] == [m["train/cobatched"] for m in alone] == [1, 1, 1]
    for got, want in zip(metrics["add-19"], alone, strict=True):
        keys = [k for k in want if not k.startswith(("time/", "mem/")) and not k.endswith("/cobatched")]
        assert {"loss", "grad_norm", "reward/mean"} <= set(keys)
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-6), (got["step"], k)


def test_a_service_gives_lora_tasks_of_one_base_the_same_cobatch_whichever_submission_they_came_in(tiny_model_dir):
    """rlsched.service.server admits tasks one submission at a time: a LoRA task's CoBatch is computed from its own
    submission, and two submissions of one base group get one key, so their rollouts can share holds."""
    from pathlib import Path

    from rlsched.config.loading import load_config
    from rlsched.run.experiment import cobatches, task_bases

    def task_cobatch(cfg, name, processes, phase="rollout"):  # as rlsched.service.server admits a task of a submission
        return next((b for b in cobatches(cfg, task_bases(cfg, name, processes)).get(name, ()) if b.phase == phase),
                    None)

    demo = Path(__file__).parent.parent / "configs" / "demo_multitask.yaml"
    lora = [f"tasks.{i}.{k}" for i in (0, 1) for k in (f"model.path={tiny_model_dir}", "model.init_preset=null",
                                                       "lora.rank=8", "actor.cobatch=true")]
    first = load_config(demo, [*lora, "tasks.1.lora.rank=4"])  # its own submission: another rank, same base
    second = load_config(demo, [*lora, "experiment.name=another", "tasks.0.grpo.num_generations=4"])
    a, b = task_cobatch(first, "subtraction", "per_device_group"), task_cobatch(second, "addition", "per_device_group")
    g = first.tasks[1].grpo
    assert a.key == b.key and a.rows == g.prompts_per_step * g.num_generations and b.rows == g.prompts_per_step * 4
    assert a.capacity == first.tasks[1].rollout.max_batch_size
    # their updates are not one program: subtraction's adapter is of rank 4 in the first submission, 8 in the second
    train_a, train_b = (task_cobatch(first, "subtraction", "per_device_group", "train"),
                        task_cobatch(second, "subtraction", "per_device_group", "train"))
    assert train_a.key != train_b.key and train_a.rows == first.tasks[1].batch_plan().micro_batch_size
    # one update program whichever submission: rank 8 and 16 generations in both, only the experiment's name differs
    assert train_b.key == task_cobatch(first, "addition", "per_device_group", "train").key
    assert train_b.key != task_cobatch(second, "addition", "per_device_group", "train").key  # 4 generations
    assert task_cobatch(first, "subtraction", "per_role") is None  # an engine per process: nothing to share
    assert task_cobatch(load_config(demo), "addition", "per_device_group") is None  # full weights
