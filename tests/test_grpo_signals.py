"""What a GRPO step sees and logs, against references: the end tokens a model's files name (transformers' generate
stops at the same tokens), the chat template's variables (the real Qwen3 template), the policy's entropy (torch on
the same weights) and the actor's gap to the sampler's log-probabilities (the sampler's own)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlsched.cli import DEMO_CONFIG
from rlsched.config.loading import load_config
from rlsched.run.phases import HostWork
from workers.actor import ActorWorker
from workers.batch import build_train_batch
from workers.data import render_prompt
from workers.models import load_pretrained
from workers.models.tokenizer import load_tokenizer, qwen3_tokenizer_dir
from workers.rollout import FinishReason, SamplingParams
from workers.rollout.jax_sampler import JaxSampler
from workers.rollout.stops import StopTokenError, end_token_ids
from workers.train_step import ActorSettings

PROMPTS = ["Hello", "What is 12 + 30?", "a", "The quick brown fox jumps over the lazy dog."]
QWEN3_END = [151645, 151643]  # <|im_end|>, <|endoftext|>: Qwen3's generation_config.json


def _settings(**kw) -> ActorSettings:
    return ActorSettings(remat="layers", adam_mu_dtype="float32",
                         **{**dict(lr=1e-2, total_steps=4, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0,
                                   grad_clip=1.0, b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.0,
                                   aggregation="token-mean", temperature=1.0, micro_batch_size=4, mini_batch_size=8,
                                   epochs=1, router_aux_loss_coef=None, kl_clamp=None, max_new_tokens=None), **kw})


def test_end_tokens_are_every_one_the_model_files_name(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 258, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    tok = load_tokenizer(_with_qwen3_tokenizer(tmp_path / "q"))
    assert end_token_ids(tmp_path) == (5, 258, 7, 9)  # each once, in the order the files name them
    assert end_token_ids(tmp_path, tok) == (151645, 5, 258, 7, 9)  # the tokenizer's own first
    assert end_token_ids(tmp_path / "q", tok) == (151645, 151643)  # Qwen3's files
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(StopTokenError, match=r"config.json: eos_token_id must be a token id .* got '</s>'"):
        end_token_ids(tmp_path)


def _with_qwen3_tokenizer(path):
    """A model directory with the real Qwen3 tokenizer and Qwen3's generation config (no weights)."""
    shutil.copytree(qwen3_tokenizer_dir(), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": QWEN3_END, "pad_token_id": 151643}))
    return path


def test_sampler_stops_at_every_end_token_as_transformers_generate_does(tiny_model_dir, tmp_path):
    """The model's generation config names the tokenizer's EOS and two tokens the greedy completions emit: the
    engine, given the task's end tokens, stops where transformers' generate (reading the same file) does."""
    model, tok = load_pretrained(tiny_model_dir)
    engine = JaxSampler(model, max_prompt_len=64, max_new_tokens=24)
    ids = [tok.encode(p) for p in PROMPTS]
    free = [s.token_ids.tolist() for s in engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=24))
            .samples]
    # Two ends: the 3rd token of the first completion, and a later token of another that comes before any of them
    first = free[0][2]
    second = next(t for out in free[1:] for k, t in enumerate(out)
                  if k >= 2 and first not in out[: k + 1] and t not in out[:k] and t not in free[0][:3])
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "two_ends")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, first, second],
                                                                  "pad_token_id": tok.pad_token_id}))
    stops = end_token_ids(model_dir, tok)
    assert stops == (tok.eos_token_id, first, second)
    out = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=stops)).samples
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert list(hf.generation_config.eos_token_id) == list(stops)  # transformers reads the same file
    for prompt, sample in zip(ids, out, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id)[0, len(prompt):]
        assert sample.token_ids.tolist() == ref.tolist()
        assert sample.finish_reason == (FinishReason.STOP if ref[-1] in stops else FinishReason.LENGTH)
    ended = {int(s.token_ids[-1]) for s in out if s.finish_reason == FinishReason.STOP}
    assert {first, second} <= ended  # both extra ends ended a completion: with the tokenizer's alone, neither would


def test_chat_template_args_reach_the_template(tmp_path):
    """Qwen3's own template reads `enable_thinking`: false closes an empty think block after the opened turn. The
    config key reaches it the way a task renders its prompts (phases.HostWork), and the task stops at both of
    Qwen3's end tokens."""
    tok = load_tokenizer(qwen3_tokenizer_dir())
    plain = tok.decode(render_prompt(tok, "hi", template="chat"))
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    off = tok.decode(render_prompt(tok, "hi", template="chat", chat_template_args={"enable_thinking": False}))
    assert off == plain + "<think>\n\n</think>\n\n"
    model_dir = _with_qwen3_tokenizer(tmp_path / "qwen3")
    base = [f"tasks.0.model.path={model_dir}", "tasks.0.model.init_preset=null", f"experiment.output_dir={tmp_path}",
            "tasks.0.data.template=chat"]
    no_thinking = ["tasks.0.data.chat_template_args.enable_thinking=false"]
    for extra, think in (([], ""), (no_thinking, "<think>\n\n</think>\n\n")):
        host = HostWork(load_config(DEMO_CONFIG, [*base, *extra]).task_specs()[0], echo=lambda *_: None)
        prompt = host.next_prompts()
        question = prompt.prompts[0].question
        assert tok.decode(prompt.ids[0]) == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{think}"
        assert host.sampling_params(1).stop_token_ids == tuple(QWEN3_END)


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    """Sampled completions of the tiny model (temperature 0.7, so the sampler's logprobs are of the scaled logits),
    as the task's driver batches them."""
    model, tok = load_pretrained(tiny_model_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    out = JaxSampler(model, max_prompt_len=64, max_new_tokens=12).generate(
        ids, SamplingParams(n=2, temperature=0.7, max_new_tokens=12, seed=3, stop_token_ids=(tok.eos_token_id,)))
    rows = [np.asarray(ids[s.prompt_index], np.int32) for s in out.samples]
    return rows, out.samples, tok


def test_actor_entropy_is_torchs_and_its_logprobs_the_samplers(tiny_model_dir, rollout):
    rows, samples, tok = rollout
    advantages = np.linspace(-1, 1, len(samples), dtype=np.float32)
    batch = build_train_batch(rows, [s.token_ids for s in samples], advantages, pad_id=tok.pad_token_id,
                              logprobs=[s.logprobs for s in samples])
    actor = ActorWorker(load_pretrained(tiny_model_dir)[0], _settings(temperature=0.7))
    metrics = actor.train(batch, step=1)

    # torch, the same weights: the entropy of softmax(logits / 0.7) at each position predicting a completion token
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    entropies = []
    for prompt, sample in zip(rows, samples, strict=True):
        full = torch.tensor(np.concatenate([prompt, sample.token_ids])[None].astype(np.int64))
        with torch.no_grad():
            logits = hf(full).logits[0, len(prompt) - 1 : -1] / 0.7
        entropies.append(torch.distributions.Categorical(logits=logits).entropy().numpy())
    np.testing.assert_allclose(metrics["entropy"], np.concatenate(entropies).mean(), rtol=2e-6)
    # The sampler's logprobs are of the same distribution: the two programs round apart, nothing more
    assert metrics["logp_gap_max"] < 2e-5 and 0 <= metrics["logp_gap_mean"] <= metrics["logp_gap_max"]

    # a sampler 0.5 off on one token of the last micro-batch: the max is over every micro-batch, the mean per token
    shifted = [s.logprobs.copy() for s in samples]
    shifted[-1][0] -= 0.5
    tokens = sum(len(s.token_ids) for s in samples)
    batch = build_train_batch(rows, [s.token_ids for s in samples], advantages, pad_id=tok.pad_token_id,
                              logprobs=shifted)
    metrics = ActorWorker(load_pretrained(tiny_model_dir)[0], _settings(temperature=0.7)).train(batch, step=1)
    np.testing.assert_allclose(metrics["logp_gap_max"], 0.5, atol=2e-5)
    assert abs(metrics["logp_gap_mean"] - 0.5 / tokens) < 2e-5


def test_a_batch_without_advantages_is_refused(tiny_model_dir, rollout):
    rows, samples, tok = rollout
    batch = build_train_batch(rows, [s.token_ids for s in samples], pad_id=tok.pad_token_id)
    assert batch.advantages is None  # never zeros: they would train on nothing without a word
    actor = ActorWorker(load_pretrained(tiny_model_dir)[0], _settings())
    with pytest.raises(ValueError, match=r"no advantages: compute them .* batch.with_advantages"):
        actor.train(batch, step=1)
    with pytest.raises(ValueError, match=r"advantages must be \(8,\), one per sample, got shape \(4,\)"):
        batch.with_advantages(np.zeros(4))
    # without the sampler's logprobs (an engine that gives none) there is no gap to report, and the entropy still is
    metrics = actor.train(batch.with_advantages(np.linspace(-1, 1, 8)), step=1)
    assert "logp_gap_mean" not in metrics and "logp_gap_max" not in metrics and np.isfinite(metrics["entropy"])
