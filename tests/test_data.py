"""Prompt datasets: file loaders and their errors, synthetic tasks, loader determinism and exact resume, templates."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workers import rewards as R
from workers.data import (
    AdditionTask,
    DataError,
    Prompt,
    PromptDataset,
    PromptLoader,
    SubtractionTask,
    load_gsm8k,
    load_jsonl,
    load_parquet,
    make_source,
    next_fitting_batch,
    render_prompt,
)
from workers.datasets import GSM8K_TEST, GSM8K_TRAIN
from workers.models.tokenizer import build_byte_tokenizer


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ---------------------------------------------------------------- files


def test_load_gsm8k_reduces_answers_to_numbers():
    ds = load_gsm8k(GSM8K_TRAIN)
    assert len(ds) == ds.size == 7473
    first = ds[0]
    assert first.uid == "gsm8k-train:0" and first.answer == "72"  # "... #### 72"
    assert first.question.startswith("Natalia sold clips")
    assert ds[7472].uid == "gsm8k-train:7472"
    assert all(R.parse_number(p.answer) is not None and "," not in p.answer for p in ds)
    assert "1080" in {p.answer for p in ds}  # the file writes "#### 1,080"


def test_load_jsonl_field_mapping_blank_lines_and_numeric_answers(tmp_path):
    path = _write_jsonl(tmp_path / "qa.jsonl", [{"q": "1+1=", "a": 2}, "", {"q": "2+2=", "a": "4", "extra": 1}])
    ds = load_jsonl(path, question_field="q", answer_field="a")
    assert list(ds) == [Prompt("qa:0", "1+1=", "2"), Prompt("qa:1", "2+2=", "4")]
    assert repr(ds) == "PromptDataset('qa', size=2)"


def test_file_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"nope.jsonl' does not exist; the path must name an existing file"):
        load_jsonl(missing)
    with pytest.raises(DataError, match="does not exist"):
        load_parquet(tmp_path / "nope.parquet")

    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "1"}, "{not json"])
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_jsonl(bad)

    arr = _write_jsonl(tmp_path / "arr.jsonl", [[1, 2]])
    with pytest.raises(DataError, match=r"arr.jsonl:1: expected a JSON object, got list"):
        load_jsonl(arr)

    records = [{"question": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    nofield = _write_jsonl(tmp_path / "nofield.jsonl", records)
    with pytest.raises(DataError, match=r"nofield.jsonl:2: record has no field 'question'; "
                                        r"fields present: \['answer', 'prompt'\]"):
        load_jsonl(nofield)

    wrong_type = _write_jsonl(tmp_path / "wt.jsonl", [{"question": "a", "answer": [1]}])
    with pytest.raises(DataError, match=r"wt.jsonl:1: field 'answer' must be a string or a number, got list"):
        load_jsonl(wrong_type)

    empty = _write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(DataError, match="dataset 'empty' is empty; it needs at least one prompt"):
        load_jsonl(empty)

    not_gsm8k = _write_jsonl(tmp_path / "g.jsonl", [{"question": "a", "answer": "The answer is 3"}])
    with pytest.raises(DataError, match=r"record 0 \(gsm8k-g:0\): answer does not end in '#### <number>'"):
        load_gsm8k(not_gsm8k)


def test_parquet_round_trip_with_renamed_fields(tmp_path):
    path = tmp_path / "math.parquet"
    pq.write_table(pa.table({"problem": ["3+5=", "9-2="], "solution": ["8", "7"], "level": [1, 2]}), path)
    ds = load_parquet(path, question_field="problem", answer_field="solution")
    assert list(ds) == [Prompt("math:0", "3+5=", "8"), Prompt("math:1", "9-2=", "7")]
    with pytest.raises(DataError, match=r"math.parquet: no column 'question'; columns present: "
                                        r"\['level', 'problem', 'solution'\]"):
        load_parquet(path)
    pq.write_table(pa.table({"question": ["a", "b"], "answer": ["1", None]}), nulls := tmp_path / "nulls.parquet")
    with pytest.raises(DataError, match=r"nulls.parquet: row 1: field 'answer' is null"):
        load_parquet(nulls)


# ---------------------------------------------------------------- synthetic tasks


def test_addition_prompts_are_a_pure_function_of_seed_and_index():
    task = AdditionTask(seed=0)
    assert task.size is None
    p = task[42]
    assert p.uid == "addition:s0:42"
    a, b = (int(x) for x in p.question[:-1].split("+"))
    assert p.question == f"{a}+{b}=" and p.answer == str(a + b) and 0 <= a <= 9 and 0 <= b <= 9
    assert AdditionTask(seed=0)[42] == p  # a fresh object, same prompt: no hidden generator state
    assert [task[i] for i in range(200)] == [AdditionTask(0)[i] for i in reversed(range(200))][::-1]
    assert [task[i].question for i in range(20)] != [AdditionTask(seed=1)[i].question for i in range(20)]
    # 2,000 draws cover all 84 operand pairs of 0..9 that are not held out for evaluation (16 are: data.heldout;
    # coupon collector: ~420 draws expected), and never one of those 16.
    assert len({task[i].question for i in range(2000)}) == 84
    with pytest.raises(TypeError):
        len(task)  # infinite: no __len__, use .size


def test_subtraction_results_are_non_negative_and_bounded():
    task = SubtractionTask(seed=3, max_operand=20)
    for i in range(500):
        p = task[i]
        a, b = (int(x) for x in p.question[:-1].split("-"))
        assert p.uid == f"subtraction:s3:{i}" and a >= b and p.answer == str(a - b) and 0 <= a - b <= 20
        assert R.subtraction(p.answer, p.answer) == 1.0


def test_synthetic_task_errors():
    with pytest.raises(DataError, match=r"AdditionTask.max_operand must be an integer >= 0, got -1"):
        AdditionTask(max_operand=-1)
    with pytest.raises(DataError, match=r"SubtractionTask.seed must be an integer >= 0, got 1.5"):
        SubtractionTask(seed=1.5)
    with pytest.raises(IndexError, match="addition prompt index must be an integer >= 0, got -1"):
        AdditionTask()[-1]


def test_make_source(tmp_path):
    assert make_source("addition", seed=2, max_operand=5) == AdditionTask(2, 5)
    assert len(make_source("gsm8k", path=GSM8K_TRAIN)) == 7473
    with pytest.raises(DataError, match=r"unknown data source kind 'csv'; choose one of \['addition', 'gsm8k', "
                                        r"'jsonl', 'parquet', 'subtraction'\]"):
        make_source("csv")
    with pytest.raises(DataError, match=r"data source 'addition': got an unexpected keyword argument 'max_op'"):
        make_source("addition", max_op=5)


# ---------------------------------------------------------------- loader


def _small(n: int = 5) -> PromptDataset:
    return PromptDataset([Prompt(f"s:{i}", f"q{i}", str(i)) for i in range(n)], name="s")


def _uids(batch: list[Prompt]) -> list[str]:
    return [p.uid for p in batch]


def test_loader_shuffles_each_epoch_with_a_seeded_permutation_and_wraps():
    ds = _small(5)
    loader = PromptLoader(ds, 2, seed=7)
    seen = [u for _ in range(5) for u in _uids(loader.next_batch())]  # 10 prompts = exactly 2 epochs
    assert sorted(seen[:5]) == sorted(seen[5:]) == [f"s:{i}" for i in range(5)]  # each epoch is a permutation
    assert seen[:5] != seen[5:]  # reshuffled (seed 7 gives different permutations for epochs 0 and 1)
    assert loader.state() == {"seed": 7, "shuffle": True, "epoch": 2, "position": 0, "size": 5}
    again = PromptLoader(ds, 2, seed=7)
    assert [u for _ in range(5) for u in _uids(again.next_batch())] == seen  # same seed, same order
    other = PromptLoader(ds, 2, seed=8)
    assert [u for _ in range(5) for u in _uids(other.next_batch())] != seen


def test_loader_without_shuffle_and_batches_larger_than_the_dataset():
    loader = PromptLoader(_small(3), 4, seed=0, shuffle=False)
    assert _uids(loader.next_batch()) == ["s:0", "s:1", "s:2", "s:0"]  # spans epochs 0 and 1
    assert _uids(loader.next_batch()) == ["s:1", "s:2", "s:0", "s:1"]
    assert loader.state() == {"seed": 0, "shuffle": False, "epoch": 2, "position": 2, "size": 3}


def test_loader_over_an_infinite_task_advances_the_index():
    loader = PromptLoader(AdditionTask(seed=1), 3, seed=0)
    assert _uids(loader.next_batch()) + _uids(next(iter(loader))) == [f"addition:s1:{i}" for i in range(6)]
    assert loader.state() == {"seed": 0, "shuffle": True, "epoch": 0, "position": 6, "size": None}


@pytest.mark.parametrize("source", [_small(7), AdditionTask(seed=4)], ids=["finite", "infinite"])
def test_resume_from_state_gives_exactly_the_uninterrupted_batches(source):
    straight = PromptLoader(source, 3, seed=11)
    expected = [_uids(straight.next_batch()) for _ in range(9)]  # 27 prompts: ~4 epochs of 7

    for cut in (1, 2, 5):  # stop mid-epoch and at various offsets
        first = PromptLoader(source, 3, seed=11)
        head = [_uids(first.next_batch()) for _ in range(cut)]
        state = json.loads(json.dumps(first.state()))  # must survive a JSON round trip
        resumed = PromptLoader.restore(source, 3, state)
        assert head + [_uids(resumed.next_batch()) for _ in range(9 - cut)] == expected
        fresh = PromptLoader(source, 3, seed=0)
        fresh.load_state(state)
        assert [_uids(fresh.next_batch()) for _ in range(9 - cut)] == expected[cut:]


def test_loader_errors():
    with pytest.raises(DataError, match="batch_size must be an integer >= 1, got 0"):
        PromptLoader(_small(), 0, seed=0)
    with pytest.raises(DataError, match=r"loader state is missing \['shuffle', 'size'\]"):
        PromptLoader.restore(_small(), 2, {"seed": 0, "epoch": 0, "position": 0})
    state = PromptLoader(_small(5), 2, seed=0).state()
    with pytest.raises(DataError, match="saved for a source of size 5, but this source has size 4"):
        PromptLoader.restore(_small(4), 2, state)
    with pytest.raises(DataError, match=r"loader state position must be an integer in \[0, 5\), got 5"):
        PromptLoader.restore(_small(5), 2, {**state, "position": 5})
    with pytest.raises(DataError, match=r"loader state epoch must be an integer in \[0, inf\), got -1"):
        PromptLoader.restore(_small(5), 2, {**state, "epoch": -1})


# ---------------------------------------------------------------- prompts longer than max_prompt_len


def _by_length(*lengths: int) -> PromptLoader:
    """An unshuffled loader, batches of 2, over prompts "a", "ab", ... of the given lengths (one token per byte)."""
    prompts = [Prompt(f"d:{i}", "abcdefghij"[:n], "0") for i, n in enumerate(lengths)]
    return PromptLoader(PromptDataset(prompts, name="d"), 2, seed=0, shuffle=False)


def _bytes(prompt: Prompt) -> list[int]:
    return list(prompt.question.encode())


def test_too_long_error_names_the_prompt_its_length_the_limit_and_the_choices():
    loader = _by_length(2, 6, 3)
    with pytest.raises(DataError) as info:
        next_fitting_batch(loader, _bytes, 4)  # "error" is the default
    assert str(info.value) == ("prompt d:1 is 6 tokens, longer than grpo.max_prompt_len=4; raise grpo.max_prompt_len, "
                               "shorten the data, or set data.too_long to 'skip' (drop such prompts) or 'truncate' "
                               "(keep their last 4 tokens)")
    with pytest.raises(DataError, match="data.too_long must be 'error', 'skip' or 'truncate', got 'drop'"):
        next_fitting_batch(_by_length(2), _bytes, 4, "drop")


def test_too_long_skip_draws_the_next_prompt_in_its_place_and_counts():
    loader = _by_length(2, 6, 3, 8, 1)  # limit 4: prompts 1 (6 tokens) and 3 (8 tokens) do not fit
    first = next_fitting_batch(loader, _bytes, 4, "skip")
    # draws d:0 (fits), d:1 (skipped), d:2 (fits)
    assert [p.uid for p in first.prompts] == ["d:0", "d:2"] and first.ids == [list(b"ab"), list(b"abc")]
    assert (first.skipped, first.truncated) == (1, 0)
    second = next_fitting_batch(loader, _bytes, 4, "skip")
    # draws d:3 (skipped), d:4 (fits), then the next epoch's d:0 (fits)
    assert [p.uid for p in second.prompts] == ["d:4", "d:0"] and (second.skipped, second.truncated) == (1, 0)
    assert loader.state()["epoch"] == 1 and loader.state()["position"] == 1  # 3 + 3 draws over 5 prompts


def test_too_long_truncate_keeps_the_tail_and_counts():
    loader = _by_length(2, 6, 3, 8)
    first = next_fitting_batch(loader, _bytes, 4, "truncate")
    assert first.ids == [list(b"ab"), list(b"cdef")] and (first.skipped, first.truncated) == (0, 1)  # abcdef -> cdef
    second = next_fitting_batch(loader, _bytes, 4, "truncate")
    assert second.ids == [list(b"abc"), list(b"efgh")] and (second.skipped, second.truncated) == (0, 1)
    assert [p.uid for p in first.prompts + second.prompts] == ["d:0", "d:1", "d:2", "d:3"]  # nothing dropped


def test_too_long_skip_with_nothing_that_fits_is_an_error_not_a_hang():
    with pytest.raises(DataError, match=r"data.too_long=skip skipped all 2 prompts: none fits in "
                                        r"grpo.max_prompt_len=4 tokens \(the shortest has 5\); raise"):
        next_fitting_batch(_by_length(5, 7), _bytes, 4, "skip")
    # an infinite source: "3+5=" is 4 bytes, so with a limit of 3 none of its prompts ever fits
    loader = PromptLoader(AdditionTask(seed=0), 2, seed=0)
    with pytest.raises(DataError, match=r"skipped 1000 prompts in a row: none fits in grpo.max_prompt_len=3 tokens"):
        next_fitting_batch(loader, _bytes, 3, "skip")


# ---------------------------------------------------------------- templates


@pytest.fixture(scope="module")
def byte_tok():
    return build_byte_tokenizer()


def test_render_prompt_plain_is_the_bytes(byte_tok):
    assert render_prompt(byte_tok, "3+5=", template="plain") == [51, 43, 53, 61]  # ord of "3", "+", "5", "="
    assert render_prompt(byte_tok, "hi", template="plain", system_prompt="S") == [83, 10, 104, 105]  # "S\nhi"


def test_render_prompt_chat_is_chatml(byte_tok):
    ids = render_prompt(byte_tok, "hi", template="chat")
    # <|im_start|>=257, "user\n", "hi", <|im_end|>=258, "\n", <|im_start|>, "assistant\n"
    assert ids == [257, *b"user\nhi", 258, 10, 257, *b"assistant\n"]
    assert byte_tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(byte_tok, "hi") == ids  # auto: the tokenizer has a chat template
    with_system = render_prompt(byte_tok, "hi", template="chat", system_prompt="Be brief.")
    assert byte_tok.decode(with_system) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_render_prompt_without_chat_template():
    tok = build_byte_tokenizer()
    tok.chat_template = None
    assert render_prompt(tok, "hi") == [104, 105]  # auto falls back to plain
    with pytest.raises(DataError, match="template='chat' needs a tokenizer with a chat template"):
        render_prompt(tok, "hi", template="chat")
    with pytest.raises(DataError, match="template must be 'auto', 'chat' or 'plain', got 'chatml'"):
        render_prompt(tok, "hi", template="chatml")


def test_gsm8k_ships_with_its_licence_and_needs_no_path():
    """A fresh clone runs the GSM8K recipe: both splits and the MIT licence are package data, and
    `data: {kind: gsm8k}` without a path reads the shipped train split."""
    from workers.datasets import GSM8K_DIR

    licence = (GSM8K_DIR / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Copyright (c) 2021 OpenAI" in licence
    assert len(load_gsm8k()) == 7473 and len(load_gsm8k(GSM8K_TEST)) == 1319
    assert load_gsm8k()[0] == load_gsm8k(GSM8K_TRAIN)[0]
    assert len(make_source("gsm8k")) == 7473
    import tomllib

    shipped = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    patterns = shipped["tool"]["setuptools"]["package-data"]["workers.datasets"]
    assert {"gsm8k/*.jsonl", "gsm8k/LICENSE"} <= set(patterns)  # a wheel carries them too
