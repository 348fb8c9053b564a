"""A run's checkpoint as a Hugging Face model directory: `rlsched export`, `tasks[i].export_final`, and
`rlsched generate` on a run or a checkpoint.

    rlsched export runs/<experiment> [--task T] [--step N] OUT
        OUT/config.json, generation_config.json        the task's model's, with its dtype (tasks[i].model.dtype)
        OUT/model.safetensors                           (or model-0000k-of-0000n.safetensors + an index, when large)
        OUT/tokenizer.json, tokenizer_config.json, ...  copied from the task's model directory

`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads it with no missing or unexpected keys.

A LoRA task's checkpoint (tasks[i].lora) holds its adapter only: it is written as PEFT writes one
(OUT/adapter_config.json + OUT/adapter_model.safetensors, workers.models.peft_files), which
`peft.PeftModel.from_pretrained(base, OUT)` loads; with `merge`, as the base with the adapter merged in, a full
model directory as above.

Design decisions (and why):
- **Leaf by leaf, never the whole model.** A checkpoint holds the actor's TrainState (rlsched.run.checkpoints); only
  its `.params` leaves are read. safetensors puts a header (every tensor's name, dtype, shape and offsets) before
  the bytes, so the header is computed from the shapes alone, then the tensors are written in its order, each
  leaf read once: `state.bin` is memory-mapped (a leaf is a view of the file; only a transposed copy of one
  tensor is ever in memory), an orbax checkpoint is restored one leaf per call. A model over `max_shard_bytes`
  is written as several files with `model.safetensors.index.json`, as Hugging Face shards.
- **The model's dtype.** A bfloat16 task's checkpoint holds float32 master weights (workers.actor); the export
  rounds them to bfloat16 (to nearest even, as the actor rounds what it serves the engine): what the run served.
- **Sharded actors export identically.** A checkpoint is the *logical* arrays, whatever the mesh: an actor in
  one process (fsdp / tp / ep over its devices) copies each leaf to host whole before the write
  (`jax.device_get`), so `state.bin` is the same bytes as an unsharded actor's. An actor across hosts (no
  process holds a leaf whole) is saved by orbax, every process its own shards; orbax assembles each leaf whole
  when one process restores it here, one leaf at a time. Both give the same files (tests/test_export.py).
- **Hugging Face names through the one renaming rule** (workers.models.params.to_hf, what init-model's
  save_pretrained uses): kernels (in, out) become `.weight` (out, in), stacked experts one tensor per expert.
  The names and shapes are checked against the task's config.json before anything is written.
- **The model directory supplies what a checkpoint lacks.** Arrays are all a checkpoint holds; config.json,
  generation_config.json and the tokenizer come from the task's `model.path` (its hparams.json). A relative
  path is relative to where `rlsched train` ran, found again from the run directory and `output_dir`.
- **Atomic.** Everything is written into a temporary directory beside OUT, renamed into place when complete;
  an existing non-empty OUT is refused unless `overwrite`.
- **export_final runs `rlsched export` in a child process** with JAX on CPU: a task's driver holds no weights
  and never imports JAX (a process that touches JAX on a TPU host may claim the chips).

JAX-free to import (the task's driver imports it); JAX comes in where a leaf or a model is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from workers.models.filemodes import as_user_made

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's default shard size
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_INDEX = "model.safetensors.index.json"


class ExportError(ValueError):
    """A run, task or checkpoint that cannot be exported as asked; the message says what exists instead."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint of one task, and the model directory its arrays belong to."""

    task: str
    step: int
    path: Path  # <run>/tasks/<task>/checkpoints/<step>
    model_dir: Path  # the task's model.path: config.json and the tokenizer

    def describe(self) -> str:
        return f"checkpoint {self.step} of task {self.task} ({self.path})"


@dataclasses.dataclass(frozen=True)
class Exported:
    checkpoint: Checkpoint
    out: Path
    files: list[str]  # the safetensors files written
    num_params: int
    dtype: str

    def describe(self) -> str:
        return (f"exported {self.checkpoint.describe()} to {self.out}: {self.num_params / 1e6:.2f}M params, "
                f"{self.dtype}, {len(self.files)} safetensors file(s), tokenizer from {self.checkpoint.model_dir}")


# ---- which checkpoint -----------------------------------------------------------------------------------------


def _is_step_dir(path: Path) -> bool:
    """A complete checkpoint: rlsched's index.json, or orbax's `state` item (a role across hosts)."""
    return path.name.isdigit() and ((path / "index.json").is_file() or (path / "state").is_dir())


def is_checkpoint_source(path: str | Path) -> bool:
    """A run directory, a task's directory, its checkpoints/ or one checkpoint (what `find_checkpoint` takes)."""
    path = Path(path)
    return path.is_dir() and (_is_step_dir(path) or path.name == "checkpoints" or (path / "checkpoints").is_dir()
                              or (path / "tasks").is_dir())


def find_checkpoint(path: str | Path, *, task: str | None = None, step: int | None = None) -> Checkpoint:
    """The checkpoint `path` names: a run directory (runs/<experiment>; `task` picks one of several tasks), a
    task's directory, its checkpoints/ directory, or one checkpoint. `step` picks a checkpoint (default: the last
    one)."""
    path = Path(path).absolute()
    if not path.exists():
        raise ExportError(f"{path} does not exist; give a run directory (runs/<experiment>), a task's directory "
                          "(runs/<experiment>/tasks/<task>) or a checkpoint (.../checkpoints/<step>)")
    if _is_step_dir(path):
        if step is not None and step != int(path.name):
            raise ExportError(f"--step {step} contradicts {path}, which is checkpoint {path.name}")
        task_dir, step = path.parent.parent, int(path.name)
    elif path.name == "checkpoints" and path.is_dir():
        task_dir = path.parent
    elif (path / "checkpoints").is_dir():
        task_dir = path
    elif (path / "tasks").is_dir():
        task_dir = path / "tasks" / _pick_task(path, task)
    else:
        raise ExportError(f"{path} is not a run directory (runs/<experiment>, holding tasks/), a task's directory "
                          "or a checkpoint (.../checkpoints/<step>)")
    if task is not None and task != task_dir.name:
        raise ExportError(f"--task {task} contradicts {path}, which is task {task_dir.name}'s")
    steps = sorted(int(p.name) for p in (task_dir / "checkpoints").iterdir() if _is_step_dir(p)) \
        if (task_dir / "checkpoints").is_dir() else []
    if not steps:
        raise ExportError(f"task {task_dir.name} has no checkpoint in {task_dir / 'checkpoints'}; set its "
                          "checkpoint_every (0 keeps no weights; unset, the last step is saved) or export_final: true")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"task {task_dir.name} has no checkpoint {step}; its checkpoints are steps "
                          f"{', '.join(map(str, steps))}")
    return Checkpoint(task_dir.name, step, task_dir / "checkpoints" / str(step), _model_dir(task_dir))


def _pick_task(run_dir: Path, task: str | None) -> str:
    tasks = sorted(p.name for p in (run_dir / "tasks").iterdir() if p.is_dir())
    if task is None and len(tasks) == 1:
        return tasks[0]
    if task is None:
        raise ExportError(f"{run_dir} holds {len(tasks)} tasks ({', '.join(tasks) or 'none'}); choose one with "
                          "--task NAME")
    if task not in tasks:
        raise ExportError(f"{run_dir} has no task {task!r}; its tasks are {', '.join(tasks) or 'none'}")
    return task


def _model_dir(task_dir: Path) -> Path:
    """The task's model.path (hparams.json). Relative, it is relative to where `rlsched train` ran: the
    directory that holds `output_dir/<experiment>`, or else this process's working directory."""
    hparams = task_dir / "hparams.json"
    try:
        given = json.loads(hparams.read_text())["model"]["path"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExportError(f"{hparams} is missing or unreadable ({type(err).__name__}: {err}); it names the task's "
                          "model directory, whose config.json and tokenizer an export needs") from None
    if Path(given).is_absolute():
        candidates = [Path(given)]
    else:
        candidates = [base / given for base in (_launch_dir(task_dir.parent.parent), Path.cwd()) if base is not None]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    raise ExportError(f"the model directory of task {task_dir.name} (model.path {given!r} in {hparams}) has no "
                      f"config.json at {' or '.join(map(str, dict.fromkeys(candidates)))}; the export takes the "
                      "model's config.json and tokenizer from there")


def _launch_dir(run_dir: Path) -> Path | None:
    """Where `rlsched train` ran, from the run's config.yaml: run_dir is <there>/<output_dir>/<experiment>."""
    import yaml

    try:
        experiment = yaml.safe_load((run_dir / "config.yaml").read_text())["experiment"]
        tail = Path(experiment.get("output_dir", "runs")) / experiment["name"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    if tail.is_absolute() or ".." in tail.parts or run_dir.parts[-len(tail.parts):] != tail.parts:
        return None
    return Path(*run_dir.parts[: -len(tail.parts)])


# ---- the leaves of a checkpoint -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Leaf:
    name: str  # rlsched flat name (workers.models.params): model.layers.0.self_attn.q_proj.kernel
    dtype: np.dtype
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]  # the whole logical array (a view of the file where it can be)


_KEY_PART = re.compile(r"\[(?:'([^']*)'|(\d+))\]")


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":  # numpy has none; ml_dtypes' is JAX's
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _leaves(ckpt: Checkpoint) -> list[_Leaf]:
    """The params of a checkpoint, leaf by leaf, without reading any array yet."""
    if (ckpt.path / "index.json").is_file():
        return _state_bin_leaves(ckpt)
    return _orbax_leaves(ckpt)


def _state_bin_leaves(ckpt: Checkpoint) -> list[_Leaf]:
    index = json.loads((ckpt.path / "index.json").read_text())["leaves"]
    blob = ckpt.path / "state.bin"
    size = blob.stat().st_size
    data = np.memmap(blob, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    out = []
    for entry in index:
        # .params['model']['layers'][0]['self_attn']['q_proj']['kernel'].value (a model's nnx state), or
        # .params['model.layers.0.self_attn.q_proj.lora_a'] (a LoRA adapter: a flat dict)
        key = entry["key"]
        if not key.startswith(".params["):
            continue  # the optimizer's state and the step count
        if entry["offset"] + entry["nbytes"] > size:
            raise ExportError(f"{ckpt.describe()}: state.bin is truncated at {key}")
        name = ".".join(a or b for a, b in _KEY_PART.findall(key[len(".params"):].removesuffix(".value")))
        dtype, shape = _np_dtype(entry["dtype"]), tuple(entry["shape"])
        view = data[entry["offset"]: entry["offset"] + entry["nbytes"]]
        out.append(_Leaf(name, dtype, shape, lambda v=view, d=dtype, s=shape: v.view(d).reshape(s)))
    return out


def _orbax_leaves(ckpt: Checkpoint) -> list[_Leaf]:
    """An orbax checkpoint (an actor across hosts): each leaf restored alone, whole, as a host array."""
    import jax
    import orbax.checkpoint as ocp

    where = ckpt.path / "state"
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(where).item_metadata
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict) or "params" not in tree:
        raise ExportError(f"{ckpt.describe()}: orbax's state holds no params")

    def nest(path, value):
        for key in reversed(path):
            value = {key.key: value}
        return value

    def read(path, meta) -> np.ndarray:
        args = ocp.args.PyTreeRestore(item=nest(path, meta), restore_args=nest(path, ocp.RestoreArgs(
            restore_type=np.ndarray)), partial_restore=True)
        value = checkpointer.restore(where, args=args)
        for key in path:
            value = value[key.key]
        return value

    out = []
    for path, meta in jax.tree_util.tree_flatten_with_path(tree["params"])[0]:
        path = (jax.tree_util.DictKey("params"), *path)
        keys = [str(k.key) for k in path[1:]]
        if keys[-1] == "value":
            keys = keys[:-1]
        out.append(_Leaf(".".join(keys), np.dtype(meta.dtype), tuple(meta.shape),
                         lambda p=path, m=meta: read(p, m)))
    return out


def _checked(ckpt: Checkpoint):
    """(the model config with the checkpoint's dtype, its leaves), after checking that the checkpoint holds
    exactly the parameters config.json describes."""
    from workers.models.config import ModelConfig

    cfg = ModelConfig.from_dir(ckpt.model_dir)
    leaves = _leaves(ckpt)
    got, want = {leaf.name: leaf.shape for leaf in leaves}, cfg.param_shapes()
    if got != want:
        missing, unexpected = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        wrong = [f"{k} {got[k]} vs {want[k]}" for k in sorted(want.keys() & got.keys()) if got[k] != want[k]]
        raise ExportError(f"{ckpt.describe()} does not hold the parameters of {ckpt.model_dir / 'config.json'} "
                          f"(did the model directory change after the run?): missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]}, other shapes {wrong[:4]}")
    dtypes = sorted({leaf.dtype.name for leaf in leaves})
    if len(dtypes) != 1 or dtypes[0] not in _SAFETENSORS_DTYPES:
        raise ExportError(f"{ckpt.describe()}: parameters of dtype(s) {dtypes}; an export writes one of "
                          f"{sorted(_SAFETENSORS_DTYPES)}")
    dtype = _model_dtype(ckpt) or dtypes[0]
    if dtype != dtypes[0]:  # a bfloat16 task's float32 master (workers.actor): rounded as the engine was served it
        target = _np_dtype(dtype)
        leaves = [_Leaf(leaf.name, target, leaf.shape, lambda leaf=leaf: leaf.read().astype(target)) for leaf in leaves]
    return cfg.replace(dtype=dtype), leaves


def _model_dtype(ckpt: Checkpoint) -> str | None:
    """The task's model.dtype (its hparams.json), which an export writes: a bfloat16 task's checkpoint holds
    float32 master weights. None where hparams.json does not say (the leaves' dtype is written then)."""
    try:
        dtype = json.loads((ckpt.path.parent.parent / "hparams.json").read_text())["model"]["dtype"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dtype if dtype in _SAFETENSORS_DTYPES else None


# ---- writing ---------------------------------------------------------------------------------------------------


def export(path: str | Path, out: str | Path, *, task: str | None = None, step: int | None = None,
           overwrite: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES, merge: bool = False) -> Exported:
    """Write checkpoint `step` (default: the last) of `task` in the run (or task, or checkpoint) at `path` as a
    Hugging Face model directory at `out` (see the module docstring); a LoRA task's as a PEFT adapter, or with
    `merge` as its merged model."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; the export writes a directory there")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty; pass --overwrite to replace it, or choose another directory")
    ckpt = find_checkpoint(path, task=task, step=step)
    lora = _lora_of(ckpt)
    if lora is not None:
        return _export_adapter(ckpt, lora, out, merge=merge)
    if merge:
        raise ExportError(f"--merge merges a LoRA adapter into its base, but task {ckpt.task} trains every weight "
                          "(no tasks[i].lora): its export is the whole model already; drop --merge")
    cfg, leaves = _checked(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = _write_weights(tmp, leaves, max_shard_bytes, metadata={
            "format": "pt", "rlsched_task": ckpt.task, "rlsched_step": str(ckpt.step)})
        raw = json.loads((ckpt.model_dir / "config.json").read_text())  # the model's own keys, kept as they are
        raw["torch_dtype"] = raw["dtype"] = cfg.dtype
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        if (ckpt.model_dir / "generation_config.json").is_file():
            shutil.copy2(ckpt.model_dir / "generation_config.json", tmp)
        else:
            generation = {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
            (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in generation.items()
                                                                    if v is not None}))
        for name in TOKENIZER_FILES:
            if (ckpt.model_dir / name).is_file():
                shutil.copy2(ckpt.model_dir / name, tmp)
        as_user_made(tmp)  # mkdtemp makes it 0700; the copied tokenizer files keep the model directory's modes
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(ckpt, out, files, cfg.num_params, cfg.dtype)


def _lora_of(ckpt: Checkpoint):
    """The LoraSpec of a LoRA task (its hparams.json's `lora`), else None."""
    from workers.models.lora import LoraSpec

    section = json.loads((ckpt.path.parent.parent / "hparams.json").read_text()).get("lora")
    return None if section is None else LoraSpec(section["rank"], section["alpha"], tuple(section["targets"]))


def _export_adapter(ckpt: Checkpoint, spec, out: Path, *, merge: bool) -> Exported:
    """A LoRA checkpoint's adapter as PEFT's files, or merged into its base (workers.models.peft_files: both
    atomic, both checked against the base's config.json first). A merged adapter on the head of a base that
    ties its embeddings is written untied: lm_head.weight of its own, tie_word_embeddings false in config.json."""
    from workers.models import peft_files
    from workers.models.config import ModelConfig
    from workers.models.lora import adapter_shapes

    cfg = ModelConfig.from_dir(ckpt.model_dir)
    adapter = {leaf.name: np.asarray(leaf.read()) for leaf in _leaves(ckpt)}
    try:
        if merge:
            peft_files.save_merged(out, ckpt.model_dir, adapter, spec)
        else:
            peft_files.save_adapter(out, adapter, spec, cfg, base_model=str(ckpt.model_dir))
    except peft_files.AdapterError as err:
        raise ExportError(f"{ckpt.describe()}: {err}") from None
    files = ["model.safetensors"] if merge else [peft_files.ADAPTER_WEIGHTS]
    if merge and cfg.tie_word_embeddings and "lm_head" in spec.targets:
        cfg = cfg.replace(tie_word_embeddings=False)  # save_merged untied the head: the model has one more matrix
    params = cfg.num_params if merge else sum(int(np.prod(s)) for s in adapter_shapes(cfg, spec).values())
    return Exported(ckpt, out, files, params, cfg.dtype if merge else "float32")


def _replace_dir(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old)


def _write_weights(directory: Path, leaves: list[_Leaf], max_shard_bytes: int, metadata: dict[str, str]) -> list[str]:
    """The safetensors file(s): tensors laid out from the shapes alone, then written leaf by leaf."""
    from workers.models.params import to_hf

    # (hf name, leaf, shape): to_hf of a zero-stride stand-in gives each tensor's name and shape, no bytes.
    tensors = [(hf, i, tuple(t.shape)) for i, leaf in enumerate(leaves)
               for hf, t in to_hf({leaf.name: np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)}).items()]
    shards: list[list[tuple[str, int, tuple[int, ...]]]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = _nbytes(tensor[2], leaves[tensor[1]].dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    current: dict[int, np.ndarray] = {}  # the one leaf held: each is read once (a leaf's tensors are adjacent)

    def tensor_of(hf: str, i: int) -> np.ndarray:
        if i not in current:
            current.clear()
            current[i] = leaves[i].read()
        return to_hf({leaves[i].name: current[i]})[hf]

    for name, shard in zip(names, shards, strict=True):
        _write_safetensors(directory / name, shard, leaves, tensor_of, metadata)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(s, leaves[i].dtype) for _, i, s in tensors)},
                 "weight_map": {hf: name for name, shard in zip(names, shards, strict=True) for hf, _, _ in shard}}
        (directory / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _write_safetensors(path: Path, shard, leaves: list[_Leaf], tensor_of, metadata: dict[str, str]) -> None:
    """safetensors: an 8-byte little-endian header length, the JSON header (padded with spaces to 8 bytes), then
    each tensor's C-order bytes at its offsets."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for hf, i, shape in shard:
        nbytes = _nbytes(shape, leaves[i].dtype)
        header[hf] = {"dtype": _SAFETENSORS_DTYPES[leaves[i].dtype.name], "shape": list(shape),
                      "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for hf, i, _ in shard:
            np.ascontiguousarray(tensor_of(hf, i)).tofile(f)  # one tensor's copy (a transpose) at most
        f.flush()
        os.fsync(f.fileno())


# ---- using a checkpoint without exporting it --------------------------------------------------------------------


def load_model(ckpt: Checkpoint, *, dtype: str | None = None):
    """(model, tokenizer) of a checkpoint, as `workers.models.load_pretrained` gives them for a model directory."""
    import jax.numpy as jnp
    from flax import nnx

    from workers.models import params as P
    from workers.models.checkpoint import abstract_model
    from workers.models.tokenizer import load_tokenizer

    cfg, leaves = _checked(ckpt)
    cfg = cfg.replace(dtype=dtype) if dtype is not None else cfg
    target = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: abstract_model(cfg)))
    flat = {leaf.name: jnp.asarray(leaf.read(), dtype=target) for leaf in leaves}
    state = P.from_flat(abstract, flat, source=ckpt.describe())
    return nnx.merge(graphdef, state), load_tokenizer(ckpt.model_dir)


def export_final(task_dir: str | Path, step: int) -> str:
    """`export_final: true`: checkpoint `step` (the run's last) of the task at `task_dir` into `task_dir/final/`,
    by `rlsched export` in a child process with JAX on CPU (see the module docstring). Returns its line."""
    from rlsched.base.errors import TaskError

    task_dir = Path(task_dir)
    command = [sys.executable, "-m", "rlsched.cli", "export", str(task_dir), str(task_dir / "final"), "--step",
               str(step), "--overwrite"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        raise TaskError(f"task {task_dir.name}: export_final failed: {lines[-1]}")
    return f"[{task_dir.name}] {done.stdout.strip()}"
