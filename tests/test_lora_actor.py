"""A LoRA actor (workers.actor.ActorWorker with `lora`): it trains its adapter only, its step 0 is its base, its
reference is the base with the adapter off, and what it computes is what the merged model computes."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from workers.actor import ActorWorker
from workers.batch import build_train_batch
from workers.models import lora as L
from workers.models import params as P
from workers.train_step import ActorSettings

SETTINGS = ActorSettings(remat="layers", adam_mu_dtype="float32",
                         lr=1e-2, total_steps=4, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0,
                         b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.04, aggregation="token-mean",
                         temperature=1.0, micro_batch_size=4, mini_batch_size=8, epochs=1, router_aux_loss_coef=None,
                         kl_clamp=None, max_new_tokens=None)
SPEC = L.LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "o", "down"))


def _batch():
    rng = np.random.default_rng(0)
    return build_train_batch([rng.integers(1, 200, 6) for _ in range(8)], [rng.integers(1, 200, 4) for _ in range(8)],
                             np.tile([0.0, 1.0, 0.5, 1.0], 2).astype(np.float32), pad_id=0)


def _model(model_dir):
    """A model of this module's own: an actor owns its arrays (an offload frees them), so the session's is not
    handed to one."""
    from workers.models import load_pretrained

    return load_pretrained(model_dir)[0]


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """A full-weight actor and a LoRA actor on the same tiny model, and the LoRA actor after two updates."""
    full = ActorWorker(_model(tiny_model_dir), SETTINGS)
    lora = ActorWorker(_model(tiny_model_dir), SETTINGS, lora=SPEC, seed=3)
    batch = _batch()
    first = {"full": full.logprobs(batch), "lora": lora.logprobs(batch), "ref": lora.logprobs(batch, reference=True)}
    base_before = jax.tree.map(np.asarray, P.to_flat(lora.base))
    adapter_before = jax.tree.map(np.asarray, lora.state.params)
    metrics = [lora.train(batch, step=s) for s in (1, 2)]
    return dict(full=full, lora=lora, batch=batch, first=first, base_before=base_before,
                adapter_before=adapter_before, metrics=metrics)


def test_a_fresh_adapter_is_its_base(trained):
    first = trained["first"]
    np.testing.assert_array_equal(first["lora"], first["ref"])  # B = 0: exactly its reference, the base
    # ... and what the base computes without adapters: XLA fuses that other program differently (1e-6 away)
    np.testing.assert_allclose(first["lora"], first["full"], atol=1e-5)


def test_only_the_adapter_trains_and_the_optimizer_holds_its_moments_only(trained):
    lora = trained["lora"]
    assert all(m["skipped"] == 0 for m in trained["metrics"]) and trained["metrics"][-1]["grad_norm"] > 0
    assert set(lora.state.params) == set(L.adapter_shapes(lora.config, SPEC))
    for name, before in trained["base_before"].items():  # the base is untouched, bit for bit
        np.testing.assert_array_equal(before, np.asarray(P.to_flat(lora.base)[name]), err_msg=name)
    moved = [n for n, a in trained["adapter_before"].items() if not np.array_equal(a, np.asarray(lora.state.params[n]))]
    assert sorted(moved) == sorted(n for n in lora.state.params if n.endswith(".lora_b")) or len(moved) == len(
        lora.state.params), moved  # B moves first (A's gradient is 0 while B is 0); both once B is non-zero
    adapter = sum(np.asarray(x).nbytes for x in lora.state.params.values())
    mem = lora.memory_bytes()
    assert mem["opt"] == 2 * adapter + _scalars(lora.state.opt_state)  # AdamW's mu and nu of the adapter only
    assert mem["ref"] == 0 and mem["params"] == adapter + sum(np.asarray(x).nbytes for x in trained["base_before"]
                                                              .values())


def _scalars(opt_state) -> int:
    """Bytes of the optimizer's non-moment leaves (its step counters)."""
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(opt_state) if np.ndim(x) == 0)


def test_the_trained_adapter_computes_what_the_merged_model_computes(trained):
    lora, batch = trained["lora"], trained["batch"]
    merged = ActorWorker(lora.model(), dataclasses.replace(SETTINGS, beta=0.0))
    np.testing.assert_allclose(lora.logprobs(batch), merged.logprobs(batch), atol=1e-5)
    # The reference is still the base: the updates never reached it
    np.testing.assert_array_equal(lora.logprobs(batch, reference=True), trained["first"]["ref"])
    published = lora.export_weights()
    assert set(published.flat) == set(lora.state.params) and published.version == 2


def test_offload_and_onload_keep_the_adapter_and_the_base(trained):
    lora, batch = trained["lora"], trained["batch"]
    before = lora.logprobs(batch)
    lora.offload()
    assert lora.memory_bytes() == {"params": 0, "opt": 0, "ref": 0} and set(lora.params_flat()) == set(
        L.adapter_shapes(lora.config, SPEC))
    lora.onload()
    np.testing.assert_array_equal(lora.logprobs(batch), before)
    np.testing.assert_array_equal(lora.logprobs(batch, reference=True), trained["first"]["ref"])


def test_prepare_compiles_what_train_runs(tiny_model_dir):
    actor = ActorWorker(_model(tiny_model_dir), SETTINGS, lora=SPEC)
    batch = _batch()
    assert actor.prepare(batch.size, batch.tokens.shape[1]) == 3  # the gradient, the update, the reference's logprobs
    assert actor.prepare(batch.size, batch.tokens.shape[1]) == 0
    actor.train(batch, step=1)
    assert sorted(k for k, _ in actor._programs) == ["logprobs", "train", "update"]  # all three: prepared


def test_a_lora_checkpoint_exports_as_peft_loads_it_and_merged(trained, tiny_model_dir, tmp_path):
    """`rlsched export` of a LoRA task's checkpoint (the adapter alone) writes PEFT's files, which peft loads
    onto the base with the logits of the trained actor's merged model; `--merge` writes that merged model."""
    import torch
    from conftest import lora_task_dir, rlsched_export
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora, batch = trained["lora"], trained["batch"]
    task = lora_task_dir(tmp_path, tiny_model_dir, {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "o", "down"]},
                         lora)

    def export(*extra):
        return rlsched_export(task, *extra)

    done = export(str(tmp_path / "adapter"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    merged = export(str(tmp_path / "merged"), "--merge")
    assert merged.returncode == 0, merged.stderr
    tokens = torch.tensor(np.asarray(batch.tokens[:2], np.int64))
    mask = torch.tensor(np.asarray(batch.attention_mask[:2], np.int64))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
        via_peft = PeftModel.from_pretrained(base, tmp_path / "adapter")(tokens, attention_mask=mask).logits
        full = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)
        via_merged = full(tokens, attention_mask=mask).logits
    ours = np.asarray(lora.model()(np.asarray(batch.tokens[:2]), attention_mask=np.asarray(batch.attention_mask[:2])))
    real = np.asarray(batch.attention_mask[:2], bool)
    np.testing.assert_allclose(via_peft.numpy()[real], ours[real], atol=1e-4)
    np.testing.assert_allclose(via_merged.numpy()[real], ours[real], atol=1e-4)
    refused = export(str(tmp_path / "again"), "--merge", "--step", "7")
    assert refused.returncode == 2 and "has no checkpoint 7" in refused.stderr, refused.stderr


def test_a_sharded_lora_actor_computes_what_one_device_does(trained, tiny_model_dir):
    """fsdp 2 x tp 2: the adapter is laid out like the projections it adapts (A's rows as the kernel's rows, B's
    columns as its columns, the rank whole), and two updates give what one device gives."""
    from workers.models import sharding as S

    mesh = S.mesh({"fsdp": 2, "tp": 2}, jax.devices()[:4])
    sharded = ActorWorker(_model(tiny_model_dir), SETTINGS, lora=SPEC, seed=3, mesh=mesh)
    kernels = {n: sh.spec for n, sh in P.to_flat(sharded.base_shardings).items() if n.endswith(".kernel")}
    for name, value in sharded.state.params.items():
        module, part = name.rsplit(".", 1)
        kernel = tuple(kernels[f"{module}.kernel"]) + (None, None)
        want = (kernel[0], None) if part == "lora_a" else (None, kernel[1])
        assert tuple(value.sharding.spec) + (None,) * (2 - len(value.sharding.spec)) == want, name
    batch = trained["batch"]
    for step in (1, 2):
        sharded.train(batch, step=step)
    np.testing.assert_allclose(sharded.logprobs(batch), trained["lora"].logprobs(batch), atol=1e-5)
