"""A LoRA task through the CLI, as a user runs one: `rlsched train` with `tasks[i].lora` under Ray, its
adapter synced to the engine every step, its bytes as planned, `rlsched export` of its adapter and merged model,
and the config errors a LoRA task can meet."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rlsched.observe.tracking import read_metrics
from workers.models import lora as L
from workers.models.config import ModelConfig


def _cli(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "rlsched.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


@pytest.mark.slow
def test_a_lora_task_trains_under_ray_and_exports_its_adapter(tmp_path, tiny_model_dir):
    from pathlib import Path

    config = Path(__file__).parent.parent / "configs" / "demo_addition.yaml"
    done = _cli("train", str(config), "--set", f"experiment.output_dir={tmp_path}",
                "--set", f"tasks.0.model.path={tiny_model_dir}", "--set", "tasks.0.model.init_preset=null",
                "--set", "tasks.0.lora.rank=8", "--set", "tasks.0.lora.targets=[q,v,down]",
                "--set", "tasks.0.steps=3", "--set", "tasks.0.checkpoint_every=3",
                "--set", "tasks.0.grpo.prompts_per_step=4", "--set", "tasks.0.grpo.num_generations=4",
                "--set", "tasks.0.grpo.mini_batch_size=8",
                # the decode attention kernel under Pallas's interpreter: the setting reaches the base group's sampler
                "--set", "tasks.0.rollout.engine_args={decode_attention: interpret}")
    assert done.returncode == 0, done.stdout + done.stderr
    run = tmp_path / "demo-addition"
    metrics = read_metrics(run / "tasks" / "addition" / "metrics.jsonl")
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1, 2]  # each step rolled out the last adapter
    spec = L.LoraSpec(8, 16.0, ("q", "v", "down"))
    adapter = L.adapter_bytes(ModelConfig.from_dir(tiny_model_dir), spec)
    assert metrics[-1]["mem/actor/held/opt"] == 2 * adapter + 8  # AdamW's moments of the adapter (+ 2 counts)
    line = next(x for x in done.stdout.splitlines() if "measured / planned" in x)
    pairs = re.findall(r"([\d.]+ \w+) / ([\d.]+ \w+)", line)
    assert len(pairs) == 3 and all(measured == planned for measured, planned in pairs), line  # params, opt, engine

    exported = _cli("export", str(run), str(tmp_path / "adapter"))
    assert exported.returncode == 0, exported.stderr
    config_json = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config_json["peft_type"], config_json["r"], config_json["lora_alpha"]) == ("LORA", 8, 16.0)
    assert sorted(config_json["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    merged = _cli("export", str(run), str(tmp_path / "merged"), "--merge")
    assert merged.returncode == 0, merged.stderr
    assert ModelConfig.from_dir(tmp_path / "merged").param_shapes() == ModelConfig.from_dir(tiny_model_dir) \
        .param_shapes()
    # `rlsched generate` on the run (its adapter merged into the base), the adapter directory and the merged export:
    # the same weights, the same greedy tokens (test_lora_actor checks merged == adapter numerically)
    prompt = ("--prompt", "3+4=", "--max-new-tokens", "6")
    outs = [_cli("generate", str(target), *prompt) for target in (run, tmp_path / "adapter", tmp_path / "merged")]
    assert [o.returncode for o in outs] == [0, 0, 0], [o.stderr for o in outs]
    assert outs[0].stdout == outs[1].stdout == outs[2].stdout
    assert "merged into its base" in outs[1].stderr


def test_lora_config_errors_name_the_key(tmp_path):
    from pathlib import Path

    config = Path(__file__).parent.parent / "configs" / "demo_addition.yaml"
    moe = tmp_path / "moe"
    made = _cli("init-model", "--preset", "tiny-qwen3moe", str(moe))
    assert made.returncode == 0, made.stderr
    cases = [
        (["tasks.0.lora.rank=0"], "tasks.0.lora.rank: Input should be greater than or equal to 1"),
        (["tasks.0.lora.targets=[q,q]"], "tasks.0.lora.targets: name each projection once"),
        (["tasks.0.lora.rank=4", "tasks.0.rollout.engine=sglang_jax"],
         "tasks.0.rollout.engine: the released sglang-jax cannot load LoRA adapters; a LoRA task rolls out with "
         "rollout.engine=jax_sampler"),
        (["tasks.0.lora.targets=[q,gate]", f"tasks.0.model.path={moe}", "tasks.0.model.init_preset=null"],
         "tasks.0.lora.targets ['gate']: Qwen3-MoE (4 experts, top 2) layers [1] are mixtures of experts"),
    ]
    for overrides, message in cases:
        checked = _cli("check", str(config), *[a for o in overrides for a in ("--set", o)], timeout=120)
        assert checked.returncode == 2 and message in checked.stdout + checked.stderr, (overrides, checked.stdout,
                                                                                       checked.stderr)


def _modes(directory) -> set[tuple[str, int]]:
    """(kind, permission bits) of an export directory and of everything in it."""
    from pathlib import Path

    paths = [Path(directory), *Path(directory).rglob("*")]
    return {("dir" if p.is_dir() else "file", p.stat().st_mode & 0o777) for p in paths}


@pytest.mark.slow
def test_a_run_keeps_its_last_weights_says_where_and_creates_a_shared_base_once(tmp_path):
    """demo_multitask's two tasks as LoRA tasks on one random base not yet made, under Ray: the run says once that
    it creates the base (each driver said it), and at the start where each task's weights go; with
    checkpoint_every unset the last step is saved (it was never saved: runs kept no weights by default), with 0
    nothing is. Both exports of that checkpoint, the adapter and --merge, written with umask 027, are 0640 files in
    a 0750 directory (they were 0600 files; a full export's 0644: one mode, the user's, test_export.py)."""
    from pathlib import Path

    config = Path(__file__).parent.parent / "configs" / "demo_multitask.yaml"
    base = tmp_path / "models" / "base"
    sets = [f"tasks.*.model={{path: {base}, init_preset: tiny}}", "tasks.*.lora={rank: 4, targets: [q, v, lm_head]}",
            "tasks.*.steps=2", "tasks.*.grpo.prompts_per_step=4", "tasks.*.grpo.num_generations=4",
            "tasks.*.grpo.mini_batch_size=8", "tasks.0.checkpoint_every=null", "tasks.1.checkpoint_every=0",
            f"experiment.output_dir={tmp_path / 'runs'}"]
    done = _cli("train", str(config), *[w for s in sets for w in ("--set", s)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [x for x in lines if "creating a random" in x] == [
        f"creating a random tiny Qwen3 at {base}, shared by 2 tasks (addition, subtraction)"], done.stdout
    run = tmp_path / "runs" / "demo-multitask"
    assert f"[addition] weights: {run}/tasks/addition/checkpoints/<step>/ (the last step); `rlsched export {run} " \
           "--task addition OUT` writes them as a Hugging Face model" in lines, done.stdout
    assert "[subtraction] keeps no weights (checkpoint_every 0); unset it to keep the last step's" in lines
    assert sorted(p.name for p in (run / "tasks" / "addition" / "checkpoints").iterdir()) == ["2"]
    assert not (run / "tasks" / "subtraction" / "checkpoints").exists() or \
        not any((run / "tasks" / "subtraction" / "checkpoints").iterdir())

    for name, flags in (("adapter", ()), ("merged", ("--merge",))):
        exported = subprocess.run([sys.executable, "-m", "rlsched.cli", "export", str(run), "--task", "addition",
                                   str(tmp_path / name), *flags], capture_output=True, text=True, timeout=600,
                                  umask=0o027)
        assert exported.returncode == 0, exported.stderr
        assert _modes(tmp_path / name) == {("dir", 0o750), ("file", 0o640)}, (name, _modes(tmp_path / name))
