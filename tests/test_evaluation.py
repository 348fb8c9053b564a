"""Held-out evaluation: splits disjoint from training, scores by hand, an evaluation inside a run (under the ROLLOUT
lock, never changing what training computes), and `rlsched eval` on every form of the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

from rlsched.config.loading import validate
from rlsched.config.schema import ConfigError
from rlsched.observe.tracking import read_metrics
from rlsched.run.evaluation import EvalWork
from workers import data as D
from workers import evaluation as E
from workers.rollout.base import RolloutOutput, Sample


@pytest.mark.parametrize("kind", ["addition", "subtraction"])
def test_an_arithmetic_task_never_trains_on_a_held_out_problem(kind):
    test = {p.question for p in E.problems(kind, "test")}
    train = {p.question for p in E.problems(kind, "train")}
    assert test and not test & train and test | train == {p.question for p in E.problems(kind, "all")}
    for seed in (0, 1, 7):
        drawn = {D.make_source(kind, seed=seed)[i].question for i in range(3000)}
        assert not drawn & test, f"seed {seed} trained on held-out problems {sorted(drawn & test)}"
        assert drawn == train  # and it still draws every other problem
    # the split is a rule of the problem's text: the same whatever the seed or max_operand
    wider = {p.question for p in E.problems(kind, "test", max_operand=12)}
    assert test == {q for q in wider if all(int(x) <= 9 for x in q[:-1].replace("+", " ").replace("-", " ").split())}


def test_gsm8k_scores_on_its_test_file_which_training_never_reads():
    test, train = E.problems("gsm8k", "test"), E.problems("gsm8k", "train")
    assert (len(test), len(train)) == (1319, 7473)
    assert not {p.uid for p in test} & {p.uid for p in train}
    assert not {p.question for p in test} & {p.question for p in train}
    trained = D.PromptLoader(D.make_source("gsm8k"), 64, seed=0)  # what a gsm8k task draws: the train file
    assert not {p.question for p in trained.next_batch()} & {p.question for p in test}


def test_a_jsonl_task_names_its_held_out_file(tmp_path):
    for name, rows in (("train", [("1+1=", "2"), ("2+2=", "4")]), ("heldout", [("3+3=", "6")])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                        for q, a in rows))
    test = E.problems("jsonl", "test", path=str(tmp_path / "heldout.jsonl"), train_path=str(tmp_path / "train.jsonl"))
    assert [(p.question, p.answer) for p in test] == [("3+3=", "6")]
    both = E.problems("jsonl", "all", path=str(tmp_path / "heldout.jsonl"), train_path=str(tmp_path / "train.jsonl"))
    assert [p.question for p in both] == ["1+1=", "2+2=", "3+3="]
    with pytest.raises(ConfigError, match=r"tasks\.0\.eval\.path.*set eval\.path"):
        validate({"experiment": {"name": "x"}, "tasks": [{
            "name": "t", "model": {"path": "m"}, "data": {"kind": "jsonl", "path": str(tmp_path / "train.jsonl")},
            "reward": {"name": "addition"}, "steps": 1, "eval": {}}]})


def test_eval_settings_that_cannot_mean_anything_are_refused():
    def config(data: dict, evaluation: dict):
        return {"experiment": {"name": "x"}, "tasks": [{"name": "t", "model": {"path": "m"}, "data": data,
                                                         "reward": {"name": "addition"}, "steps": 1,
                                                         "eval": evaluation}]}

    with pytest.raises(ConfigError, match="repeats the one greedy answer"):
        validate(config({"kind": "addition"}, {"samples": 4}))
    with pytest.raises(ConfigError, match="reads no file; remove eval.path"):
        validate(config({"kind": "addition"}, {"path": "x.jsonl"}))
    assert validate(config({"kind": "addition"}, {"samples": 4, "temperature": 1.0})).tasks[0].eval.samples == 4


def test_a_limit_is_one_fixed_subset():
    first = [p.uid for p in E.problems("gsm8k", "test", limit=50)]
    assert first == [p.uid for p in E.problems("gsm8k", "test", limit=50)] and len(set(first)) == 50
    assert set(first) < {p.uid for p in E.problems("gsm8k", "test")}
    assert len(E.problems("addition", "test", limit=1000)) == len(E.problems("addition", "test"))  # all there are


def test_scores_by_hand():
    # 3 problems x 2 samples; right = reward >= 1.0:
    #   [1.0, 0.3] -> one right   [0.2, 0.1] -> none   [1.0, 1.0] -> both
    # accuracy = 3 right / 6 samples = 0.5; pass@2 = 2 of 3 problems; reward = (1.3 + 0.3 + 2.0) / 6 = 0.6
    m = E.scores(np.array([1.0, 0.3, 0.2, 0.1, 1.0, 1.0]), 2)
    assert m == pytest.approx({"eval/accuracy": 0.5, "eval/pass@2": 2 / 3, "eval/reward": 0.6, "eval/problems": 3})
    # a lower bar of correctness counts the 0.3 too: 4 of 6, every problem but the second
    assert E.scores(np.array([1.0, 0.3, 0.2, 0.1, 1.0, 1.0]), 2, correct=0.3)["eval/accuracy"] == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match=r"problems \* 4"):
        E.scores(np.ones(6), 4)


def _work(tiny_model_dir, data: dict, evaluation: dict) -> EvalWork:
    from workers.models import load_tokenizer
    from workers.rewards import builtin

    cfg = validate({"experiment": {"name": "x"}, "tasks": [{
        "name": "t", "model": {"path": str(tiny_model_dir)}, "data": {"template": "plain", **data},
        "reward": {"name": data["kind"]}, "steps": 1, "eval": evaluation}]}).tasks[0]
    tok = load_tokenizer(tiny_model_dir)
    return EvalWork(cfg, task="t", seed=0, tokenizer=tok, reward=builtin(data["kind"]),
                    encode=lambda p: tok.encode(p.question), stop_token_ids=(tok.eos_token_id,))


def _answering(work: EvalWork, answer_of) -> RolloutOutput:
    """The engine's output had it answered problem i with answer_of(problem) (then its end token)."""
    tok = work.tokenizer
    n = work.cfg.eval.samples
    return RolloutOutput([Sample(i, np.asarray(tok.encode(answer_of(p), add_special_tokens=False)
                                               + [tok.eos_token_id], np.int32), np.zeros(0, np.float32), "stop")
                          for i, p in enumerate(work.prompts.prompts) for _ in range(n)], 0, 0.0)


def test_an_oracle_scores_one_and_a_constant_its_share(tiny_model_dir):
    work = _work(tiny_model_dir, {"kind": "addition"}, {"split": "all"})
    assert len(work.prompts.ids) == 100
    assert work.score(_answering(work, lambda p: p.answer))["eval/accuracy"] == 1.0
    # "9" is the sum of (0,9), (1,8), ..., (9,0): 10 of the 100 problems. Its near misses earn the reward's
    # closeness term (< 1.0): counted in the mean reward, never as right.
    constant = work.score(_answering(work, lambda p: "9"))
    assert constant["eval/accuracy"] == 0.10 and constant["eval/pass@1"] == 0.10
    assert 0.10 < constant["eval/reward"] < 1.0
    held_out = _work(tiny_model_dir, {"kind": "subtraction"}, {})  # 4 problems held out, one of them 7-7=0
    assert [p.question for p in held_out.prompts.prompts] == ["8-1=", "4-3=", "6-4=", "7-7="]
    assert held_out.score(_answering(held_out, lambda p: "1"))["eval/accuracy"] == 0.25  # 4-3=1 alone


def test_metrics_lines_of_one_step_are_read_as_one_row(tmp_path):
    from rlsched.observe.tracking import JsonlTracker

    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    tracker.log(0, {"eval/accuracy": 0.0})
    tracker.log(1, {"reward/mean": 0.5})
    tracker.log(2, {"reward/mean": 0.7})
    tracker.log(2, {"eval/accuracy": 0.25})
    tracker.finish()
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 0, "eval/accuracy": 0.0}, {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.7, "eval/accuracy": 0.25}]


# ---- inside a run ---------------------------------------------------------------------------------------------

_TRAINING = {"grpo": {"prompts_per_step": 4, "num_generations": 4, "max_prompt_len": 16, "max_new_tokens": 4,
                      "mini_batch_size": 8}, "optim": {"lr": 3e-3}}


def _experiment(tmp_path, model_dir, name, tasks: dict[str, str], steps: int, evaluation: dict | None,
                checkpoint_every: int = 0):
    from rlsched.rundir.files import prepare_run_dir

    raw = {"experiment": {"name": name, "output_dir": str(tmp_path), "seed": 0},
           "tasks": [{"name": t, "seed": 100 + i, "model": {"path": str(model_dir)},
                      "data": {"kind": kind, "template": "plain"}, "reward": {"name": kind}, **_TRAINING,
                      "steps": steps, "checkpoint_every": checkpoint_every,
                      **({"eval": evaluation} if evaluation is not None else {})}
                     for i, (t, kind) in enumerate(tasks.items())]}
    cfg = validate(yaml.safe_load(yaml.safe_dump(raw)))
    prepare_run_dir(cfg, resume=False, overwrite=True)
    return cfg


def _training(cfg, task):
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "mem/", "eval/"))}
            for m in read_metrics(cfg.run_dir / "tasks" / task / "metrics.jsonl") if "reward/mean" in m]


@pytest.mark.slow
def test_evaluation_runs_under_the_rollout_lock_and_never_changes_training(ray_session, tmp_path, tiny_model_dir):
    from rlsched.observe.timeline import check_lock_exclusivity, read_trace
    from rlsched.run.experiment import run_experiment, run_in_process

    tasks = {"addition": "addition", "subtraction": "subtraction"}
    evaluated = _experiment(tmp_path, tiny_model_dir, "evaluated", tasks, 3, {"every": 2, "before": True})
    lines = []
    results = run_experiment(evaluated, echo=lines.append)
    assert {r["status"] for r in results.values()} == {"ok"}, results
    plain = _experiment(tmp_path, tiny_model_dir, "plain", tasks, 3, None)
    run_in_process(plain, echo=lambda *_: None)
    for task in tasks:
        assert len(_training(plain, task)) == 3 and _training(evaluated, task) == _training(plain, task), task
        rows = read_metrics(evaluated.run_dir / "tasks" / task / "metrics.jsonl")
        assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 3]  # before, every 2, after the last
        assert all(r["eval/problems"] == len(E.problems(tasks[task], "test")) for r in rows if "eval/accuracy" in r)
        assert sum(f"[{task}] eval " in line for line in lines) == 3
    events = read_trace(evaluated.run_dir / "timeline.json")
    assert check_lock_exclusivity(events) == []
    spans = [e for e in events if e["kind"] == "span"]
    for ev in (e for e in spans if e["name"] == "eval"):  # each inside a ROLLOUT hold of its task, on its resource
        assert [h for h in spans if h["name"] == "ROLLOUT" and h["task"] == ev["task"]
                and h["resource"] == ev["resource"] and h["start"] <= ev["start"] and ev["end"] <= h["end"]], ev
    assert sum(e["name"] == "eval" for e in spans) == 6


_HASH_REWARD = textwrap.dedent('''
    import zlib


    def hashed(completion: str, answer: str) -> float:
        """A reward that tells completions apart: equal means (almost surely) the same completions."""
        return zlib.crc32(completion.encode()) % 1000 / 1000
''')


def _eval_cli(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "rlsched.cli", "eval", *args, "--json"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: out[k] for k in ("accuracy", "pass@1", "reward", "problems")}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rlsched_eval_scores_every_form_of_the_same_weights_alike(tmp_path, tiny_model_dir, lora):
    """The run, its checkpoint, its export (a full model, or a LoRA task's PEFT adapter and merged model) are the
    same weights: `rlsched eval` gives each the accuracy the run's own evaluation gave its last step. The reward
    hashes the completion, so equal means the same completions, not only the same count of right answers."""
    from rlsched.run.experiment import run_in_process

    (tmp_path / "hashed.py").write_text(_HASH_REWARD)
    raw = {"experiment": {"name": "forms", "output_dir": str(tmp_path / "runs"), "seed": 0},
           "tasks": [{"name": "t", "model": {"path": str(tiny_model_dir)}, "data": {"kind": "addition",
                                                                                    "template": "plain"},
                      "reward": {"function": "hashed", "file": str(tmp_path / "hashed.py")}, **_TRAINING,
                      "optim": {"lr": 3e-2}, "steps": 2, "checkpoint_every": 2,
                      "eval": {"split": "all", "correct": 0.5},
                      **({"lora": {"rank": 4, "targets": ["q", "v", "down"]}} if lora else {})}]}
    config = tmp_path / "forms.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = validate(raw)
    from rlsched.rundir.files import prepare_run_dir

    prepare_run_dir(cfg, resume=False, overwrite=True)
    run_in_process(cfg, echo=lambda *_: None)
    in_run = read_metrics(cfg.run_dir / "tasks" / "t" / "metrics.jsonl")[-1]
    want = {k: in_run[f"eval/{k}"] for k in ("accuracy", "pass@1", "reward", "problems")}
    assert want["problems"] == 100 and 0 < want["accuracy"] < 1  # the hash splits the completions
    assert _eval_cli(str(cfg.run_dir)) == want
    assert _eval_cli(str(cfg.run_dir / "tasks" / "t" / "checkpoints" / "2")) == want
    forms = [["export"], ["export", "--merge"]] if lora else [["export"]]
    for form in forms:
        out = tmp_path / "_".join(form)
        done = subprocess.run([sys.executable, "-m", "rlsched.cli", *form[:1], str(cfg.run_dir), str(out), *form[1:]],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert _eval_cli(str(out), "--config", str(config)) == want, form
    if lora:  # the adapter moved: the base alone answers otherwise
        assert _eval_cli(str(tiny_model_dir), "--config", str(config)) != want
