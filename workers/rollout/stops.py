"""Which tokens end a completion: every end token the model's files name, not only the tokenizer's one.

A model may name several: Qwen3's `generation_config.json` lists `<|im_end|>` (151645), which ends a chat turn,
and `<|endoftext|>` (151643), which ends a document, while its tokenizer's `eos_token` is one of them.
transformers' `generate` stops at any id the generation config lists; an engine given only the tokenizer's would
run a completion that emits the other on to max_new_tokens, scoring and training on the padding it writes after.

Host work (json only, no JAX): the task's driver chooses the ids and every engine stops at them
(`SamplingParams.stop_token_ids`).
"""

from __future__ import annotations

import json
from pathlib import Path


class StopTokenError(ValueError):
    """A model file names an end token that is not a token id."""


def end_token_ids(model_dir: str | Path, tokenizer=None) -> tuple[int, ...]:
    """The ids that end a completion, in order, each once: the tokenizer's `eos_token_id` first (when given), then
    `eos_token_id` of the directory's generation_config.json and of its config.json (an int or a list in each;
    either file may be absent)."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise StopTokenError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
            ids.append(token)
    return tuple(dict.fromkeys(ids))
