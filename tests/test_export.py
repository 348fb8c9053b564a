"""`rlsched export` (rlsched.run.export): a run's checkpoint as a Hugging Face model directory. transformers (torch CPU)
is the reference: it loads the export with no missing or unexpected keys and its logits equal rlsched's logits of
the checkpointed params (1e-4), for every family, for actors sharded over a mesh and for the orbax format an actor
across hosts writes; through the CLI on a real run, `rlsched generate` of the export and of the run agree with
transformers' greedy decoding, and `export_final` leaves tasks/<task>/final/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlsched.cli import DEMO_CONFIG, main
from rlsched.run.checkpoints import TaskCheckpointer, _orbax_args
from rlsched.run.export import ExportError, export, find_checkpoint
from tests.test_sharding import SETTINGS, _batch, _mesh
from workers.actor import ActorWorker
from workers.models import ModelConfig, load_pretrained, save_pretrained
from workers.models import params as P
from workers.models.checkpoint import abstract_model, read_safetensors
from workers.models.presets import preset_config
from workers.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {  # name -> (preset, changes): each family's parts, tied and untied heads
    "qwen3": ("tiny", {}),
    "qwen2_untied": ("tiny-qwen2", {"tie_word_embeddings": False}),
    "qwen3moe": ("tiny-qwen3moe", {}),
}
IDS = np.random.default_rng(0).integers(0, 300, size=(2, 11)).astype(np.int32)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """A model directory per family, weights drawn large (std 0.2) so a mis-wired tensor shows in the logits."""
    tok = load_tokenizer(tiny_model_dir)
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    out = {}
    for name, (preset, changes) in FAMILIES.items():
        cfg = preset_config(preset, vocab_size=vocab, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            initializer_range=0.2).replace(**changes)
        out[name] = save_pretrained(abstract_model(cfg, seed=1), tmp_path_factory.mktemp("families") / name,
                                    tokenizer=tok)
    return out


def _trained(model_dir: Path, mesh: dict | None = None) -> ActorWorker:
    """An actor (on `mesh`, or one device) after one GRPO update: params the model directory does not hold."""
    actor = ActorWorker(load_pretrained(model_dir)[0], SETTINGS, mesh=_mesh(mesh) if mesh else None)
    _, _, mini = _batch()
    actor._steps([mini], [])
    return actor


def _task_dir(root: Path, model_dir: Path, task: str = "t") -> Path:
    """A task's directory as a run lays it out: hparams.json names the model, checkpoints/ beside it."""
    task_dir = root / "tasks" / task
    task_dir.mkdir(parents=True)
    (task_dir / "hparams.json").write_text(json.dumps({"name": task, "model": {"path": str(model_dir)}}))
    return task_dir


def _save(task_dir: Path, actor: ActorWorker, step: int, *, orbax: bool = False) -> None:
    """What the task's ActorRole.save does; `orbax`: the format of an actor across hosts (no process holds a leaf
    whole), written here through the checkpointer's own orbax path."""
    ckpt = TaskCheckpointer(task_dir / "checkpoints", background=False)
    if orbax:
        ckpt._orbax_manager().save(step, args=_orbax_args(actor.state, {"step": step}))
    else:
        ckpt.save(step, actor.state, {"step": step})
    ckpt.close()


def _ours(actor: ActorWorker) -> np.ndarray:
    """rlsched's logits of the actor's params, on its mesh."""
    return np.asarray(jax.jit(lambda p: nnx.merge(actor.graphdef, p)(IDS))(actor.state.params))


def _hf(out: Path, dtype=torch.float32):
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _logits_hf(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def _equal_logits(ours: np.ndarray, ref: np.ndarray) -> None:
    assert np.abs(ref).max() > 1.0, "logits too small to tell a wrong tensor from rounding"
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


# ---- every family ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_export_loads_in_transformers_with_the_trained_logits(family, family_dirs, tmp_path):
    model_dir = family_dirs[family]
    actor = _trained(model_dir)
    _save(_task_dir(tmp_path / "run", model_dir), actor, 3)
    done = export(tmp_path / "run", tmp_path / "out")
    assert (done.checkpoint.task, done.checkpoint.step, done.files) == ("t", 3, ["model.safetensors"])
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    hf = _hf(tmp_path / "out")
    ours = _ours(actor)
    _equal_logits(ours, _logits_hf(hf, IDS))
    # The trained params, not the model directory's: the two differ far beyond the tolerance.
    assert np.abs(ours - _logits_hf(_hf(model_dir), IDS)).max() > 1e-3
    assert load_tokenizer(tmp_path / "out").encode("3+5=") == load_tokenizer(model_dir).encode("3+5=")


# ---- sharded actors and the format of one across hosts ----------------------------------------------------------


@pytest.mark.parametrize(("family", "mesh"), [("qwen3", dict(fsdp=2, tp=2)), ("qwen3moe", dict(fsdp=2, ep=2))])
def test_a_sharded_actor_and_its_orbax_checkpoint_export_the_same_files(family, mesh, family_dirs, tmp_path):
    """fsdp 2 x tp 2, and a MoE actor with its experts over ep 2: each leaf is gathered whole on its own (state.bin)
    or assembled by orbax when read here; both exports hold exactly the actor's params and equal files."""
    model_dir = family_dirs[family]
    actor = _trained(model_dir, mesh)
    assert any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
               for x in jax.tree.leaves(actor.state.params)), "the params are not sharded"
    _save(_task_dir(tmp_path / "a", model_dir), actor, 1)
    _save(_task_dir(tmp_path / "b", model_dir), actor, 1, orbax=True)
    assert not (tmp_path / "b/tasks/t/checkpoints/1/index.json").exists()  # orbax's, not state.bin
    export(tmp_path / "a", tmp_path / "out_a")
    export(tmp_path / "b", tmp_path / "out_b")
    assert (tmp_path / "out_a/model.safetensors").read_bytes() == (tmp_path / "out_b/model.safetensors").read_bytes()
    written = read_safetensors(tmp_path / "out_a")
    expected = P.to_hf({k: np.asarray(v) for k, v in P.to_flat(actor.state.params).items()})
    assert sorted(written) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(written[name]), value, err_msg=name)
    _equal_logits(_ours(actor), _logits_hf(_hf(tmp_path / "out_b"), IDS))


def test_a_large_model_is_written_in_shards_with_an_index(family_dirs, tmp_path):
    model_dir = family_dirs["qwen3moe"]
    actor = _trained(model_dir)
    _save(_task_dir(tmp_path / "run", model_dir), actor, 2)
    whole = export(tmp_path / "run", tmp_path / "whole")
    sharded = export(tmp_path / "run", tmp_path / "sharded", max_shard_bytes=100_000)
    assert len(sharded.files) > 2 and (tmp_path / "sharded/model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "sharded/model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sharded.files
    for file in sharded.files:  # each shard within the limit, unless one tensor alone exceeds it
        with safe_open(str(tmp_path / "sharded" / file), framework="numpy") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118 - not a dict
        assert len(sizes) == 1 or sum(int(np.prod(s)) * 4 for s in sizes) <= 100_000, file
    np.testing.assert_array_equal(_logits_hf(_hf(tmp_path / "sharded"), IDS), _logits_hf(_hf(whole.out), IDS))


def test_a_bfloat16_actor_exports_bfloat16_tensors_bit_for_bit(family_dirs, tmp_path):
    """A bfloat16 task's checkpoint holds its float32 master weights (workers.actor); the export writes them as the
    engine was served them: rounded to bfloat16 (after an update, so the master is not bfloat16's already)."""
    model_dir = family_dirs["qwen2_untied"]
    actor = ActorWorker(load_pretrained(model_dir, dtype="bfloat16")[0], SETTINGS)
    _, _, mini = _batch()
    actor._steps([mini], [])
    task_dir = _task_dir(tmp_path / "run", model_dir)
    hparams = json.loads((task_dir / "hparams.json").read_text())
    (task_dir / "hparams.json").write_text(json.dumps({**hparams, "model": {**hparams["model"], "dtype": "bfloat16"}}))
    _save(task_dir, actor, 1)
    export(tmp_path / "run", tmp_path / "out")
    assert json.loads((tmp_path / "out/config.json").read_text())["dtype"] == "bfloat16"
    written = read_safetensors(tmp_path / "out")
    served = actor.export_weights().flat
    master = {k: np.asarray(v) for k, v in P.to_flat(actor.state.params).items()}
    assert any(not np.array_equal(master[k], np.asarray(served[k]).astype(np.float32)) for k in master)
    for name, value in P.to_hf({k: np.asarray(v) for k, v in served.items()}).items():
        assert written[name].dtype == value.dtype == np.dtype("bfloat16"), name
        np.testing.assert_array_equal(np.asarray(written[name]).view(np.uint16), value.view(np.uint16), err_msg=name)
    hf = _hf(tmp_path / "out", dtype="auto")  # the dtype config.json says
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}


# ---- what is refused -------------------------------------------------------------------------------------------


def test_bad_requests_are_refused_with_what_exists_and_nothing_is_left_behind(family_dirs, tmp_path, capsys):
    qwen3, moe = family_dirs["qwen3"], family_dirs["qwen3moe"]
    actor = _trained(qwen3)
    run = tmp_path / "run"
    for task in ("a", "b"):
        _save(_task_dir(run, qwen3, task), actor, 2)
    _save(run / "tasks" / "a", actor, 4)
    with pytest.raises(ExportError, match=r"holds 2 tasks \(a, b\); choose one with --task NAME"):
        find_checkpoint(run)
    assert find_checkpoint(run, task="a").step == 4 and find_checkpoint(run, task="a", step=2).step == 2
    with pytest.raises(ExportError, match="has no task 'c'; its tasks are a, b"):
        find_checkpoint(run, task="c")
    # The CLI: one line, exit 2.
    assert main(["export", str(run), "--task", "a", "--step", "3", str(tmp_path / "out")]) == 2
    assert "error: task a has no checkpoint 3; its checkpoints are steps 2, 4" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["export", str(run / "tasks/b"), str(tmp_path / "full")]) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    # A checkpoint that is not the model directory's model (it changed after the run): named, nothing written.
    (run / "tasks/b/hparams.json").write_text(json.dumps({"model": {"path": str(moe)}}))
    with pytest.raises(ExportError, match="does not hold the parameters of .*qwen3moe/config.json"):
        export(run, tmp_path / "out", task="b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "run"]  # no OUT, no temporary directory
    assert main(["export", str(run), "--task", "a", str(tmp_path / "full"), "--overwrite"]) == 0
    assert "exported checkpoint 4 of task a" in capsys.readouterr().out
    assert not (tmp_path / "full" / "keep.txt").exists() and (tmp_path / "full" / "model.safetensors").is_file()
    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "1"]) == 2
    err = capsys.readouterr().err
    assert "does not exist; give a model directory" in err and "init-model" not in err
    assert main(["generate", str(run / "tasks"), "--prompt", "1"]) == 2
    err = capsys.readouterr().err
    assert "tasks has no config.json or adapter_config.json and holds no run, task or checkpoint" in err


def test_a_full_export_has_the_modes_the_users_umask_gives(family_dirs, tmp_path):
    """`rlsched export` with umask 027: 0640 files in a 0750 directory, as the adapter and merged exports
    (test_lora_run.py); it wrote 0644 and 0755 whatever the umask, and those 0600."""
    model_dir = family_dirs["qwen3"]
    task_dir = _task_dir(tmp_path / "run", model_dir)
    _save(task_dir, ActorWorker(load_pretrained(model_dir)[0], SETTINGS), 1)
    done = subprocess.run([sys.executable, "-m", "rlsched.cli", "export", str(task_dir), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, umask=0o027,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "out", *(tmp_path / "out").iterdir()]}
    assert "model.safetensors" in found and "tokenizer.json" in found, found
    assert found == {name: 0o750 if name == "out" else 0o640 for name in found}


# ---- through the CLI, on a real run --------------------------------------------------------------------------------


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsched.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_a_real_run_exports_through_the_cli_and_generates_what_transformers_does(tmp_path, tiny_model_dir):
    """`rlsched train` (2 steps, a checkpoint each, export_final) from its own directory with a relative model
    path; then, from another directory, `rlsched export` and `rlsched generate` of the export and of the run."""
    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    import shutil

    shutil.copytree(tiny_model_dir, work / "models" / "tiny")
    sets = ["experiment.output_dir=runs", "tasks.0.model.path=models/tiny", "tasks.0.model.init_preset=null",
            "tasks.0.grpo.prompts_per_step=4", "tasks.0.grpo.num_generations=4", "tasks.0.grpo.mini_batch_size=8",
            "tasks.0.steps=2", "tasks.0.checkpoint_every=1", "tasks.0.export_final=true",
            "tasks.0.optim.weight_decay=0.5"]  # a random model's rewards are all 0 (no gradient): the decay moves it
    trained = _cli("train", str(DEMO_CONFIG), "--in-process", *[w for s in sets for w in ("--set", s)], cwd=work)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    run = work / "runs" / "demo-addition"
    final = run / "tasks" / "addition" / "final"
    assert f"exported checkpoint 2 of task addition ({run}/tasks/addition/checkpoints/2) to {final}" in trained.stdout
    hf = _hf(final)

    out = tmp_path / "exported"
    done = _cli("export", str(run), str(out))  # from the repository: the model path is found from the run
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("exported checkpoint 2 of task addition")
    assert (out / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()
    again = _cli("export", str(run), str(out))
    assert again.returncode == 2 and "exists and is not empty; pass --overwrite" in again.stderr
    missing = _cli("export", str(run), "--step", "7", str(tmp_path / "never"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: task addition has no checkpoint 7; its checkpoints are steps 1, 2"
    assert not (tmp_path / "never").exists()
    first = _cli("export", str(run), "--step", "1", str(tmp_path / "step1"))
    assert first.returncode == 0, first.stderr[-3000:]
    ids = np.asarray([load_tokenizer(out).encode("3+5=1+2=")], np.int32)
    base, step1, step2 = (_logits_hf(_hf(d), ids) for d in (work / "models" / "tiny", tmp_path / "step1", final))
    assert np.abs(step1 - base).max() > 1e-3 and np.abs(step2 - step1).max() > 1e-3  # each step moved the weights

    # Greedy text: rlsched on the export, rlsched on the run's checkpoint, transformers on the export.
    prompt = ["--prompt", "3+5=", "--max-new-tokens", "8"]
    of_export, of_run = _cli("generate", str(out), *prompt), _cli("generate", str(run), *prompt)
    assert of_export.returncode == of_run.returncode == 0, of_export.stderr[-2000:] + of_run.stderr[-2000:]
    assert f"[loaded the model directory {out}]" in of_export.stderr
    assert f"[loaded checkpoint 2 of task addition ({run}/tasks/addition/checkpoints/2)" in of_run.stderr
    assert of_export.stdout == of_run.stdout
    tok = load_tokenizer(out)
    prompt_ids = tok.encode("3+5=")
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt_ids):]
    assert len(generated) >= 2 and of_export.stdout == tok.decode(generated.tolist(), skip_special_tokens=True) + "\n"
