"""Every shipped config runs for two steps: demo_4tasks here (the other demos in the tests of what they show:
demo_addition in test_train, demo_multitask in test_stopping and test_terminal, demo_mesh in test_mesh_run,
demo_sglang in the sglang stage, demo_lora in test_lora_shared), and the real-hardware recipes configs/gsm8k_*.yaml
from a fresh clone, as shipped but on a tiny random model of the recipe's family (Qwen3, Qwen2, Qwen3-MoE) with the
real Qwen3 tokenizer and small batches: the shipped GSM8K, its chat template and system prompt, the gsm8k reward, a
reference model (beta 0.08), bfloat16 parameters at the recipe's learning rate, and the recipe's meshes on 8 CPU
devices (fsdp 4 x tp 2 actors, tp 2 and tp 4 engines; the MoE recipe's tp 8 actor and ep 4 x tp 2 engine).
Lengths are the one other change: prompts padded to max_prompt_len 96, not the recipe's 256, with the longer ones
skipped (data.too_long=skip; 4,441 of GSM8K's 7,473 prompts fit 96 with the system prompt and chat template, as
`rlsched check` counts them; 6,862 fit 128): the actor computes 151,936-token logits at every padded position, forward
and backward, so a step's work on CPU grows with the padded length (104 positions a row, not 136 at 128). The
recipes' own 256 (every prompt fits it) is checked by test_check, their plans at it by test_plan."""

from __future__ import annotations

import pytest

from rlsched.cli import CONFIGS
from rlsched.run.experiment import train

pytestmark = pytest.mark.slow

SMALL = ["grpo.prompts_per_step=4", "grpo.num_generations=2", "grpo.max_new_tokens=8", "grpo.mini_batch_size=8",
         "grpo.micro_batch_size=4", "rollout.max_batch_size=8", "steps=2", "checkpoint_every=2",
         "grpo.max_prompt_len=96", "data.too_long=skip"]


@pytest.fixture(scope="module")
def tiny_real_tokenizer(tmp_path_factory):
    """preset -> a tiny random model of it with the real Qwen3 tokenizer (Qwen2.5's vocabulary is the same)."""
    from workers.models import init_model

    root, made = tmp_path_factory.mktemp("models"), {}

    def model(preset: str):
        if preset not in made:
            made[preset] = init_model(root / preset, preset=preset, seed=0, tokenizer="qwen3")
        return made[preset]
    return model


@pytest.mark.parametrize(("recipe", "preset"), [("gsm8k_qwen3.yaml", "tiny"), ("gsm8k_qwen3_1p7b_mesh.yaml", "tiny"),
                                                ("gsm8k_qwen2p5_7b.yaml", "tiny-qwen2"),
                                                ("gsm8k_qwen3_30b_a3b.yaml", "tiny-qwen3moe")])
def test_a_gsm8k_recipe_runs_two_steps(tmp_path, tiny_real_tokenizer, recipe, preset):
    overrides = [f"experiment.output_dir={tmp_path}", f"tasks.0.model.path={tiny_real_tokenizer(preset)}",
                 *(f"tasks.0.{s}" for s in SMALL)]
    history = train(CONFIGS / recipe, overrides=overrides, in_process=True, echo=lambda *_: None)["gsm8k"]["metrics"]
    assert len(history) == 2
    for m in history:  # GSM8K prompts went through the chat template and came back scored
        assert m["tokens/generated"] > 0 and 0.0 <= m["reward/mean"] <= 1.0, m
    # beta 0.08: a reference model is held, the policy itself at step 1. Its logprobs come from another program than
    # the train step's: equal bit for bit on every layout but the MoE recipe's tp 8 actor (4 KV heads, replicated
    # k/v), whose two programs round a bfloat16 forward apart by 7.5e-9 of KL (measured before and after float32
    # master weights alike; ep 2 x tp 4 gave 0). Step 2's policy has moved: 3e-7.
    assert history[0]["kl"] == 0.0 or (recipe == "gsm8k_qwen3_30b_a3b.yaml" and history[0]["kl"] < 1e-8)
    assert history[1]["kl"] >= 0
    (run,) = tmp_path.iterdir()
    assert (run / "tasks" / "gsm8k" / "checkpoints" / "2").is_dir()


def test_the_four_task_demo_runs_two_steps(tmp_path):
    sets = [f"experiment.output_dir={tmp_path}"]
    for i in range(4):
        sets += [f"tasks.{i}.{k}" for k in ("steps=2", "grpo.prompts_per_step=4", "grpo.num_generations=4",
                                            "grpo.mini_batch_size=8", "rollout.max_batch_size=16")]
        sets += [f"tasks.{i}.model.path={tmp_path / 'models' / str(i)}"]
    results = train(CONFIGS / "demo_4tasks.yaml", overrides=sets, in_process=True, echo=lambda *_: None)
    assert sorted(results) == ["add-a", "add-b", "sub-a", "sub-b"]
    assert all(r["status"] == "ok" and len(r["metrics"]) == 2 for r in results.values())
