"""Hugging Face format in and out: config.json + model.safetensors (or a sharded index) + tokenizer.

`load_pretrained(path)` is the only way a model enters rlsched; `save_pretrained` writes a
directory that `transformers.AutoModelForCausalLM` loads unchanged. Writes are atomic: files go to
a temporary sibling directory that is renamed into place, so a crash never leaves half a model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from workers.models import params as P
from workers.models.config import ModelConfig, ModelConfigError
from workers.models.decoder import CausalLM
from workers.models.filemodes import as_user_made

_INDEX = "model.safetensors.index.json"


def _check_dir(path: Path) -> None:
    if not path.exists():
        raise ModelConfigError(
            f"model directory {path} does not exist; create a local one with `rlsched init-model --preset tiny {path}`")
    if not path.is_dir():
        raise ModelConfigError(f"{path} is a file; a model is a directory holding config.json and *.safetensors")


def _weight_files(path: Path) -> list[Path]:
    if (path / _INDEX).is_file():
        index = json.loads((path / _INDEX).read_text())
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise ModelConfigError(
        f"{path} has no model.safetensors (nor {_INDEX}); rlsched reads safetensors weights only")


def read_safetensors(path: str | Path) -> dict[str, jnp.ndarray]:
    """All tensors of a model directory as host arrays, keyed by Hugging Face name."""
    path = Path(path)
    out: dict[str, jnp.ndarray] = {}
    for file in _weight_files(path):
        # numpy has no bfloat16; the flax framework yields jax arrays that keep the stored dtype.
        with safe_open(str(file), framework="flax") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                out[key] = f.get_tensor(key)
    return out


def abstract_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """A randomly initialised model (std = config.initializer_range, norms at 1), as HF initialises."""
    return CausalLM(cfg, rngs=nnx.Rngs(seed))


def load_pretrained(path: str | Path, *, dtype: str | None = None, with_tokenizer: bool = True):
    """Load a model directory of any supported family (config.json's model_type) -> (model, tokenizer).

    dtype: override the stored parameter dtype ("float32" or "bfloat16"); weights are cast once at load.
    with_tokenizer: False returns (model, None) for directories without tokenizer files.
    """
    path = Path(path)
    _check_dir(path)
    cfg = ModelConfig.from_dir(path)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    tokenizer = None
    if with_tokenizer:  # imported here: the tokenizer brings in transformers (~0.8 s of CPU), which a role
        from workers.models.tokenizer import load_tokenizer  # process loading weights alone never needs

        tokenizer = load_tokenizer(path)
    tensors = read_safetensors(path)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters write the tied head anyway
    target = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    tensors = {k: v.astype(target) for k, v in tensors.items()}
    # Build on abstract shapes: no random init work for weights we are about to overwrite.
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: abstract_model(cfg)))
    expected = {P.name_of(path) for path, _ in nnx.to_flat_state(abstract)}
    state = P.from_flat(abstract, P.from_hf(tensors, expected), source=f"{path}/*.safetensors")
    return nnx.merge(graphdef, state), tokenizer


def save_pretrained(model: CausalLM, path: str | Path, tokenizer=None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files) atomically into `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
        flat = {k: jnp.asarray(v) for k, v in P.to_hf(P.to_flat(nnx.state(model, nnx.Param))).items()}
        save_file(flat, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        gen = {"eos_token_id": model.config.eos_token_id, "pad_token_id": model.config.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}))
        if tokenizer is not None:
            from workers.models.tokenizer import save_tokenizer

            save_tokenizer(tokenizer, tmp)
        as_user_made(tmp)  # mkdtemp's 0700 and save_file's 0600: the modes of any file the user makes
        if path.exists():
            backup = path.with_name(f".{path.name}.old")
            os.replace(path, backup)
            os.replace(tmp, path)
            shutil.rmtree(backup)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
