"""One GRPO task, end to end, in one process: the step loop the scheduler later distributes.

`TaskRunner.step` reads as the algorithm of DESIGN.md ("One step of one task"); everything it
calls is a named method, so the multi-task driver can take the same calls and put locks around them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from rlsched.comm import WeightMessage, comm_group_name, make_channel
from rlsched.config import ExperimentConfig, TaskConfig
from rlsched.tracking import make_trackers
from workers import data as D
from workers import rewards as R
from workers.actor import TrainBatch, build_train_batch
from workers.grpo import group_advantages
from workers.models import init_model, load_tokenizer
from workers.rollout import OWN_PROCESS_ENGINES, RolloutOutput, SamplingParams

log = logging.getLogger(__name__)


class TaskError(RuntimeError):
    """A task cannot go on; the message names the task and the cause."""


def _timeline(task: str):
    from rlsched.timeline import Timeline

    return Timeline("driver", task=task)


def _rollout_seed(task_seed: int, step: int) -> int:
    # A pure function of (seed, step): a resumed run samples exactly what the uninterrupted one did.
    return (task_seed * 1_000_003 + step) % (2**31)


class TaskRunner:
    """One task's step loop over its two roles (rlsched.roles), which live in this process
    (`spawn=spawn_local`, the default) or in Ray actor processes of their own (the TaskDriver's)."""

    def __init__(self, experiment: ExperimentConfig, index: int, *, resume: bool = False, echo=print,
                 spawn=None, channel: str = "local", timeline=None):
        from rlsched.roles import ActorRole, EngineRole, spawn_local, spawn_process

        self.cfg: TaskConfig = experiment.tasks[index]
        self.index = index
        self.name = self.cfg.name
        self.seed = self.cfg.resolved_seed(experiment.experiment.seed, index)
        self.plan = self.cfg.batch_plan()
        self.dir = experiment.run_dir / "tasks" / self.name
        self.echo = echo
        self.timeline = timeline if timeline is not None else _timeline(self.name)
        self.where: dict[str, str] = {}  # phase and resource of the lock held now (set by the TaskDriver)
        g = self.cfg.grpo

        self.tokenizer = load_tokenizer(self._ensure_model())
        self.stop_ids = (self.tokenizer.eos_token_id,)
        self.sampling = dict(n=g.num_generations, temperature=g.temperature, top_p=g.top_p,
                             max_new_tokens=g.max_new_tokens, stop_token_ids=self.stop_ids)
        R.get_reward(self.cfg.reward.name)  # fail at start, not at the first reward
        self.loader = D.PromptLoader(self._make_source(), g.prompts_per_step, seed=self.seed,
                                     shuffle=self.cfg.data.shuffle)
        spawn = spawn or spawn_local
        spawn_engine = spawn
        if spawn is spawn_local and self.cfg.rollout.engine in OWN_PROCESS_ENGINES:
            # In-process runs too: this engine's crash must end its own process, never the caller's.
            spawn_engine = spawn_process
            channel = "object_store" if channel == "local" else channel
        self._engine_process_is_ours = spawn_engine is spawn_process
        # The task's own comm group: made here, handed to its two roles only.
        self.channel = make_channel(channel, comm_group_name(experiment.experiment.name, self.name))
        raw = experiment.model_dump(mode="json")
        self.actor = spawn(ActorRole, raw, index, channel=self.channel, role="actor")
        self.engine = spawn_engine(EngineRole, raw, index, channel=self.channel, role="engine")
        self.tracker = make_trackers(experiment.experiment.tracking, run_dir=self.dir,
                                     experiment=experiment.experiment.name, task=self.name,
                                     hparams=self.cfg.model_dump(mode="json"))
        self.step_done = 0
        if resume:
            self._resume()
        self.published = self._publish()  # what the engine must hold before it generates

    # ---- setup ----------------------------------------------------------------------------------

    def _ensure_model(self) -> Path:
        m = self.cfg.model
        path = Path(m.path)
        if m.init_preset is not None and not (path / "config.json").is_file():
            self.echo(f"[{self.name}] creating a random {m.init_preset} Qwen3 at {path}")
            init_model(path, preset=m.init_preset, seed=m.init_seed)
        if not path.exists():
            raise TaskError(
                f"task {self.name}: model.path {path} does not exist. Point it at a local Hugging Face Qwen3 "
                f"directory (--set tasks.{self.index}.model.path=/path/to/Qwen3) or set model.init_preset "
                "to create a random model there; rlsched never downloads weights")
        return path

    def _make_source(self):
        d = self.cfg.data
        if d.kind in ("addition", "subtraction"):
            return D.make_source(d.kind, seed=self.seed, max_operand=d.max_operand)
        if d.kind == "gsm8k":
            return D.make_source("gsm8k", path=d.path)
        return D.make_source(d.kind, path=d.path, question_field=d.question_field, answer_field=d.answer_field)

    def _resume(self) -> None:
        meta = self.actor.restore_latest()
        if meta is None:
            self.echo(f"[{self.name}] --resume: no checkpoint in {self.actor.checkpoint_dir()}; starting fresh")
            return
        self.loader.load_state(meta["loader"])
        self.step_done = int(meta["step"])
        self.tracker.truncate_after(self.step_done)  # lines written after the checkpoint are replayed
        self.echo(f"[{self.name}] resumed after step {self.step_done} (weights v{meta['version']})")

    # ---- one step ---------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, Any]:
        """One GRPO step without a scheduler (the Ray TaskDriver puts locks around the phases)."""
        t0 = time.perf_counter()
        rollout = self.rollout_phase(step)
        t1 = time.perf_counter()
        rewards, reward_errors = self.score(rollout.prompts, rollout.output)  # host work, outside any lock
        batch = self.train_batch(rollout, rewards)
        t2 = time.perf_counter()
        train_metrics = self.train_phase(step, batch)
        t3 = time.perf_counter()
        return step_metrics(rollout, rewards, reward_errors, train_metrics, self.published.version,
                            {"time/rollout_s": t1 - t0, "time/reward_s": t2 - t1, "time/train_s": t3 - t2,
                             "time/step_s": t3 - t0})

    def next_prompts(self) -> tuple[list[D.Prompt], list[np.ndarray]]:
        """The step's prompts, drawn and tokenized on the host (before the ROLLOUT lock is asked for)."""
        prompts = self.loader.next_batch()
        return prompts, self.encode(prompts)

    def rollout_phase(self, step: int, prompts: tuple[list[D.Prompt], list[np.ndarray]] | None = None) -> Rollout:
        """ROLLOUT: bring the engine up to the published weights, verify them, generate for `prompts`
        (default: the next ones)."""
        prompts, prompt_ids = prompts if prompts is not None else self.next_prompts()
        self.sync_weights()
        with self.timeline.span("generate", **self.where) as span:
            output = self.generate(prompt_ids, step)
            span["tokens"] = output.num_tokens
        return Rollout(prompts, prompt_ids, output)

    def train_batch(self, rollout: Rollout, rewards: np.ndarray) -> TrainBatch:
        """Group advantages and the padded batch: host work, done before the TRAIN lock is asked for."""
        advantages = np.asarray(group_advantages(jnp.asarray(rewards), self.cfg.grpo.num_generations,
                                                 normalize_std=self.cfg.grpo.normalize_advantage_std))
        samples = rollout.output.samples
        return build_train_batch([rollout.prompt_ids[s.prompt_index] for s in samples],
                                 [s.token_ids for s in samples], advantages, pad_id=self.tokenizer.pad_token_id)

    def train_phase(self, step: int, batch: TrainBatch) -> dict[str, float]:
        """TRAIN: GRPO updates (logprobs inside), publish weights v+1."""
        with self.timeline.span("train", samples=batch.size, **self.where):
            train_metrics, events = self.actor.train(batch, step)
        self._extend(events)
        if train_metrics["skipped"]:
            self.echo(f"[{self.name}] step {step}: non-finite loss or gradient in {train_metrics['skipped']:.0f} "
                      "optimizer step(s); those updates were skipped, the params are unchanged")
        self.published = self._publish()  # only params leave the actor; v+1
        return train_metrics

    def _publish(self) -> WeightMessage:
        message, events = self.actor.publish()
        self._extend(events)
        return message

    def _extend(self, events: list[dict]) -> None:
        """Add spans recorded inside a role, placed on the lock's phase and resource."""
        self.timeline.extend([{**e, **{k: v for k, v in self.where.items() if e.get(k) is None}} for e in events])

    def encode(self, prompts: list[D.Prompt]) -> list[np.ndarray]:
        d, limit = self.cfg.data, self.cfg.grpo.max_prompt_len
        out = []
        for p in prompts:
            ids = D.render_prompt(self.tokenizer, p.question, template=d.template, system_prompt=d.system_prompt)
            if len(ids) > limit:
                raise TaskError(f"task {self.name}: prompt {p.uid} is {len(ids)} tokens, longer than "
                                f"grpo.max_prompt_len={limit}; raise grpo.max_prompt_len or shorten the data")
            out.append(np.asarray(ids, np.int32))
        return out

    def generate(self, prompt_ids: list[np.ndarray], step: int) -> RolloutOutput:
        engine_version = self.engine.version()
        if engine_version != self.published.version:
            raise TaskError(f"task {self.name}: the engine holds weights v{engine_version} but the "
                            f"actor published v{self.published.version}; refusing to generate with stale weights")
        params = SamplingParams(**self.sampling, seed=_rollout_seed(self.seed, step))
        return self.engine.generate(prompt_ids, params)

    def score(self, prompts: list[D.Prompt], rollout: RolloutOutput) -> tuple[np.ndarray, int]:
        with self.timeline.span("reward"):
            texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in rollout.samples]
            answers = [prompts[s.prompt_index].answer for s in rollout.samples]
            result = R.score(self.cfg.reward.name, texts, answers, task=self.name, on_error=self.cfg.reward.on_error)
        if result.num_errors:
            self.echo(f"[{self.name}] {result.num_errors} reward error(s) scored 0; first: {result.first_error}")
        return result.rewards, result.num_errors

    def sync_weights(self) -> dict[str, int]:
        """Update the engine if it is behind the published version, then verify its checksum against
        the one the actor computed before the weights left. Returns the swap's stats (or {})."""
        message, stats = self.published, {}
        if self.engine.version() != message.version:
            with self.timeline.span("sync_weights", bytes=message.nbytes, **self.where) as span:
                stats, events = self.engine.update_weights(message)
                span.update(stats)
            self._extend(events)
        with self.timeline.span("verify", **self.where):
            checksum = self.engine.verify()
        if checksum != message.checksum:
            raise TaskError(f"task {self.name}: engine checksum differs from the actor's published v{message.version}"
                            "; refusing to generate with unverified weights")
        return stats

    def save_checkpoint(self, step: int) -> None:
        self.actor.save(step, {"step": step, "loader": self.loader.state(), "task": self.name})

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self, until: int | None = None) -> list[dict[str, Any]]:
        """Run the remaining steps (or stop after step `until`); returns this call's metrics."""
        history = []
        last = self.cfg.steps if until is None else min(until, self.cfg.steps)
        try:
            for step in range(self.step_done + 1, last + 1):
                metrics = self.step(step)
                self.record(step, metrics)
                history.append(metrics)
        except BaseException:
            self.close(exit_code=1)  # the W&B run is finished as failed, never left open
            raise
        self.close()
        return history

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """After a step: metrics line (with the memory each role holds now), progress line, checkpoint when due."""
        self.tracker.log(step, {**metrics, **self.actor.memory_probe(), **self.engine.memory_probe()})
        self.step_done = step
        if step % self.cfg.log_every == 0 or step == self.cfg.steps:
            self.echo(progress_line(self.name, step, self.cfg.steps, metrics))
        every = self.cfg.checkpoint_every
        if every and (step % every == 0 or step == self.cfg.steps):
            self.save_checkpoint(step)

    def close(self, exit_code: int = 0) -> None:
        try:
            self.tracker.finish(exit_code)
        finally:
            self.actor.close()
            self.engine.close()
            if self._engine_process_is_ours:
                self.engine.terminate()


@dataclasses.dataclass(frozen=True)
class Rollout:
    prompts: list[D.Prompt]
    prompt_ids: list[np.ndarray]
    output: RolloutOutput


def step_metrics(rollout: Rollout, rewards: np.ndarray, reward_errors: int, train: dict[str, float], version: int,
                 times: dict[str, float]) -> dict[str, Any]:
    """The metrics.jsonl line of one step."""
    lengths = np.array([len(s.token_ids) for s in rollout.output.samples])
    return {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "reward/max": float(rewards.max()), "reward/errors": reward_errors,
        "loss": train["loss"], "kl": train["kl"], "clip_frac": train["clip_frac"],
        "ratio_mean": train["ratio_mean"], "grad_norm": train["grad_norm"],
        "lr": train["lr"], "skipped_updates": train["skipped"],
        "response_len/mean": float(lengths.mean()), "tokens/generated": int(lengths.sum()),
        "weight_version": version, **times,
    }


def progress_line(task: str, step: int, steps: int, m: dict[str, Any]) -> str:
    return (f"[{task}] step {step:>4}/{steps}  reward {m['reward/mean']:.3f}±{m['reward/std']:.3f}  "
            f"kl {m['kl']:.4f}  loss {m['loss']:+.4f}  len {m['response_len/mean']:.1f}  "
            f"step {m['time/step_s']:.2f}s (rollout {m['time/rollout_s']:.2f} reward {m['time/reward_s']:.2f} "
            f"train {m['time/train_s']:.2f})")
