"""A LoRA adapter as PEFT's files, and the merged model it stands for.

    save_adapter(out, adapter, spec, cfg, base_model="Qwen/Qwen3-0.6B")   # out/adapter_config.json
    adapter, spec = load_adapter(out)                                       #    /adapter_model.safetensors
    save_merged("merged", base_dir, adapter, spec)                          # a full Hugging Face model

An adapter directory is what `peft.PeftModel.save_pretrained` writes for a LoRA on a causal LM, so
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)` loads it unchanged, and
`load_adapter` reads one written by peft itself. In the safetensors file each adapted projection has

    base_model.model.<module>.lora_A.weight   (r, in)    = lora_a.T
    base_model.model.<module>.lora_B.weight   (out, r)   = lora_b.T

torch's (out, in) orientation of rlsched's (in, r) / (r, out) arrays (workers/models/lora.py), and
adapter_config.json says peft_type LORA, r, lora_alpha (scale = alpha / r, as rlsched's) and target_modules by
their Hugging Face names (q_proj ... down_proj, lm_head). The output head's tensors are
base_model.model.lm_head.lora_A/B.weight, tied base or not: PEFT adapts the head's output either way (on a tied
base it warns that `ensure_weight_tying` is off; on, it would adapt the embedding's lookups too, which rlsched's
adapter does not, so it stays off).

Design decisions:
- Adapter files are numpy, safetensors and json only: a process that holds an adapter's arrays writes them without
  JAX. `save_merged` builds the model with rlsched's own decoder and `save_pretrained`, so JAX is imported there.
- Only what rlsched's layout can express is read: every layer adapted alike, one rank and alpha, no DoRA,
  no rsLoRA, no bias or modules_to_save. Anything else is refused by name, never approximated.
- A merged head of a base that ties its embeddings is untied (lora.merged): the merged model has its own
  lm_head.weight and says tie_word_embeddings false, the embedding stays the base's.
- Writes are atomic: files go to a temporary sibling directory that replaces `out` in one rename, so a failure
  (a missing tensor, a full disk) leaves the old directory, or none, and never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import safetensors
from safetensors.numpy import save_file

from workers.models.config import ModelConfig
from workers.models.filemodes import as_user_made
from workers.models.lora import HEAD, LAYER_TARGETS, MODEL_TARGETS, TARGETS, LoraSpec, adapter_shapes, merged

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Tokenizer files a model directory may hold; save_merged copies those its base has.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")

# rlsched target -> the projection's Hugging Face module name (what PEFT's target_modules lists), and back.
HF_NAMES = {t: path.rsplit(".", 1)[-1] for t, path in TARGETS.items()}
_TARGET_OF = {name: t for t, name in HF_NAMES.items()}
# PeftModel wraps the causal LM (base_model) which wraps the transformers model (.model): two prefixes.
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.\w+\.(\w+))\.lora_([AB])\.weight")
_HEAD_TENSOR = re.compile(r"base_model\.model\.(lm_head)\.lora_([AB])\.weight")
# numpy has no bfloat16 of its own: ml_dtypes' (which JAX's arrays use) is what a bf16 adapter reads back as.
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class AdapterError(ValueError):
    """An adapter (arrays or a directory) rlsched cannot write or read; the message names the file or tensor."""


def _check_adapter(adapter: Mapping[str, object], spec: LoraSpec, cfg: ModelConfig) -> None:
    """AdapterError naming the tensors an adapter lacks, has too many of, or holds in the wrong shape for `spec`
    on `cfg`'s model."""
    expected = adapter_shapes(cfg, spec)
    missing, unexpected = sorted(expected.keys() - adapter.keys()), sorted(adapter.keys() - expected.keys())
    if missing or unexpected:
        raise AdapterError(f"adapter of rank {spec.rank} on {list(spec.targets)} ({cfg.describe()}, "
                           f"{cfg.num_hidden_layers} layers): missing tensors {missing[:4]}"
                           f"{'...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                           f"{'...' if len(unexpected) > 4 else ''}")
    for name, shape in expected.items():
        got = tuple(np.shape(adapter[name]))
        if got != shape:
            raise AdapterError(f"adapter tensor {name} has shape {got}; rank {spec.rank} on {cfg.describe()} "
                               f"needs {shape}")


def adapter_config(spec: LoraSpec, *, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for a LoRA on a causal LM: the fields every peft since 0.9 reads,
    each set to what rlsched's layout means (newer fields keep their defaults, so older peft loads it too)."""
    alpha = float(spec.alpha)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": None,
        "inference_mode": True,
        "r": spec.rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": 0.0,
        "target_modules": [HF_NAMES[t] for t in spec.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "auto_mapping": None,
    }


def to_peft_tensors(adapter: Mapping[str, object], spec: LoraSpec, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """rlsched's adapter arrays -> PEFT's tensor names and (out, in) orientation, checked against `cfg` first."""
    _check_adapter(adapter, spec, cfg)
    out = {}
    for name, value in adapter.items():
        module, kind = name.rsplit(".", 1)
        letter = "A" if kind == "lora_a" else "B"
        out[f"{_PREFIX}{module}.lora_{letter}.weight"] = np.ascontiguousarray(np.asarray(value).T)
    return out


@contextlib.contextmanager
def _staged(path: Path) -> Iterator[Path]:
    """A directory path to fill (not yet created) that replaces `path` in one rename when the block ends well;
    whatever the block wrote is removed if it raises. An existing `path` is swapped out, then deleted."""
    if path.exists() and not path.is_dir():
        raise AdapterError(f"{path} is a file; give a directory to write into (it is replaced if it exists)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))  # same filesystem: renames are atomic
    try:
        stage = tmp / path.name
        yield stage
        if not path.exists():
            os.replace(stage, path)
            return
        os.replace(path, tmp / "replaced")  # renaming onto a non-empty directory fails, so swap it out first
        try:
            os.replace(stage, path)
        except BaseException:
            os.replace(tmp / "replaced", path)  # the old directory back, never none
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_adapter(out_dir: str | Path, adapter: Mapping[str, object], spec: LoraSpec, cfg: ModelConfig, *,
                 base_model: str) -> Path:
    """Write `adapter` (rlsched's layout, for `spec` on `cfg`'s model) as PEFT's adapter_config.json +
    adapter_model.safetensors into out_dir, atomically. base_model: what the config's base_model_name_or_path
    says (a hub id or the base's directory; PEFT loads the base from it only when asked to)."""
    out_dir = Path(out_dir)
    with _staged(out_dir) as stage:
        stage.mkdir()
        (stage / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(spec, base_model=base_model), indent=2) + "\n")
        save_file(to_peft_tensors(adapter, spec, cfg), str(stage / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        as_user_made(stage)  # save_file writes 0600
    return out_dir


def _read_tensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a numpy array (bf16 as ml_dtypes' bfloat16), read without a framework."""
    import ml_dtypes  # noqa: F401 - registers numpy's "bfloat16" dtype name

    try:
        items = safetensors.deserialize(file.read_bytes())
    except Exception as err:  # SafetensorError: a truncated or foreign file
        raise AdapterError(f"{file} is not a readable safetensors file ({err})") from None
    out = {}
    for name, view in items:
        if view["dtype"] not in _DTYPES:
            raise AdapterError(f"{file}: tensor {name} is {view['dtype']}; adapters are float (F32, BF16, F16)")
        out[name] = np.frombuffer(view["data"], dtype=_DTYPES[view["dtype"]]).reshape(view["shape"]).copy()
    return out


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist (or is not a directory)")
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise AdapterError(f"{path} has no {ADAPTER_CONFIG}; an adapter directory holds {ADAPTER_CONFIG} and "
                           f"{ADAPTER_WEIGHTS}, as rlsched's save_adapter and peft's save_pretrained write them")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise AdapterError(f"{file} is not valid JSON ({err})") from None
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{file}: peft_type is {config.get('peft_type')!r}; rlsched reads LoRA adapters only "
                           "(peft_type \"LORA\")")
    refused = {"use_dora": "DoRA", "use_rslora": "rsLoRA's alpha / sqrt(r) scale", "fan_in_fan_out": "fan_in_fan_out",
               "lora_bias": "a LoRA bias", "rank_pattern": "per-module ranks (rank_pattern)",
               "alpha_pattern": "per-module alphas (alpha_pattern)", "modules_to_save": "modules_to_save",
               "layers_to_transform": "a subset of layers (layers_to_transform)"}
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{file}: {key} = {config[key]!r}; rlsched's adapters have no {what}: export the "
                               "adapter without it")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias = {config['bias']!r}; rlsched's adapters train no biases (bias \"none\")")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(f"{file}: r = {config.get('r')!r}; the rank must be a positive integer")
    if not isinstance(config.get("lora_alpha"), int | float) or config["lora_alpha"] <= 0:
        raise AdapterError(f"{file}: lora_alpha = {config.get('lora_alpha')!r}; it must be a number > 0")
    return config


def load_adapter(path: str | Path, cfg: ModelConfig | None = None) -> tuple[dict[str, np.ndarray], LoraSpec]:
    """An adapter directory (save_adapter's or peft's) -> (arrays in rlsched's layout, LoraSpec).

    Every tensor's shape is checked against the config's rank (and, with `cfg`, against the model's
    projections); targets are ordered as target_modules lists them.
    """
    path = Path(path)
    config = _read_config(path)
    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        legacy = " (adapter_model.bin is pickled torch; re-save it with safe_serialization)" if (
            path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{path} has no {ADAPTER_WEIGHTS}{legacy}")
    rank = config["r"]
    adapter, layers, targets = {}, {}, set()
    for name, tensor in _read_tensors(file).items():
        match, head = _TENSOR.fullmatch(name), _HEAD_TENSOR.fullmatch(name)
        target = _TARGET_OF.get(match[3]) if match else HEAD if head else None
        if head:
            module, letter = HEAD, head[2]
        elif target is None or target in MODEL_TARGETS or match[1] != f"model.layers.{match[2]}.{TARGETS[target]}":
            raise AdapterError(f"{file}: tensor {name} is not a LoRA A or B of a projection rlsched adapts "
                               f"({', '.join(HF_NAMES[t] for t in LAYER_TARGETS)} of model.layers.<i>, or "
                               f"{', '.join(MODEL_TARGETS)})")
        else:
            module, letter = match[1], match[4]
        want = "(r, in)" if letter == "A" else "(out, r)"
        if tensor.ndim != 2 or tensor.shape[0 if letter == "A" else 1] != rank:
            raise AdapterError(f"{file}: tensor {name} has shape {tuple(tensor.shape)}; with r = {rank} in "
                               f"{ADAPTER_CONFIG} it must be {want}")
        adapter[f"{module}.lora_{letter.lower()}"] = np.ascontiguousarray(tensor.T)
        if not head:
            layers.setdefault(target, set()).add(int(match[2]))
        targets.add(target)
    if not adapter:
        raise AdapterError(f"{file} holds no LoRA tensors")
    for name in list(adapter):
        module, kind = name.rsplit(".", 1)
        pair = f"{module}.{'lora_b' if kind == 'lora_a' else 'lora_a'}"
        if pair not in adapter:
            raise AdapterError(f"{file}: {module} has lora_{kind[-1].upper()} but no lora_{pair[-1].upper()}")
    listed = config.get("target_modules")
    listed = [_TARGET_OF[m] for m in listed if m in _TARGET_OF] if isinstance(listed, list) else []
    absent = [HF_NAMES[t] for t in listed if t not in targets]
    if absent:
        raise AdapterError(f"{path}: {ADAPTER_CONFIG} targets {absent} but {ADAPTER_WEIGHTS} has no tensors for them")
    first = next(iter(layers.values()), set())
    for target, seen in layers.items():
        if seen != first or seen != set(range(len(seen))):
            raise AdapterError(f"{file}: {HF_NAMES[target]} is adapted in layers {sorted(seen)}, other targets in "
                               f"{sorted(first)}; rlsched adapts every layer alike")
    ordered = [t for t in listed if t in targets] + [t for t in TARGETS if t in targets and t not in listed]
    try:
        spec = LoraSpec(rank=rank, alpha=config["lora_alpha"], targets=tuple(ordered))
    except ValueError as err:  # ModelConfigError: a rank or alpha out of range
        raise AdapterError(f"{path / ADAPTER_CONFIG}: {err}") from None
    if cfg is not None:
        try:
            _check_adapter(adapter, spec, cfg)
        except AdapterError as err:
            raise AdapterError(f"{path} does not fit the model: {err}") from None
    return adapter, spec


def save_merged(out_dir: str | Path, base_dir: str | Path, adapter: Mapping[str, object], spec: LoraSpec) -> Path:
    """The full model `adapter` stands for on the base in base_dir (every adapted kernel K + alpha/r A B, see
    lora.merged) as a Hugging Face model directory: config.json + model.safetensors by rlsched's save_pretrained,
    and the base's tokenizer files copied. transformers.AutoModelForCausalLM loads it unchanged. Atomic.

    An adapted head of a base that ties its embeddings unties the merged model: it has its own lm_head.weight and
    its config.json says tie_word_embeddings false (the embedding is the base's)."""
    from workers.models.checkpoint import save_pretrained

    out_dir, base_dir = Path(out_dir), Path(base_dir)
    if out_dir.exists() and base_dir.exists() and out_dir.resolve() == base_dir.resolve():
        raise AdapterError(f"{out_dir} is the base model's directory; write the merged model elsewhere")
    model = merged_model(base_dir, adapter, spec)
    with _staged(out_dir) as stage:
        save_pretrained(model, stage)
        for name in TOKENIZER_FILES:
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, stage / name)
        as_user_made(stage)  # save_pretrained's staging directory is mkdtemp's 0700; copy2 keeps the base's modes
    return out_dir


def merged_model(base_dir: str | Path, adapter: Mapping[str, object], spec: LoraSpec, *, dtype: str | None = None):
    """The model (CausalLM) `adapter` stands for on the base in base_dir: every adapted kernel K + alpha/r A B
    (lora.merged), untied when the head of a tied base is adapted (see save_merged). `dtype` overrides the base's."""
    from flax import nnx

    from workers.models import params as P
    from workers.models.checkpoint import load_pretrained
    from workers.models.decoder import CausalLM

    model, _ = load_pretrained(base_dir, dtype=dtype, with_tokenizer=False)
    _check_adapter(adapter, spec, model.config)
    weights = merged(P.host_params(model), {k: np.asarray(v) for k, v in adapter.items()}, spec)
    if model.config.tie_word_embeddings and f"{HEAD}.kernel" in weights:  # untied: a model with its own head
        untied = model.config.replace(tie_word_embeddings=False)
        model = nnx.eval_shape(lambda: CausalLM(untied, rngs=nnx.Rngs(0)))  # shapes only: filled below
    nnx.update(model, P.from_flat(nnx.state(model, nnx.Param), weights, source=f"{base_dir} merged with the adapter"))
    return model
