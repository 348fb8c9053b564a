"""`rlsched check`: every GSM8K recipe passes it from a fresh clone (no model directory anywhere), and a broken
config fails with the line that names what is wrong; the published shapes it plans with are the model cards'."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlsched.cli import main
from workers.models.config import ModelConfig
from workers.models.published import PUBLISHED, match_name, published_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").glob("gsm8k_*.yaml"))
sys.path.insert(0, str(Path(__file__).parent))
from test_plan import QWEN2P5_7B, QWEN3_1P7B, QWEN3_30B_A3B  # noqa: E402 - config.json copies of the real models


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "rlsched.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def _lines(out: str) -> dict[str, tuple[str, str]]:
    """{what: (status, text)} of the check lines."""
    found = {}
    for line in out.splitlines():
        m = re.fullmatch(r"(ok|FAIL|skip) +([^:]+): (.*)", line)
        if m:
            found[m.group(2)] = (m.group(1), m.group(3))
    return found


# What each recipe's memory line must say: the plans test_plan computes by hand from the real config.json.
RECIPE_MEMORY = {
    "gsm8k_qwen3_30b_a3b.yaml": "group shared (devices 0-7): 85.6 GiB on device 0 with every role resident; largest "
                                "role 75.5 GiB; fits (`rlsched plan`",  # every role resident: no offload
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_gsm8k_recipe_passes_check_from_a_fresh_clone(tmp_path, recipe):
    """As shipped, in a fresh process, from a directory of its own: exit 0, every check ok, shapes from the
    published table (the model directory's name says which), nothing written, and no JAX (nor torch) imported."""
    out = cli("check", str(recipe), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = _lines(out.stdout)
    assert set(lines) == {"schema", "devices", "model gsm8k", "tokenizer gsm8k", "data gsm8k", "reward gsm8k",
                          "meshes", "memory", "output"}
    assert all(status == "ok" for status, _ in lines.values()), out.stdout
    assert out.stdout.splitlines()[-1].startswith("9 ok, 0 failed, 0 skipped: the config is ready")
    path = Path(re.search(r"model:\s*\n\s*path: (\S+)", recipe.read_text()).group(1))
    status, text = lines["model gsm8k"]
    if (path / "config.json").is_file():  # a machine with the weights: they are checked instead
        assert text.endswith("weights and tokenizer.json present")
    else:
        assert f"shapes from the published {match_name(path)}, named by the directory {path.name}" in text
        assert out.stdout.splitlines()[-1].endswith(f"(`rlsched train` needs the model at {path})")
    assert re.search(r"7473 prompts; longest \d+ tokens <= grpo\.max_prompt_len 256", lines["data gsm8k"][1])
    if recipe.name in RECIPE_MEMORY:
        assert RECIPE_MEMORY[recipe.name] in lines["memory"][1]
    assert list(tmp_path.iterdir()) == []  # no runs/, nothing
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    heavy = {m for m in imported if m.split(".")[0] in ("jax", "flax", "torch", "ray")}
    assert "rlsched.config.check" in imported and not heavy


@pytest.mark.slow
def test_a_broken_config_fails_with_the_line_that_says_why(tmp_path, small_gsm8k):
    """A real process: exit 2, and the FAIL line names the key and the numbers."""
    out = cli("check", str(ROOT / "configs" / "gsm8k_qwen3_1p7b_mesh.yaml"), "--devices", "4",
              "--set", "tasks.0.rollout.mesh.tp=3", "--set", small_gsm8k, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    lines = _lines(out.stdout)
    assert lines["devices"] == ("FAIL", "the pool is 8 devices (cluster.num_devices), but --devices 4 gives 4; set "
                                        "cluster.num_devices and the meshes to fit them")
    assert lines["meshes"] == ("FAIL", "tasks.0.rollout.mesh: model.embed_tokens.weight (151936, 2048): dimension 0 "
                                       "(vocab, 151936) does not split over tp 3 = 3")  # 151,936 = 2^7 x 1187
    assert lines["memory"] == ("skip", "the meshes do not split the models (see the meshes line)")
    assert out.stdout.splitlines()[-1] == "6 ok, 2 failed, 1 skipped: fix the FAIL lines"


def _check(capsys, *args: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    code = main(["check", *args])
    out = capsys.readouterr().out
    return code, _lines(out), out.splitlines()[-1]


RECIPE = str(ROOT / "configs" / "gsm8k_qwen3.yaml")


@pytest.fixture
def small_gsm8k(tmp_path) -> str:
    """`--set` of the recipe's data to the first 20 problems of the shipped GSM8K: what a test of another line
    needs, without counting 7,473 prompts each time."""
    from workers.datasets import GSM8K_TRAIN

    path = tmp_path / "gsm8k-20.jsonl"
    path.write_text("".join(Path(GSM8K_TRAIN).read_text().splitlines(keepends=True)[:20]))
    return f"tasks.0.data.path={path}"


def _over(data_set: str, limit: int) -> tuple[int, int]:
    """(prompts longer than `limit`, the longest) of the recipe's system prompt and a question, through the Qwen3
    tokenizer's chat template, counted here with transformers directly."""
    import yaml
    from transformers import AutoTokenizer

    from workers.models.tokenizer import qwen3_tokenizer_dir

    system = yaml.safe_load(Path(RECIPE).read_text())["tasks"][0]["data"]["system_prompt"]
    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    questions = [json.loads(line)["question"] for line in Path(data_set.partition("=")[2]).read_text().splitlines()]
    lengths = [len(tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False))
               for q in questions]
    return sum(n > limit for n in lengths), max(lengths)


@pytest.mark.slow
def test_each_kind_of_broken_config_fails_its_own_line(capsys, tmp_path, tiny_model_dir, small_gsm8k):
    code, lines, summary = _check(capsys, RECIPE, "--set", "tasks.0.grpo.beta=-1")
    assert code == 2 and list(lines) == ["schema"] and summary == "0 ok, 1 failed, 0 skipped: fix the FAIL lines"
    assert lines["schema"][0] == "FAIL" and "tasks.0.grpo.beta" in lines["schema"][1]

    code, lines, _ = _check(capsys, RECIPE, "--set", small_gsm8k, "--set", "tasks.0.grpo.max_prompt_len=100")
    over, longest = _over(small_gsm8k, 100)
    assert code == 2 and lines["data gsm8k"][0] == "FAIL" and over > 0
    assert re.match(rf"{over} of 20 prompts are longer than grpo\.max_prompt_len 100 \(longest {longest} tokens, "
                    r"gsm8k-\S+:\d+; chat template;", lines["data gsm8k"][1]), lines["data gsm8k"]
    code, lines, _ = _check(capsys, RECIPE, "--set", small_gsm8k, "--set", "tasks.0.grpo.max_prompt_len=100", "--set",
                            "tasks.0.data.too_long=skip")
    assert code == 0 and f"{over} longer than grpo.max_prompt_len 100 (longest {longest}), which data.too_long=skip " \
                         "handles" in lines["data gsm8k"][1]

    code, lines, _ = _check(capsys, RECIPE, "--set", small_gsm8k, "--set", "tasks.0.reward.name=gsm8kk")
    assert code == 2 and lines["reward gsm8k"][0] == "FAIL"
    assert lines["reward gsm8k"][1].startswith("tasks.0.reward.name: unknown reward 'gsm8kk'; known rewards: ")

    nowhere = tmp_path / "llama-7b"
    code, lines, _ = _check(capsys, RECIPE, "--set", small_gsm8k, "--set", f"tasks.0.model.path={nowhere}")
    assert code == 2 and lines["model gsm8k"] == ("FAIL", f"{nowhere} has no config.json here, so its shapes are "
                                                          f"unknown: give --model NAME (one of {', '.join(PUBLISHED)}) "
                                                          "or --model-config FILE (its config.json)")
    assert lines["tokenizer gsm8k"][0] == lines["memory"][0] == "skip"

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((tiny_model_dir / name).read_bytes())
    code, lines, _ = _check(capsys, RECIPE, "--set", small_gsm8k, "--set", f"tasks.0.model.path={no_weights}")
    assert code == 2 and lines["model gsm8k"][0] == "FAIL"
    assert lines["model gsm8k"][1].startswith(f"tasks.0.model.path: {no_weights} has config.json but no weights")


def test_the_shapes_of_an_absent_model_come_from_the_flags(capsys, tmp_path, small_gsm8k):
    nowhere, recipe = str(tmp_path / "my-finetune"), [RECIPE, "--set", small_gsm8k]
    code, lines, _ = _check(capsys, *recipe, "--set", f"tasks.0.model.path={nowhere}", "--model", "Qwen2.5-7B-Instruct")
    assert code == 0
    assert lines["model gsm8k"] == ("ok", f"Qwen2 of 7.62B params, shapes from --model Qwen2.5-7B-Instruct ({nowhere} "
                                          "has no config.json here)")
    by_name = lines["memory"]
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN2P5_7B))
    code, lines, _ = _check(capsys, *recipe, "--set", f"tasks.0.model.path={nowhere}", "--model-config", str(config))
    assert code == 0
    assert lines["model gsm8k"][1].startswith(f"Qwen2 of 7.62B params, shapes from --model-config {config}")
    assert by_name[1].endswith("(`rlsched plan --model Qwen2.5-7B-Instruct` has each role's bytes)"), by_name
    # the table's shapes are the config.json's: the same bytes; `plan` is sent the same flag
    flag = by_name[1].replace("--model Qwen2.5-7B-Instruct", f"--model-config {config}")
    assert lines["memory"] == (by_name[0], flag)
    code, lines, _ = _check(capsys, *recipe, "--set", f"tasks.0.model.path={nowhere}", "--model", "qwen9-1b")
    assert code == 2 and lines["model gsm8k"] == ("FAIL", f"no published shapes for 'qwen9-1b'; known: "
                                                          f"{', '.join(PUBLISHED)}")


# The model cards' parameter counts (Qwen/<name> on the Hugging Face hub): total and non-embedding, in billions as
# printed there (rounded, or cut: Qwen2.5-7B's 7.6156 reads 7.61), so within one unit of the last digit printed.
# Non-embedding leaves out the embedding and, untied, the output layer.
MODEL_CARDS = {"qwen3-0.6b": ("0.6", "0.44"), "qwen3-1.7b": ("1.7", "1.4"), "qwen3-4b": ("4.0", "3.6"),
               "qwen3-8b": ("8.2", "6.95"), "qwen3-14b": ("14.8", "13.2"), "qwen3-32b": ("32.8", "31.2"),
               "qwen3-30b-a3b": ("30.5", "29.9"), "qwen2.5-0.5b": ("0.49", "0.36"), "qwen2.5-1.5b": ("1.54", "1.31"),
               "qwen2.5-3b": ("3.09", "2.77"), "qwen2.5-7b": ("7.61", "6.53")}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_shapes_give_the_model_cards_parameter_counts(name):
    cfg = published_config(name)
    shapes = cfg.param_shapes()
    total = sum(math.prod(s) for s in shapes.values())
    embedding = sum(math.prod(shapes[k]) for k in ("model.embed_tokens.weight", "lm_head.kernel") if k in shapes)
    card_total, card_non_embedding = MODEL_CARDS[name]
    for value, printed in ((total, card_total), (total - embedding, card_non_embedding)):
        unit = 10.0 ** -len(printed.partition(".")[2])
        assert abs(value / 1e9 - float(printed)) < unit, (name, value, printed)


def test_published_shapes_equal_the_real_config_files():
    for name, raw in (("qwen3-1.7b", QWEN3_1P7B), ("qwen2.5-7b", QWEN2P5_7B), ("qwen3-30b-a3b", QWEN3_30B_A3B)):
        assert published_config(name) == ModelConfig.from_hf_dict(raw), name
    assert match_name("/models/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert match_name("/m/Qwen3-30B-A3B") == "qwen3-30b-a3b"
    assert match_name("/models/Llama-3-8B") is None


def test_a_model_directory_that_is_here_is_checked_itself(capsys, tmp_path, tiny_model_dir):
    """Its config.json, weights and tokenizer: the tokenizer must fit the model's vocabulary."""
    demo = str(ROOT / "configs" / "demo_addition.yaml")
    code, lines, summary = _check(capsys, demo, "--set", f"tasks.0.model.path={tiny_model_dir}")
    assert code == 0 and summary == "9 ok, 0 failed, 0 skipped: the config is ready", lines
    assert lines["model addition"] == ("ok", f"Qwen3 of 0.20M params ({tiny_model_dir / 'config.json'}); weights "
                                             "and tokenizer.json present")
    assert lines["tokenizer addition"] == ("ok", f"259 tokens <= vocab_size 384, eos '<|im_end|>', a chat template; "
                                                 f"{tiny_model_dir}'s tokenizer")
    small = tmp_path / "small-vocab"  # the same files, but a config.json whose vocabulary the tokenizer overflows
    small.mkdir()
    for f in tiny_model_dir.iterdir():
        (small / f.name).write_bytes(f.read_bytes())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(config | {"vocab_size": 256}))
    code, lines, _ = _check(capsys, demo, "--set", f"tasks.0.model.path={small}")
    assert code == 2 and lines["tokenizer addition"] == (
        "FAIL", f"259 tokens but the model's vocab_size is 256: ids past it index no embedding row; use the tokenizer "
                f"saved with the model ({small}'s tokenizer)")
    assert lines["data addition"][1].endswith("load; their lengths are not counted (no tokenizer)")
