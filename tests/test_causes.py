"""Causes on the terminal: a model directory that cannot work is refused by the config check, one line, exit 2,
before Ray starts and before anything is written; an error a role's constructor raises reaches the user as its
own type and message (no ANSI colour codes, no Ray wrapper), whichever process holds the role."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TASK = """\
experiment: {{name: causes, output_dir: {out}}}
tasks:
  - name: addition
    model: {{path: {model}}}
    data: {{kind: addition}}
    reward: {{name: addition}}
    grpo: {{prompts_per_step: 4, num_generations: 2, mini_batch_size: 8, micro_batch_size: 8, max_new_tokens: 8}}
    rollout: {{max_batch_size: 8}}
    steps: 2
"""


def cli(*args: str, cwd: Path = ROOT, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python, "-m", "rlsched.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def _config(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "task.yaml"
    path.write_text(textwrap.dedent(TASK.format(out=tmp_path / "runs", model=model)))
    return path


def _model_copy(tiny_model_dir: Path, where: Path) -> Path:
    shutil.copytree(tiny_model_dir, where)
    return where


def _broken_models(tmp_path: Path, tiny_model_dir: Path) -> dict[str, tuple[Path, str]]:
    """name -> (model directory, the line `rlsched train` must print for it)."""
    missing = tmp_path / "nowhere" / "Qwen3-1.7B"
    no_weights = _model_copy(tiny_model_dir, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    sharded = _model_copy(tiny_model_dir, tmp_path / "sharded")  # an index naming a shard that is not there
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    shards = {"model.norm.weight": "model-00001-of-00002.safetensors",
              "lm_head.weight": "model-00002-of-00002.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    no_tokenizer = _model_copy(tiny_model_dir, tmp_path / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    fix = ("point it at a local Hugging Face model directory (--set tasks.0.model.path=DIR) or set "
           "tasks.0.model.init_preset to create a random one there; rlsched never downloads weights")
    safetensors_only = ("rlsched reads safetensors weights only: copy the model's *.safetensors (and "
                        "model.safetensors.index.json) there, or save it with transformers' "
                        "save_pretrained(safe_serialization=True)")
    return {
        "missing": (missing, f"error: tasks.0.model.path: {missing} does not exist; {fix}"),
        "no weights": (no_weights, f"error: tasks.0.model.path: {no_weights} has config.json but no weights (no "
                                   f"model.safetensors nor model.safetensors.index.json); {safetensors_only}"),
        "a shard absent": (sharded, f"error: tasks.0.model.path: {sharded} has config.json but 1 of the 2 weight "
                                    "files model.safetensors.index.json names are absent (first: "
                                    f"model-00002-of-00002.safetensors); {safetensors_only}"),
        "no tokenizer": (no_tokenizer, f"error: tasks.0.model.path: {no_tokenizer} has no tokenizer.json; rlsched "
                                       "needs the fast (tokenizers) tokenizer saved with the model "
                                       "(tokenizer.save_pretrained(DIR) writes it)"),
    }


def test_a_model_directory_that_cannot_work_is_refused_before_ray_starts(tmp_path, tiny_model_dir):
    """`rlsched train` in a real process: one line, exit 2, in seconds (Ray takes ~12 s to start here; this process
    never even imports it, nor JAX), and no run directory."""
    for name, (model, expected) in _broken_models(tmp_path, tiny_model_dir).items():
        config = _config(tmp_path, model)
        t0 = time.monotonic()
        out = cli("train", str(config), python=("-X", "importtime"))
        took = time.monotonic() - t0
        assert out.returncode == 2, (name, out.returncode, out.stderr[-2000:])
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                    if line.startswith("import time")}
        assert [line for line in out.stderr.splitlines() if not line.startswith("import time")] == [expected], name
        assert out.stdout == "", name  # not even the batch plan: the check comes first
        assert not (tmp_path / "runs").exists(), name
        assert "rlsched.config.preflight" in imported and not {m for m in imported if m.split(".")[0] in ("ray", "jax")}
        assert took < 10, (name, took)


def test_submit_checks_the_model_directory_where_the_user_is(tmp_path, tiny_model_dir):
    """`rlsched submit` validates on the client, before anything is sent: the same refusal as train's."""
    from rlsched.config.schema import ConfigError
    from rlsched.service.client import service_config

    settings = {"num_devices": 1, "placement": "colocated", "memory_budget_gb": None, "policy": "fifo"}
    for name, (model, expected) in _broken_models(tmp_path, tiny_model_dir).items():
        with pytest.raises(ConfigError) as caught:
            service_config([_config(tmp_path, model)], [], None, settings, echo=lambda *_: None)
        assert f"error: {caught.value}" == expected, name
    assert not (tmp_path / "runs").exists()


def test_a_preset_model_may_be_absent(tmp_path):
    """model.init_preset: `rlsched train` creates the model, so an absent directory (or one without config.json)
    is not an error; one that has config.json must have its weights."""
    from rlsched.config.loading import load_config
    from rlsched.config.preflight import check_model_dir
    from rlsched.config.schema import ConfigError

    config = _config(tmp_path, tmp_path / "made-later")
    check_model_dir(load_config(config, ["tasks.0.model.init_preset=tiny"]).tasks[0], 0)
    (tmp_path / "made-later").mkdir()
    check_model_dir(load_config(config, ["tasks.0.model.init_preset=tiny"]).tasks[0], 0)
    (tmp_path / "made-later" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="has config.json but no weights"):
        check_model_dir(load_config(config, ["tasks.0.model.init_preset=tiny"]).tasks[0], 0)


# ---- a role's constructor error -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lacking_model(tmp_path_factory):
    """A complete-looking model directory whose weights lack one tensor: the config check cannot see it (it never
    reads weights), the actor's constructor (load_pretrained) raises WeightMismatchError."""
    from safetensors.numpy import load_file, save_file

    from workers.models import init_model

    path = init_model(tmp_path_factory.mktemp("models") / "lacking", preset="tiny", seed=0)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.slow
@pytest.mark.parametrize("processes", ["per_device_group", "per_role"])
def test_a_role_constructor_error_reaches_the_terminal_as_itself(tmp_path, lacking_model, processes):
    out = cli("train", str(_config(tmp_path, lacking_model)), "--set", f"cluster.processes={processes}")
    assert out.returncode == 1, out.stderr[-3000:]
    expected = (f"WeightMismatchError: {lacking_model}/*.safetensors: tensor names differ from the model's: missing "
                "['model.norm.weight'], unexpected []")
    assert out.stderr.splitlines()[-1] == f"error: task addition failed: {expected}"
    assert f"[addition] failed: {expected} after " in out.stdout
    everything = out.stdout + out.stderr
    assert "\x1b[" not in everything and "RoleDied" not in everything and "creation task" not in everything
    assert "close failed" not in everything  # a role that was never built has nothing to close
    # the whole traceback is kept in the task's directory, without colour codes, and the run's output names it
    kept = tmp_path / "runs" / "causes" / "tasks" / "addition" / "traceback.txt"
    assert f"[addition] its traceback: {kept}" in out.stdout.splitlines()
    text = kept.read_text()
    assert "WeightMismatchError" in text and 'File "' in text and "load_pretrained" in text, text[-3000:]
    assert "\x1b[" not in text
    summary = json.loads((tmp_path / "runs" / "causes" / "summary.json").read_text())
    assert summary["tasks"]["addition"]["traceback_file"] == str(kept)


def test_a_ray_actors_constructor_error_is_read_from_rays_text(ray_session):
    """Actors other than roles (a device group's process, the scheduler) still die of their constructor's error; Ray
    keeps only its text, coloured. What RoleDied says of it is the exception's own type and first line."""
    import ray

    from rlsched.base.errors import cause_of, creation_error
    from rlsched.cluster.exits import death_cause

    class _Refused(ValueError):
        pass

    class _Refuses:  # defined here: Ray sends it by value to a worker that cannot import this test module
        def __init__(self):
            raise _Refused("the model directory lacks model.norm.weight\nsecond line of the message")

        def ping(self):
            return "never"

    handle = ray.remote(num_cpus=0)(_Refuses).remote()
    with pytest.raises(ray.exceptions.RayActorError) as caught:
        ray.get(handle.ping.remote(), timeout=120)
    err = caught.value
    assert "\x1b[" in str(err)  # what Ray gives: ANSI colour codes around the process's name
    assert creation_error(err) == "_Refused: the model directory lacks model.norm.weight"
    assert death_cause(err) == "its constructor raised _Refused: the model directory lacks model.norm.weight"
    assert cause_of(err) == "_Refused: the model directory lacks model.norm.weight"
    assert creation_error(RuntimeError("not Ray's")) is None
