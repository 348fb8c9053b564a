"""`rlsched train` end to end on a tiny model: it learns, it resumes exactly, bad input is named."""

from __future__ import annotations

import json
import math
import re
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from rlsched.base.errors import CheckpointError, TaskError
from rlsched.cli import DEMO_CONFIG, main
from rlsched.config.loading import load_config
from rlsched.config.schema import ConfigError
from rlsched.observe.timeline import read_trace
from rlsched.observe.tracking import read_metrics
from rlsched.run.checkpoints import TaskCheckpointer
from rlsched.run.experiment import train
from rlsched.run.task import TaskDriver
from rlsched.rundir.files import RunDirError, prepare_run_dir
from rlsched.scheduling.policy import Role
from rlsched.scheduling.scheduler import FreeLocks
from workers import rewards as R
from workers.actor import ActorWorker
from workers.batch import build_train_batch
from workers.data import DataError, load_jsonl
from workers.train_step import ActorSettings, Optimizer

REQUIRED_METRICS = ["step", "reward/mean", "reward/std", "reward/max", "loss", "kl", "clip_frac", "grad_norm", "lr",
                    "response_len/mean", "tokens/generated", "time/rollout_s", "time/reward_s", "time/train_s",
                    "time/step_s", "mem/actor/process/rss_bytes", "mem/engine/device0/bytes_in_use",
                    "train/tied_groups", "rollout/truncated", "train/entropy", "train/logp_gap_mean",
                    "train/logp_gap_max"]


def _quick(tmp_path: Path, model_dir: Path, *extra: str) -> list[str]:
    """Overrides that shrink the demo to a few fast steps on the shared tiny model."""
    return [f"experiment.output_dir={tmp_path}", f"tasks.0.model.path={model_dir}", "tasks.0.model.init_preset=null",
            "tasks.0.grpo.prompts_per_step=4", "tasks.0.grpo.num_generations=4", "tasks.0.grpo.mini_batch_size=8",
            "tasks.0.steps=4", "tasks.0.checkpoint_every=2", *extra]


def _silent(*_args):
    pass


def _driver(cfg, **kw) -> TaskDriver:
    """The one step loop, in this process, with always-free locks (what `--in-process` runs)."""
    spec = cfg.task_specs()[0]
    return TaskDriver(spec, FreeLocks(spec.name), echo=_silent, **kw)


def test_train_has_the_cli_defaults():
    """`rlsched.run.experiment.train(configs)` is `rlsched train configs`: the same defaults (under Ray, not
    in-process), and both return {task: {"status": ...}} (checked in-process below and, through the CLI, under Ray)."""
    import inspect

    from rlsched.cli import build_parser

    cli = vars(build_parser().parse_args(["train", "a.yaml"]))
    defaults = {k: v.default for k, v in inspect.signature(train).parameters.items() if v.default is not v.empty}
    assert defaults["in_process"] is False
    for name in ("resume", "overwrite", "in_process", "address", "tasks"):
        assert defaults[name] == cli[name], name
    assert tuple(cli["set"]) == tuple(defaults["overrides"])


def test_in_process_a_mesh_across_hosts_is_refused_before_any_port_is_asked():
    """Always-free locks have no port allocator (`FreeLocks.take_port` is None): a role group across hosts
    needs a Ray cluster, and spawn says so naming the way out."""
    import dataclasses

    from rlsched.run.roles import ActorRole, spawn

    spec = dataclasses.replace(load_config(DEMO_CONFIG, ["tasks.0.actor.mesh.dp=2"]).task_specs()[0], hosts=2,
                               num_devices=1)  # the actor's 2 devices span 2 hosts of 1 device each
    with pytest.raises(TaskError, match=r"spans hosts .* needs a Ray cluster: run without --in-process"):
        spawn(ActorRole, spec, channel=None, sites=None, take_port=FreeLocks(spec.name).take_port)


@pytest.mark.slow
def test_demo_learns_addition(tmp_path):
    """A random tiny Qwen3 (HF init, std 0.02) learns: the field saw ~0 -> ~0.4 in ~30 steps of 16 x 16. Here, with
    issue 39's arithmetic reward (partial credit 0.4 x prefix + 0.1 x closeness, tied groups without signal), the
    first 10 steps' mean reward 0.008 -> the last 10's 0.148 over 40 steps (the old 0.5 x closeness rose ~0.3)."""
    history = train(DEMO_CONFIG, overrides=[f"experiment.output_dir={tmp_path}",
                                            f"tasks.0.model.path={tmp_path / 'model'}", "tasks.0.steps=40"],
                    in_process=True, echo=_silent)["addition"]["metrics"]
    rewards = [m["reward/mean"] for m in history]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last > first + 0.10, f"no clear learning: first 10 steps {first:.3f}, last 10 {last:.3f}"


def test_run_directory_holds_config_metrics_and_checkpoints(tmp_path, tiny_model_dir):
    # with a KL reference that waits in host memory between its log-probs (actor.offload_reference)
    reference = ("tasks.0.grpo.beta=0.05", "tasks.0.actor.offload_reference=true")
    result = train(DEMO_CONFIG, overrides=_quick(tmp_path, tiny_model_dir, *reference), in_process=True,
                   echo=_silent)["addition"]
    assert (result["status"], result["steps"], len(result["metrics"])) == ("ok", 4, 4)  # the CLI's shape, and metrics
    run = tmp_path / "demo-addition"
    resolved = load_config(run / "config.yaml")
    assert resolved.tasks[0].grpo.prompts_per_step == 4 and resolved.tasks[0].optim.lr == 3e-3
    lines = read_metrics(run / "tasks/addition/metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert set(REQUIRED_METRICS) <= m.keys()
        assert m["tokens/generated"] == m["response_len/mean"] * 16
        # prompt + completion tokens, within the 16 padded rows of one length
        assert m["tokens/generated"] < m["train/tokens"] <= m["train/padded_tokens"]
        assert m["train/padded_tokens"] % 16 == 0
        assert math.isfinite(m["loss"]) and m["weight_version"] == m["step"]
        assert m["rollout/weight_version"] == m["step"] - 1  # sampled with the weights of the step before
        # the jax_sampler's logprobs are the actor's to float rounding; 4 groups of 4: shares in quarters
        assert m["train/logp_gap_max"] < 1e-4 and m["train/entropy"] > 0
        assert m["train/tied_groups"] in (0, 0.25, 0.5, 0.75, 1) and 0 <= m["rollout/truncated"] <= 1
    assert sorted(p.name for p in (run / "tasks/addition/checkpoints").iterdir()) == ["2", "4"]
    # in one process too, the run's timeline: each step's sync and generate (benchmarks/gpu.py reads them)
    spans = [e["name"] for e in read_trace(run / "timeline.json") if e.get("kind") == "span"]
    assert spans.count("generate") == spans.count("sync_weights") == spans.count("TRAIN") == 4, spans
    # the reference's moves: off after each step's reference log-probs, back on before the next step's
    assert spans.count("offload_reference") == spans.count("onload_reference") + 1 == 4
    assert all(m["kl"] >= 0 for m in lines) and lines[-1]["kl"] > 0
    assert json.loads((run / "summary.json").read_text())["tasks"]["addition"] == {"task": "addition", "status": "ok",
                                                                                   "steps": 4}
    with pytest.raises(RunDirError, match="already holds a run; pass --resume"):
        train(DEMO_CONFIG, overrides=_quick(tmp_path, tiny_model_dir), in_process=True, echo=_silent)


def test_resume_is_exact(tmp_path, tiny_model_dir, capsys):
    # evaluated every 2 steps (16 problems): the resumed run's step 2 was evaluated before the crash, not again
    evaluation = ("tasks.0.eval.every=2", "tasks.0.eval.problems=16")
    straight = tmp_path / "a"
    train(DEMO_CONFIG, overrides=_quick(straight, tiny_model_dir, *evaluation), in_process=True, echo=_silent)

    interrupted = tmp_path / "b"
    cfg = load_config(DEMO_CONFIG, _quick(interrupted, tiny_model_dir, *evaluation))
    prepare_run_dir(cfg, resume=False, overwrite=False)
    _driver(cfg).run(until=3)  # crash after step 3: checkpoint 2 is the latest
    metrics = interrupted / "demo-addition/tasks/addition/metrics.jsonl"
    with metrics.open("a") as f:  # ... and the crash cut step 4's line short
        f.write('{"step": 4, "reward/mean": 0.1')
    capsys.readouterr()
    lines = []
    train(DEMO_CONFIG, overrides=_quick(interrupted, tiny_model_dir, *evaluation), resume=True, in_process=True,
          echo=lines.append)
    assert "its last line (line 5) was cut short" in capsys.readouterr().err  # steps 1-3 and step 2's evaluation
    evaluations = [line for line in lines if "] eval " in line]
    assert len(evaluations) == 1 and "eval after step 4:" in evaluations[0], evaluations  # step 2's is on file

    def comparable(path):
        return [{k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))} for m in read_metrics(path)]

    a = comparable(straight / "demo-addition/tasks/addition/metrics.jsonl")
    b = comparable(interrupted / "demo-addition/tasks/addition/metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert a == b and [m["step"] for m in a if "eval/accuracy" in m] == [2, 4]
    for run in (straight, interrupted):  # one evaluation line a step, as a run that was never stopped writes
        rows = [json.loads(line) for line in (run / "demo-addition/tasks/addition/metrics.jsonl").open()]
        assert [r["step"] for r in rows if "eval/accuracy" in r] == [2, 4], run


def test_cli_reports_config_mistakes(tmp_path, capsys):
    bad = yaml.safe_load(DEMO_CONFIG.read_text())
    bad["tasks"][0]["grpo"]["bta"] = 0.1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["train", str(path)]) == 2
    assert "tasks.0.grpo.bta: unknown key (got 0.1); did you mean 'beta'?" in capsys.readouterr().err
    assert main(["train", str(DEMO_CONFIG), "--set", "tasks.0.steps=ten"]) == 2
    assert "tasks.0.steps: Input should be a valid integer (got 'ten')" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_missing_and_empty_data_files_are_named(tmp_path, tiny_model_dir):
    over = _quick(tmp_path, tiny_model_dir, "tasks.0.data.kind=jsonl", "tasks.0.data.max_operand=9",
                  f"tasks.0.data.path={tmp_path / 'nope.jsonl'}", "tasks.0.reward.name=gsm8k")
    with pytest.raises(ConfigError, match="tasks.0.data.path: .*nope.jsonl does not exist"):  # before anything runs
        train(DEMO_CONFIG, overrides=over, echo=_silent)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    over = [o.replace(str(tmp_path / "nope.jsonl"), str(empty)) for o in over] + ["experiment.name=empty"]
    with pytest.raises(ConfigError, match="empty.jsonl has no records"):
        train(DEMO_CONFIG, overrides=over, echo=_silent)
    with pytest.raises(DataError, match="nope.jsonl"):  # the loader says it too, for callers that skip preflight
        load_jsonl(tmp_path / "nope.jsonl")


def test_prompt_longer_than_max_prompt_len_is_named(tmp_path, tiny_model_dir):
    with pytest.raises(TaskError, match=r"prompt addition:s\d+:0 is \d tokens, longer than grpo.max_prompt_len=2"):
        train(DEMO_CONFIG, overrides=_quick(tmp_path, tiny_model_dir, "tasks.0.grpo.max_prompt_len=2"), in_process=True,
              echo=_silent)
    assert not list((tmp_path / "demo-addition/tasks/addition/checkpoints").iterdir())


@R.register("test_always_raises")
def _always_raises(completion: str, answer: str) -> float:
    raise ZeroDivisionError("boom")


def test_raising_reward_fails_the_task_or_scores_zero_by_policy(tmp_path, tiny_model_dir):
    over = _quick(tmp_path, tiny_model_dir, "tasks.0.reward.name=test_always_raises")
    with pytest.raises(R.RewardError, match=r"task 'addition': reward 'test_always_raises' failed on sample 0"):
        train(DEMO_CONFIG, overrides=over, in_process=True, echo=_silent)
    over = [*over, "tasks.0.reward.on_error=zero", "experiment.name=zero"]
    echoed = []
    history = train(DEMO_CONFIG, overrides=over, in_process=True, echo=echoed.append)["addition"]["metrics"]
    assert all(m["reward/errors"] == 16 and m["reward/mean"] == 0.0 for m in history)
    assert any("16 reward error(s) scored 0" in line and "ZeroDivisionError" in line for line in echoed)


def _own_model(model_dir):
    """A model of the actor's own: an ActorWorker on one device holds its model's arrays as they are and its updates
    donate them, so the session's `tiny_model` (read by other tests) is never handed to one that trains."""
    from workers.models import load_pretrained

    return load_pretrained(model_dir, with_tokenizer=False)[0]


def test_non_finite_update_is_skipped_and_never_checkpointed(tiny_model_dir, tmp_path):
    model = _own_model(tiny_model_dir)
    settings = ActorSettings(remat="layers", adam_mu_dtype="float32",
                             lr=1e-2, total_steps=4, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0,
                             b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.0, aggregation="token-mean",
                             temperature=1.0, micro_batch_size=4, mini_batch_size=4, epochs=1,
                             router_aux_loss_coef=None, kl_clamp=None, max_new_tokens=None)
    actor = ActorWorker(model, settings)
    before = jax.tree.map(np.asarray, actor.state.params)
    prompts = [np.array([49, 43, 50, 61], np.int32)] * 4
    completions = [np.array([51, 258], np.int32)] * 4
    batch = build_train_batch(prompts, completions, np.array([np.nan, 1.0, -1.0, 0.0]), pad_id=256)
    metrics = actor.train(batch, step=1)
    assert metrics["skipped"] == 1.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(actor.state.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert int(actor.state.step) == 0

    poisoned = actor.state._replace(params=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), actor.state.params))
    ckpt = TaskCheckpointer(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="refusing to write checkpoint 1: the params contain NaN"):
        ckpt.save(1, poisoned, {"step": 1})
    assert ckpt.latest_step() is None and not any((tmp_path / "ckpt").glob("1*"))
    json.dumps(metrics)  # metrics stay JSON-serialisable


def test_the_update_in_a_program_of_its_own_is_optax_clip_then_adamw_to_the_bit(tiny_model_dir):
    """The actor runs an optimizer step as two programs (workers.actor `gradients`, then `update` on the device's word
    that the step is finite, writing the clipped gradient over the gradient): the update allocates no copy of the
    params beside the gradient (tests/test_plan_memory.py), where one program clipping inside AdamW and selecting the
    new state against the old kept 1.27 x the float32 params. The arithmetic is optax's, written here in programs of
    their own: the gradient, optax.clip_by_global_norm (its result stored), optax.adamw from the settings, and the
    old state kept where the step is not finite. Three steps of a float32 model with the clip at work (grad_clip 0.01
    under a gradient norm of ~5), the second one's loss not finite, leave the params, the moments, the step counts
    and every metric equal to the bit."""
    import optax

    from workers.train_step import TrainState, gradients, make_schedule

    model = _own_model(tiny_model_dir)
    s = ActorSettings(remat="layers", adam_mu_dtype="float32", lr=1e-2, total_steps=4, warmup_steps=0,
                      min_lr_ratio=0.1, weight_decay=0.1, grad_clip=0.01, b1=0.9, b2=0.999, epsilon=0.2,
                      epsilon_high=None, beta=0.0, aggregation="token-mean", temperature=1.0, micro_batch_size=2,
                      mini_batch_size=4, epochs=1, router_aux_loss_coef=None, kl_clamp=None, max_new_tokens=None)
    actor = ActorWorker(model, s)
    clip = optax.clip_by_global_norm(s.grad_clip)
    adamw = optax.adamw(make_schedule(s), b1=s.b1, b2=s.b2, weight_decay=s.weight_decay)
    grad_program = jax.jit(lambda state, mini: gradients(state, mini, graphdef=actor.graphdef, settings=actor.settings))
    clip_program = jax.jit(lambda grads: clip.update(grads, optax.EmptyState())[0])

    @partial(jax.jit, donate_argnums=0)
    def adamw_program(state, clipped, skipped):
        updates, opt_state = adamw.update(clipped, state.opt_state[1], state.params)
        finite = skipped == 0
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        return TrainState(keep(optax.apply_updates(state.params, updates), state.params),
                          keep((state.opt_state[0], opt_state), state.opt_state), state.step + finite.astype(jnp.int32))

    def one_step(state, mini):
        grads, metrics = grad_program(state, mini)
        return adamw_program(state, clip_program(grads), metrics["skipped"]), metrics

    rng, minis = np.random.default_rng(0), []
    for advantages in (rng.normal(size=4), np.array([np.nan, 1.0, -1.0, 0.0]), rng.normal(size=4)):
        prompts = [rng.integers(40, 60, size=4).astype(np.int32) for _ in range(4)]
        completions = [rng.integers(40, 60, size=4).astype(np.int32) for _ in range(4)]  # one length: one compile
        minis += actor._minis(build_train_batch(prompts, completions, advantages, pad_id=256).arrays(), False, rng)
    state, want = jax.tree.map(jnp.copy, actor.state), []
    for mini in minis:
        state, metrics = one_step(state, mini)
        want.append(metrics)
    got: list = []
    actor._steps(minis, got)
    assert [float(m["skipped"]) for m in got] == [0.0, 1.0, 0.0] and float(got[2]["grad_norm"]) > 100 * s.grad_clip
    for a, b in zip(jax.tree.leaves((state, want)), jax.tree.leaves((actor.state, got)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_update_is_a_branch_on_cpu_and_a_select_elsewhere_with_the_same_state():
    """`update` keeps the state in place on each compiler by a branch (XLA:CPU) or a select (XLA:GPU, where the
    branch copied 4 x the float32 master: benchmarks/gpu_memory.py). Lowered for each platform with no device of it
    (jax.export), each program holds its platform's function alone (its source locations name it); run here, the
    select's arithmetic (written here as `update`'s) leaves the same state as the branch, to the bit: a finite step
    with the clip at work, then a non-finite one, which changes nothing."""
    import optax

    from workers.train_step import TrainState, make_optimizer, update

    s = ActorSettings(remat="layers", adam_mu_dtype="float32", lr=1e-2, total_steps=4, warmup_steps=0,
                      min_lr_ratio=0.1, weight_decay=0.1, grad_clip=0.01, b1=0.9, b2=0.999, epsilon=0.2,
                      epsilon_high=None, beta=0.0, aggregation="token-mean", temperature=1.0, micro_batch_size=2,
                      mini_batch_size=2, epochs=1, router_aux_loss_coef=None, kl_clamp=None, max_new_tokens=None)
    tx = make_optimizer(s)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=4), jnp.float32)}
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    step = jax.jit(lambda state, grads, finite: update(state, grads, finite, tx=tx))
    args = (state, params, jnp.bool_(True))
    text = {p: jax.export.export(step, platforms=[p])(*args).mlir_module() for p in ("cpu", "cuda", "rocm")}
    lowered = {p: set(re.findall(r"update\.<locals>\.(\w+)", t)) for p, t in text.items()}
    assert lowered == {"cpu": {"apply", "branch"}, "cuda": {"apply", "select"}, "rocm": {"apply", "select"}}

    def select(state, grads, finite):  # what `update` lowers to where the platform is not the CPU
        clip_state, step_state = state.opt_state
        clipped, clip_state = tx.clip.update(grads, clip_state, state.params)
        updates, step_state = tx.step.update(clipped, step_state, state.params)
        new = (optax.apply_updates(state.params, updates), (clip_state, step_state), clipped)
        return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (state.params, state.opt_state, grads))

    grads = jax.tree.map(lambda p: 100.0 * p, params)  # a norm far over grad_clip: the clip at work
    for finite in (True, False):
        new, clipped = step(state, grads, jnp.bool_(finite))
        params_, opt_, clipped_ = jax.jit(select)(state, grads, jnp.bool_(finite))
        assert int(new.step) == int(state.step) + finite
        got, want = (new.params, new.opt_state, clipped), (params_, opt_, clipped_)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if not finite:
            for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        state = new


GSM8K_RECIPE = DEMO_CONFIG.parent / "gsm8k_qwen3.yaml"


def test_gsm8k_recipe_fails_clearly_without_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(DEMO_CONFIG.parents[1])  # the recipe's data path is relative to the repo root
    with pytest.raises(ConfigError, match=r"tasks\.0\.model\.path: /models/Qwen3-1.7B does not exist; point it at a "
                                          r"local Hugging Face model directory"):  # by the config check, before Ray
        train(GSM8K_RECIPE, overrides=[f"experiment.output_dir={tmp_path}"], echo=_silent)
    assert list(tmp_path.iterdir()) == []


def test_stale_or_unverified_engine_weights_are_refused(tmp_path, tiny_model_dir, host_transfers):
    from workers.rollout import SamplingParams

    cfg = load_config(DEMO_CONFIG, _quick(tmp_path, tiny_model_dir))
    prepare_run_dir(cfg, resume=False, overwrite=False)
    driver = _driver(cfg)
    driver.start()
    engine = driver.roles[Role.ENGINE]
    assert engine.version() == -1  # the engine holds nothing of the actor's until the first sync
    driver.step(1)  # ROLLOUT synced v0; the actor published v1 at the end of TRAIN; the engine still holds v0
    ids = driver.host.next_prompts().ids
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=4, stop_token_ids=())
    with pytest.raises(TaskError, match="holds weights v0 but the actor published v1; refusing"):
        engine.generate(ids, greedy, expected=driver.published)
    from workers.offload import on_device

    assert all(on_device(v) for v in driver.channel.receive(driver.published).values())  # the actor's, on device
    with host_transfers() as seen:  # the in-process sync: the actor's arrays, through the local channel
        stats = engine.update_weights(driver.published)
    # The engine's old weights wait beside the new ones (the CPU device has room: its memory is host memory) until
    # the new verify: no weight byte is read on the host, only the checksum's one uint32 a tensor.
    assert {(shape, dtype) for _, shape, dtype, _ in seen} == {((len(engine.engine._served_flat()),), "uint32")}
    assert stats["params_bytes"] > 4 * stats["largest_leaf_bytes"] > 0
    assert stats["peak_extra_bytes"] == stats["params_bytes"] and stats["undo_host_bytes"] == 0
    before = engine.generate(ids, greedy, expected=driver.published)
    engine.offload()  # offload -> onload: the contents come back and are re-hashed
    assert engine.memory()["params"] == 0
    assert engine.onload()["params"] == stats["params_bytes"]
    engine.update_weights(driver.published)  # swap to identical weights
    after = engine.generate(ids, greedy, expected=driver.published)  # verified against the published checksum
    assert [s.token_ids.tolist() for s in before.samples] == [s.token_ids.tolist() for s in after.samples]
    # An onload that brought back different contents (the field's garbled generations) is caught.
    engine.offload()
    off = engine.engine._host_state
    assert off.memory_kind == "pinned_host"  # JAX's CPU backend has the memory kind too
    off.tree = jax.tree.map(lambda x: np.asarray(x) * 1.01, off.tree)  # the onload brings back other contents
    off.memory_kind = "numpy"
    engine.onload()
    with pytest.raises(TaskError, match="checksum differs from the actor's published v1; refusing"):
        engine.rollout(driver.published, ids, greedy)  # same version: no sync, so only the checksum can tell
    driver.close()


def test_weights_altered_in_transit_are_refused(tmp_path, tiny_model_dir):
    """The engine verifies what it holds against the checksum the actor computed before sending."""
    from rlsched.cluster.comm import FakeChannel

    cfg = load_config(DEMO_CONFIG, _quick(tmp_path, tiny_model_dir))
    prepare_run_dir(cfg, resume=False, overwrite=False)
    driver = _driver(cfg, channel="fake")
    driver.start()
    assert isinstance(driver.channel, FakeChannel) and driver.channel.name == "demo-addition/addition/actor->rollout"
    driver.channel.corrupt_next = True
    driver.published, _ = driver.roles[Role.ACTOR].publish()  # v0 again, altered on the way
    with pytest.raises(TaskError, match=r"weights received for v0 were refused \(the engine holds v-1, it held v-1\)"):
        driver.step(1)  # staged, hashed, refused: the engine stays on what it held
    driver.close()


def test_an_update_that_leaves_the_weights_unchanged_is_an_error(tmp_path, tiny_model_dir):
    """An update that reaches no weight (here an optimizer whose updates are all zero, as a wrong freeze mask
    would give) must not be published as new weights: v2 would hash like v1 and hide a broken run. The task fails
    instead. A step whose groups all scored alike has no gradient: unchanged weights are right then, and pass. (A
    bfloat16 model's float32 master may rightly serve unchanged weights for a step: tests/test_mixed_precision.py.)"""
    import optax

    cfg = load_config(DEMO_CONFIG, _quick(tmp_path, tiny_model_dir, "tasks.0.optim.warmup_ratio=0"))
    prepare_run_dir(cfg, resume=False, overwrite=False)
    driver = _driver(cfg)
    driver.start()
    actor = driver.roles[Role.ACTOR]
    rng = np.random.default_rng(0)
    batch = build_train_batch([rng.integers(1, 200, 6) for _ in range(16)],
                              [rng.integers(1, 200, 4) for _ in range(16)], pad_id=0)
    actor.train(batch, np.zeros(16, np.float32), step=1)  # every group scored alike: nothing to move, no error
    varied = np.tile([0.0, 1.0, 0.0, 1.0], 4).astype(np.float32)
    actor.train(batch, varied, step=2)  # a real update
    worker = actor.worker
    worker.tx = Optimizer(optax.identity(), optax.set_to_zero())
    worker.state = worker.state._replace(opt_state=worker.tx.init(worker.state.params))
    worker.shardings = worker.shardings._replace(opt_state=worker.tx.init(worker.state.params))
    worker._programs.clear()  # the step compiles again with the broken optimizer
    with pytest.raises(TaskError, match="step 3's update left every parameter as it was"):
        actor.train(batch, varied, step=3)
    driver.close()


def test_completions_that_end_early_compile_nothing_after_step_1(tmp_path, tiny_model_dir, monkeypatch):
    """In-process, the tiny model's actor under the fake engine, whose every completion stops at a random length in
    1..8 (engine_args stop_probability 1): the steps' longest rows differ, and the old padding (the power-of-two
    bucket of the longest row: 8 or 16 as the longest completion is under 5 or not) made a new program mid-run. Now
    every batch is the prompts' bucket (8: "a+b=" is 4 bytes) + max_new_tokens 8 = 16 long: the actor prepares
    (compiles) once, in step 1, and never runs a program it did not prepare."""
    from workers.actor import ActorWorker
    from workers.batch import length_bucket

    prepared, trained = [], []
    prepare, update = ActorWorker.prepare, ActorWorker.train

    def recording_prepare(self, size, length, **kw):
        compiled = prepare(self, size, length, **kw)
        prepared.append((length, compiled))
        return compiled

    def recording_train(self, batch, **kw):
        out = update(self, batch, **kw)
        on_first_use = sum(fn._cache_size() for fn in self._programs.values())  # jitted, not prepared
        trained.append((batch.tokens.shape[1], int(batch.attention_mask.sum(1).max()), on_first_use))
        return out

    monkeypatch.setattr(ActorWorker, "prepare", recording_prepare)
    monkeypatch.setattr(ActorWorker, "train", recording_train)
    over = _quick(tmp_path, tiny_model_dir, "tasks.0.rollout.engine=fake",
                  "tasks.0.rollout.engine_args={stop_probability: 1.0}", "tasks.0.grpo.max_new_tokens=8",
                  "tasks.0.grpo.prompts_per_step=1", "tasks.0.grpo.num_generations=2", "tasks.0.grpo.mini_batch_size=2",
                  "tasks.0.steps=6", "tasks.0.checkpoint_every=0")
    train(DEMO_CONFIG, overrides=over, in_process=True, echo=_silent)
    assert len({length_bucket(longest) for _, longest, _ in trained}) > 1, trained  # the old rule: two shapes
    assert [t for t, _, _ in trained] == [16] * 6 and [n for _, _, n in trained] == [0] * 6, trained
    assert len(prepared) == 1 and prepared[0][0] == 16 and prepared[0][1] >= 1, prepared


@pytest.mark.parametrize("padding", ["max", "bucket"])
def test_the_train_batch_shape_is_known_from_the_prompts_before_the_rollout(tmp_path, tiny_model_dir, padding):
    """The driver has the actor compile for a step's batch while the engine compiles for its prompts
    (TaskDriver.prepare): HostWork.train_shape must be the shape train_batch then builds, whatever the completions'
    lengths (one that ends at once, one of max_new_tokens). Without prompts it is known under "max" only."""
    from rlsched.run.phases import HostWork
    from workers.rollout.base import FinishReason, RolloutOutput, Sample

    over = _quick(tmp_path, tiny_model_dir, "tasks.0.grpo.max_prompt_len=40", "tasks.0.grpo.max_new_tokens=6",
                  f"tasks.0.grpo.prompt_padding={padding}")
    host = HostWork(load_config(DEMO_CONFIG, over).task_specs()[0], echo=_silent)
    prompts = host.next_prompts()
    longest = max(len(p) for p in prompts.ids)
    bucket = max(8, 1 << (longest - 1).bit_length())  # the power-of-two bucket of the longest prompt
    assert bucket <= 16 < 40  # the demo's sums: their bucket is not max_prompt_len's
    samples = [Sample(prompt_index=i, token_ids=np.arange(1, 1 + (6 if j else 1), dtype=np.int32),
                      logprobs=np.zeros(6 if j else 1, np.float32),
                      finish_reason=FinishReason.LENGTH if j else FinishReason.STOP)
               for i in range(len(prompts.ids)) for j in range(4)]
    batch = host.train_batch(prompts, RolloutOutput(samples=samples, weight_version=0, generate_seconds=0.0))
    assert host.train_shape(prompts) == batch.tokens.shape == (16, (40 if padding == "max" else bucket) + 6)
    assert host.train_shape() == (batch.tokens.shape if padding == "max" else None)


@pytest.mark.parametrize("padding", ["max", "bucket"])
def test_max_prompt_padding_compiles_nothing_after_step_1_when_prompt_lengths_change_bucket(
        tmp_path, tiny_model_dir, monkeypatch, padding):
    """In-process, the tiny model under the jax_sampler engine, one prompt a step, in file order (data.shuffle
    false): "1+2=" (4 byte tokens, bucket 8) and "12345+67890=" (12 tokens, bucket 16) take turns under
    max_prompt_len 16. grpo.prompt_padding=max pads both to 16, in the engine and in the train batch: the engine
    holds one generate program from step 1 on and the actor prepares one update (16 + max_new_tokens 8 = 24).
    bucket (the default) pads each step to its prompt's bucket: step 2 brings a new shape to both (a compile)."""
    from workers.actor import ActorWorker
    from workers.rollout.jax_sampler import JaxSampler

    prepared, lengths, programs, prompt_shapes = [], [], [], []
    prepare, update, generate = ActorWorker.prepare, ActorWorker.train, JaxSampler.generate_many

    def recording_prepare(self, size, length, **kw):
        prepared.append(length)
        return prepare(self, size, length, **kw)

    def recording_train(self, batch, **kw):
        lengths.append(batch.tokens.shape[1])
        return update(self, batch, **kw)

    def recording_generate(self, requests):
        out = generate(self, requests)
        programs.append(self.programs_compiled())  # prepared, plus any jitted on first use
        prompt_shapes.append({plen for _, plen, _, _ in self.compiled_shapes})
        return out

    monkeypatch.setattr(ActorWorker, "prepare", recording_prepare)
    monkeypatch.setattr(ActorWorker, "train", recording_train)
    monkeypatch.setattr(JaxSampler, "generate_many", recording_generate)
    data = tmp_path / "sums.jsonl"
    data.write_text('{"question": "1+2=", "answer": "3"}\n{"question": "12345+67890=", "answer": "80235"}\n')
    over = _quick(tmp_path, tiny_model_dir, "tasks.0.data.kind=jsonl", f"tasks.0.data.path={data}",
                  "tasks.0.data.shuffle=false", "tasks.0.grpo.max_prompt_len=16", "tasks.0.grpo.max_new_tokens=8",
                  f"tasks.0.grpo.prompt_padding={padding}", "tasks.0.grpo.prompts_per_step=1",
                  "tasks.0.grpo.num_generations=2", "tasks.0.grpo.mini_batch_size=2", "tasks.0.steps=2",
                  "tasks.0.checkpoint_every=0")
    train(DEMO_CONFIG, overrides=over, in_process=True, echo=_silent)
    assert len(programs) == 2, programs
    if padding == "max":
        assert programs[1] == programs[0] and prompt_shapes[-1] == {16}, (programs, prompt_shapes)
        assert prepared == [24] and lengths == [24, 24], (prepared, lengths)
    else:  # the same data compiles again at step 2, in the engine and in the actor
        assert programs[1] == programs[0] + 1 and prompt_shapes[-1] == {8, 16}, (programs, prompt_shapes)
        assert prepared == [16, 24] and lengths == [16, 24], (prepared, lengths)
