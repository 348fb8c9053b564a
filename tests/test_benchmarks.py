"""Benchmarks cannot rot: each one's smallest setting runs end to end and saves its results.

The figures are not checked here (speed goals are met in the benchmarks themselves, not in timed
tests); what is checked is that every benchmark still runs against today's code and writes
results.json and report.md. A benchmark added to benchmarks/ without a row here fails the last test.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# A step of a few samples and tokens: what runs here is the benchmark's code, not its figures.
TINY_STEP = [a for kv in ("grpo.prompts_per_step=2", "grpo.num_generations=2", "grpo.max_new_tokens=2",
                          "grpo.mini_batch_size=4", "rollout.max_batch_size=4") for a in ("--set", kv)]
# module -> (its smallest setting, a key its results.json must have)
SMALLEST = {
    "rollout": (["--batch", "1", "--prompt-len", "4", "--new-tokens", "2", "--repeats", "1"], "engines"),
    "train_step": (["--steps", "1", "--warmup-steps", "1", "--prompts", "2", "--generations", "2",
                    "--new-tokens", "2"], "ratio"),
    "multitask": (["--steps", "3", "--warmup-steps", "1", "--round-trips", "5", "--solo-once", *TINY_STEP],
                  "speedup_steady"),
    "bench": (["--tasks", "1", "--placement", "colocated", "--steps", "4", "--warmup", "1"], "placements"),
    "simulate": (["--tasks", "1,2", "--steps", "2"], None),
    # one Ray layout: per_role's run goes through the same loop (tests/test_restarts.py runs that layout)
    "overhead": (["--steps", "3", "--warmup-steps", "1", "--repeats", "1", "--no-settle", "--layouts",
                  "per_device_group", *TINY_STEP], "overhead_ms"),
    "checkpoint": (["--steps", "2", "--warmup-steps", "1", "--preset", "tiny", *TINY_STEP], "runs"),
    # in_process first: the untimed first run (models, compile cache) is then the one without a Ray to start
    "footprint": (["--steps", "2", "--repeats", "1", "--layouts", "in_process", "per_device_group", *TINY_STEP],
                  "median"),
    # one restart run: the actor's goes through the same code as the engine's (tests/test_restarts.py kills both)
    "startup": (["--tasks", "1", "--steps", "2", "--repeats", "1", "--restart-roles", "engine", *TINY_STEP],
                "restart_s"),
    # room for both tasks' rows in one rollout (TINY_STEP's batch holds one task's)
    "lora": (["--tasks", "1,2", "--steps", "2", "--warmup-steps", "0", *TINY_STEP, "--set", "rollout.max_batch_size=8"],
             "goals"),
    "cobatch": (["--tasks", "1,3", "--prompts", "2", "--n", "2", "--prompt-len", "8", "--new-tokens", "4",
                 "--repeats", "1"], "runs"),
    "cotrain": (["--tasks", "1,3", "--rows", "2", "--prompt-len", "4", "--completion-len", "4", "--steps", "1"],
                "runs"),
    # one tiny task in one process, from a cold compile cache and again warm; every field written (null: why)
    "gpu": (["--preset", "tiny", "--tasks", "1", "--lora", "none", "--layouts", "in_process", "--steps", "3",
             "--warmup-steps", "1", "--prompts", "2", "--generations", "2", "--new-tokens", "2", "--prompt-len", "32",
             "--micro-batch", "4", "--copy-mib", "8"], "runs"),
    # the present backend (the CPU): what CI can run; --target h100 needs the CUDA plugin (its docstring)
    "gpu_memory": (["--preset", "tiny", "--vocab-size", "256", "--micro-batch", "2", "--accumulate", "1,2",
                    "--prompt-len", "8", "--new-tokens", "8", "--target", "present"], "runs"),
    # two points of the small grid on the present backend (the CPU): XLA:CPU's compiles and the plan's --backend cpu
    "plan_fit": (["--target", "present", "--grid", "small", "--points", "2"], "summary"),
    "decode_cost": (["--preset", "tiny", "--vocab-size", "256", "--batch", "4", "--prompt-len", "8", "--new-tokens",
                     "8", "--target", "present"], "step"),
    "compile_cost": (["--preset", "tiny", "--vocab-size", "256", "--batch", "4", "--micro-batch", "2",
                      "--prompt-len", "8", "--new-tokens", "8", "--target", "present"], "ways"),
    "sharding": (["--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "2", "--kv-heads", "2",
                  "--vocab", "256", "--fsdp", "1,2", "--repeats", "1"], "weight_sync"),
}
NOT_BENCHMARKS = {"__init__", "common"}
# Benchmarks run end to end by a test of their own, which checks their results and files: not run twice.
ELSEWHERE = {"soak": "tests/test_soak.py (18 cycles: its verdict, results.json, report.md and soak.png)"}


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_benchmark_runs_at_its_smallest_setting(name, ray_session, tmp_path):
    argv, key = SMALLEST[name]
    importlib.import_module(f"benchmarks.{name}").main([*argv, "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "report.md").read_text().strip()
    if key is not None:
        assert key in results, f"benchmarks/{name}.py results.json lacks {key!r}: {sorted(results)}"
    if name in DEEPER:
        DEEPER[name](results, tmp_path)


def check_lora(results: dict, out: Path) -> None:
    """benchmarks/lora.py: every run's figures are there, and its bytes are `rlsched plan`'s for the config it ran
    (bytes are deterministic; timings are not checked), run here as a user runs it, through the CLI."""
    import subprocess
    import sys

    runs = results["runs"]
    assert set(runs) == {"lora-1", "full-1", "lora-2", "full-2"}
    # the four `rlsched plan` processes at once: each is mostly its imports, on a core of its own where there is one
    plans = {name: subprocess.Popen([sys.executable, "-m", "rlsched.cli", *r["plan_command"], "--json"], cwd=out,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, r in runs.items()}
    for name, r in runs.items():
        assert r["samples_per_s"] > 0 and r["step_s"] > 0, (name, r)
        stdout, stderr = plans[name].communicate(timeout=120)
        assert plans[name].returncode == 0, stderr[-2000:]
        plan = json.loads(stdout)
        kinds = {"actor": ("params", "optimizer", "reference"), "engine": ("params",), "base": ("params",)}
        held = sum(role["bytes"].get(k, 0) for role in plan["roles"] for k in kinds[role["role"]])
        assert r["bytes_planned"]["total"] == held
        assert r["bytes_planned"]["every_role_resident"] == plan["per_device"][0]
        train = max(a["bytes"].get("grads", 0) + a["bytes"].get("activations", 0) for a in plan["roles"]
                    if a["role"] == "actor")  # one task trains at a time, one rolls out
        kv = max(e["bytes"]["kv_cache"] for e in plan["roles"] if e["role"] == "engine")
        assert r["bytes_planned"]["one_phase_at_a_time"] == held + train + kv
        assert r["bytes_measured"]["total"] == held, (name, r["bytes_measured"], held)  # what the roles hold, measured
    one, two = runs["lora-1"]["bytes_measured"], runs["lora-2"]["bytes_measured"]
    assert two["bases"] == one["bases"] > 0 and two["tasks"] == 2 * one["tasks"]  # the base once, an adapter per task
    assert runs["full-1"]["bytes_measured"]["bases"] == 0
    assert runs["full-2"]["bytes_measured"]["total"] == 2 * runs["full-1"]["bytes_measured"]["total"]
    for goal in ("throughput", "step_time", "bytes"):
        assert isinstance(results["goals"][goal]["met"], bool) and results["goals"][goal]["ratio"] > 0
    assert results["goals"]["bytes"]["ratio"] == two["total"] / runs["full-1"]["bytes_measured"]["total"]
    for name in ("lora-1", "lora-2"):  # tasks whose rows ran together, per step: at most the run's tasks
        assert 1 <= runs[name]["cobatched"] <= runs[name]["tasks"], runs[name]["cobatched"]
        assert 1 <= runs[name]["cotrained"] <= runs[name]["tasks"], runs[name]["cotrained"]
    assert "tasks per rollout | tasks per train" in (out / "report.md").read_text()


def check_cobatch(results: dict, out: Path) -> None:
    """benchmarks/cobatch.py: on CPU in float32 a task's co-batched samples are the ones it draws alone, every one."""
    runs = {r["tasks"]: r for r in results["runs"]}
    assert set(runs) == {1, 3} and runs[3]["cobatched_reported"] == 3 and runs[3]["samples"] == 3 * 4
    assert all(r["identical_samples"] == 1.0 and r["speedup"] > 0 for r in runs.values()), runs


def check_cotrain(results: dict, out: Path) -> None:
    """benchmarks/cotrain.py: one task "co-batched" trains alone (the same adapter, to the bit); three share one
    program and land within float rounding of training alone (docs/lora.md)."""
    runs = {r["tasks"]: r for r in results["runs"]}
    assert set(runs) == {1, 3} and runs[3]["cobatched_reported"] == [3] and runs[1]["cobatched_reported"] == [1]
    assert runs[1]["apart"] == {"norm": 0.0, "element": 0.0}, runs[1]
    assert 0 < runs[3]["apart"]["norm"] < 1e-2 and runs[3]["speedup"] > 0, runs[3]


def check_gpu(results: dict, out: Path) -> None:
    """benchmarks/gpu.py: a cold run and its warm rerun, each with every field, a null only with its reason; the
    figures a CPU can give are there and add up (the FLOP formula from the run's own metrics)."""
    from benchmarks.gpu import FIELDS

    cold, warm = results["runs"]
    assert (cold["name"], cold["cache"], warm["name"], warm["cache"]) == (
        "in_process/full-1", "cold", "in_process/full-1/warm", "warm"), (cold["name"], warm["name"])
    for r in (cold, warm):
        assert r["status"] == "ok" and set(FIELDS) <= r.keys(), (r["status"], set(FIELDS) - r.keys())
        assert all(r["nulls"].get(k) for k in FIELDS if r[k] is None), (r["nulls"], [k for k in FIELDS if r[k] is None])
        assert r["launch_to_first_step_s"] > r["first_step_s"] >= r["first_step_compile_s"] > 0
        assert "CPU" in r["nulls"]["mfu"] and "memory_stats" in r["nulls"]["peak_device_bytes"]  # a CPU has neither
    assert cold["steady_steps"] == 2 and cold["compiles_after_step1"] == 0  # steps 2-3; shapes seen at step 1
    # before step 1: the task's start, its roles' imports, devices, model and worker within it (in process: one of each)
    for r in (cold, warm):
        start = r["startup_s"]
        assert {"start", "imports", "devices", "load_model", "build_worker", "make_engine"} <= start.keys(), start
        assert r["launch_to_first_step_s"] > start["start"] >= start["load_model"] + start["make_engine"] > 0, start
    assert "Before step 1, besides its compiles" in (out / "report.md").read_text()
    assert cold["rollout_s"] >= cold["spans_s"]["sync_weights"] + cold["spans_s"]["generate"] > 0
    params = results["model"]["params"]  # the checkpoint's, from its safetensors headers
    bandwidth = results["device"]["copy"]["bandwidth_bytes_per_s"]
    assert cold["decode_bound_ms"] == pytest.approx(1e3 * params * 4 / bandwidth)  # float32 weights, read once
    kv = cold["plan_bytes"]["kv_cache"]  # with the whole KV cache, which the attention reads every token-step
    assert kv > 0 and cold["decode_bound_kv_ms"] == pytest.approx(1e3 * (params * 4 + kv) / bandwidth)
    # (6 + 2 + 2) x ((N - H V) x rows x padded length + H V x rows x 2 new tokens), beta > 0: the output head (the
    # tiny preset's hidden 64 x vocabulary 384) on each row's completion window only; a whole number of padded
    # lengths of 4 rows each
    head = results["model"]["head_params"]
    assert head == 64 * 384
    padded = (cold["train_flops_per_step"] / 10 - head * 4 * 2) / (params - head)
    assert padded == pytest.approx(round(padded)) and round(padded) % 4 == 0 and 4 * 32 < padded <= 4 * 64, padded
    assert cold["steps_per_s_x_one"] == 1.0 and cold["samples_per_s"] == pytest.approx(4 * cold["steps_per_s"])
    goals = {g["goal"]: g["met"] for g in results["goals"]}
    assert goals["no compile after step 1 in a steady run"] is True and None in goals.values()
    assert "| goal (issue 40) | measured | verdict |" in (out / "report.md").read_text()
    # the decode attention kernel checked on the device, in a process of its own (the CPU: under the interpreter,
    # against XLA's attention at the engine's 4 rows x 34 slots); the runs took the default
    check = results["device"]["decode_attention"]
    assert check["impl"] == "interpret" and "error" not in check and check["shape"]["slots"] == 32 + 2, check
    assert check["max_abs_diff"] < 1e-5 and check["kernel_ms"] is None, check  # the interpreter's time: no figure
    assert results["args"]["decode_attention"] == "auto"
    assert "Decode attention kernel (interpret), 4 rows x 1 KV heads" in (out / "report.md").read_text()


def test_the_gpu_benchmark_checks_the_simulator_against_its_runs_of_several_tasks_under_ray():
    """benchmarks/gpu.py's `with_simulation`: a run of N full-weight tasks under Ray beside benchmarks.simulate fed
    one task's profile in that layout. Hand-computed: colocated, both phases 1 s at half speed when they overlap (the
    device saturated), two tasks do 2 s of device work a step at speed 1 at most: 0.5 steps/s."""
    import dataclasses

    from benchmarks.gpu import with_simulation
    from benchmarks.simulate import PhaseProfile

    profile = PhaseProfile(rollout_s=1.0, train_s=1.0, reward_s=0.1, host_s=0.2, lock_rtt_s=0.0)

    def run(layout, tasks, **kw):
        return dict(name=f"{layout}/full-{tasks}", layout=layout, tasks=tasks, lora=False, warm=False, nulls={},
                    steps_per_s=0.4, simulated_steps_per_s=None, simulate_error=None) | kw

    runs = with_simulation([run("per_device_group", 1, profile=dataclasses.asdict(profile)),
                            run("per_device_group", 2), run("in_process", 2), run("per_device_group", 8, lora=True),
                            run("in_process", 1)])
    one, two, inside, lora, alone = runs
    assert two["simulated_steps_per_s"] == pytest.approx(0.5, rel=0.02)
    assert two["simulate_error"] == (two["simulated_steps_per_s"] - 0.4) / 0.4 and not two["nulls"]
    for r, why in ((one, "the profile"), (alone, "the profile"), (inside, "one after another"), (lora, "LoRA")):
        assert r["simulate_error"] is None and why in r["nulls"]["simulate_error"], r["nulls"]


def check_startup(results: dict, out: Path) -> None:
    """benchmarks/startup.py: the restart run asked for, and only it, measured a restart (a completed step after
    the kill)."""
    assert set(results["restart_s"]) == {"engine"} and results["restart_s"]["engine"] > 0, results["restart_s"]
    assert "restart cost (seconds from SIGKILL to the next completed step): engine " in (out / "report.md").read_text()


def check_gpu_memory(results: dict, out: Path) -> None:
    """benchmarks/gpu_memory.py builds the actor's two programs itself (from abstract shapes, for a device it may
    not have): on the present backend their memory analysis is, byte for byte, that of the programs
    workers.actor.ActorWorker compiles for the same config."""
    from flax import nnx

    from benchmarks import gpu_memory
    from rlsched.config.spec import actor_settings
    from workers.actor import ActorWorker
    from workers.models.decoder import CausalLM
    from workers.models.presets import preset_config

    args = gpu_memory.parse_args(SMALLEST["gpu_memory"][0])
    for run in results["runs"]:
        spec = gpu_memory.task_config(args, run["accumulate"]).task_specs()[0]
        model = CausalLM(preset_config(args.preset, dtype=args.dtype, vocab_size=args.vocab_size), rngs=nnx.Rngs(0))
        worker = ActorWorker(model, actor_settings(spec.config))
        worker.prepare(spec.plan.mini_batch_size, run["positions"])
        for kind, name in (("train", "gradient"), ("update", "update")):
            (program,) = [p for key, p in worker._prepared.items() if key[0] == kind]
            m = program.memory_analysis()
            assert (m.temp_size_in_bytes, m.output_size_in_bytes) == \
                (run[name]["temp_bytes"], run[name]["output_bytes"]), (run["accumulate"], name)
        assert run["plan"]["activations"] > 0 and run["gradient"]["temp_bytes"] > 0


def check_plan_fit(results: dict, out: Path) -> None:
    """benchmarks/plan_fit.py: every point's fields written, and its ratio is rlsched.config.plan.actor_bytes of the
    point's config (XLA:CPU's count) over what the programs it compiled allocate, recomputed here from their bytes."""
    from benchmarks import plan_fit
    from rlsched.config.plan import actor_bytes

    runs = results["runs"]
    assert results["backend"] == "cpu" and [r["name"] for r in runs] == [p.name for p in plan_fit.SMALL[:2]]
    for run, point in zip(runs, plan_fit.SMALL, strict=False):
        assert all(run[k] is not None for k in (*plan_fit.Point.__dataclass_fields__, "positions", "layers",
                                                "vocab_size", "allocated_bytes", "ratio")), run
        for program in ("gradient", "update"):
            assert set(run[program]) >= {"temp_bytes", "output_bytes", "argument_bytes", "peak_bytes", "compile_s"}
        assert run["gradient"]["temp_bytes"] > 0 and run["gradient"]["output_bytes"] > 0
        allocated = max(run["gradient"]["temp_bytes"], run["update"]["temp_bytes"]) + run["gradient"]["output_bytes"]
        assert run["allocated_bytes"] == allocated
        plan = actor_bytes(*plan_fit.point_config(point), backend="cpu")
        assert run["plan"] == {"grads": plan["grads"], "activations": plan["activations"]}
        assert run["ratio"] == (plan["grads"] + plan["activations"]) / allocated
    ratios = [r["ratio"] for r in runs]
    assert results["summary"]["min"] == min(ratios) and results["summary"]["max"] == max(ratios)
    assert results["summary"]["within_10_percent"] == sum(abs(r - 1) <= 0.10 for r in ratios)
    assert f"over {len(runs)} points: min {min(ratios):.3f}" in (out / "report.md").read_text()


def check_decode_cost(results: dict, out: Path) -> None:
    """benchmarks/decode_cost.py compiles the sampler's own generate program: its memory analysis is, byte for
    byte, that of the program JaxSampler.prepare compiles for the same shapes; a decode step reads the weights at
    least once, and the KV cache it reads is the filled slots' at least (both summed from the loop body's ops)."""
    from flax import nnx

    from benchmarks import decode_cost
    from workers.models.decoder import CausalLM
    from workers.models.presets import preset_config
    from workers.rollout.base import SamplingParams
    from workers.rollout.jax_sampler import JaxSampler

    args = decode_cost.parse_args(SMALLEST["decode_cost"][0])
    config = preset_config(args.preset, dtype=args.dtype, vocab_size=args.vocab_size)
    engine = JaxSampler(CausalLM(config, rngs=nnx.Rngs(0)), max_prompt_len=args.prompt_len,
                        max_new_tokens=args.new_tokens, max_batch_size=args.batch, prompt_padding="max")
    params = SamplingParams(n=args.batch, max_new_tokens=args.new_tokens, temperature=0.9, stop_token_ids=(1,))
    assert engine.prepare([[5, 6, 7]], params) == 1
    (program,) = engine._executables.values()
    m = program.memory_analysis()
    assert (m.temp_size_in_bytes, m.argument_size_in_bytes) == \
        (results["memory"]["temp_bytes"], results["memory"]["argument_bytes"])
    kv = decode_cost.kv_bytes(config, args.batch, args.prompt_len + args.new_tokens)
    # (B, slots, K heads, head dim) keys and values of every layer
    assert kv == 2 * config.num_hidden_layers * args.batch * 16 * config.num_key_value_heads * config.head_dim * \
        (2 if args.dtype == "bfloat16" else 4)
    assert results["step"]["bytes"] >= results["weight_bytes"] + results["kv_filled_mean_bytes"]
    assert results["step_by_source"] and results["program_cost"]["bytes accessed"] > 0  # XLA:CPU gives a cost


def test_decode_cost_on_a_mesh_counts_one_devices_bytes(tmp_path):
    """benchmarks/decode_cost.py --mesh dp=2,tp=2 (4 CPU devices; the tiny model's one KV head whole on each tp
    device): one device's KV cache is half the rows', its weights the tp shard of the projections and the vocabulary
    (the norms and the k/v projections whole), and the program's collectives are counted; a mesh it cannot take is
    refused by name."""
    import math

    from flax import nnx

    from benchmarks import decode_cost
    from workers.models.decoder import CausalLM
    from workers.models.presets import preset_config

    argv = [*SMALLEST["decode_cost"][0], "--out", str(tmp_path)]
    results = decode_cost.main([*argv, "--mesh", "dp=2,tp=2"])
    args = decode_cost.parse_args(argv)
    config = preset_config(args.preset, dtype=args.dtype, vocab_size=args.vocab_size)
    slots = args.prompt_len + args.new_tokens
    assert results["mesh"]["devices"] == 4 and results["mesh"]["shape"]["tp"] == 2
    assert results["kv_cache_bytes"] == decode_cost.kv_bytes(config, args.batch, slots) // 2
    assert config.num_key_value_heads == 1
    state = nnx.state(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
    flat = {".".join(str(k) for k in path): leaf for path, leaf in nnx.to_flat_state(state)}
    nbytes = {name: math.prod(x.value.shape) * x.value.dtype.itemsize for name, x in flat.items()}
    whole = [name for name in nbytes if name.endswith("norm.weight") or ".k_proj." in name or ".v_proj." in name]
    assert results["weight_bytes"] == sum(nbytes[n] for n in whole) + sum(
        nbytes[n] // 2 for n in nbytes if n not in whole)  # the rest split over tp 2, none over dp
    assert results["mesh"]["collectives"]["program"].get("all-reduce", 0) > 0  # tp's row-parallel projections
    assert "dp 2 x tp 2" in (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit):
        decode_cost.parse_args([*argv, "--mesh", "fsdp=2"])
    with pytest.raises(SystemExit, match="does not split"):
        decode_cost.main([*argv, "--mesh", "dp=8"])


def test_decode_cost_counts_hlo_bytes():
    """benchmarks/decode_cost.py's byte count of a loop body: an in-place dynamic-update-slice writes its update
    only, a gather reads what it takes, a dot its operands and output."""
    from benchmarks.decode_cost import shape_bytes, step_ops

    assert shape_bytes("bf16[128,512,8,128]{3,1,2,0}") == 128 * 512 * 8 * 128 * 2
    assert shape_bytes("(s32[], f32[2,3], pred[4])") == 4 + 24 + 4
    hlo = """
%fused_dus (p0: f32[16,8], p1: f32[1,8], p2: s32[]) -> f32[16,8] {
  %p0 = f32[16,8]{1,0} parameter(0)
  %p1 = f32[1,8]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %d = f32[16,8]{1,0} dynamic-update-slice(%p0, %p1, %p2, %c)
}

%fused_gather (q0: bf16[100,8], q1: s32[4]) -> bf16[4,8] {
  %q0 = bf16[100,8]{1,0} parameter(0)
  %q1 = s32[4]{0} parameter(1)
  ROOT %g = bf16[4,8]{1,0} gather(%q0, %q1), offset_dims={1}
}

%fused_scaled (r0: bf16[100,8], r1: bf16[], r2: s32[4]) -> bf16[4,8] {
  %r0 = bf16[100,8]{1,0} parameter(0)
  %r1 = bf16[] parameter(1)
  %b = bf16[100,8]{1,0} broadcast(%r1), dimensions={}
  %dv = bf16[100,8]{1,0} divide(%r0, %b)
  %sel = bf16[100,8]{1,0} select(%dv, %r0, %dv)
  %r2 = s32[4]{0} parameter(2)
  ROOT %g3 = bf16[4,8]{1,0} gather(%sel, %r2), offset_dims={1}
}

%fused_convert (c0: f32[16,8]) -> bf16[16,8] {
  %c0 = f32[16,8]{1,0} parameter(0)
  ROOT %cv = bf16[16,8]{1,0} convert(%c0)
}

%fused_w (w0: bf16[100,8], w1: bf16[], w2: s32[4]) -> (bf16[4,8], bf16[8]) {
  %w0 = bf16[100,8]{1,0} parameter(0)
  %w1 = bf16[] parameter(1)
  %wb = bf16[100,8]{1,0} broadcast(%w1), dimensions={}
  %wdv = bf16[100,8]{1,0} divide(%w0, %wb)
  %w2 = s32[4]{0} parameter(2)
  %g4 = bf16[4,8]{1,0} gather(%wdv, %w2), offset_dims={1}
  %sum = bf16[8]{0} reduce(%wdv, %w1), dimensions={0}, to_apply=%add
  ROOT %both = (bf16[4,8]{1,0}, bf16[8]{0}) tuple(%g4, %sum)
}

%body (arg: (s32[], f32[16,8], bf16[100,8], s32[4], f32[1,8])) -> (s32[], f32[16,8], bf16[100,8], s32[4], f32[1,8]) {
  %arg = (s32[], f32[16,8]{1,0}, bf16[100,8]{1,0}, s32[4]{0}, f32[1,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %cache = f32[16,8]{1,0} get-tuple-element(%arg), index=1
  %table = bf16[100,8]{1,0} get-tuple-element(%arg), index=2
  %ids = s32[4]{0} get-tuple-element(%arg), index=3
  %new = f32[1,8]{1,0} get-tuple-element(%arg), index=4
  %upd = f32[16,8]{1,0} fusion(%cache, %new, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="dus"}
  %emb = bf16[4,8]{1,0} fusion(%table, %ids), kind=kLoop, calls=%fused_gather, metadata={op_name="take"}
  %two = bf16[] constant(2)
  %half = bf16[16,8]{1,0} fusion(%upd), kind=kLoop, calls=%fused_convert, metadata={op_name="convert"}
  %scaled = bf16[4,8]{1,0} fusion(%table, %two, %ids), kind=kLoop, calls=%fused_scaled, metadata={op_name="scaled"}
  %whole = (bf16[4,8]{1,0}, bf16[8]{0}) fusion(%table, %two, %ids), kind=kInput, calls=%fused_w, metadata={op_name="s"}
  %dot = f32[16,4]{1,0} dot(%upd, %emb), lhs_contracting_dims={1}, metadata={op_name="jit(f)/while/body/dot"}
  ROOT %t = (s32[], f32[16,8]{1,0}, bf16[100,8]{1,0}, s32[4]{0}, f32[1,8]{1,0}) tuple(%i, %upd, %table, %ids, %new)
}

%cond (c: (s32[], f32[16,8], bf16[100,8], s32[4], f32[1,8])) -> pred[] {
  %c = (s32[], f32[16,8]{1,0}, bf16[100,8]{1,0}, s32[4]{0}, f32[1,8]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%ci, %ci), direction=LT
}

ENTRY %main (a: (s32[], f32[16,8], bf16[100,8], s32[4], f32[1,8])) -> (s32[], f32[16,8], bf16[100,8], ...) {
  %a = (s32[], f32[16,8]{1,0}, bf16[100,8]{1,0}, s32[4]{0}, f32[1,8]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[16,8]{1,0}, bf16[100,8]{1,0}, s32[4]{0}, f32[1,8]{1,0}) while(%a), condition=%cond, body=%body
}
"""
    ops = {op["label"]: (op["read"], op["written"]) for op in step_ops(hlo)}
    # dus: reads the update (1 x 8 f32 = 32) and the index (4), writes the update (32); the cache is its buffer
    # take: 4 rows of 8 bf16 = 64 read of the table, the 4 int32 ids (16); writes 4 x 8 bf16 = 64
    # scaled: the gather takes 4 rows of an elementwise function of the table (reaching it two ways): those 4
    # rows read (64), the scalar (2) and the ids (16)
    # convert: an elementwise op of the whole of its operand, its output: 16 x 8 f32 read (512), bf16 written (256)
    # s: the same function also reduced whole: the table read whole (1,600), the scalar, the ids; both outputs
    # dot: 16 x 8 f32 (512) + 4 x 8 bf16 (64) read, 16 x 4 f32 (256) written
    assert ops == {"dus": (36, 32), "take": (80, 64), "scaled": (82, 64), "s": (1618, 80), "convert": (512, 256),
                   "dot": (576, 256)}


def test_decode_cost_counts_the_slots_the_decode_attention_kernel_reads():
    """A custom call named as the kernel reads its k and v operands (1 and 2) in the share given; and that share's
    slots: prompts of 20 tokens padded to 64, 64 new slots, blocks of 32: the first block read is slot 32's (44
    // 32 = 1); steps t = 1..32 end in block 2 (2 blocks read), t = 33..63 in block 3 (3 blocks)."""
    from benchmarks.decode_cost import kernel_slots, step_ops

    assert kernel_slots(64, 64, 20) == pytest.approx(32 * (2 * 32 + 3 * 31) / 63)
    hlo = """
%body (arg: (f32[4,8], bf16[4,1,128,8], bf16[4,1,128,8])) -> (f32[4,8], bf16[4,1,128,8], bf16[4,1,128,8]) {
  %arg = (f32[4,8]{1,0}, bf16[4,1,128,8]{3,2,1,0}, bf16[4,1,128,8]{3,2,1,0}) parameter(0)
  %q = f32[4,8]{1,0} get-tuple-element(%arg), index=0
  %k = bf16[4,1,128,8]{3,2,1,0} get-tuple-element(%arg), index=1
  %v = bf16[4,1,128,8]{3,2,1,0} get-tuple-element(%arg), index=2
  %o = f32[4,8]{1,0} custom-call(%q, %k, %v), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="attn"}, \
backend_config={"name":"rlsched_decode_attention"}
  ROOT %t = (f32[4,8]{1,0}, bf16[4,1,128,8]{3,2,1,0}, bf16[4,1,128,8]{3,2,1,0}) tuple(%o, %k, %v)
}

ENTRY %main (a: (f32[4,8], bf16[4,1,128,8], bf16[4,1,128,8])) -> (f32[4,8], bf16[4,1,128,8], bf16[4,1,128,8]) {
  %a = (f32[4,8]{1,0}, bf16[4,1,128,8]{3,2,1,0}, bf16[4,1,128,8]{3,2,1,0}) parameter(0)
  ROOT %w = (f32[4,8]{1,0}, bf16[4,1,128,8]{3,2,1,0}, bf16[4,1,128,8]{3,2,1,0}) while(%a), body=%body
}
"""
    (op,) = step_ops(hlo, kernel_share=0.25)
    # q 4 x 8 f32 (128) whole; k and v 4 x 128 x 8 bf16 (8192 each) a quarter each; writes 4 x 8 f32 (128)
    assert (op["label"], op["read"], op["written"]) == ("attn", 128 + 2 * 8192 / 4, 128)


# module -> a check of its results beyond their presence
def check_compile_cost(results: dict, out: Path) -> None:
    """benchmarks/compile_cost.py built the first step's four programs both ways, each in a process of its own: one
    after another (each program's trace and compile timed), and at once; the report gives both walls and their
    ratio."""
    ways = results["ways"]
    alone = ways["one_after_another"]
    assert set(alone["programs"]) == {"generate", "reference", "gradient", "update"}
    assert all(p["lower_s"] > 0 and p["compile_s"] > 0 for p in alone["programs"].values())
    assert alone["wall_s"] >= sum(p["lower_s"] + p["compile_s"] for p in alone["programs"].values())
    assert ways["at_once"]["wall_s"] > 0 and results["ratio"] == alone["wall_s"] / ways["at_once"]["wall_s"]
    assert f"({results['ratio']:.2f} x faster)" in (out / "report.md").read_text()


def test_gpu_memory_on_an_fsdp_mesh_counts_one_devices_programs(tmp_path):
    """benchmarks/gpu_memory.py --fsdp 2 (2 CPU devices): the actor's programs on its mesh, one device's bytes: the
    float32 gradient (the gradient program's output, beside a few metrics) is the plan's grads for that mesh (the
    matrices split, the norms whole), about half of one device's; the report says which mesh."""
    from benchmarks import gpu_memory

    argv = [*SMALLEST["gpu_memory"][0], "--accumulate", "1"]
    one = gpu_memory.main([*argv, "--out", str(tmp_path / "one")])["runs"][0]
    two = gpu_memory.main([*argv, "--fsdp", "2", "--out", str(tmp_path / "two")])["runs"][0]
    for run in (one, two):  # the output is the gradient and the step's metrics (a few scalars)
        assert 0 <= run["gradient"]["output_bytes"] - run["plan"]["grads"] < 1024
    assert 0.5 < two["plan"]["grads"] / one["plan"]["grads"] < 0.51
    assert "one device's of fsdp 2" in (tmp_path / "two" / "report.md").read_text()


def test_compile_cost_lora_builds_the_programs_a_lora_group_compiles(tiny_model_dir):
    """benchmarks/compile_cost.py --lora K builds a LoRA group's first-step programs itself (for a GPU it may not
    have): the generate programs' batch sizes are those a base group's shared sampler prepares for K tasks, and on
    the present backend every program's memory analysis is, byte for byte, that of the program the sampler or a
    LoRA ActorWorker compiles for the same config."""
    import jax
    from flax import nnx

    from benchmarks import compile_cost, decode_cost, gpu_memory
    from rlsched.config.spec import actor_settings
    from workers.actor import ActorWorker
    from workers.models import load_pretrained
    from workers.models import sharding as S
    from workers.models.lora import LoraSpec
    from workers.rollout.base import SamplingParams
    from workers.rollout.shared_engine import open_view

    args = compile_cost.parse_args([*SMALLEST["compile_cost"][0], "--lora", "3", "--lora-rows", "8",
                                    "--lora-rank", "4"])
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    model, _ = load_pretrained(tiny_model_dir)
    config, device = model.config, jax.devices()[0]
    # the engine: 3 tasks of 4 rows (2 prompts x 2) on a sampler of 8 rows
    views = [open_view(tiny_model_dir, dtype=None, mesh=S.mesh({}, [device]), spec=spec,
                       max_prompt_len=args.prompt_len, max_new_tokens=args.new_tokens, max_batch_size=8)
             for _ in range(args.lora)]
    try:
        prompts = [[5] * args.prompt_len, [6] * args.prompt_len]
        views[0].prepare(prompts, SamplingParams(n=args.batch // 2, max_new_tokens=args.new_tokens))
        executables = views[0].group.sampler._executables
        assert sorted(key[5] for key in executables) == compile_cost.lora_batches(args.batch, args.lora, 8) == [4, 8]
        for key, program in executables.items():
            ours = decode_cost.lower_generate(config, device, key[5], args.prompt_len, args.new_tokens, lora=spec,
                                              lora_slots=args.lora)[0]().compile().memory_analysis()
            m = program.memory_analysis()
            assert (m.temp_size_in_bytes, m.argument_size_in_bytes) == \
                (ours.temp_size_in_bytes, ours.argument_size_in_bytes), key[5]
    finally:
        for view in views:
            view.close()
    # the actor
    task = gpu_memory.task_config(args, 1).task_specs()[0]
    settings = actor_settings(task.config)
    length = args.prompt_len + args.new_tokens
    worker = ActorWorker(load_pretrained(tiny_model_dir)[0], settings, lora=spec)
    worker.prepare(task.plan.mini_batch_size, length)
    ours = gpu_memory.lower_programs(nnx.eval_shape(lambda: model), settings, device, 1, length, lora=spec)
    for kind, name in (("train", "gradient"), ("update", "update"), ("logprobs", "reference")):
        (program,) = [p for key, p in worker._prepared.items() if key[0] == kind]
        m, o = program.memory_analysis(), ours[name]().compile().memory_analysis()
        assert (m.temp_size_in_bytes, m.output_size_in_bytes, m.argument_size_in_bytes) == \
            (o.temp_size_in_bytes, o.output_size_in_bytes, o.argument_size_in_bytes), name


DEEPER = {"lora": check_lora, "cobatch": check_cobatch, "cotrain": check_cotrain, "gpu": check_gpu,
          "startup": check_startup, "gpu_memory": check_gpu_memory, "plan_fit": check_plan_fit,
          "decode_cost": check_decode_cost, "compile_cost": check_compile_cost}


def test_every_benchmark_has_a_smallest_setting():
    modules = {p.stem for p in BENCHMARKS.glob("*.py")} - NOT_BENCHMARKS
    assert not set(SMALLEST) & set(ELSEWHERE)
    assert modules == set(SMALLEST) | set(ELSEWHERE), \
        f"add the new benchmarks to SMALLEST: {sorted(modules - set(SMALLEST) - set(ELSEWHERE))}"


def test_the_gpu_benchmarks_device_probe_lets_jax_pick_the_device(tmp_path):
    """benchmarks/gpu.py's probe child imports benchmarks.common, which defaults JAX_PLATFORMS to cpu: without
    JAX_PLATFORMS in the caller's environment the probe must leave JAX its own choice (on a GPU machine it probed
    the CPU, and made a float32 model, until it did)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS.parent), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--probe", str(tmp_path / "m"), "--preset", "tiny",
                           "--dtype", "auto", "--copy-mib", "1"], env=env, capture_output=True, text=True,
                          cwd=BENCHMARKS.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["jax_platforms"] is None, probe["jax_platforms"]
    import jax

    assert probe["platform"] == jax.devices()[0].platform  # the device JAX picks by itself (the CPU here)


def test_a_decode_attention_check_that_dies_is_an_error_and_the_runs_decode_without_the_kernel(tmp_path):
    """benchmarks/gpu.py checks the kernel in a child of its own: its death (here: no model where it looks) is
    returned as an error, which main turns into `xla` for the runs, and the report line says so."""
    from types import SimpleNamespace

    from benchmarks.gpu import attention_check, attention_line

    args = SimpleNamespace(prompts=2, generations=2, prompt_len=32, new_tokens=2)
    check = attention_check(args, tmp_path / "no-model", "float32")
    assert check["error"].startswith("the check's process ended with 1") and check["shape"] is None, check
    line = attention_line(check, {"decode_attention": "xla"})
    assert "its shape unknown: failed on this device" in line and "the runs decoded with `xla`" in line
