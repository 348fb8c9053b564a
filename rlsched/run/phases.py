"""The host side of a task's phases: prompts in; rewards, the padded batch and the metrics line out.

The device side is one call per phase on a role (rlsched.run.roles: `EngineRole.rollout`,
`ActorRole.train`); everything here is numpy, tokenizer and reward code, done by the task's driver
*outside* the locks, so a lock is held only while devices work.

Design decisions (and why):
- **Pure functions of (seed, step).** The rollout seed and the prompt order depend on the task's seed,
  the step and the loader's saved position only, so a resumed run, an in-process run and a Ray run
  compute the same thing.
- **No JAX here.** The driver is a process without devices (on a TPU host it would claim the chips):
  the tokenizer, the data and the rewards are host libraries, and the advantages are computed by the
  actor inside TRAIN.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from rlsched.base.errors import TaskError
from rlsched.config.spec import TaskSpec
from workers import data as D
from workers import rewards as R
from workers.batch import TrainBatch, build_train_batch, run_batch_length
from workers.reward_loader import load_reward
from workers.rollout.base import FinishReason, RolloutOutput, SamplingParams
from workers.rollout.stops import end_token_ids


def rollout_seed(task_seed: int, step: int) -> int:
    # A pure function of (seed, step): a resumed run samples exactly what the uninterrupted one did.
    return (task_seed * 1_000_003 + step) % (2**31)


@dataclasses.dataclass(frozen=True)
class Prompts:
    prompts: list[D.Prompt]  # the step's prompts, with their reference answers
    ids: list[np.ndarray]  # int32 (L_i,) token ids of each rendered prompt
    skipped: int = 0  # prompts drawn and skipped as longer than grpo.max_prompt_len (data.too_long=skip)
    truncated: int = 0  # prompts cut to grpo.max_prompt_len (data.too_long=truncate)

    @property
    def metrics(self) -> dict[str, int]:
        return {"data/skipped_too_long": self.skipped, "data/truncated": self.truncated}


def check_model_path(spec: TaskSpec) -> Path:
    """The task's model directory, or a TaskError that says how to get one (before any process starts)."""
    m = spec.config.model
    path = Path(m.path)
    if m.init_preset is None and not path.exists():
        raise TaskError(
            f"task {spec.name}: model.path {path} does not exist. Point it at a local Hugging Face Qwen3 "
            f"directory (--set tasks.{spec.index}.model.path=/path/to/Qwen3) or set model.init_preset "
            "to create a random model there; rlsched never downloads weights")
    return path


def render_prompt(tokenizer, data, prompt: D.Prompt) -> list[int]:
    """Token ids of `prompt` as the policy sees it under the task's data section (template, system prompt): the
    one rendering of training, evaluation and `rlsched eval`."""
    return D.render_prompt(tokenizer, prompt.question, template=data.template, system_prompt=data.system_prompt,
                           chat_template_args=data.chat_template_args)


class HostWork:
    """A task's tokenizer, prompt loader and reward: the work between its phases."""

    def __init__(self, spec: TaskSpec, echo=print):
        from workers.models import load_tokenizer  # the tokenizer alone: no JAX

        self.spec, self.echo = spec, echo
        c, g = spec.config, spec.config.grpo
        self.tokenizer = load_tokenizer(c.model.path)
        # Every end token the model names (workers.rollout.stops): Qwen3's generation config lists two
        stops = end_token_ids(c.model.path, self.tokenizer)
        self.sampling = dict(n=g.num_generations, temperature=g.temperature, top_p=g.top_p,
                             max_new_tokens=g.max_new_tokens, stop_token_ids=stops)
        # Loaded here, in the process that scores (the user's file or module too): fails at start, not at step 1.
        r = c.reward
        self.reward = load_reward(name=r.name, function=r.function, file=r.file, batch=r.batch)
        self.loader = D.PromptLoader(self._source(), g.prompts_per_step, seed=spec.seed, shuffle=c.data.shuffle)

    def _source(self):
        d = self.spec.config.data
        if d.kind in ("addition", "subtraction"):
            return D.make_source(d.kind, seed=self.spec.seed, max_operand=d.max_operand)
        if d.kind == "gsm8k":
            return D.make_source("gsm8k", path=d.path)
        return D.make_source(d.kind, path=d.path, question_field=d.question_field, answer_field=d.answer_field)

    def next_prompts(self) -> Prompts:
        """The step's prompts, drawn and tokenized, too-long ones handled per data.too_long (before the ROLLOUT
        lock is asked for)."""
        d, limit = self.spec.config.data, self.spec.config.grpo.max_prompt_len
        try:
            batch = D.next_fitting_batch(self.loader, self.render, limit, d.too_long)
        except D.DataError as err:
            raise TaskError(f"task {self.spec.name}: {err}") from None
        return Prompts(batch.prompts, [np.asarray(ids, np.int32) for ids in batch.ids], batch.skipped,
                       batch.truncated)

    def render(self, prompt: D.Prompt) -> list[int]:
        return render_prompt(self.tokenizer, self.spec.config.data, prompt)

    def sampling_params(self, step: int) -> SamplingParams:
        return SamplingParams(**self.sampling, seed=rollout_seed(self.spec.seed, step))

    def score(self, prompts: Prompts, output: RolloutOutput) -> tuple[np.ndarray, int]:
        """Rewards (N,) of the samples, and how many raised (scored 0 under reward.on_error=zero)."""
        r = self.spec.config.reward
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in output.samples]
        answers = [prompts.prompts[s.prompt_index].answer for s in output.samples]
        questions = [prompts.prompts[s.prompt_index].question for s in output.samples]
        result = R.score(self.reward, texts, answers, task=self.spec.name, on_error=r.on_error, prompts=questions)
        if result.num_errors:
            self.echo(f"[{self.spec.name}] {result.num_errors} reward error(s) scored 0; first: {result.first_error}")
        return result.rewards, result.num_errors

    def train_shape(self, prompts: Prompts | None = None) -> tuple[int, int] | None:
        """(rows, length) of the train batch `train_batch` will build from these prompts' rollout, known before it:
        every prompt's num_generations samples, padded by the prompts' lengths alone (workers.batch). Without
        prompts, that of any step's where it does not depend on them (grpo.prompt_padding "max": every step draws
        prompts_per_step prompts of at most max_prompt_len tokens), else None."""
        g = self.spec.config.grpo
        if prompts is None:
            if g.prompt_padding != "max":
                return None
            lengths, rows = [g.max_prompt_len], g.prompts_per_step
        else:
            lengths, rows = [len(p) for p in prompts.ids], len(prompts.ids)
        return rows * g.num_generations, run_batch_length(lengths, max_prompt_len=g.max_prompt_len,
                                                          max_new_tokens=g.max_new_tokens,
                                                          prompt_padding=g.prompt_padding)

    def train_batch(self, prompts: Prompts, output: RolloutOutput) -> TrainBatch:
        """[prompt + completion] rows, padded (before the TRAIN lock is asked for), with the engine's logprobs (the
        actor compares its own with them); the actor adds the advantages."""
        samples, g = output.samples, self.spec.config.grpo
        # padded to the prompts' bucket (or max_prompt_len: grpo.prompt_padding) + max_new_tokens: completions that end
        # early never make a new shape (a compile)
        return build_train_batch([prompts.ids[s.prompt_index] for s in samples], [s.token_ids for s in samples],
                                 pad_id=self.tokenizer.pad_token_id, logprobs=[s.logprobs for s in samples],
                                 max_prompt_len=g.max_prompt_len, max_new_tokens=g.max_new_tokens,
                                 prompt_padding=g.prompt_padding)


def step_metrics(output: RolloutOutput, rewards: np.ndarray, reward_errors: int, train: dict[str, float],
                 version: int, times: dict[str, float]) -> dict[str, Any]:
    """The metrics.jsonl line of one step (without the memory probes)."""
    lengths = np.array([len(s.token_ids) for s in output.samples])
    # The policy's entropy and the actor-sampler log-prob gap, when measured: an engine that gives no logprobs
    # (sglang_jax) leaves the gap NaN, and a NaN is no measurement to log
    policy = {f"train/{k}": train[k] for k in ("entropy", "logp_gap_mean", "logp_gap_max")
              if k in train and np.isfinite(train[k])}
    return {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "reward/max": float(rewards.max()), "reward/errors": reward_errors,
        "loss": train["loss"], "kl": train["kl"], "clip_frac": train["clip_frac"],
        "ratio_mean": train["ratio_mean"], "grad_norm": train["grad_norm"],
        "lr": train["lr"], "skipped_updates": train["skipped"],
        "response_len/mean": float(lengths.mean()), "tokens/generated": int(lengths.sum()),
        # completions cut at grpo.max_new_tokens before any end token (their reward reads an unfinished answer)
        "rollout/truncated": float(np.mean([s.finish_reason == FinishReason.LENGTH for s in output.samples])),
        # groups whose G rewards all tie: advantage 0, no signal (workers.grpo.tied_groups)
        **({"train/tied_groups": train["tied_groups"]} if "tied_groups" in train else {}), **policy,
        # the weights that generated this step's samples, and those the step's update published
        "rollout/weight_version": output.weight_version, "weight_version": version, **times,
        # tasks of its base group whose rows ran in one program run with this one's (1: alone)
        "rollout/cobatched": output.cobatched,
        # tasks whose optimizer steps ran in one program run with this one's (1: alone)
        "train/cobatched": int(train.get("cobatched", 1)),
        # models with experts: the router's load-balancing loss (unweighted), when it is trained with
        **({"router_aux_loss": train["router_aux_loss"]} if "router_aux_loss" in train else {}),
    }


def progress_line(task: str, step: int, steps: int, m: dict[str, Any]) -> str:
    together, trained = m.get("rollout/cobatched", 1), m.get("train/cobatched", 1)
    shared = f" ({together} tasks)" if together > 1 else ""  # the tasks whose rows ran in one co-batched run
    trained = f" ({trained} tasks)" if trained > 1 else ""  # the tasks whose updates ran in one program run
    return (f"[{task}] step {step:>4}/{steps}  reward {m['reward/mean']:.3f}±{m['reward/std']:.3f}  "
            f"kl {m['kl']:.4f}  loss {m['loss']:+.4f}  len {m['response_len/mean']:.1f}  "
            f"step {m['time/step_s']:.2f}s (compile {m['time/compile_s']:.2f} rollout {m['time/rollout_s']:.2f}"
            f"{shared} reward {m['time/reward_s']:.2f} train {m['time/train_s']:.2f}{trained})")
