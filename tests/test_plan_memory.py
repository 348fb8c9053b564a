"""`rlsched plan`'s actor activations against what XLA allocates: the real train program (workers.actor's GRPO update
over one micro-batch, log-probabilities by chunks, actor.remat as configured) compiled from a task's config, and
its memory analysis beside the plan of that config. Shapes only: no weights are made, nothing runs."""

from __future__ import annotations

import json
from pathlib import Path

from flax import nnx

from rlsched.config.loading import load_config
from rlsched.config.plan import actor_bytes
from workers.models.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# The `small` preset's widths (hidden 256, MLP 768, 4 heads, 2 KV heads, head_dim 128) over a 4,096-token vocabulary:
# big enough that the layers, the attention scores and the output head each weigh in, small enough to compile fast
SHAPES = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 4096, "tie_word_embeddings": False,
          "max_position_embeddings": 4096}


def _task(tmp_path, *, layers: int, dtype: str, remat: str, rows: int, positions: int, mu: str = "float32",
          accumulate: int = 1):
    """configs/gsm8k_qwen3.yaml's task on one device, with a model of SHAPES and `accumulate` micro-batches of `rows`
    per update (`mu`: actor.adam_mu_dtype)."""
    (tmp_path / "config.json").write_text(json.dumps({**SHAPES, "num_hidden_layers": layers, "torch_dtype": dtype}))
    cfg = load_config(CONFIGS / "gsm8k_qwen3.yaml", [
        f"tasks.0.model.path={tmp_path}", f"tasks.0.model.dtype={dtype}", f"tasks.0.actor.remat='{remat}'",
        "tasks.0.grpo.max_prompt_len=64", f"tasks.0.grpo.max_new_tokens={positions - 64}", "tasks.0.grpo.beta=0",
        f"tasks.0.grpo.prompts_per_step={rows * accumulate // 2}", "tasks.0.grpo.num_generations=2",
        f"tasks.0.grpo.mini_batch_size={rows * accumulate}", f"tasks.0.grpo.micro_batch_size={rows}",
        f"tasks.0.actor.adam_mu_dtype={mu}"])
    return cfg, ModelConfig.from_dir(tmp_path).replace(dtype=dtype)


def _temporaries(cfg, model: ModelConfig, positions: int) -> tuple[int, int]:
    """What the actor of `cfg` allocates beside its state to train on a mini-batch of `positions` (XLA's memory
    analysis of its two programs): the gradient's program's temporaries and its output (the float32 gradient, and a
    few scalar metrics), or the update's program's temporaries beside that gradient, its argument, whichever is
    more; and the update's temporaries alone."""
    from rlsched.config.spec import actor_settings
    from workers.actor import ActorWorker
    from workers.models.decoder import CausalLM

    spec = cfg.task_specs()[0]
    worker = ActorWorker(CausalLM(model, rngs=nnx.Rngs(0)), actor_settings(spec.config))
    worker.prepare(spec.plan.mini_batch_size, positions)
    (program,), (step,) = ([p for key, p in worker._prepared.items() if key[0] == kind] for kind in ("train", "update"))
    grads, update = program.memory_analysis(), step.memory_analysis()
    return max(grads.temp_size_in_bytes, update.temp_size_in_bytes) + grads.output_size_in_bytes, \
        update.temp_size_in_bytes


def _planned_and_temporaries(tmp_path, **point) -> tuple[int, int, int, int]:
    """(the plan's grads + activations, XLA's temporaries, the update program's temporaries, the plan's grads) of the
    train programs at `point`: the temporaries are the float32 gradient of the master (the plan's `grads`) and the
    activations (`_temporaries`)."""
    (tmp_path / point["remat"]).mkdir(parents=True)
    cfg, model = _task(tmp_path / point["remat"], **point)
    planned = actor_bytes(cfg.tasks[0], model, backend="cpu")  # XLA:CPU's count: the compiler here
    temp, update = _temporaries(cfg, model, point["positions"])
    counted = planned["grads"] + planned["activations"]
    print(f"{point}: temporaries {temp / 2**20:.1f} MiB, planned {counted / 2**20:.1f} MiB ({counted / temp:.3f})")
    return counted, temp, update, planned["grads"]


def test_plan_counts_what_the_train_program_allocates(tmp_path):
    """Within 10 % of XLA:CPU's count (`rlsched plan --backend cpu`), remat layers and off, float32 and bfloat16, one
    micro-batch a step and four (measured 0.966-1.022 at one); and layers plans fewer bytes than off, as XLA allocates
    fewer (float32, 2 layers, 4 x 256: 73.6 MiB against 127.6). Where the micro-batch is small beside the params (4
    layers, 2 rows of 72 positions: a 4B model's case), the optimizer's step allocates nothing beside the gradient
    with a float32 first moment (the clipped gradient is written over the gradient: workers.train_step `update`), and
    half a float32 copy of the params with a bfloat16 one, which is then the peak, as the plan counts it
    (rlsched.config.plan.UPDATE_COPIES). A bfloat16 actor accumulating 4 micro-batches a step allocates ~1.7 x the
    float32 master more than with one (XLA:CPU's float32 copy of the weights through the loop: ACCUMULATION_COPIES)."""
    point = {"layers": 2, "dtype": "float32", "rows": 4, "positions": 256}
    layers, off = (_planned_and_temporaries(tmp_path, **point, remat=remat) for remat in ("layers", "off"))
    assert layers[1] < off[1] and layers[0] < off[0]
    bf16 = _planned_and_temporaries(tmp_path / "bf16", layers=2, dtype="bfloat16", rows=2, positions=512,
                                    remat="layers")
    f32_mu, bf16_mu = (_planned_and_temporaries(tmp_path / "update" / mu, layers=4, dtype="bfloat16", rows=2,
                                                positions=72, remat="layers", mu=mu) for mu in ("float32", "bfloat16"))
    assert f32_mu[2] < 0.01 * f32_mu[3]  # the update's temporaries: under 1 % of the float32 params (0.001 measured)
    assert 0.45 * bf16_mu[3] < bf16_mu[2] < 0.55 * bf16_mu[3]
    one, four = (_planned_and_temporaries(tmp_path / "accumulate" / str(a), layers=4, dtype="bfloat16", rows=2,
                                          positions=256, remat="layers", accumulate=a) for a in (1, 4))
    assert four[1] - one[1] > 1.5 * four[3]  # XLA:CPU's weights in float32 through the accumulation loop
    for planned, temp, *_ in (layers, off, bf16, f32_mu, bf16_mu, one, four):
        assert 0.9 * temp <= planned <= 1.1 * temp, (planned, temp)
