"""Sharded roles on this machine's XLA host devices: bytes per device as fsdp grows, and the resharding
weight sync (actor fsdp 4 x tp 2 -> engine tp 2) against a plain device copy of the same bytes.

    python -m benchmarks.sharding [--hidden 768 --layers 12 --vocab 32000] [--repeats 3]
                                  [--out benchmarks/results/sharding]

1. Bytes per device, measured from the live arrays: params and AdamW state of an actor on fsdp 1/2/4/8,
   and the gradients of one backward pass compiled to come out in the parameters' layout. Each should
   fall as 1/n (norm scales are replicated: a few KB).
2. Weight sync, both roles in this process on 8 devices: `JaxSampler.update_weights` taking the actor's
   live params (fsdp 4 x tp 2) into the engine's layout (tp 2), hashed on the devices and checked, the old
   weights kept beside the new ones until they verify (the devices have room: on CPU always); the same sync
   where the devices lack room (`host undo`: leaf by leaf, each old leaf to host first, a peak of one leaf's
   shard); against `raw`: one `device_put` of every leaf into the engine's layout (the same bytes resharded,
   nothing else), with each part of the sync timed alone beside it; and the same sync into an engine just
   onloaded (the colocated step: its old weights still on host, so there is no undo copy to make).
   Goal: sync <= 1.5 x raw.
On CPU the "devices" share two cores and one memory: the ratios say what the code adds, not what
NVLink or ICI would give.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from benchmarks.common import environment, save_results  # noqa: E402  (sets the JAX platform first)


def _model(args):
    from workers.models.checkpoint import abstract_model
    from workers.models.config import Qwen3Config

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads, tie_word_embeddings=True)
    return abstract_model(cfg, seed=0), cfg


def _settings():
    from workers.train_step import ActorSettings

    return ActorSettings(remat="layers", adam_mu_dtype="float32",
                         lr=1e-5, total_steps=10, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0,
                         b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.0, aggregation="token-mean",
                         temperature=1.0, micro_batch_size=8, mini_batch_size=8, epochs=1, router_aux_loss_coef=None,
                         kl_clamp=None, max_new_tokens=None)


def bytes_per_device(args) -> list[dict]:
    import jax
    import numpy as np
    from flax import nnx

    from workers.actor import ActorWorker
    from workers.models import sharding as S
    from workers.offload import per_device_bytes

    rows = []
    tokens = np.ones((8, 16), np.int32)
    for n in args.fsdp:
        if n > len(jax.devices()):
            continue
        model, _ = _model(args)
        actor = ActorWorker(model, _settings(), mesh=S.mesh({"fsdp": n}, jax.devices()[:n]))
        graphdef = actor.graphdef
        grads = jax.jit(jax.grad(lambda p, g=graphdef: nnx.merge(g, p)(tokens).mean()),
                        out_shardings=actor.shardings.params)(actor.state.params)
        mem = actor.memory_bytes()
        rows.append({"fsdp": n, "params": mem["params"], "grads": per_device_bytes(grads), "opt": mem["opt"]})
        rows[-1]["total"] = rows[-1]["params"] + rows[-1]["grads"] + rows[-1]["opt"]
        del actor, grads
    return rows


def weight_sync(args) -> dict:
    import jax

    from workers.actor import ActorWorker
    from workers.models import params as P
    from workers.models import sharding as S
    from workers.offload import offload
    from workers.rollout import jax_sampler
    from workers.rollout.jax_sampler import JaxSampler

    devices = jax.devices()
    model, cfg = _model(args)
    engine = JaxSampler(model, max_prompt_len=8, max_new_tokens=8, mesh=S.mesh({"tp": 2}, devices[:2]))
    actor = ActorWorker(_model(args)[0], _settings(), mesh=S.mesh({"fsdp": 4, "tp": 2}, devices[:8]))
    flat = P.to_flat(actor.state.params)
    target = {k: v.sharding for k, v in P.to_flat(engine._state).items()}
    parts = {  # what a sync is made of, each alone over every leaf
        "raw": lambda: jax.block_until_ready(jax.device_put(flat, target)),  # the bytes, resharded: the floor
        # (placed as copies first: device_put may share a replicated leaf's buffer with the actor's)
        "host_backup": lambda: jax.block_until_ready([offload(S.place(x, target[k], copy=True)).tree
                                                      for k, x in flat.items()]),
        "hash": lambda: P.checksum(flat),
    }
    times: dict[str, list[float]] = {k: [] for k in ("sync", "sync_host_undo", "sync_resumed", *parts)}
    stats = undo_stats = {}
    room_for = jax_sampler.room_for
    for version in range(1, args.repeats + 2):  # the first round compiles: not counted
        checksum = P.checksum(flat)  # the actor hashes before publishing (its own cost, not the sync's)
        t0 = time.perf_counter()
        stats = engine.update_weights(flat, 3 * version, checksum=checksum)
        times["sync"].append(time.perf_counter() - t0)
        jax_sampler.room_for = lambda nbytes: False  # devices without room for a second copy: the host undo path
        try:
            t0 = time.perf_counter()
            undo_stats = engine.update_weights(flat, 3 * version + 1, checksum=checksum)
            times["sync_host_undo"].append(time.perf_counter() - t0)
        finally:
            jax_sampler.room_for = room_for
        # The colocated step: the engine was offloaded while the actor trained and is onloaded for ROLLOUT;
        # its old weights wait on host (a lazy onload), so the sync has no undo copy to make.
        engine.offload()
        engine.onload()
        t0 = time.perf_counter()
        engine.update_weights(flat, 3 * version + 2, checksum=checksum)
        times["sync_resumed"].append(time.perf_counter() - t0)
        for name, run in parts.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    median = {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in times.items()}
    median["host_backup"] = max(0.0, median["host_backup"] - median["raw"])  # it placed the leaves first
    return {"params": cfg.num_params, "bytes": P.num_bytes(flat), "seconds": median,
            "ratio": median["sync"] / median["raw"], "ratio_resumed": median["sync_resumed"] / median["raw"],
            "ratio_host_undo": median["sync_host_undo"] / median["raw"],
            "largest_leaf_shard_bytes": stats["largest_leaf_bytes"], "peak_extra_bytes": stats["peak_extra_bytes"],
            "undo_host_bytes": stats["undo_host_bytes"], "host_undo_peak_extra_bytes": undo_stats["peak_extra_bytes"],
            "host_undo_bytes": undo_stats["undo_host_bytes"],
            "checksum_equal": engine.weight_checksum == P.checksum(flat)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharding", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--fsdp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=3, help="timed syncs (after one warm-up)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sharding"))
    args = p.parse_args(argv)

    memory = bytes_per_device(args)
    sync = weight_sync(args)
    mib = 2**20
    lines = [f"model: {sync['params'] / 1e6:.1f}M params ({sync['bytes'] / mib:.0f} MiB float32), "
             f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}", "",
             "| fsdp | params MiB/device | grads MiB/device | AdamW MiB/device | total MiB/device | vs fsdp 1 |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in memory:
        lines.append(f"| {row['fsdp']} | {row['params'] / mib:.1f} | {row['grads'] / mib:.1f} | {row['opt'] / mib:.1f} "
                     f"| {row['total'] / mib:.1f} | {row['total'] / memory[0]['total']:.3f} |")
    sec = sync["seconds"]
    lines += ["", f"weight sync fsdp 4 x tp 2 -> tp 2 (median of {args.repeats}): update_weights "
              f"{sec['sync']:.3f} s = {sync['ratio']:.1f} x the raw resharding transfer ({sec['raw']:.3f} s; goal "
              "<= 1.5 x); the old weights beside the new: peak extra "
              f"{sync['peak_extra_bytes'] / mib:.1f} MiB/device, {sync['undo_host_bytes'] / mib:.1f} MiB to host; "
              f"logical checksum equal: {sync['checksum_equal']}",
              f"where the devices lack room (host undo): {sec['sync_host_undo']:.3f} s = "
              f"{sync['ratio_host_undo']:.1f} x raw; peak extra {sync['host_undo_peak_extra_bytes'] / mib:.1f} "
              f"MiB/device (largest leaf shard {sync['largest_leaf_shard_bytes'] / mib:.1f} MiB), "
              f"{sync['host_undo_bytes'] / mib:.1f} MiB/device to host",
              f"into an engine just onloaded (the colocated step): {sec['sync_resumed']:.3f} s = "
              f"{sync['ratio_resumed']:.1f} x raw",
              "", "| part of a sync, alone | seconds | x raw |", "|---|---:|---:|"]
    for name, what in (("raw", "resharding transfer (device_put of every leaf into the engine's layout)"),
                       ("host_backup", "the old leaves to host memory (the transaction's undo copy)"),
                       ("hash", "logical checksum on the devices (the verification)"),
                       ("sync", "update_weights, room for both versions: transfer + checksum, old ones freed after"),
                       ("sync_host_undo", "update_weights without room: all of the above, leaf by leaf"),
                       ("sync_resumed", "update_weights into a just-onloaded engine: transfer + checksum, no undo")):
        lines.append(f"| {what} | {sec[name]:.3f} | {sec[name] / sec['raw']:.2f} |")
    results = {"environment": environment(), "bytes_per_device": memory, "weight_sync": sync}
    save_results(args.out, "Sharded roles: bytes per device and resharding weight sync", results, "\n".join(lines))
    return results


if __name__ == "__main__":
    main()
