"""GPU benchmark: a real-shape model on whatever device JAX sees, one task to 32, in one process and under Ray.

    python -m benchmarks.gpu [--preset qwen3-0.6b] [--tasks 1,2,4] [--lora 8,32]
                             [--layouts in_process,per_device_group] [--steps 6] [--warmup-steps 2]
                             [--budget-s S] [--out benchmarks/results/gpu-<device>]

Issue 40's setting by default: a random Qwen3-0.6B-shaped model made here (`rlsched init-model --preset
qwen3-0.6b`, the real tokenizer, bfloat16 off CPU), GSM8K chat prompts (configs/gsm8k_qwen3.yaml's task), 16
prompts x 8 generations, 256 new tokens, beta 0.08, micro-batch 16. Each run is `rlsched train` in a process of
its own, as a user runs it (so each has its own device allocator, peak and compile state): `--in-process`, or
under Ray with every role in the device group's one process (`cluster.processes=per_device_group`); N
full-weight tasks (--tasks) and N LoRA tasks on one base (--lora: rank 16 on every projection, co-batched).
Runs go cheapest first; the first one starts from an empty compile cache and is run again at once with the cache
it filled (its cold and warm first step); every later run finds that cache.

Per run, from what the run writes (metrics.jsonl, timeline.json), medians over the steady steps (past
--warmup-steps) of every task:
- step, rollout (sync + generate), train; where the rest of a step goes (onload, offload, verify, lock waits);
- decode: the generate span / grpo.max_new_tokens steps (prefill included), beside the bound of reading the
  engine's weights once per token-step at the bandwidth of a large device-to-device copy measured at the start;
- train MFU: FLOPS_FORMULA over the TRAIN phase's seconds, against DENSE_BF16_PEAK for the device's kind;
- peak device bytes (the allocator's, where it keeps statistics) beside the bytes the roles hold and the plan's;
- first step: launch -> step 1, step 1's own time and compile; compiles after step 1;
- aggregate steps/s and samples/s of all tasks at once, against one full-weight task in the same layout.
results.json and report.md are rewritten after every run (a benchmark stopped early keeps what it measured);
--budget-s starts no run that would end past it (estimated from the runs done) and stops one that runs past it.
A figure the backend cannot measure is null, with the reason in the run's "nulls".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

USER_PLATFORMS = os.environ.get("JAX_PLATFORMS")  # read before benchmarks.common defaults it to cpu here

from benchmarks.common import count_params, save_results  # noqa: E402 - after the platform is read
from benchmarks.lora import task_counts  # noqa: E402
from rlsched.rundir.files import write_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "configs" / "gsm8k_qwen3.yaml"
LAYOUTS = ("in_process", "per_device_group")
LORA_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]  # every projection
# Dense bf16 peak FLOP/s by device kind (vendor datasheets, without sparsity); the first substring that matches.
DENSE_BF16_PEAK = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("A100", 312e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v6 lite", 918e12),
                   ("TPU v4", 275e12))
FLOPS_FORMULA = ("train FLOPs per step = (update 6 + old-policy forward 2 + reference forward 2 if beta > 0) x "
                 "((N - H x V) x tokens + H x V x rows x max_new_tokens); N the model's parameters, tokens = "
                 "train/padded_tokens (rows x padded length, what the programs compute); the output head (H x V, "
                 "hidden x vocabulary) runs only on each row's window of max_new_tokens positions where its "
                 "completion lies (workers.token_logprobs.window_logprobs); a LoRA task's update counts 4 (forward "
                 "and input gradients: the frozen base has no weight gradients)")
SWITCH = ("sync_weights", "onload", "offload", "verify")  # what time-sharing costs a task, each step
SPANS = ("generate", *SWITCH, "logprobs", "update", "publish", "restore_weights")
COMPILE_SPAN_S = "compile"
# a task's start (phase startup: rlsched.run.task.TaskDriver.start) and, inside it, its roles' construction
STARTUP = ("start", "imports", "devices", "load_model", "build_worker", "make_engine", "restore", "host_work")
GRACE_S = 30.0  # a run stopped by --budget-s is asked this long before the budget ends: its step and outputs end
GOAL = {"sync_s": 0.010, "decode_ms": 1.5, "mfu": 0.45, "peak_over_held": 1.25, "cold_s": 30.0, "warm_s": 10.0,
        "speedup": 1.2, "switch_share": 0.02, "lora_first_s": 60.0, "lora_samples_x": 4.0, "simulate_error": 0.10}
# Every run's figures, present in results.json whatever happened (null, with its reason in "nulls").
FIELDS = ("status", "wall_s", "launch_to_first_step_s", "launch_to_every_first_step_s", "startup_s", "first_step_s",
          "first_step_compile_s", "compiles_after_step1", "compile_s_after_step1", "steady_steps", "step_s",
          "rollout_s", "train_s", "reward_s", "lock_wait_s", "spans_s", "switch_share", "sync_s_max_task",
          "decode_ms_per_token_step", "decode_rows", "decode_bound_ms", "decode_bound_kv_ms",
          "decode_over_bound", "generated_tokens_per_s",
          "train_flops_per_step", "mfu", "peak_device_bytes", "held_bytes", "plan_bytes", "peak_over_held",
          "steps_per_s", "samples_per_s", "steps_per_s_x_one", "samples_per_s_x_one_full",
          "simulated_steps_per_s", "simulate_error")
SIMULATE_STEPS = 50  # per task: the simulated rate is a steady state's (the pipeline's filling a small part of it)
SIMULATE = ("benchmarks.simulate (the scheduler's own policy), fed the phase profile of one full-weight task alone in "
            "the same layout (profile_from_metrics: medians past warmup), N tasks colocated on one device group, "
            "shared_speed 0.5 (phases that overlap on the device each run at half speed), "
            f"{SIMULATE_STEPS} steps each; error = (simulated - measured) / measured aggregate steps/s, the measured "
            "one over the window where every task is past warmup and none has ended (the tasks' starts differ, "
            "the simulator's do not)")


@dataclass(frozen=True)
class Run:
    layout: str
    tasks: int
    lora: bool
    steps: int
    warm: bool = False  # the first run again, with the compile cache that run filled

    @property
    def name(self) -> str:
        return f"{self.layout}/{'lora' if self.lora else 'full'}-{self.tasks}" + ("/warm" if self.warm else "")

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-0.6b", help="the model's shape (`rlsched init-model --preset`)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="weights and compute (auto: bfloat16, float32 on CPU)")
    p.add_argument("--tasks", type=task_counts, default=[1, 2, 4], help="full-weight task counts, e.g. 1,2,4 (none)")
    p.add_argument("--lora", type=task_counts, default=[8, 32], help="LoRA task counts on one base, e.g. 8,32 (none)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-rows", type=int, default=256,
                   help="rollout.max_batch_size of LoRA tasks: rows of several tasks in one co-batched generate")
    p.add_argument("--layouts", type=lambda s: [x for x in s.split(",") if x], default=list(LAYOUTS),
                   help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per task")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps per task left out of the medians")
    p.add_argument("--warm-steps", type=int, default=1, help="steps of the warm-cache rerun of the first run (0: none)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256, help="grpo.max_prompt_len (longer prompts are truncated)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--beta", type=float, default=0.08)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--decode-attention", choices=("auto", "xla", "pallas"), default="auto",
                   help="the runs' rollout.engine_args.decode_attention (auto: the Pallas kernel on GPUs, unless "
                        "the probe's check of it on the device failed: then xla, and the report says why)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="MiB of the bandwidth probe's copy (default 2048, 64 on CPU)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no run that would end past this many seconds from the start; stop one that does")
    p.add_argument("--work", type=Path, default=None,
                   help="where the model, runs and compile cache go (default: a temporary directory, removed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of every task, as `rlsched train --set` (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/gpu-<device kind>")
    p.add_argument("--probe", type=Path, default=None, help=argparse.SUPPRESS)  # the child: device and model
    p.add_argument("--check-attention", type=Path, default=None, help=argparse.SUPPRESS)  # the child: the kernel
    args = p.parse_args(argv)
    bad = [x for x in args.layouts if x not in LAYOUTS]
    if bad or not args.layouts:
        p.error(f"--layouts {','.join(args.layouts)}: choose from {', '.join(LAYOUTS)}")
    if args.steps < args.warmup_steps + 2:
        p.error(f"--steps {args.steps}: need at least --warmup-steps + 2 = {args.warmup_steps + 2}, so that the "
                "steady state has an interval to time")
    return args


def plan_runs(args) -> list[Run]:
    """Cheapest first: full-weight before LoRA, fewer tasks first, in-process before Ray; the warm rerun second.
    Several tasks in one process run one after another (their aggregate is one task's by construction): last."""
    runs = [Run(layout, n, lora, args.steps) for lora, counts in ((False, args.tasks), (True, args.lora))
            for n in counts for layout in args.layouts]
    runs.sort(key=lambda r: (r.layout == "in_process" and r.tasks > 1, r.lora, r.tasks, LAYOUTS.index(r.layout)))
    if runs and args.warm_steps:
        first = runs[0]
        runs.insert(1, Run(first.layout, first.tasks, first.lora, args.warm_steps, warm=True))
    return runs


def child_env() -> dict[str, str]:
    """The runs' environment: JAX picks the device unless the caller named one; each run's compile cache is the
    benchmark's (`cluster.compile_cache_dir`), not one the environment sets (the tests share one per session)."""
    env = dict(os.environ)
    if USER_PLATFORMS is None:
        env.pop("JAX_PLATFORMS", None)
    for key in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_COMPILATION_CACHE_MAX_SIZE"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


# ---- the device: its kind, allocator and copy bandwidth (in a child: this process never opens the device) ----

def probe_device(copy_mib: int | None, preset: str, dtype: str, model: Path) -> dict:
    """Run in the probe's child: the device's kind, the bandwidth of a copy of `copy_mib` MiB on it, and the
    model of `preset` at `model` (made here, if it is not there yet: one process start less)."""
    if USER_PLATFORMS is None:  # this child imported benchmarks.common too, which defaults JAX to the CPU
        os.environ.pop("JAX_PLATFORMS", None)
    import jax
    import jax.numpy as jnp

    from benchmarks.common import environment
    from workers.models import init_model

    device = jax.devices()[0]
    stats = device.memory_stats()
    mib = copy_mib or (64 if device.platform == "cpu" else 2048)
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1)  # every byte read once and written once: a copy's traffic, never elided
    copy(x).block_until_ready()
    seconds = []
    for _ in range(5):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        seconds.append(time.perf_counter() - t0)
    best = min(seconds)
    del x
    dtype = dtype if dtype != "auto" else ("float32" if device.platform == "cpu" else "bfloat16")
    t0 = time.perf_counter()
    if not (model / "config.json").is_file():
        init_model(model, preset=preset, dtype=dtype)
    return dict(kind=device.device_kind, platform=device.platform, count=len(jax.devices()),
                allocator_stats=stats is not None, bytes_limit=(stats or {}).get("bytes_limit"),
                copy=dict(bytes=2 * x_bytes(mib), seconds=best, bandwidth_bytes_per_s=2 * x_bytes(mib) / best),
                env=environment(), dtype=dtype, model_s=time.perf_counter() - t0,
                jax_platforms=os.environ.get("JAX_PLATFORMS"))  # what JAX was told here (None: its own choice)


def check_decode_attention(model: Path, dtype: str, rows: int, prompt_len: int, new_tokens: int) -> dict:
    """The decode attention kernel on this device at the engine's shape (rows x the model's KV heads, prompt_len +
    new_tokens slots) against XLA's attention over the whole cache (what one decode loop of `xla` reads): its
    largest difference (float32 outputs), and both timed mid-generation (slots from the first of a GSM8K-long
    prompt, PROMPT_TOKENS, to prompt_len + new_tokens / 2), with the bytes the kernel reads. The kernel is the
    GPU's `pallas`, elsewhere the same body under Pallas's interpreter (slow: its time is no figure). Run in a
    child of its own (`attention_check`): an error, or the child's death, is returned as such, and the runs then
    decode with `xla`."""
    if USER_PLATFORMS is None:  # as the probe's child: JAX's own choice of device
        os.environ.pop("JAX_PLATFORMS", None)
    import jax
    import jax.numpy as jnp

    from workers.models.config import ModelConfig
    from workers.models.decode_attention import attend, reference, unsupported

    device = jax.devices()[0]
    cfg = ModelConfig.from_dir(model)
    kv, groups, d = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    slots = prompt_len + new_tokens
    impl = "pallas" if device.platform == "gpu" else "interpret"
    out = dict(impl=impl, shape=dict(rows=rows, kv_heads=kv, groups=groups, head_dim=d, slots=slots))
    why = unsupported(d)
    if why:
        return dict(out, error=why)
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (rows, kv, groups, d), jnp.float32).astype(dt)
    k, v = (jax.random.normal(x, (rows, kv, slots, d), jnp.float32).astype(dt) for x in keys[1:])
    first = jnp.full((rows,), max(0, prompt_len - PROMPT_TOKENS), jnp.int32)
    end = jnp.int32(prompt_len + new_tokens // 2)
    kernel = jax.jit(lambda *a: attend(*a, impl=impl))
    xla = jax.jit(reference)
    try:
        got = kernel(q, k, v, first, end).block_until_ready()
    except Exception as e:  # the kernel does not lower or run here: said, and the runs use XLA's attention
        return dict(out, error=f"{type(e).__name__}: {str(e)[:500]}")
    want = xla(q, k, v, first, end).block_until_ready()

    def timed(f) -> float:
        seconds = []
        for _ in range(5):
            t0 = time.perf_counter()
            f(q, k, v, first, end).block_until_ready()
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

    read = 2 * rows * kv * (int(end) - int(first[0])) * d * jnp.dtype(dt).itemsize  # k and v, the run it attends
    out.update(max_abs_diff=float(jnp.max(jnp.abs(got - want))), kernel_read_bytes=read)
    if impl != "pallas":  # the interpreter's time says nothing of a kernel's
        return dict(out, kernel_ms=None, xla_ms=None, kernel_bytes_per_s=None, tilings=[])
    kernel_s, xla_s = timed(kernel), timed(xla)
    tilings = []  # the kernel at other tilings than its default, for the next choice of it (an error is kept)
    for block, warps in TILINGS:
        try:
            tiled = jax.jit(lambda *a, block=block, warps=warps: attend(*a, impl=impl, block=block, num_warps=warps))
            tilings.append(dict(block=block, num_warps=warps, ms=1e3 * timed(tiled)))
        except Exception as e:
            tilings.append(dict(block=block, num_warps=warps, error=f"{type(e).__name__}: {str(e)[:200]}"))
    return dict(out, kernel_ms=1e3 * kernel_s, xla_ms=1e3 * xla_s, kernel_bytes_per_s=read / kernel_s,
                tilings=tilings)


PROMPT_TOKENS = 96  # a GSM8K chat prompt's tokens, about: the rest of prompt_len is left padding
TILINGS = [(16, 4), (32, 2), (32, 8), (64, 4), (64, 8)]  # (block, num_warps) the probe times beside the default


def attention_check(args, model: Path, dtype: str) -> dict:
    """`check_decode_attention` in a child process (a kernel that kills its process takes only the check with it)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--check-attention", str(model), "--dtype", dtype,
                           *(f"--{k}={getattr(args, k.replace('-', '_'))}"
                             for k in ("prompts", "generations", "prompt-len", "new-tokens"))],
                          env=child_env(), capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return dict(impl="pallas", shape=None, seconds=time.perf_counter() - t0,
                    error=f"the check's process ended with {done.returncode}: {done.stderr.strip()[-500:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), seconds=time.perf_counter() - t0)


def x_bytes(mib: int) -> int:
    return mib * 2**20 // 4 * 4


def dense_peak(kind: str, platform: str) -> tuple[float | None, str | None]:
    """(the device kind's dense bf16 peak FLOP/s, None) or (None, why there is none)."""
    if platform == "cpu":
        return None, "a CPU has no dense bf16 peak in the table (MFU is a matrix units' figure)"
    for match, peak in DENSE_BF16_PEAK:
        if match.lower() in kind.lower():
            return peak, None
    return None, f"device kind {kind!r} is not in DENSE_BF16_PEAK (benchmarks/gpu.py): add its dense bf16 peak"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


# ---- one run ------------------------------------------------------------------------------------------------

def lora_engine_rows(rows: int, tasks: int, max_rows: int) -> int:
    """A LoRA run's rollout.max_batch_size: the rows of all its tasks (`rows` each), at most `max_rows` (--lora-rows),
    at least one task's."""
    return max(rows, min(max_rows, rows * tasks))


def experiment(run: Run, args, *, model: Path, dtype: str, work: Path) -> dict:
    """The config of `run`: N tasks of gsm8k_qwen3.yaml's task at the benchmark's setting on the model made here."""
    import yaml

    raw = yaml.safe_load(TEMPLATE.read_text())
    template = raw["tasks"][0]
    rows = args.prompts * args.generations
    template["model"] = {"path": str(model), "dtype": dtype}
    template["data"] = {**template["data"], "too_long": "truncate"}  # the byte tokenizer's prompts are long
    template["grpo"] = {**template["grpo"], "prompts_per_step": args.prompts, "num_generations": args.generations,
                        "max_prompt_len": args.prompt_len, "max_new_tokens": args.new_tokens, "beta": args.beta,
                        "mini_batch_size": rows, "micro_batch_size": min(args.micro_batch, rows)}
    template["rollout"] = {"max_batch_size": lora_engine_rows(rows, run.tasks, args.lora_rows) if run.lora else rows,
                           "engine_args": {"decode_attention": args.decode_attention}}
    if run.lora:
        template["lora"] = {"rank": args.lora_rank, "alpha": 2 * args.lora_rank, "targets": LORA_TARGETS}
    template.update(steps=run.steps, checkpoint_every=0)
    raw["tasks"] = [{**template, "name": f"t{i}", "seed": i} for i in range(run.tasks)]
    raw["experiment"] = {"name": run.slug, "output_dir": str(work / "runs"), "seed": 0}
    raw["cluster"] = {"placement": "colocated", "compile_cache_dir": str(work / "jax_cache"),
                      **({"processes": "per_device_group"} if run.layout == "per_device_group" else {})}
    return raw


def launch(run: Run, path: Path, overrides: list[str], log: Path, deadline: float | None
           ) -> tuple[int, float, float, bool]:
    """`rlsched train` of `path` in a process of its own; (exit code, launch unix time, wall s, stopped by the
    deadline). GRACE_S before the deadline it is asked to stop (it ends its step and writes its outputs); at the
    deadline it is killed (its metrics.jsonl, written step by step, stay)."""
    command = [sys.executable, "-m", "rlsched.cli", "train", str(path), "--overwrite"]
    command += [a for o in overrides for a in ("--set", o)] + (["--in-process"] if run.layout == "in_process" else [])
    launched, t0, stopped = time.time(), time.perf_counter(), False
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=path.parent)
        try:
            proc.wait(timeout=None if deadline is None else max(deadline - GRACE_S - time.perf_counter(), 0.1))
        except KeyboardInterrupt:  # this benchmark is stopped: so is its run (which ends its step, and Ray)
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=GRACE_S)
            if proc.poll() is None:
                proc.kill()
            raise
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=max(deadline - time.perf_counter(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return proc.returncode, launched, time.perf_counter() - t0, stopped


def read_run(cfg, run: Run) -> tuple[dict[str, list[dict]], list[dict]]:
    """({task: its metrics rows}, the run's timeline spans); what is missing is empty."""
    from rlsched.observe.timeline import TimelineError, read_trace
    from rlsched.observe.tracking import read_metrics

    metrics = {}
    for t in cfg.tasks:
        path = cfg.run_dir / "tasks" / t.name / "metrics.jsonl"
        metrics[t.name] = read_metrics(path) if path.is_file() else []
    try:
        spans = [e for e in read_trace(cfg.run_dir / "timeline.json") if e.get("kind") == "span"]
    except TimelineError:
        spans = []
    return metrics, spans


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def train_flops(factor: int, params: int, head: int, tokens: int, rows: int, window: int) -> float:
    """FLOPS_FORMULA for one task's step: `factor` FLOPs per parameter and position (update and forwards), the
    model's `params` at all `tokens` (rows x padded length) but its output head's `head` (hidden x vocabulary) at
    each of the `rows` rows' `window` completion positions only."""
    return factor * ((params - head) * tokens + head * rows * window)


def head_params(model: Path) -> int:
    """The output head's matrix (hidden x vocabulary) of the model in directory `model`, from its config.json."""
    config = json.loads((Path(model) / "config.json").read_text())
    return int(config["hidden_size"]) * int(config["vocab_size"])


def figures(run: Run, cfg, metrics: dict[str, list[dict]], spans: list[dict], launched: float, device: dict,
            params: int, args, head: int) -> tuple[dict, dict[str, str]]:
    """The run's figures and, for each that is null, why. `params`: the model's; `head`: its output head's."""
    nulls: dict[str, str] = {}
    out: dict = {}
    task = cfg.tasks[0]
    rows_per_task = task.grpo.prompts_per_step * task.grpo.num_generations
    w = args.warmup_steps if not run.warm else 0
    firsts = [rows[0] for rows in metrics.values() if rows]
    if firsts:
        ends = [m["time/end_unix"] for m in firsts]
        out["launch_to_first_step_s"] = min(ends) - launched
        if len(firsts) == run.tasks:
            out["launch_to_every_first_step_s"] = max(ends) - launched
        out["first_step_s"] = max(m["time/step_s"] for m in firsts)
        out["first_step_compile_s"] = max(m["time/compile_s"] for m in firsts)
    # where the time before step 1 went besides its compiles: the slowest task's start, and its roles' parts of it
    started = [e for e in spans if e.get("phase") == "startup" and e["name"] in STARTUP]
    if started:
        slowest = max((e for e in started if e["name"] == "start"), key=lambda e: e["end"] - e["start"], default=None)
        mine = [e for e in started if slowest is None or e["task"] == slowest["task"]]
        out["startup_s"] = {name: sum(e["end"] - e["start"] for e in mine if e["name"] == name)
                            for name in STARTUP if any(e["name"] == name for e in mine)}
    elif firsts:
        nulls["startup_s"] = "the run wrote no timeline.json (it did not end by itself)"
    # compiles after each task's step 1 (a compile span is recorded only when programs were compiled)
    late = [e for e in spans if e["name"] == COMPILE_SPAN_S and metrics.get(e["task"])
            and e["start"] > metrics[e["task"]][0]["time/end_unix"]]
    if any(len(rows) > 1 for rows in metrics.values()):
        later = [m for rows in metrics.values() for m in rows[1:]]
        out["compile_s_after_step1"] = sum(m["time/compile_s"] for m in later)  # each step's own count
        # A run stopped early writes no timeline.json: then the later steps that spent a second or more compiling
        # (a run stopped at --budget-s on an H100 compiled 74 s at step 3, which the spans alone missed).
        out["compiles_after_step1"] = len(late) if spans else sum(m["time/compile_s"] >= 1.0 for m in later)
    steady = {t: rows[w:] for t, rows in metrics.items() if len(rows) > w}
    pooled = [m for rows in steady.values() for m in rows]
    out["steady_steps"] = len(pooled)
    for key in ("step_s", "rollout_s", "train_s", "reward_s", "lock_wait_s"):
        out[key] = med(m[f"time/{key}"] for m in pooled)
    # each steady step's spans: those of its task that start inside the step
    per_step = []
    for t, rows in steady.items():
        mine = [e for e in spans if e["task"] == t]
        for m in rows:
            start, end = m["time/end_unix"] - m["time/step_s"], m["time/end_unix"]
            inside = [e for e in mine if start <= e["start"] <= end]
            per_step.append((t, m, {name: sum(e["end"] - e["start"] for e in inside if e["name"] == name)
                                    for name in SPANS}))
    if per_step and spans:
        out["spans_s"] = {name: med(s[name] for _, _, s in per_step) for name in SPANS}
        out["switch_share"] = {name: max(s[name] / m["time/step_s"] for _, m, s in per_step) for name in SWITCH}
        out["sync_s_max_task"] = max(med(s["sync_weights"] for tt, _, s in per_step if tt == t) for t in steady)
    elif pooled:
        nulls["spans_s"] = "the run wrote no timeline.json (it did not end by itself)"
    # decode: the sampler runs grpo.max_new_tokens steps when a completion ran to it
    full = [(m, s) for _, m, s in per_step if m["rollout/truncated"] > 0 and s["generate"] > 0]
    steps = task.grpo.max_new_tokens
    if full:
        out["decode_ms_per_token_step"] = 1e3 * med(s["generate"] / steps for _, s in full)
        out["decode_rows"] = med(rows_per_task * m["rollout/cobatched"] for m, _ in full)
        out["generated_tokens_per_s"] = med(m["tokens/generated"] * m["rollout/cobatched"] / s["generate"]
                                            for m, s in full)
    elif per_step:
        nulls["decode_ms_per_token_step"] = ("no steady step had a completion run to grpo.max_new_tokens: the "
                                             "sampler's number of token-steps is not known")
    last = {t: rows[-1] for t, rows in metrics.items() if rows}
    weights = max((int(r.get("mem/engine/held/params", 0)) + int(r.get("mem/engine/held/base", 0))
                   for r in last.values()), default=0)
    bandwidth = device["copy"]["bandwidth_bytes_per_s"]
    if weights:
        out["decode_bound_ms"] = 1e3 * weights / bandwidth
        if out.get("decode_ms_per_token_step") is not None:
            out["decode_over_bound"] = out["decode_ms_per_token_step"] / out["decode_bound_ms"]
    # train MFU over the TRAIN phase
    factor = (4 if run.lora else 6) + 2 + (2 if task.grpo.beta > 0 else 0)
    flops = {id(m): train_flops(factor, params, head, m["train/padded_tokens"], rows_per_task, task.grpo.max_new_tokens)
             for m in pooled if "train/padded_tokens" in m}
    if flops:
        out["train_flops_per_step"] = med(flops.values())
    peak, why = dense_peak(device["kind"], device["platform"])
    if peak is None:
        nulls["mfu"] = why
    elif flops:
        # tasks whose updates ran as one program (LoRA, train/cobatched) share the phase: the device did all theirs
        out["mfu"] = med(flops[id(m)] * m.get("train/cobatched", 1) / m["time/train_s"] / peak
                         for m in pooled if "train/padded_tokens" in m)
    # bytes: the allocator's peak, beside what the roles hold and what the plan counts
    held = sum(int(r.get(f"mem/{role}/held/{k}", 0)) for r in last.values()
               for role, kinds in (("actor", ("params", "opt", "ref")), ("engine", ("params",))) for k in kinds)
    held += sum({int(r[k]) for r in last.values() for k in r if k.endswith("/held/base")})  # a shared base once
    if last:
        out["held_bytes"] = held
        if any(k.endswith("/device0/bytes_limit") for r in last.values() for k in r):
            out["peak_device_bytes"] = max(int(r[k]) for r in last.values() for k in r
                                           if k.endswith("/device0/peak_bytes"))
        else:
            nulls["peak_device_bytes"] = ("the roles' process has no allocator statistics (device.memory_stats() "
                                          "is None: the CPU backend, or XLA's platform allocator); rlsched's "
                                          "probe sums live arrays at phase ends, which is not a peak")
    out["plan_bytes"], why = plan_bytes(cfg)
    if why:
        nulls["plan_bytes"] = why
    if weights and out.get("plan_bytes"):
        # The sampler's attention reads every slot of its KV cache (prompt bucket + new tokens) at every token-step,
        # filled or not: at GSM8K's setting those bytes are several times the weights'.
        out["decode_bound_kv_ms"] = 1e3 * (weights + out["plan_bytes"]["kv_cache"]) / bandwidth
    elif weights:
        nulls["decode_bound_kv_ms"] = "needs plan_bytes (see its reason)"
    if out.get("peak_device_bytes") and out.get("plan_bytes"):
        out["peak_over_held"] = out["peak_device_bytes"] / (held + out["plan_bytes"]["kv_cache"])
    elif "peak_device_bytes" in nulls or "plan_bytes" in nulls:
        nulls["peak_over_held"] = "needs peak_device_bytes and plan_bytes (see theirs)"
    out.update(aggregate(run, metrics, w, rows_per_task))
    if run.tasks == 1 and not run.lora and not run.warm and metrics and all(len(r) > w for r in metrics.values()):
        # what `rlsched simulate` projects the runs of several tasks from (`with_simulation`)
        from benchmarks import simulate as S

        out["profile"] = dataclasses.asdict(S.profile_from_metrics(next(iter(metrics.values())), warmup=w))
    return out, nulls


def plan_bytes(cfg) -> tuple[dict | None, str | None]:
    """`rlsched plan`'s bytes on device 0: what the roles hold, the largest engine KV cache and actor train phase
    (one of each at a time under the locks), and every role resident at once."""
    from rlsched.config.plan import device_plan

    try:
        plan = device_plan(cfg)
    except Exception as err:  # noqa: BLE001 - the plan is one figure among many
        return None, f"rlsched plan failed: {type(err).__name__}: {err}"
    on0 = [r for r in plan.roles if 0 in r.devices]
    kinds = {"actor": ("params", "optimizer", "reference"), "engine": ("params",), "base": ("params",)}
    held = sum(r.bytes.get(k, 0) for r in on0 for k in kinds.get(r.role, ()))
    kv = max((r.bytes.get("kv_cache", 0) for r in on0 if r.role == "engine"), default=0)
    train = max((r.bytes.get("grads", 0) + r.bytes.get("activations", 0) for r in on0 if r.role == "actor"), default=0)
    return dict(held=held, kv_cache=kv, train=train, one_phase_at_a_time=held + kv + train,
                every_role_resident=plan.per_device[0]), None


def aggregate(run: Run, metrics: dict[str, list[dict]], w: int, rows: int) -> dict:
    """Steps/s and samples/s of all tasks together in steady state: steps that end in the window where every
    task is past warmup and none has finished; in one process the tasks run one after another, so their
    steady spans add up."""
    ends = {t: [m["time/end_unix"] for m in r] for t, r in metrics.items() if len(r) > max(w, 1)}
    if len(ends) < run.tasks:
        return {}
    i = max(w, 1) - 1  # the end of the last warmup step (step 1's when there is none)
    if run.layout == "in_process":
        steps = sum(len(e) - 1 - i for e in ends.values())
        seconds = sum(e[-1] - e[i] for e in ends.values())
    else:
        start, stop = max(e[i] for e in ends.values()), min(e[-1] for e in ends.values())
        if stop <= start:
            return {}
        steps = sum(1 for e in ends.values() for x in e if start < x <= stop)
        seconds = stop - start
    return {"steps_per_s": steps / seconds, "samples_per_s": steps * rows / seconds}


# ---- the benchmark ------------------------------------------------------------------------------------------

def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def estimate_s(run: Run, done: list[dict]) -> float | None:
    """A run's seconds, from the most similar run done: its wall x tasks x steps (a LoRA task counted as a full
    one: conservative), or None before any run is done."""
    ok = [r for r in done if r["wall_s"] and not r["warm"]] or [r for r in done if r["wall_s"]]
    if not ok:
        return None
    ref = next((r for r in reversed(ok) if r["layout"] == run.layout), ok[-1])
    return ref["wall_s"] * (run.tasks * run.steps) / (ref["tasks"] * ref["steps"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.probe is not None:  # the probe's child: one JSON line
        print(json.dumps(probe_device(args.copy_mib, args.preset, args.dtype, args.probe)))
        return {}
    if args.check_attention is not None:  # the decode attention check's child: one JSON line
        print(json.dumps(check_decode_attention(args.check_attention, args.dtype, args.prompts * args.generations,
                                                args.prompt_len, args.new_tokens)))
        return {}
    t_start = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="rlsched-gpubench-"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "jax_cache", ignore_errors=True)  # the first run's cache is cold
    model = work / "models" / f"{args.preset}-{args.dtype}"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--probe", str(model), "--preset", args.preset,
                           "--dtype", args.dtype, *(["--copy-mib", str(args.copy_mib)] if args.copy_mib else [])],
                          env=child_env(), capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(f"the device probe failed:\n{done.stderr[-3000:]}")
    device = json.loads(done.stdout.strip().splitlines()[-1])
    env, dtype = device.pop("env"), device.pop("dtype")
    clock = {"probe_s": time.perf_counter() - t_start - device["model_s"], "model_s": device.pop("model_s"),
             "runs_s": 0.0}
    device["slug"] = slug(device["kind"])
    check = device["decode_attention"] = attention_check(args, model, dtype)
    if check.get("error") and args.decode_attention == "auto":  # the kernel fails here: the runs decode without it
        args.decode_attention = "xla"
        print(f"decode attention kernel ({check['impl']}) failed on this device, the runs use xla: {check['error']}",
              flush=True)
    device["dense_bf16_peak_flops"], why = dense_peak(device["kind"], device["platform"])
    device["nulls"] = {"dense_bf16_peak_flops": why} if why else {}
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu-{device['slug']}"
    params, head = count_params(model), head_params(model)
    print(f"device: {device['kind']} ({device['platform']}), copy bandwidth "
          f"{device['copy']['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, probe {clock['probe_s']:.1f} s; model: "
          f"{args.preset} ({params / 1e6:.1f}M params, {dtype}), {clock['model_s']:.1f} s", flush=True)
    runs = plan_runs(args)
    results = dict(args={k: str(v) for k, v in vars(args).items() if k not in ("probe", "check_attention")},
                   env=env, device=device,
                   model=dict(preset=args.preset, dtype=dtype, params=params, head_params=head),
                   flops_formula=FLOPS_FORMULA,
                   planned=[r.name for r in runs], runs=[], skipped=[], time=clock)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    save(out, results, t_start)  # the device and the model, before any run
    # a `timeout` of this command: save what was measured, stop the run in progress (the caller's handler after)
    before = signal.signal(signal.SIGTERM, interrupted)
    try:
        for i, run in enumerate(runs):
            elapsed = time.perf_counter() - t_start
            guess = estimate_s(run, results["runs"])
            if args.budget_s is not None and guess is not None and elapsed + guess > args.budget_s:
                results["skipped"].append(dict(run=run.name, why=f"estimated {guess:.0f} s; {elapsed:.0f} s of "
                                                                 f"--budget-s {args.budget_s:g} spent"))
                print(f"[{i + 1}/{len(runs)}] {run.name}: skipped ({results['skipped'][-1]['why']})", flush=True)
                continue
            print(f"[{i + 1}/{len(runs)}] {run.name}: starting" + (f" (estimated {guess:.0f} s)" if guess else ""),
                  flush=True)
            deadline = None if args.budget_s is None else t_start + args.budget_s
            results["runs"].append(measure(run, args, model=model, dtype=dtype, work=work, device=device,
                                           params=params, head=head, deadline=deadline,
                                           log=logs / f"{run.slug}.log"))
            clock["runs_s"] += results["runs"][-1]["wall_s"]
            print(progress(i, len(runs), results["runs"][-1]), flush=True)
            save(out, results, t_start)
    finally:
        signal.signal(signal.SIGTERM, before)
        save(out, results, t_start, final=True)
        print(where_time_went(results), flush=True)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return results


def measure(run: Run, args, *, model: Path, dtype: str, work: Path, device: dict, params: int, head: int,
            deadline: float | None, log: Path) -> dict:
    import yaml

    from rlsched.config.loading import load_configs

    path = work / f"{run.slug}.yaml"
    raw = experiment(run, args, model=model, dtype=dtype, work=work)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    overrides = [f"tasks.{i}.{o}" for i in range(run.tasks) for o in args.overrides]
    cfg = load_configs([path], overrides)
    cache = "warm" if any((work / "jax_cache").glob("*")) else "cold"
    code, launched, wall, stopped = launch(run, path, overrides, log, deadline)
    metrics, spans = read_run(cfg, run)
    status = "stopped at --budget-s" if stopped else ("ok" if code == 0 else f"failed (exit {code})")
    row = dict(name=run.name, layout=run.layout, tasks=run.tasks, lora=run.lora, steps=run.steps, warm=run.warm,
               cache=cache, status=status, wall_s=wall, steps_done={t: len(r) for t, r in metrics.items()},
               log=str(log))
    try:
        found, nulls = figures(run, cfg, metrics, spans, launched, device, params, args, head)
    except Exception as err:  # noqa: BLE001 - a bug in one run's reading must not lose the runs after it
        found, nulls = {}, {}
        row["figures_error"] = f"{type(err).__name__}: {err}"
        print(f"{run.name}: its figures could not be read: {row['figures_error']}", file=sys.stderr, flush=True)
    row.update(found)
    for field in FIELDS:
        if row.get(field) is None:
            row[field] = None
            nulls.setdefault(field, "not measured: " + ("the run failed, see its log" if code != 0 and not stopped
                                                        else "too few steps or tasks in this run for it"))
    row["nulls"] = {k: v for k, v in nulls.items() if row.get(k) is None}
    if code != 0 and not stopped:
        print(f"{run.name}: failed; the end of {log}:\n" + "".join(log.read_text().splitlines(True)[-30:]),
              file=sys.stderr, flush=True)
    return row


def with_ratios(runs: list[dict]) -> list[dict]:
    """Each run's aggregate against one full-weight task in its layout."""
    one = {r["layout"]: r for r in runs if r["tasks"] == 1 and not r["lora"] and not r["warm"] and r["steps_per_s"]}
    for r in runs:
        base = one.get(r["layout"])
        if base and r["steps_per_s"] and not r["lora"]:
            r["steps_per_s_x_one"] = r["steps_per_s"] / base["steps_per_s"]
            r["nulls"].pop("steps_per_s_x_one", None)
        if base and r["samples_per_s"]:
            r["samples_per_s_x_one_full"] = r["samples_per_s"] / base["samples_per_s"]
            r["nulls"].pop("samples_per_s_x_one_full", None)
    return runs


def with_simulation(runs: list[dict]) -> list[dict]:
    """Each run of N > 1 full-weight tasks under Ray beside what benchmarks.simulate predicts for it from one task's
    profile in that layout (SIMULATE says how): simulated_steps_per_s and simulate_error."""
    from benchmarks import simulate as S

    one = {r["layout"]: r for r in runs
           if r["tasks"] == 1 and not r["lora"] and not r["warm"] and r.get("profile")}
    for r in runs:
        base = one.get(r["layout"])
        why = ("LoRA and warm reruns are not checked against the simulator" if r["lora"] or r["warm"] else
               "one task alone is the profile the others are simulated from" if r["tasks"] < 2 else
               "several tasks in one process run one after another: nothing for the scheduler to overlap"
               if r["layout"] == "in_process" else None)
        if why:
            r["nulls"].update({k: why for k in ("simulated_steps_per_s", "simulate_error") if r[k] is None})
            continue
        if base is None or not r["steps_per_s"]:
            r["nulls"].update({k: "needs this run's steady steps/s and one full-weight task alone in the same layout "
                                  "(its profile)" for k in ("simulated_steps_per_s", "simulate_error")})
            continue
        r["simulated_steps_per_s"] = S.simulate(S.PhaseProfile(**base["profile"]), r["tasks"], placement="colocated",
                                                steps=SIMULATE_STEPS).steps_per_s
        r["simulate_error"] = (r["simulated_steps_per_s"] - r["steps_per_s"]) / r["steps_per_s"]
        for key in ("simulated_steps_per_s", "simulate_error"):
            r["nulls"].pop(key, None)
    return runs


def save(out: Path, results: dict, t_start: float, *, final: bool = False) -> None:
    """results.json and report.md, each atomically; the report is printed at the end only."""
    results["runs"] = with_simulation(with_ratios(results["runs"]))
    results["goals"] = goals(results["runs"])
    results["time"]["total_s"] = time.perf_counter() - t_start
    results["timestamp"] = datetime.now(UTC).isoformat(timespec="seconds")
    title = f"rlsched on {results['device']['kind']}"
    if final:
        save_results(out, title, results, report(results))
        return
    write_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    write_atomic(out / "report.md", f"# {title}\n\n{report(results)}\n")


def goals(runs: list[dict]) -> list[dict]:
    """Issue 40's goals, each {goal, measured, met}: met None where no run here measures it."""
    def pick(pred):
        return [r for r in runs if pred(r)]

    def row(goal: str, values: list[tuple[str, float | None]], ok, unit: str = "") -> dict:
        known = [(n, v) for n, v in values if v is not None]
        return dict(goal=goal, measured={n: v for n, v in known}, unit=unit,
                    met=all(ok(v) for _, v in known) if known else None)

    one = pick(lambda r: r["tasks"] == 1 and not r["lora"] and not r["warm"])
    ray = pick(lambda r: r["layout"] == "per_device_group" and not r["lora"] and not r["warm"])
    multi = pick(lambda r: not r["lora"] and r["tasks"] > 1 and r["layout"] == "per_device_group")
    cold, warm = pick(lambda r: r["cache"] == "cold"), pick(lambda r: r["warm"])
    lora8 = pick(lambda r: r["lora"] and r["tasks"] == 8)
    return [
        row("weight sync in a device group's process <= 10 ms per task, alone and beside another task's train",
            [(r["name"], r["sync_s_max_task"]) for r in ray], lambda v: v <= GOAL["sync_s"], "s"),
        row("decode <= 1.5 ms per token-step at batch 128",
            [(r["name"], r["decode_ms_per_token_step"]) for r in one], lambda v: v <= GOAL["decode_ms"], "ms"),
        row("train >= 45 % of the dense bf16 peak", [(r["name"], r["mfu"]) for r in one],
            lambda v: v >= GOAL["mfu"]),
        row("peak device bytes <= 1.25 x (held bytes + the engine's KV cache)",
            [(r["name"], r["peak_over_held"]) for r in runs if not r["warm"]], lambda v: v <= GOAL["peak_over_held"]),
        row("first step <= 30 s from a cold cache (launch -> step 1)",
            [(r["name"], r["launch_to_first_step_s"]) for r in cold], lambda v: v <= GOAL["cold_s"], "s"),
        row("first step <= 10 s warm (launch -> step 1)", [(r["name"], r["launch_to_first_step_s"]) for r in warm],
            lambda v: v <= GOAL["warm_s"], "s"),
        row("no compile after step 1 in a steady run", [(r["name"], r["compiles_after_step1"]) for r in runs],
            lambda v: v == 0),
        row("N full-weight tasks: aggregate steps/s >= 1.2 x one task's at N = 2 and 4",
            [(r["name"], r["steps_per_s_x_one"]) for r in multi], lambda v: v >= GOAL["speedup"], "x"),
        row("no task's sync, onload or offload above 2 % of its step (N full-weight tasks)",
            [(r["name"], max((r["switch_share"] or {}).get(k, 0) for k in ("sync_weights", "onload", "offload"))
              if r["switch_share"] else None) for r in multi], lambda v: v <= GOAL["switch_share"]),
        row("8 LoRA tasks reach step 1 within 60 s (launch -> every task's step 1)",
            [(r["name"], r["launch_to_every_first_step_s"]) for r in lora8], lambda v: v <= GOAL["lora_first_s"], "s"),
        row("32 LoRA tasks run", [(r["name"], float(r["status"] == "ok")) for r in pick(
            lambda r: r["lora"] and r["tasks"] == 32)], lambda v: v == 1.0),
        row("aggregate samples/s of 8 LoRA tasks >= 4 x one full-weight task's",
            [(r["name"], r["samples_per_s_x_one_full"]) for r in lora8], lambda v: v >= GOAL["lora_samples_x"], "x"),
        row("`rlsched simulate`, fed one task's profile, predicts N = 2 and 4 within 10 % (steps/s error)",
            [(r["name"], r.get("simulate_error")) for r in multi], lambda v: abs(v) <= GOAL["simulate_error"]),
    ]


def report(results: dict) -> str:
    d, m = results["device"], results["model"]

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    gib = 2**30
    a = results["args"]
    lines = [
        f"{d['kind']} ({d['platform']}, {d['count']} device(s)); {m['preset']} shape, random weights, "
        f"{m['params'] / 1e6:.1f}M params, {m['dtype']}; GSM8K chat prompts, {a['prompts']} prompts x "
        f"{a['generations']} generations, "
        f"{a['new_tokens']} new tokens, prompts up to {a['prompt_len']}, beta {a['beta']}, micro-batch "
        f"{a['micro_batch']}; {a['steps']} steps per task, medians past {a['warmup_steps']} warmup steps "
        f"({results['timestamp']}). Copy bandwidth {d['copy']['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
        f"({d['copy']['bytes'] / 2**20:.0f} MiB read + written); dense bf16 peak "
        + (f"{d['dense_bf16_peak_flops']:.3g} FLOP/s" if d["dense_bf16_peak_flops"] else
           f"unknown: {d['nulls']['dense_bf16_peak_flops']}") + ".", "", attention_line(d["decode_attention"], a),
        "", "| run | cache | status | launch -> step 1 s | step 1 s (compile) | compiles after step 1 | step s | "
        "rollout s (sync + generate) | train s | decode ms/step (bound, x) | tokens/s | MFU | peak GiB | held GiB "
        "(+ KV plan) | steps/s (x one) | samples/s (x one full) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        sp, plan = r["spans_s"] or {}, r["plan_bytes"] or {}
        lines.append(
            f"| {r['name']} | {r['cache']} | {r['status']} | {f(r['launch_to_first_step_s'], '{:.1f}')} | "
            f"{f(r['first_step_s'], '{:.1f}')} ({f(r['first_step_compile_s'], '{:.1f}')}) | "
            f"{f(r['compiles_after_step1'], '{:d}')} | {f(r['step_s'])} | {f(r['rollout_s'])} "
            f"({f(sp.get('sync_weights'), '{:.3f}')} + {f(sp.get('generate'))}) | {f(r['train_s'])} | "
            f"{f(r['decode_ms_per_token_step'])} ({f(r['decode_bound_ms'], '{:.3f}')}, "
            f"{f(r['decode_over_bound'], '{:.1f}')}) | {f(r['generated_tokens_per_s'], '{:,.0f}')} | "
            f"{f(r['mfu'], '{:.1%}')} | {f(r['peak_device_bytes'] and r['peak_device_bytes'] / gib)} | "
            f"{f(r['held_bytes'] and r['held_bytes'] / gib)} (+{f(plan.get('kv_cache', 0) / gib)}) | "
            f"{f(r['steps_per_s'], '{:.3f}')} ({f(r['steps_per_s_x_one'])}) | {f(r['samples_per_s'], '{:.1f}')} "
            f"({f(r['samples_per_s_x_one_full'])}) |")
    lines += ["", "Before step 1, besides its compiles (the slowest task's start and its roles' parts of it, s): "
              + "; ".join(f"{r['name']} ({r['cache']}): " + ", ".join(f"{k} {v:.2f}" for k, v in r["startup_s"].items())
                          for r in results["runs"] if r["startup_s"])]
    lines += ["", "Where a steady step goes (medians, s): "
              + "; ".join(f"{r['name']}: " + ", ".join(f"{k} {v:.3f}" for k, v in (r["spans_s"] or {}).items() if v)
                          + f", lock waits {f(r['lock_wait_s'], '{:.3f}')}, reward {f(r['reward_s'], '{:.3f}')}"
                          for r in results["runs"] if r["spans_s"]),
              "", f"MFU: {results['flops_formula']}; over the TRAIN phase's seconds (time/train_s: log-probs, update, "
              "publish). Decode: the generate span / grpo.max_new_tokens token-steps (prefill included); its bound: "
              "the engine's weight bytes read once per token-step at the copy's bandwidth (decode_bound_kv_ms in "
              "results.json: with the whole KV cache, which XLA's attention reads at every token-step; the decode "
              "attention kernel reads a row's filled slots). Peak: the allocator's peak_bytes_in_use in the roles' "
              "process; held: what the roles hold between phases (params, optimizer, reference, the engine's params; "
              "a shared base once); KV plan: `rlsched plan`'s largest engine KV cache.",
              "", "| goal (issue 40) | measured | verdict |", "|---|---|---|"]
    for g in results["goals"]:
        measured = ", ".join(f"{n} {v:.4g}{g['unit'] and ' ' + g['unit']}" for n, v in g["measured"].items())
        verdict = {True: "met", False: "NOT met", None: "not measured here"}[g["met"]]
        lines.append(f"| {g['goal']} | {measured or '-'} | {verdict} |")
    lines.append("| LoRA tasks' metrics equal their runs alone | - | not measured here (tests/test_lora_*.py) |")
    checked = [r for r in results["runs"] if r["simulate_error"] is not None]
    lines += ["", f"Simulated: {SIMULATE}."]
    lines += (["", "| run | measured steps/s | simulated steps/s | error |", "|---|---:|---:|---:|"]
              + [f"| {r['name']} | {f(r['steps_per_s'], '{:.3f}')} | {f(r['simulated_steps_per_s'], '{:.3f}')} | "
                 f"{f(r['simulate_error'], '{:+.1%}')} |" for r in checked]
              if checked else [" No run here to check it against (N > 1 full-weight tasks under Ray)."])
    nulls = [f"- {r['name']}: " + "; ".join(f"{k}: {v}" for k, v in r["nulls"].items()) for r in results["runs"]
             if r["nulls"]]
    if nulls:
        lines += ["", "Not measured (null in results.json), and why:", *nulls]
    if results["skipped"]:
        lines += ["", "Runs not started (--budget-s):", *(f"- {s['run']}: {s['why']}" for s in results["skipped"])]
    lines += ["", "```", where_time_went(results), "```"]
    return "\n".join(lines)


def attention_line(check: dict, args: dict) -> str:
    """The probe's check of the decode attention kernel, in words."""
    shape = check["shape"]
    at = ("its shape unknown" if shape is None else
          f"{shape['rows']} rows x {shape['kv_heads']} KV heads x {shape['groups']} query heads each, "
          f"{shape['slots']} slots of {shape['head_dim']}")
    if check.get("error"):
        return (f"Decode attention kernel ({check['impl']}), {at}: failed on this device ({check['error']}); the "
                f"runs decoded with `{args.get('decode_attention')}`.")
    timing = ("" if check["impl"] != "pallas" else
              f"; {check['kernel_ms']:.3f} ms reading {check['kernel_read_bytes'] / 2**20:.0f} MiB "
              f"({check['kernel_bytes_per_s'] / 1e9:.0f} GB/s) vs XLA's attention over every slot "
              f"{check['xla_ms']:.3f} ms")
    tilings = "; ".join(f"block {t['block']} x {t['num_warps']} warps " + (f"{t['ms']:.3f} ms" if "ms" in t else
                                                                            f"failed ({t['error']})")
                        for t in check.get("tilings", []))
    return (f"Decode attention kernel ({check['impl']}), {at}, mid-generation: max |kernel - XLA's| "
            f"{check['max_abs_diff']:.2e}{timing}" + (f" (other tilings: {tilings})" if tilings else "")
            + f"; the runs decoded with `{args.get('decode_attention')}`.")


def progress(i: int, n: int, r: dict) -> str:
    def s(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    spans = r["spans_s"] or {}
    return (f"[{i + 1}/{n}] {r['name']} ({r['cache']} cache): {r['status']}, wall {r['wall_s']:.1f} s, step 1 at "
            f"{s(r['launch_to_first_step_s'], '{:.1f}')} s; steady step {s(r['step_s'])} s = rollout "
            f"{s(r['rollout_s'])} (sync {s(spans.get('sync_weights'), '{:.3f}')} generate "
            f"{s(spans.get('generate'))}) + train {s(r['train_s'])}; decode {s(r['decode_ms_per_token_step'])} ms/step "
            f"(bound {s(r['decode_bound_ms'])}), MFU {s(r['mfu'], '{:.1%}')}, {s(r['steps_per_s'], '{:.3f}')} steps/s")


def where_time_went(results: dict) -> str:
    t = results["time"]
    lines = [f"time: {t.get('total_s', 0):.1f} s in all = probe {t['probe_s']:.1f} + model {t['model_s']:.1f} + runs "
             f"{t['runs_s']:.1f} (+ reading and writing)"]
    for r in results["runs"]:
        first = r["launch_to_first_step_s"]
        lines.append(f"  {r['name']}: {r['wall_s']:.1f} s" + (
            "" if first is None else f" = {first:.1f} to step 1 + {r['wall_s'] - first:.1f} steps and exit"))
    lines += [f"  skipped {s['run']}: {s['why']}" for s in results["skipped"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
