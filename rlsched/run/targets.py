"""What `rlsched generate` and `rlsched eval` load: the model a TARGET names, and the task it came from.

A TARGET is any of what a run leaves or `rlsched export` writes:
- a model directory (config.json + safetensors): a model made by `init-model`, a full export, a merged export;
- a PEFT adapter directory (adapter_config.json + adapter_model.safetensors): merged into its base, the
  directory `--base` names or else the adapter config's base_model_name_or_path;
- a run directory, a task's directory or one checkpoint (rlsched.run.export.find_checkpoint): its weights,
  a LoRA task's adapter merged into its base, with the task's config (data, reward, eval) from the run's
  config.yaml.

Design decisions:
- **One model for every form of the same weights**: an adapter is merged (workers.models.lora.merged) rather
  than served as an adapter, so a full export, a merged export, a PEFT directory and the checkpoint they came
  from decode the same tokens, and `rlsched eval` gives them the same accuracy.
- JAX is imported inside the functions: the control plane's modules import none (a CLI that only validates
  must not claim an accelerator).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rlsched.base.errors import UsageError


@dataclasses.dataclass
class Loaded:
    model: Any  # workers.models.decoder.CausalLM
    tokenizer: Any
    what: str  # "checkpoint 20 of task addition (...)", for the line that says what was loaded
    model_dir: Path  # the directory of its config.json, generation_config.json and tokenizer (a base's, for LoRA)
    task: Any = None  # the TaskConfig of the run the weights came from (None: a bare model or adapter directory)
    task_dir: Path | None = None  # runs/<experiment>/tasks/<task> of a checkpoint


def load(path: str | Path, *, task: str | None = None, step: int | None = None, base: str | Path | None = None,
         dtype: str | None = None) -> Loaded:
    """The model TARGET `path` names (see the module docstring), in `dtype` if given (else as stored)."""
    from rlsched.run.export import ExportError, find_checkpoint, is_checkpoint_source

    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return _adapter_dir(path, base, dtype)
    if base is not None:
        raise UsageError(f"--base goes with a PEFT adapter directory (adapter_config.json); {path} is not one")
    if (path / "config.json").is_file():
        from workers.models import load_pretrained

        model, tok = load_pretrained(path, dtype=dtype)
        return Loaded(model, tok, f"the model directory {path}", path)
    if is_checkpoint_source(path):
        try:
            ckpt = find_checkpoint(path, task=task, step=step)
        except ExportError as err:
            raise UsageError(str(err)) from None
        return _checkpoint(ckpt, dtype)
    what = (f"{path} does not exist" if not path.exists() else
            f"{path} has no config.json or adapter_config.json and holds no run, task or checkpoint")
    raise UsageError(f"{what}; give a model directory (config.json, *.safetensors), a PEFT adapter directory "
                     "(adapter_config.json), a run directory (runs/<experiment>), a task's directory or a checkpoint "
                     "(.../checkpoints/<step>)")


def _checkpoint(ckpt, dtype: str | None) -> Loaded:
    from rlsched.run.export import _leaves, _lora_of, load_model
    from workers.models import peft_files
    from workers.models.tokenizer import load_tokenizer

    lora = _lora_of(ckpt)
    task_dir = ckpt.path.parent.parent
    if lora is None:
        model, tok = load_model(ckpt, dtype=dtype)
    else:  # its adapter, merged into its base
        adapter = {leaf.name: leaf.read() for leaf in _leaves(ckpt)}
        try:
            model = peft_files.merged_model(ckpt.model_dir, adapter, lora, dtype=dtype)
        except peft_files.AdapterError as err:
            raise UsageError(f"{ckpt.describe()}: {err}") from None
        tok = load_tokenizer(ckpt.model_dir)
    return Loaded(model, tok, f"{ckpt.describe()}; config and tokenizer from {ckpt.model_dir}", ckpt.model_dir,
                  task=_task_config(task_dir), task_dir=task_dir)


def _adapter_dir(path: Path, base: str | Path | None, dtype: str | None) -> Loaded:
    from workers.models import peft_files
    from workers.models.config import ModelConfig
    from workers.models.tokenizer import load_tokenizer

    if base is None:
        named = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not named or not (Path(named) / "config.json").is_file():
            raise UsageError(f"{path} is a LoRA adapter whose base ({named!r} in adapter_config.json) is not a local "
                             "model directory; name the base with --base DIR")
        base = named
    base = Path(base)
    if not (base / "config.json").is_file():
        raise UsageError(f"--base {base} has no config.json; it must be the adapter's base model directory")
    try:
        adapter, spec = peft_files.load_adapter(path, ModelConfig.from_dir(base))
        model = peft_files.merged_model(base, adapter, spec, dtype=dtype)
    except peft_files.AdapterError as err:
        raise UsageError(str(err)) from None
    return Loaded(model, load_tokenizer(base), f"the adapter {path} merged into its base {base}", base)


def _task_config(task_dir: Path):
    """The TaskConfig of the task at runs/<experiment>/tasks/<task>, from the run's config.yaml (None if the run
    has none, or no longer names the task)."""
    from rlsched.config.loading import load_config

    path = task_dir.parent.parent / "config.yaml"
    if not path.is_file():
        return None
    cfg = load_config(path)
    return next((t for t in cfg.tasks if t.name == task_dir.name), None)
