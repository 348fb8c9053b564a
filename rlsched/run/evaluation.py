"""The host side of a task's held-out evaluation (`tasks[i].eval`): its prompts, sampling and score.

The device side is the engine's `evaluate` (rlsched.run.roles.EngineRole), called under the task's ROLLOUT lock
like any generation (rlsched.run.task.TaskDriver.evaluate). Here, as in rlsched.run.phases, only numpy, the
tokenizer and the reward: the driver never imports JAX.

Design decisions (and why):
- **The prompts are rendered once**, at the task's start: the split is fixed (workers.evaluation), so every
  evaluation of a run scores the same token ids, and a prompt that cannot fit fails the task at its start,
  not after hours of training.
- **Its own sampling seed**: a pure function of (task seed, step) apart from the rollout's, so a run with
  evaluation generates exactly the training samples a run without it does (greedy evaluation draws nothing).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from rlsched.base.errors import TaskError
from rlsched.config.schema import TaskConfig
from rlsched.config.spec import TaskSpec
from rlsched.run.phases import render_prompt, rollout_seed
from workers import data as D
from workers import evaluation as E
from workers import rewards as R
from workers.rollout.base import RolloutOutput, SamplingParams

_SEED_SALT = 999_983  # evaluation's sampling seeds: another stream than the rollout's rollout_seed(seed, step)


@dataclasses.dataclass(frozen=True)
class EvalPrompts:
    prompts: list[D.Prompt]  # the problems scored, in the split's fixed order
    ids: list[np.ndarray]  # int32 (L_i,) token ids of each rendered prompt
    skipped: int  # problems dropped as longer than grpo.max_prompt_len (data.too_long=skip)


def eval_problems(cfg: TaskConfig, task: str) -> D.PromptDataset:
    """A task's evaluation problems (`eval.split` of its data, `eval.problems` of them)."""
    d, e = cfg.data, cfg.eval
    try:
        return E.problems(d.kind, e.split, limit=e.problems, path=e.path, train_path=d.path,
                          max_operand=d.max_operand, question_field=d.question_field, answer_field=d.answer_field)
    except D.DataError as err:
        raise TaskError(f"task {task}: eval: {err}") from None


def render(problems: D.PromptDataset, encode, limit: int, too_long: str, task: str) -> EvalPrompts:
    """Token ids of every problem, too-long ones handled as data.too_long says for training (error, skip,
    truncate to the last `limit` tokens)."""
    prompts, ids, skipped = [], [], 0
    for p in problems:
        tokens = list(encode(p))
        if len(tokens) > limit:
            if too_long == "error":
                raise TaskError(f"task {task}: eval problem {p.uid} is {len(tokens)} tokens, longer than "
                                f"grpo.max_prompt_len={limit}; raise it, or set data.too_long to skip or truncate")
            if too_long == "skip":
                skipped += 1
                continue
            tokens = tokens[-limit:]
        prompts.append(p)
        ids.append(np.asarray(tokens, np.int32))
    if not prompts:
        raise TaskError(f"task {task}: no eval problem fits in grpo.max_prompt_len={limit} tokens")
    return EvalPrompts(prompts, ids, skipped)


class EvalWork:
    """A task's evaluation on the host: the prompts (rendered once), sampling params and the score. The same for a
    run's evaluations (TaskDriver.evaluate) and `rlsched eval`'s.

    cfg: the task's config (its `eval` set); encode: Prompt -> token ids (the training prompts' rendering);
    reward: what `workers.rewards.score` calls; stop_token_ids: the tokens that end a completion."""

    def __init__(self, cfg: TaskConfig, *, task: str, seed: int, tokenizer, reward, encode, stop_token_ids):
        self.cfg, self.task, self.seed, self.tokenizer, self.reward = cfg, task, seed, tokenizer, reward
        self.stop_token_ids = tuple(stop_token_ids)
        self.prompts = render(eval_problems(cfg, task), encode, cfg.grpo.max_prompt_len, cfg.data.too_long, task)

    @classmethod
    def of(cls, spec: TaskSpec, host) -> EvalWork:
        """A run's: its task's host work (rlsched.run.phases.HostWork) renders, stops and scores as training does."""
        return cls(spec.config, task=spec.name, seed=spec.seed, tokenizer=host.tokenizer, reward=host.reward,
                   encode=host.render, stop_token_ids=host.sampling["stop_token_ids"])

    def sampling_params(self, step: int) -> SamplingParams:
        e, g = self.cfg.eval, self.cfg.grpo
        return SamplingParams(n=e.samples, temperature=e.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens,
                              stop_token_ids=self.stop_token_ids,
                              seed=rollout_seed(self.seed, step + _SEED_SALT))

    def score(self, output: RolloutOutput) -> dict[str, Any]:
        """The evaluation's metrics (workers.evaluation.scores) from the engine's samples, in prompt order."""
        e, prompts = self.cfg.eval, self.prompts.prompts
        samples = sorted(output.samples, key=lambda s: s.prompt_index)  # problem-major: (P, n)
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        answers = [prompts[s.prompt_index].answer for s in samples]
        result = R.score(self.reward, texts, answers, task=self.task, on_error=self.cfg.reward.on_error,
                         prompts=[prompts[s.prompt_index].question for s in samples])
        metrics = E.scores(result.rewards, e.samples, correct=e.correct)
        metrics["eval/skipped_too_long"] = self.prompts.skipped
        return metrics


def evaluated(rows: list[dict[str, Any]], step: int) -> bool:
    """Whether metrics.jsonl's rows (rlsched.observe.tracking.read_metrics) hold an evaluation of `step`'s weights:
    a run resumed after step N that evaluated N before it stopped does not evaluate it again."""
    return any(r.get("step") == step and "eval/accuracy" in r for r in rows)


def eval_line(task: str, step: int, metrics: dict[str, Any], seconds: float) -> str:
    """The progress line of one evaluation."""
    n = next(k for k in metrics if k.startswith("eval/pass@")).split("@")[1]
    when = "before the first step" if step == 0 else f"after step {step}"
    return (f"[{task}] eval {when}: accuracy {metrics['eval/accuracy']:.3f}  pass@{n} {metrics[f'eval/pass@{n}']:.3f}"
            f"  reward {metrics['eval/reward']:.3f}  ({metrics['eval/problems']} problems x {n}, {seconds:.2f}s)")


def score_model(model, tokenizer, cfg: TaskConfig, *, task: str, model_dir, seed: int = 0, step: int = 0,
                max_batch_size: int = 64) -> dict[str, Any]:
    """`rlsched eval`: the held-out metrics of `model` (a CausalLM, here in this process; its files in `model_dir`)
    on task config `cfg`'s evaluation, decoded by the built-in sampler as a run's engine does (stopping at every end
    token the model's files name), scored as a run's evaluation is."""
    from workers.reward_loader import load_reward
    from workers.rollout.jax_sampler import JaxSampler
    from workers.rollout.stops import end_token_ids

    d, r = cfg.data, cfg.reward
    work = EvalWork(cfg, task=task, seed=seed, tokenizer=tokenizer,
                    reward=load_reward(name=r.name, function=r.function, file=r.file, batch=r.batch),
                    encode=partial(render_prompt, tokenizer, d),
                    stop_token_ids=end_token_ids(model_dir, tokenizer))
    engine = JaxSampler(model, max_prompt_len=max(len(ids) for ids in work.prompts.ids),
                        max_new_tokens=cfg.grpo.max_new_tokens, max_batch_size=max_batch_size,
                        prompt_padding=cfg.grpo.prompt_padding)
    return work.score(engine.generate(work.prompts.ids, work.sampling_params(step)))
