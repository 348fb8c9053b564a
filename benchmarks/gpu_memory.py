"""What the actor's train programs allocate on a GPU, from XLA:GPU's own memory analysis, without a GPU.

    python -m benchmarks.gpu_memory [--preset qwen3-4b] [--micro-batch 8] [--accumulate 1,16]
                                    [--prompt-len 256] [--new-tokens 256] [--beta 0.08] [--remat layers]
                                    [--target h100 | h200 | present | FILE] [--out DIR]

The actor's two programs (workers.actor.ActorWorker._program): the gradient of a mini-batch of `--accumulate`
micro-batches of `--micro-batch` rows x (prompt-len + new-tokens) positions (workers.train_step.gradients, a
bfloat16 model's forward reading its served copy, log-probabilities on the completion windows, beta > 0: ref_logp
in the batch), and the optimizer's step (workers.train_step.update, gradient and state donated). Abstract shapes
only (nnx.eval_shape): no weights are made, nothing runs, so a 4B model compiles on a laptop. Per program,
`compiled.memory_analysis()`: temporaries, outputs, arguments; beside `rlsched plan`'s count for the same setting
(rlsched.config.plan.actor_bytes: grads + activations against the larger program's temporaries plus the gradient,
as tests/test_plan_memory.py compares them).

--target h100 / h200 compiles for that GPU with no GPU present ("deviceless AOT": XLA:GPU's compiler from the
CUDA plugin, given the device's description, TARGETS below; a FILE is a GpuTargetConfigProto in text form, the
format of XLA's xla/tools/hlo_opt/gpu_specs/*.txtpb); --target present compiles for the first device JAX sees (the
CPU in CI). The CUDA plugin is not a dependency of rlsched; for the GPU targets, in a venv of its own:
    python3 -m venv gpuaot && gpuaot/bin/pip install "jax==$V" "jaxlib==$V" "jax-cuda12-plugin[with-cuda]==$V" \
        "jax-cuda12-pjrt==$V" flax optax pydantic pyyaml     # V: the jax of rlsched's venv; ~3 GB of CUDA wheels
    PYTHONPATH=. JAX_PLATFORMS=cpu gpuaot/bin/python -m benchmarks.gpu_memory --target h100
JAX_PLATFORMS=cpu (benchmarks.common's default, set before jax is first imported): the CUDA backend is then never
started and the topology is made from the description alone (jax.experimental.topologies.get_topology_desc). Where
JAX may start it and there is no driver, cuInit fails (CUDA error 303) and the topology is refused ("topology not
implemented for cuda"). XLA:GPU then compiles in full, to PTX, without autotuning (its dumped autotune results
are empty: no device to time kernels on). What it allocates is not XLA:CPU's, whose dots compute bfloat16 in
float32 from float32 copies of the weights.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from benchmarks.common import save_results  # first: sets JAX to CPU, hubs offline
from rlsched.base.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "configs" / "gsm8k_qwen3.yaml"
GiB = 2**30

# GpuTargetConfigProto text of an H100 SXM: XLA's xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb (what
# CudaExecutor::CreateDeviceDescription reports on one), with the cuDNN and CUDA runtime versions the plugin's
# wheels bring, which the compiler asks for when it has no device to ask (openxla/xla#25919).
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
# An H200 is the H100's chip (sm_90, 132 SMs, the same caches) with 141 GB of HBM3e at 4.8 TB/s: the H100's
# description with those two figures (143,771 MiB, what the driver reports on one); XLA has no spec file of it.
H200 = (H100.replace("device_memory_size: 84978434048", "device_memory_size: 150754820096")
        .replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 4800000000000")
        .replace("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
TARGETS = {"h100": H100, "h200": H200}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_memory", description=__doc__.splitlines()[0])
    add_task_args(p, preset="qwen3-4b", micro_batch=8)
    p.add_argument("--accumulate", default="1,16", help="micro-batches per optimizer step, one compile each")
    p.add_argument("--fsdp", type=int, default=1,
                   help="the actor's mesh: fsdp N over N devices of one host (every figure is then one device's)")
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/gpu_memory-<target, or the platform with present>-<preset>")
    return p.parse_args(argv)


def add_task_args(p: argparse.ArgumentParser, *, preset: str, micro_batch: int) -> None:
    """The model, the actor's batch and the target, as `task_config` and `target_device` read them (the benchmarks
    that compile an actor's programs for a GPU without one share them)."""
    p.add_argument("--preset", default=preset, help="a workers.models.presets preset (tiny, qwen3-0.6b, ...)")
    p.add_argument("--vocab-size", type=int, default=None, help="the vocabulary of a preset without its own (tiny...)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--micro-batch", type=int, default=micro_batch, help="rows per micro-batch")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens: the head's completion window")
    p.add_argument("--beta", type=float, default=0.08, help="> 0: the batch carries ref_logp")
    p.add_argument("--remat", default="layers", choices=("layers", "off"))
    p.add_argument("--adam-mu-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--target", default="h100", help="h100, h200, present (the first device JAX sees) or a file")


def target_device(target: str):
    """The device to compile for: the first one JAX sees, or a GPU described by `target` (deviceless)."""
    return target_devices(target)[0]


def target_devices(target: str, count: int = 1) -> list:
    """`count` devices to compile for: the first JAX sees, or `count` GPUs of one host described by `target`
    (deviceless: topology 1 slice x 1 host x `count` devices)."""
    import jax

    if target == "present":
        if len(jax.devices()) < count:
            raise SystemExit(f"--target present: {count} devices wanted, JAX sees {len(jax.devices())}")
        return jax.devices()[:count]
    from jax.experimental import topologies

    config = TARGETS[target] if target in TARGETS else Path(target).read_text()
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology=f"1x1x{count}")
    except Exception as e:  # the plugin is absent, or refuses the description: say which, and how to get it
        raise SystemExit(f"--target {target}: cannot describe the GPU to XLA ({type(e).__name__}: {e}); the CUDA "
                         f"plugin is needed (this module's docstring), or use --target present") from e
    return list(topology.devices)


def task_config(args, accumulate: int):
    """configs/gsm8k_qwen3.yaml's task at this setting, one optimizer step a GRPO step (for `rlsched plan`)."""
    from rlsched.config.loading import load_config

    rows = args.micro_batch * accumulate
    generations = min(8, rows)
    return load_config(TEMPLATE, [
        "tasks.0.model.path=/nonexistent", f"tasks.0.model.dtype={args.dtype}", f"tasks.0.actor.remat='{args.remat}'",
        f"tasks.0.actor.adam_mu_dtype={args.adam_mu_dtype}", f"tasks.0.grpo.max_prompt_len={args.prompt_len}",
        f"tasks.0.grpo.max_new_tokens={args.new_tokens}", f"tasks.0.grpo.beta={args.beta}",
        f"tasks.0.grpo.prompts_per_step={rows // generations}", f"tasks.0.grpo.num_generations={generations}",
        f"tasks.0.grpo.mini_batch_size={rows}", f"tasks.0.grpo.micro_batch_size={args.micro_batch}",
        f"tasks.0.actor.mesh.fsdp={getattr(args, 'fsdp', 1)}"])


def stats(compiled, seconds: float) -> dict:
    """A compiled program's memory analysis; its peak is what its own buffers need at once (arguments, outputs
    not written over a donated argument, temporaries): arrays the device holds beside them (the master and the
    optimizer's state beside the gradient's program, which does not read them) are not in it."""
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"temp_bytes": m.temp_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "argument_bytes": m.argument_size_in_bytes, "alias_bytes": m.alias_size_in_bytes, "peak_bytes": peak,
            "compile_s": seconds}


def compile_programs(model, settings, device, accumulate: int, length: int, mesh=None) -> dict:
    """The gradient and update programs of a full-weight actor on one `device` (or `mesh`), with the shardings
    workers.actor.ActorWorker gives them, compiled from abstract arguments: each one's memory analysis."""
    out = {}
    lowerings = lower_programs(model, settings, device, accumulate, length, mesh=mesh)
    for name in ("gradient", "update"):
        t0 = time.perf_counter()
        out[name] = stats(lowerings[name]().compile(), time.perf_counter() - t0)
    return out


def lower_programs(model, settings, device, accumulate: int, length: int, lora=None, mesh=None) -> dict:
    """{name: a function that traces and lowers it} of a full-weight actor's programs on one `device` (a LoRA
    actor's with `lora`, a workers.models.lora.LoraSpec: its adapter trained, the base frozen), with the shardings
    workers.actor.ActorWorker gives them, from abstract arguments: "gradient", "update", and "reference" (the
    reference's log-probabilities of one micro-batch, on the completion windows: a LoRA actor's is its logprobs
    program, the base's row). `mesh`: a jax Mesh of the actor's axes (workers.models.sharding.mesh) instead of the
    one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from workers.models import lora_batch as LB
    from workers.models import params as P
    from workers.models import sharding as S
    from workers.train_step import (
        ROW_KEYS,
        WINDOW,
        TrainState,
        compute_params,
        gradients,
        make_optimizer,
        master_params,
        update,
        window_token_logprobs,
    )

    mesh = S.mesh({}, [device]) if mesh is None else mesh
    repl = S.replicated(mesh)
    graphdef, params = nnx.split(model)
    param_sh = S.state_shardings(params, mesh, kv_heads=model.config.num_key_value_heads)
    abstract = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    base, base_sh = (), ()  # a LoRA actor's frozen base and the logprobs' adapter row: arguments of its programs
    if lora is not None:  # what trains is the adapter (float32), laid out as the projections it adapts
        base_sh = (param_sh, repl)
        base = (abstract(params, param_sh), jax.ShapeDtypeStruct((), jnp.int32, sharding=repl))
        params = jax.eval_shape(lambda: LB.init_adapter(model.config, lora, jax.random.key(0)))
        param_sh = S.adapter_shardings(P.to_flat(param_sh), params)
    tx = make_optimizer(settings)
    master = params if lora is not None else jax.eval_shape(master_params, params)
    opt = jax.eval_shape(tx.init, master)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, opt, param_sh, transform_non_params=lambda _: repl)
    shardings = TrainState(param_sh, opt_sh, repl)
    state = abstract(TrainState(master, opt, jax.ShapeDtypeStruct((), jnp.int32)), shardings)
    dtype = None if model.config.dtype == "float32" or lora is not None else jnp.dtype(model.config.dtype)
    served = None if dtype is None else abstract(jax.eval_shape(partial(compute_params, dtype=dtype), master),
                                                 param_sh)
    m, f32 = settings.micro_batch_size, np.float32
    batch = {"tokens": ((accumulate, m, length), np.int32), "attention_mask": ((accumulate, m, length), np.bool_),
             "loss_mask": ((accumulate, m, length - 1), f32), "advantages": ((accumulate, m), f32),
             "sampler_logp": ((accumulate, m, length - 1), f32), WINDOW: ((accumulate, m), np.int32)}
    if settings.beta > 0:
        batch["ref_logp"] = ((accumulate, m, length - 1), f32)
    batch_sh = {k: S.batch_sharding(mesh, 2 if k in ROW_KEYS else 3, leading=1) for k in batch}
    batch = {k: jax.ShapeDtypeStruct(*v, sharding=batch_sh[k]) for k, v in batch.items()}
    stream = S.residual_sharding(mesh)  # as ActorWorker holds it
    fn = partial(gradients, graphdef=graphdef, settings=settings, lora=lora, dtype=dtype, rows=stream)
    frozen_sh, frozen = (base_sh[:1], base[:1]) if dtype is None else ((None, param_sh), (None, served))
    grad = jax.jit(fn, in_shardings=(shardings, batch_sh, *frozen_sh), out_shardings=(param_sh, repl))
    step = jax.jit(lambda st, gr, skipped: update(st, gr, skipped == 0, tx=tx, platform=device.platform),
                   in_shardings=(shardings, param_sh, repl), out_shardings=(shardings, param_sh), donate_argnums=(0, 1))
    skipped = jax.ShapeDtypeStruct((), f32, sharding=repl)
    rows, vec = S.batch_sharding(mesh, 2), S.batch_sharding(mesh, 1)
    reference = jax.jit(partial(window_token_logprobs, graphdef, width=settings.max_new_tokens,
                                temperature=settings.temperature, lora=lora, dtype=dtype, rows=stream),
                        in_shardings=(param_sh, rows, rows, vec, *base_sh), out_shardings=rows)
    ref_params = state.params if lora is not None else abstract(
        jax.eval_shape(partial(compute_params, dtype=dtype or jnp.float32), master), param_sh)
    micro = [jax.ShapeDtypeStruct((m, length), t, sharding=rows) for t in (np.int32, np.bool_)]
    starts = jax.ShapeDtypeStruct((m,), np.int32, sharding=vec)
    return {"gradient": lambda: grad.lower(state, batch, *frozen),
            "update": lambda: step.lower(state, state.params, skipped),
            "reference": lambda: reference.lower(ref_params, *micro, starts, *base)}


def target_name(device, target: str) -> str:
    """What a results folder is named by: the present backend's platform, a named target, or a target file's stem."""
    return device.platform if target == "present" else target if target in TARGETS else Path(target).stem


def target_memory(target: str) -> int | None:
    """The GPU's memory in bytes, as its description gives it; None for the present backend."""
    import re

    if target == "present":
        return None
    config = TARGETS[target] if target in TARGETS else Path(target).read_text()
    return int(re.search(r"device_memory_size: (\d+)", config).group(1))


def environment(device, target: str) -> dict:
    import importlib.metadata as md
    import platform

    import flax
    import jax

    env = dict(python=platform.python_version(), jax=jax.__version__, flax=flax.__version__,
               target=str(getattr(device, "device_kind", device)), cpus_usable=len(os.sched_getaffinity(0)),
               target_memory_bytes=target_memory(target))
    for dist in ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    return env


def main(argv=None) -> dict:
    args = parse_args(argv)
    from flax import nnx

    from rlsched.config.plan import actor_bytes
    from rlsched.config.spec import actor_settings
    from workers.models import sharding as S
    from workers.models.decoder import CausalLM
    from workers.models.presets import preset_config

    devices = target_devices(args.target, args.fsdp)
    device, mesh = devices[0], S.mesh({"fsdp": args.fsdp}, devices)
    vocab = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
    config = preset_config(args.preset, dtype=args.dtype, **vocab)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    length = args.prompt_len + args.new_tokens
    runs = []
    for accumulate in (int(a) for a in args.accumulate.split(",")):
        task = task_config(args, accumulate).tasks[0]
        programs = compile_programs(model, actor_settings(task), device, accumulate, length, mesh=mesh)
        plan = actor_bytes(task, config, backend="cpu" if device.platform == "cpu" else "gpu")
        grad, upd = programs["gradient"], programs["update"]
        # as tests/test_plan_memory.py: the gradient (the plan's grads, the gradient program's output) and the
        # activations of the larger of the two programs, against the plan's grads + activations
        allocated = max(grad["temp_bytes"], upd["temp_bytes"]) + grad["output_bytes"]
        run = dict(accumulate=accumulate, rows=args.micro_batch, positions=length, **programs,
                   plan={k: plan[k] for k in ("grads", "activations")},
                   plan_over_allocated=(plan["grads"] + plan["activations"]) / allocated,
                   plan_activations_over_gradient_temp=plan["activations"] / max(grad["temp_bytes"], 1))
        runs.append(run)
        print(f"{args.preset} {args.micro_batch} x {length} x {accumulate}: gradient temp "
              f"{grad['temp_bytes'] / GiB:.2f} GiB ({grad['compile_s']:.0f} s), update temp "
              f"{upd['temp_bytes'] / GiB:.2f} GiB; plan activations {plan['activations'] / GiB:.2f} GiB", flush=True)
    env = environment(device, args.target)
    memory = env["target_memory_bytes"]
    rows = [f"| {r['accumulate']} | " + " | ".join(format_bytes(n) for n in (
        r["gradient"]["temp_bytes"], r["gradient"]["output_bytes"], r["gradient"]["argument_bytes"],
        r["gradient"]["peak_bytes"], r["update"]["temp_bytes"], r["update"]["peak_bytes"], r["plan"]["activations"],
        r["plan"]["grads"])) + f" | {r['plan_over_allocated']:.3f} |" for r in runs]
    report = "\n".join([
        f"{args.preset} ({args.dtype}, remat {args.remat}), micro-batches of {args.micro_batch} x {length} positions "
        f"(window {args.new_tokens}, beta {args.beta}), compiled for {env['target']} ({args.target}"
        + (f", {format_bytes(memory)}" if memory else "") + "); XLA's memory_analysis() of each program"
        + (f", one device's of fsdp {args.fsdp}" if args.fsdp > 1 else ""), "",
        "| micro-batches a step | gradient temp | gradient out | gradient args | gradient peak | update temp | "
        "update peak | plan activations | plan grads | plan / allocated |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        "peak: the program's own buffers at once (arguments + outputs not aliased to a donated argument + temporaries; "
        "what the device holds beside them, e.g. the master and the optimizer's state beside the gradient's program, "
        "which does not read them, is not in it); allocated = max(gradient temp, update temp) + gradient out (the "
        "float32 gradient); plan = grads + activations (rlsched.config.plan.actor_bytes)"])
    results = dict(args={k: str(v) for k, v in vars(args).items()}, env=env, runs=runs,
                   timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    fsdp = f"-fsdp{args.fsdp}" if args.fsdp > 1 else ""
    out = args.out or ROOT / "benchmarks" / "results" / \
        f"gpu_memory-{target_name(device, args.target)}-{args.preset}{fsdp}"
    save_results(out, "The actor's train programs: XLA's memory analysis beside the plan", results, report)
    return results


if __name__ == "__main__":
    main()
