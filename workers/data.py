"""Prompt datasets: finite files (JSONL, parquet, GSM8K), seeded synthetic tasks, a resumable loader, templating.

Design decisions:
- Every source is a `PromptSource`: `size` (an int, or None for an infinite generator) and
  `source[i] -> Prompt`. The loader reads only those two, so finite and infinite sources are used the
  same way. Infinite generators define no `__len__`: `len()` of an infinite thing should fail loudly.
- A `Prompt` carries a stable `uid` ("gsm8k-train:17", "addition:s0:42") so metrics, logs and
  rollouts can be traced back to the record that produced them across restarts.
- Synthetic prompt i is a pure function of (seed, i) through `np.random.default_rng([seed, i])`: no
  hidden generator state, so any index can be regenerated and resuming needs only a position.
  Prompts are short ("3+5=") because tiny byte-level models learn short prompts faster.
- The second synthetic task is subtraction with a non-negative result (a >= b): the same operand
  space as addition, but a different function, so two concurrent tasks are distinguishable; every
  answer is at most max_operand and never needs a "-" sign, so a from-scratch model can learn it.
- `PromptLoader` shuffles a finite source with a permutation of (seed, epoch) and wraps around
  epochs; its state is (seed, shuffle, epoch, position), JSON-serialisable, and restoring it yields
  exactly the batches the uninterrupted loader would have. A batch may span an epoch boundary, so a
  batch larger than the dataset works: it holds some prompts twice, from consecutive epochs (GRPO
  groups are per prompt instance, so that is just more samples of those prompts).
- A prompt longer than grpo.max_prompt_len is an error, skipped or truncated (data.too_long), in
  `next_fitting_batch`: a skipped prompt's place goes to the loader's next one, so batches keep their size
  and a resumed run draws the same replacements.
- Errors are `DataError` and name the file, line (or row) and field, and what was found instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from workers.rewards import extract_gsm8k_answer


class DataError(ValueError):
    """A dataset, loader state or template rlsched cannot use; the message says where and why."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    uid: str  # stable id "<source>:<index>", e.g. "gsm8k-train:17" or "addition:s0:42"
    question: str  # the question text, before any chat template
    answer: str  # ground truth the reward checks against (GSM8K: the final number only, e.g. "72")


class PromptSource(Protocol):
    size: int | None  # number of prompts; None for an infinite generator

    def __getitem__(self, index: int) -> Prompt: ...


# ---------------------------------------------------------------- finite datasets


class PromptDataset:
    """A finite, in-memory list of prompts (a Sequence: len, indexing, iteration)."""

    def __init__(self, prompts: list[Prompt], *, name: str):
        if not prompts:
            raise DataError(f"dataset {name!r} is empty; it needs at least one prompt")
        self.name, self._prompts = name, list(prompts)
        self.size: int | None = len(self._prompts)

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self._prompts[index]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self._prompts)

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, size={len(self)})"


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise DataError(f"dataset file {str(path)!r} is a directory; the path must name a file (JSONL or parquet)")
    if not path.is_file():
        raise DataError(f"dataset file {str(path)!r} does not exist; the path must name an existing file")
    return path


def _field(record: Mapping, field: str, where: str) -> str:
    if field not in record:
        raise DataError(f"{where}: record has no field {field!r}; fields present: {sorted(record)}")
    if record[field] is None:
        raise DataError(f"{where}: field {field!r} is null")
    value = record[field]
    # Numbers are fine as answers ({"answer": 42}); anything else is almost surely the wrong column.
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"{where}: field {field!r} must be a string or a number, got {type(value).__name__}")
    return str(value)


def _prompt(record: Mapping, uid: str, where: str, question_field: str, answer_field: str) -> Prompt:
    return Prompt(uid=uid, question=_field(record, question_field, where), answer=_field(record, answer_field, where))


def load_jsonl(path: str | Path, *, question_field: str = "question", answer_field: str = "answer",
               name: str | None = None) -> PromptDataset:
    """One JSON object per line (blank lines skipped); uids are "<name>:<record index>", name = file stem."""
    path = _existing(path)
    name = name or path.stem
    prompts = [_prompt(record, f"{name}:{i}", where, question_field, answer_field)
               for i, (where, record) in enumerate(jsonl_records(path))]
    return PromptDataset(prompts, name=name)


def jsonl_records(path: str | Path):
    """(`<path>:<line>`, record) for each JSON object of a JSONL file, blank lines skipped; a line that is not a
    JSON object is a DataError naming it. Lazy: reading the first record reads one line."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}): {line.strip()[:60]!r}") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def load_parquet(path: str | Path, *, question_field: str = "question", answer_field: str = "answer",
                 name: str | None = None) -> PromptDataset:
    """A parquet table with one prompt per row; uids are "<name>:<row>", name = file stem."""
    import pyarrow.parquet as pq  # only parquet users pay for the import

    path = _existing(path)
    name = name or path.stem
    columns = pq.read_schema(path).names
    for field in (question_field, answer_field):
        if field not in columns:
            raise DataError(f"{path}: no column {field!r}; columns present: {sorted(columns)}")
    rows = pq.read_table(path, columns=[question_field, answer_field]).to_pylist()
    return PromptDataset([_prompt(r, f"{name}:{i}", f"{path}: row {i}", question_field, answer_field)
                          for i, r in enumerate(rows)], name=name)


def load_gsm8k(path: str | Path | None = None, *, name: str | None = None) -> PromptDataset:
    """GSM8K JSONL (`question`, `answer` ending in "#### N"); the answer is reduced to N, commas stripped.
    `path` None: the train split shipped with rlsched (workers.datasets)."""
    from workers.datasets import GSM8K_TRAIN

    path = GSM8K_TRAIN if path is None else Path(path)
    full = load_jsonl(path, name=name or f"gsm8k-{path.stem}")
    prompts = []
    for i, p in enumerate(full):
        final = extract_gsm8k_answer(p.answer)
        if final is None:
            raise DataError(f"{path}: record {i} ({p.uid}): answer does not end in '#### <number>': "
                            f"{p.answer[-60:]!r}")
        prompts.append(dataclasses.replace(p, answer=final))
    return PromptDataset(prompts, name=full.name)


# ---------------------------------------------------------------- synthetic generators


HELDOUT_EVERY = 10  # one arithmetic problem in this many is held out of training (see `heldout`)
_MAX_DRAWS = 1000  # draws of one prompt that all land on held-out problems: every problem is held out


def heldout(question: str) -> bool:
    """Whether an arithmetic problem belongs to the held-out split: crc32 of its text is 0 modulo HELDOUT_EVERY.
    A rule of the problem's text, not of its index or seed, so every seed and every run holds out the same
    problems, and training never sees one of them (`_ArithmeticTask` draws again when it lands on one)."""
    return zlib.crc32(question.encode()) % HELDOUT_EVERY == 0


@dataclasses.dataclass(frozen=True)
class _ArithmeticTask:
    """Infinite, indexable "a<op>b=" prompts with operands in [0, max_operand]; prompt i depends only on (seed, i).
    `split` "train" (the prompts a task trains on) never yields a held-out problem (`heldout`); `problems(split)`
    lists the distinct problems of a split, for evaluation."""

    seed: int = 0
    max_operand: int = 9
    size = None  # infinite: the loader advances an index instead of shuffling epochs
    name = ""  # overridden by subclasses; also the uid prefix

    def __post_init__(self) -> None:
        for field in ("seed", "max_operand"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DataError(f"{type(self).__name__}.{field} must be an integer >= 0, got {value!r}")

    def problem(self, a: int, b: int) -> tuple[str, str]:
        """(question, answer) of operands a, b."""
        raise NotImplementedError

    def _operands(self, index: int) -> tuple[int, int]:
        if isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
            raise IndexError(f"{self.name} prompt index must be an integer >= 0, got {index!r}")
        rng = np.random.default_rng([self.seed, int(index)])
        for _ in range(_MAX_DRAWS):  # a held-out problem is drawn again: the next draw of the same stream
            a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
            if not heldout(self.problem(a, b)[0]):
                return a, b
        raise DataError(f"{self.name} with max_operand {self.max_operand}: every problem is held out for "
                        "evaluation, none is left to train on; raise data.max_operand")

    def __getitem__(self, index: int) -> Prompt:
        question, answer = self.problem(*self._operands(index))
        return Prompt(uid=f"{self.name}:s{self.seed}:{index}", question=question, answer=answer)

    def problems(self, split: Literal["train", "test", "all"]) -> PromptDataset:
        """The distinct problems of `split` ("test": the held-out ones), as operands (a, b) first give them; uids
        "<name>:<question>" (a problem's text names it whatever the seed)."""
        found: dict[str, str] = {}
        for a in range(self.max_operand + 1):
            for b in range(self.max_operand + 1):
                question, answer = self.problem(a, b)
                if split == "all" or heldout(question) == (split == "test"):
                    found.setdefault(question, answer)
        return PromptDataset([Prompt(uid=f"{self.name}:{q}", question=q, answer=ans) for q, ans in found.items()],
                             name=f"{self.name}-{split}")


class AdditionTask(_ArithmeticTask):
    name = "addition"

    def problem(self, a: int, b: int) -> tuple[str, str]:
        return f"{a}+{b}=", str(a + b)


class SubtractionTask(_ArithmeticTask):
    name = "subtraction"

    def problem(self, a: int, b: int) -> tuple[str, str]:
        a, b = max(a, b), min(a, b)  # non-negative results: no "-" sign for a tiny model to learn
        return f"{a}-{b}=", str(a - b)


SOURCES: dict[str, Callable[..., PromptSource]] = {
    "jsonl": load_jsonl, "parquet": load_parquet, "gsm8k": load_gsm8k,
    "addition": AdditionTask, "subtraction": SubtractionTask,
}


def make_source(kind: str, **kwargs) -> PromptSource:
    """Build a prompt source by kind; kwargs go to its loader or constructor (e.g. path=..., seed=...)."""
    if kind not in SOURCES:
        raise DataError(f"unknown data source kind {kind!r}; choose one of {sorted(SOURCES)}")
    fn = SOURCES[kind]
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise DataError(f"data source {kind!r}: {e}; it takes {inspect.signature(fn)}") from None
    return fn(**kwargs)


# ---------------------------------------------------------------- loader


class PromptLoader:
    """Deterministic batches of prompts; `state()` / `restore()` resume exactly (see module doc)."""

    def __init__(self, source: PromptSource, batch_size: int, *, seed: int, shuffle: bool = True):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if source.size is not None and source.size < 1:
            raise DataError(f"the prompt source is empty (size {source.size})")
        self.source, self.batch_size, self.seed, self.shuffle = source, batch_size, int(seed), shuffle
        self.epoch, self.position = 0, 0  # position: index within the epoch (the global index if infinite)
        self._order: np.ndarray | None = None  # this epoch's permutation, built lazily

    def _index(self) -> int:
        if self.source.size is None or not self.shuffle:
            return self.position
        if self._order is None:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self.source.size)
        return int(self._order[self.position])

    def next_batch(self) -> list[Prompt]:
        return [self.next_prompt() for _ in range(self.batch_size)]

    def next_prompt(self) -> Prompt:
        """One prompt, in the order batches take them (a skipped prompt's replacement is the next one)."""
        prompt = self.source[self._index()]
        self.position += 1
        if self.source.size is not None and self.position == self.source.size:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return prompt

    def __iter__(self) -> Iterator[list[Prompt]]:
        while True:
            yield self.next_batch()

    def state(self) -> dict:
        return {"seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "position": self.position,
                "size": self.source.size}

    def load_state(self, state: Mapping) -> None:
        missing = [k for k in ("seed", "shuffle", "epoch", "position", "size") if k not in state]
        if missing:
            raise DataError(f"loader state is missing {missing}; got keys {sorted(state)}")
        if state["size"] != self.source.size:
            raise DataError(f"loader state was saved for a source of size {state['size']}, but this source has "
                            f"size {self.source.size}; resume with the same dataset")
        size = self.source.size
        for key, limit in (("epoch", None), ("position", size)):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (limit and value >= limit):
                raise DataError(f"loader state {key} must be an integer in [0, {limit or 'inf'}), got {value!r}")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position, self._order = int(state["epoch"]), state["position"], None

    @classmethod
    def restore(cls, source: PromptSource, batch_size: int, state: Mapping) -> PromptLoader:
        loader = cls(source, batch_size, seed=int(state.get("seed", 0)))
        loader.load_state(state)
        return loader


# ---------------------------------------------------------------- prompts longer than the limit

TooLong = Literal["error", "skip", "truncate"]
MAX_SKIPS_IN_A_ROW = 1000  # an infinite source that yields this many too-long prompts in a row yields no other


@dataclasses.dataclass(frozen=True)
class FittedBatch:
    prompts: list[Prompt]  # batch_size prompts, each within the limit (after truncation)
    ids: list[list[int]]  # their token ids, len(ids[i]) <= limit
    skipped: int  # prompts drawn and dropped as too long (too_long="skip"); their places went to the next ones
    truncated: int  # prompts cut to their last `limit` tokens (too_long="truncate")


def next_fitting_batch(loader: PromptLoader, encode: Callable[[Prompt], list[int]], limit: int,
                       too_long: TooLong = "error") -> FittedBatch:
    """The loader's next batch, encoded, with every prompt longer than `limit` tokens handled by `too_long`:

    - "error": DataError naming the prompt, its length, the limit and the other choices;
    - "skip": dropped, and the next prompt drawn in its place (the batch stays batch_size; resuming from the
      loader's state draws the same replacements); DataError when no prompt of the source fits;
    - "truncate": its last `limit` tokens kept. The tail, not the head: the end holds the question itself
      (long prompts are mostly context before it) and, with a chat template, the opened assistant turn the
      model answers in; cutting the head loses a system prompt or the start of the context instead.
    """
    if too_long not in ("error", "skip", "truncate"):
        raise DataError(f"data.too_long must be 'error', 'skip' or 'truncate', got {too_long!r}")
    prompts, ids, skipped, truncated = [], [], 0, 0
    too_long_uids: set[str] = set()  # distinct prompts skipped: all of a finite source means none fits
    in_a_row, shortest = 0, None
    while len(prompts) < loader.batch_size:
        prompt = loader.next_prompt()
        tokens = list(encode(prompt))
        if len(tokens) > limit:
            if too_long == "error":
                raise DataError(f"prompt {prompt.uid} is {len(tokens)} tokens, longer than grpo.max_prompt_len="
                                f"{limit}; raise grpo.max_prompt_len, shorten the data, or set data.too_long to "
                                f"'skip' (drop such prompts) or 'truncate' (keep their last {limit} tokens)")
            if too_long == "truncate":
                tokens, truncated = tokens[-limit:], truncated + 1
            else:
                skipped, in_a_row = skipped + 1, in_a_row + 1
                too_long_uids.add(prompt.uid)
                shortest = len(tokens) if shortest is None else min(shortest, len(tokens))
                size = loader.source.size
                if (size is not None and len(too_long_uids) >= size) or (size is None and
                                                                          in_a_row >= MAX_SKIPS_IN_A_ROW):
                    every = f"all {size} prompts" if size is not None else f"{in_a_row} prompts in a row"
                    raise DataError(f"data.too_long=skip skipped {every}: none fits in grpo.max_prompt_len={limit} "
                                    f"tokens (the shortest has {shortest}); raise grpo.max_prompt_len or set "
                                    "data.too_long=truncate")
                continue
        in_a_row = 0
        prompts.append(prompt)
        ids.append(tokens)
    return FittedBatch(prompts, ids, skipped, truncated)


# ---------------------------------------------------------------- templating


def render_prompt(tokenizer, question: str, *, template: Literal["auto", "chat", "plain"] = "auto",
                  system_prompt: str | None = None,
                  chat_template_args: Mapping[str, object] | None = None) -> list[int]:
    """Token ids of the prompt the policy sees.

    "chat": the tokenizer's chat template with the generation prompt (the assistant turn is opened), rendered with
    `chat_template_args` as the template's variables (e.g. Qwen3's `enable_thinking`).
    "plain": `question` encoded as is, after `system_prompt + "\\n"` when given; the tokenizer's own
    special tokens (e.g. a BOS) are added as its `encode` does by default.
    "auto": "chat" when the tokenizer has a chat template, else "plain".
    """
    if template not in ("auto", "chat", "plain"):
        raise DataError(f"template must be 'auto', 'chat' or 'plain', got {template!r}")
    has_chat = getattr(tokenizer, "chat_template", None) is not None
    if template == "chat" and not has_chat:
        raise DataError("template='chat' needs a tokenizer with a chat template, and this one has none; "
                        "use template='plain' (or 'auto')")
    if template == "plain" or (template == "auto" and not has_chat):
        text = question if system_prompt is None else f"{system_prompt}\n{question}"
        return list(tokenizer.encode(text))
    messages = [{"role": "user", "content": question}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **dict(chat_template_args or {}))
    return [int(i) for i in ids]
