"""Experiment config: defaults, batch arithmetic by hand, and every error naming the field and the value."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import pydantic
import pytest

from rlsched.config.loading import dump_resolved, load_config
from rlsched.config.schema import ConfigError, ExperimentConfig
from rlsched.config.spec import BatchPlan

# One task with batches that exercise every derived number (see test_batch_plan_arithmetic).
ADDITION = """\
experiment:
  name: demo
tasks:
  - name: addition
    model: {path: runs/demo/model, init_preset: tiny}
    data: {kind: addition}
    reward: {name: addition}
    grpo: {prompts_per_step: 16, num_generations: 16, mini_batch_size: 128, micro_batch_size: 64}
    optim: {lr: 1e-6}
    steps: 60
"""


def write(tmp_path, text: str, name: str = "demo.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_error(tmp_path, text: str, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    return str(info.value)


def test_valid_config_fills_defaults(tmp_path):
    cfg = load_config(write(tmp_path, ADDITION))
    assert cfg.experiment.name == "demo" and cfg.experiment.output_dir == "runs" and cfg.experiment.seed == 0
    assert cfg.cluster.placement == "colocated" and cfg.cluster.num_devices is None
    assert cfg.cluster.memory_budget_gb is None
    (task,) = cfg.tasks
    assert task.model.init_preset == "tiny" and task.model.dtype == "float32" and task.model.init_seed == 0
    assert task.data.path is None and task.data.template == "auto" and task.data.max_operand == 9
    assert task.reward.on_error == "fail"
    assert task.rollout.engine == "jax_sampler" and task.rollout.max_batch_size == 64 and task.rollout.engine_args == {}
    assert task.grpo.beta == 0.0 and task.grpo.epsilon == 0.2 and task.grpo.clip_range == (0.2, 0.2)
    assert task.grpo.loss_aggregation == "token-mean" and task.grpo.epochs_per_step == 1
    # YAML 1.1 (PyYAML's default) would read `1e-6` as the string "1e-6"; we read YAML 1.2 floats.
    assert task.optim.lr == 1e-6 and task.optim.warmup_ratio == 0.1 and task.optim.grad_clip == 1.0
    assert task.checkpoint_every is None and task.log_every == 1
    assert cfg.run_dir == Path("runs/demo")


def test_fields_are_documented():
    from rlsched.config import schema
    from rlsched.config.schema import GRPOSection, field_doc

    assert "group size" in field_doc(GRPOSection, "num_generations")
    assert field_doc(GRPOSection, "no_such_field") is None
    sections = [c for c in vars(schema).values() if isinstance(c, type) and issubclass(c, schema._Section)]
    is_section = lambda f: isinstance(f.annotation, type) and issubclass(f.annotation, schema._Section)  # noqa: E731
    undocumented = [f"{s.__name__}.{n}" for s in sections for n, f in s.model_fields.items()
                    if not is_section(f) and not field_doc(s, n)]
    assert undocumented == [], f"fields without a docstring under them: {undocumented}"


def test_task_seed_defaults_to_experiment_seed_plus_index(tmp_path):
    cfg = load_config(write(tmp_path, ADDITION), ["experiment.seed=7"])
    assert cfg.tasks[0].resolved_seed(cfg.experiment.seed, 0) == 7 + 0
    assert cfg.tasks[0].resolved_seed(cfg.experiment.seed, 3) == 7 + 3
    cfg = load_config(write(tmp_path, ADDITION), ["tasks.0.seed=42"])
    assert cfg.tasks[0].resolved_seed(7, 3) == 42


def test_task_specs_resolve_seed_directory_and_comm_group_once(tmp_path):
    import pickle

    cfg = load_config(write(tmp_path, ADDITION), ["experiment.seed=7", f"experiment.output_dir={tmp_path / 'out'}"])
    cfg = cfg.model_copy(update={"tasks": [cfg.tasks[0], cfg.tasks[0].model_copy(update={"name": "again", "seed": 3})]})
    first, second = cfg.task_specs()
    assert (first.seed, second.seed) == (7, 3)  # experiment seed + index, or the task's own
    assert first.dir == tmp_path / "out" / "demo" / "tasks" / "addition" and first.dir.is_absolute()
    assert first.checkpoint_dir == first.dir / "checkpoints"
    assert (first.comm_group, second.comm_group) == ("demo/addition/actor->rollout", "demo/again/actor->rollout")
    assert first.plan is cfg.tasks[0].batch_plan() and first.placement == "colocated"
    assert pickle.loads(pickle.dumps(first)) == first  # handed to other processes as it is


def test_tasks_saves_are_staggered_over_the_checkpoint_interval(tmp_path):
    """Task i of n saves at the steps where step + i * every // n is a multiple of `every` (and the last)."""
    cfg = load_config(write(tmp_path, ADDITION), ["tasks.0.checkpoint_every=20"])
    tasks = [cfg.tasks[0].model_copy(update={"name": f"t{i}"}) for i in range(4)]
    specs = cfg.model_copy(update={"tasks": tasks}).task_specs()
    from rlsched.run.task import TaskDriver
    from rlsched.scheduling.scheduler import FreeLocks

    assert [s.checkpoint_offset for s in specs] == [0, 5, 10, 15]
    saved: dict[str, list[int]] = {}
    for spec in specs:  # the step loop's own decision, its save recorded instead of written
        driver = TaskDriver(dataclasses.replace(spec, config=spec.config.model_copy(update={"steps": 42})),
                            FreeLocks(spec.name), echo=lambda *_: None)
        driver._save = saved.setdefault(spec.name, []).append
        for n in range(1, 43):
            driver.checkpoint_if_due(n)
    assert list(saved.values()) == [[20, 40, 42], [15, 35, 42], [10, 30, 42], [5, 25, 42]]  # and the last
    never = load_config(write(tmp_path, ADDITION), ["tasks.0.checkpoint_every=0"]).task_specs()
    assert never[0].checkpoint_offset == 0
    # Unset: the last step only (a run keeps its final weights); 0: never, unless export_final needs the last.
    for sets, expected in (([], [42]), (["tasks.0.checkpoint_every=0"], []),
                           (["tasks.0.checkpoint_every=0", "tasks.0.export_final=true"], [42])):
        (spec,) = load_config(write(tmp_path, ADDITION), [*sets, "tasks.0.steps=42"]).task_specs()
        driver = TaskDriver(spec, FreeLocks(spec.name), echo=lambda *_: None)
        driver._save = (got := []).append
        for n in range(1, 43):
            driver.checkpoint_if_due(n)
        assert got == expected, sets


def test_every_setting_that_changes_results_is_a_config_key(tmp_path):
    """The actor's settings are built from the config alone (no defaults of their own), and the keys
    that used to be hidden are in the run's resolved config."""
    import dataclasses

    from rlsched.config.spec import actor_settings

    over = ["tasks.0.optim.min_lr_ratio=0.25", "cluster.lease_timeout_s=30"]
    cfg = load_config(write(tmp_path, ADDITION), over)
    settings = actor_settings(cfg.tasks[0])
    assert settings.min_lr_ratio == 0.25 and settings.lr == 1e-6 and settings.micro_batch_size == 64
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(settings))
    resolved = dump_resolved(cfg)
    assert "min_lr_ratio: 0.25" in resolved and "lease_timeout_s: 30" in resolved


def test_batch_plan_arithmetic(tmp_path):
    plan = load_config(write(tmp_path, ADDITION)).tasks[0].batch_plan()
    assert plan == BatchPlan(
        task="addition", prompts_per_step=16, num_generations=16,
        samples_per_step=256,  # 16 prompts x 16 generations
        mini_batch_size=128, micro_batch_size=64,
        grad_accumulation=2,  # 128 / 64
        epochs_per_step=1,
        optimizer_steps_per_step=2,  # 256 / 128 x 1 epoch
        steps=60,
        total_optimizer_steps=120,  # 2 x 60
        warmup_steps=12,  # int(0.1 x 120)
    )
    assert plan.describe() == (
        "task addition: 16 prompts x 16 generations = 256 samples/step; mini-batch 128 (2 optimizer steps/step, "
        "2 micro-batches of 64 each); 60 steps = 120 optimizer steps, 12 warmup")


def test_batch_plan_defaults_and_epochs(tmp_path):
    # Defaults: 16 prompts x 8 generations = 128 samples; mini = micro = 128 -> 1 optimizer step, no accumulation.
    plan = load_config(write(tmp_path, ADDITION), ["tasks.0.grpo={}"]).tasks[0].batch_plan()
    assert (plan.samples_per_step, plan.mini_batch_size, plan.micro_batch_size) == (128, 128, 128)
    assert (plan.grad_accumulation, plan.optimizer_steps_per_step, plan.total_optimizer_steps) == (1, 1, 60)
    assert plan.warmup_steps == 6  # int(0.1 x 60)
    # 3 epochs over 256 samples in mini-batches of 128: 2 x 3 = 6 optimizer steps per step, x 60 = 360;
    # warmup 0.29 x 360 = 104.4 -> 104 (and 0.29 x 100 would be 28.999... in floats, still 29 below).
    plan = load_config(write(tmp_path, ADDITION), ["tasks.0.grpo.epochs_per_step=3",
                                                   "tasks.0.optim.warmup_ratio=0.29"]).tasks[0].batch_plan()
    assert (plan.optimizer_steps_per_step, plan.total_optimizer_steps, plan.warmup_steps) == (6, 360, 104)
    assert "mini-batch 128 x 3 epochs (6 optimizer steps/step" in plan.describe()
    # 4 prompts x 25 generations = 100 samples, one optimizer step, 100 steps -> 100; 0.29 x 100 -> 29.
    plan = load_config(write(tmp_path, ADDITION), [
        "tasks.0.grpo={prompts_per_step: 4, num_generations: 25}", "tasks.0.steps=100",
        "tasks.0.optim.warmup_ratio=0.29"]).tasks[0].batch_plan()
    assert (plan.total_optimizer_steps, plan.warmup_steps) == (100, 29)


def test_config_is_frozen(tmp_path):
    cfg = load_config(write(tmp_path, ADDITION))
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.tasks[0].grpo.beta = 0.5
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.experiment = None


def test_dump_resolved_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, ADDITION), ["tasks.0.rollout.engine_args={page_size: 16}",
                                                  "cluster.memory_budget_gb=1.5"])
    text = dump_resolved(cfg)
    assert "beta: 0.0" in text and "placement: colocated" in text  # defaults written out
    again = load_config(write(tmp_path, text, "resolved.yaml"))
    assert again == cfg and again.tasks[0].batch_plan() == cfg.tasks[0].batch_plan()
    assert dump_resolved(again) == text


# --- errors: each names the file, the field path and the value received -------------------------------------


def test_unknown_key_suggests_the_field(tmp_path):
    msg = load_error(tmp_path, ADDITION.replace("micro_batch_size: 64}", "micro_batch_size: 64, bta: 0.1}"))
    assert msg == f"{tmp_path / 'demo.yaml'}: tasks.0.grpo.bta: unknown key (got 0.1); did you mean 'beta'?"


def test_unknown_key_without_a_close_match_lists_the_keys(tmp_path):
    msg = load_error(tmp_path, ADDITION + "zzz: 1\n")
    assert msg.endswith("zzz: unknown key (got 1); valid keys: experiment, tasks, cluster")


def test_wrong_type(tmp_path):
    msg = load_error(tmp_path, ADDITION.replace("steps: 60", "steps: ten"))
    assert "demo.yaml: tasks.0.steps: Input should be a valid integer (got 'ten')" in msg
    # Strict: a quoted number is a string, not silently converted.
    msg = load_error(tmp_path, ADDITION.replace("steps: 60", "steps: '60'"))
    assert "tasks.0.steps: Input should be a valid integer (got '60')" in msg


def test_out_of_range(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["tasks.0.grpo.beta=-1"])
    assert "demo.yaml: tasks.0.grpo.beta: Input should be greater than or equal to 0 (got -1)" in msg
    assert "[from override 'tasks.0.grpo.beta=-1']" in msg
    msg = load_error(tmp_path, ADDITION, ["tasks.0.grpo.num_generations=1"])
    assert "tasks.0.grpo.num_generations: Input should be greater than or equal to 2 (got 1)" in msg
    msg = load_error(tmp_path, ADDITION, ["tasks.0.grpo.top_p=1.5"])
    assert "tasks.0.grpo.top_p: Input should be less than or equal to 1 (got 1.5)" in msg


def test_an_unknown_decode_attention_is_refused_with_the_choices(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["tasks.0.rollout.engine_args={decode_attention: flash}"])
    assert "tasks.0.rollout.engine_args: decode_attention 'flash': one of auto, xla, pallas, interpret" in msg
    cfg = load_config(write(tmp_path, ADDITION), ["tasks.0.rollout.engine_args={decode_attention: xla}"])
    assert cfg.tasks[0].rollout.engine_args == {"decode_attention": "xla"}


def test_the_schemas_decode_attention_choices_are_the_samplers():
    from rlsched.config.schema import DECODE_ATTENTION
    from workers.models.decode_attention import IMPLS

    assert ("auto", *IMPLS) == DECODE_ATTENTION


def test_several_problems_one_line_each(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["tasks.0.grpo.beta=-1", "tasks.0.steps=0", "cluster.placement=split"])
    lines = msg.splitlines()
    assert len(lines) == 3
    assert any(re.search(r"cluster\.placement: Input should be 'colocated' or 'disaggregated' \(got 'split'\)", x)
               for x in lines)


def test_missing_required(tmp_path):
    msg = load_error(tmp_path, ADDITION.replace("    reward: {name: addition}\n", ""))
    assert msg.endswith("demo.yaml: tasks.0.reward: Field required")
    msg = load_error(tmp_path, "experiment: {name: demo}\ntasks: []\n")
    assert "tasks: List should have at least 1 item after validation, not 0 (got [])" in msg


def test_bad_name(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["experiment.name=my run"])
    assert "experiment.name: must be letters, digits, '_', '.' or '-' (it names a directory) (got 'my run')" in msg


def test_data_path_required_for_file_kinds(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["tasks.0.data.kind=jsonl"])
    assert "tasks.0.data.path: data.path is required when data.kind is 'jsonl' (got None)" in msg
    msg = load_error(tmp_path, ADDITION, ["tasks.0.data.path=train.jsonl"])
    assert "tasks.0.data.path: synthetic kind 'addition' reads no file; remove data.path (got 'train.jsonl')" in msg
    cfg = load_config(write(tmp_path, ADDITION), ["tasks.0.data={kind: gsm8k, path: gsm8k/train.parquet}"])
    assert cfg.tasks[0].data.path == "gsm8k/train.parquet"


def test_non_divisible_batches(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["tasks.0.grpo.mini_batch_size=96"])
    assert ("tasks.0.grpo.mini_batch_size: must divide the 256 samples/step = grpo.prompts_per_step 16 x "
            "grpo.num_generations 16; use one of 256, 128, 64, 32, 16, 8 (got 96)") in msg
    msg = load_error(tmp_path, ADDITION, ["tasks.0.grpo.mini_batch_size=512"])
    assert "tasks.0.grpo.mini_batch_size: must divide the 256 samples/step" in msg and "(got 512)" in msg
    msg = load_error(tmp_path, ADDITION, ["tasks.0.grpo.micro_batch_size=48"])
    assert "tasks.0.grpo.micro_batch_size: must divide grpo.mini_batch_size 128; use one of 128, 64" in msg
    assert "(got 48)" in msg
    msg = load_error(tmp_path, ADDITION, ["tasks.0.grpo.mini_batch_size=null", "tasks.0.grpo.micro_batch_size=300"])
    assert "must divide grpo.mini_batch_size 256 (unset: all samples of a step)" in msg and "(got 300)" in msg


def test_duplicate_task_names(tmp_path):
    two = ADDITION + ADDITION.split("tasks:\n")[1]  # the same task twice
    msg = load_error(tmp_path, two)
    assert ("tasks.1.name: duplicate task name: tasks.0 and tasks.1 are both named 'addition'; task names must be "
            "unique (they name run directories) (got 'addition')") in msg
    assert len(load_config(write(tmp_path, two), ["tasks.1.name=addition2"]).tasks) == 2


def test_override_into_a_list_element(tmp_path):
    cfg = load_config(write(tmp_path, ADDITION), [
        "tasks.0.grpo.beta=0.04", "tasks.0.rollout.engine_args={page_size: 16}", "tasks.0.data.shuffle=false",
        "tasks.0.model.init_preset=null", "tasks.0.grpo.epsilon_high=0.28"])
    task = cfg.tasks[0]
    assert task.grpo.beta == 0.04 and isinstance(task.grpo.beta, float)
    assert task.rollout.engine_args == {"page_size": 16} and task.data.shuffle is False
    assert task.model.init_preset is None and task.grpo.clip_range == (0.2, 0.28)


def test_override_of_one_task_leaves_tasks_sharing_its_yaml_anchor_alone():
    cfg = load_config(Path(__file__).parents[1] / "configs" / "demo_multitask.yaml",  # grpo: *grpo in task 1
                      ["tasks.1.grpo.beta=0.3", "tasks.0.rollout.max_batch_size=8"])
    assert [t.grpo.beta for t in cfg.tasks] == [0.1, 0.3]
    assert [t.rollout.max_batch_size for t in cfg.tasks] == [8, 512]


def test_override_of_a_new_key_is_validated_like_the_file(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["tasks.0.optim.lrr=3e-6"])
    assert "tasks.0.optim.lrr: unknown key (got 3e-06); did you mean 'lr'? [from override 'tasks.0.optim.lrr=3e-6']" \
        in msg


def test_a_star_override_sets_every_task():
    """`tasks.*.key=value` is the same as one override per task; a mapping set so is each task's own (a later
    override of one task's leaves the other's alone)."""
    demo = Path(__file__).parents[1] / "configs" / "demo_multitask.yaml"
    cfg = load_config(demo, ["tasks.*.steps=7", "tasks.*.rollout={max_batch_size: 8}",
                             "tasks.1.rollout.max_batch_size=4", "tasks.*.grpo.beta=0.04"])
    each = load_config(demo, [f"tasks.{i}.{k}" for i in (0, 1) for k in ("steps=7", "rollout={max_batch_size: 8}",
                                                                             "grpo.beta=0.04")]
                       + ["tasks.1.rollout.max_batch_size=4"])
    assert [t.steps for t in cfg.tasks] == [7, 7] and [t.rollout.max_batch_size for t in cfg.tasks] == [8, 4]
    assert cfg == each


def test_a_star_override_of_a_key_no_task_has_names_the_override_for_each_task():
    demo = Path(__file__).parents[1] / "configs" / "demo_multitask.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(demo, ["tasks.*.stepz=10"])
    assert str(err.value).splitlines() == [
        f"{demo}: tasks.{i}.stepz: unknown key (got 10); did you mean 'steps'? [from override 'tasks.*.stepz=10']"
        for i in (0, 1)]


@pytest.mark.parametrize(("override", "expected"), [
    ("tasks.0.grpo.beta", "override 'tasks.0.grpo.beta' is malformed; expected path.to.key=value"),
    ("=3", "override '=3' is malformed"),
    ("tasks.1.steps=3", "override 'tasks.1.steps=3': tasks is a list of 1 items; index '1' is out of range (use 0..0, "
                        "or * for every item)"),
    ("experiment.*=3", "override 'experiment.*=3': experiment is a mapping; '*' stands for every item of a list "
                       "(e.g. tasks.*.steps=10); name the key instead"),
    ("tasks.first.steps=3", "override 'tasks.first.steps=3': tasks is a list of 1 items; index 'first'"),
    ("tasks.0.steps.x=3", "override 'tasks.0.steps.x=3': tasks.0.steps is 60, not a mapping or list, so it has no "
                          "key 'x'"),
    ("tasks.0.steps=[1", "override 'tasks.0.steps=[1': value '[1' is not valid YAML"),
])
def test_bad_overrides(tmp_path, override, expected):
    assert expected in load_error(tmp_path, ADDITION, [override])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    msg = load_error(tmp_path, ADDITION.replace("steps: 60", "steps: [60"))
    assert re.search(r"demo\.yaml:\d+:\d+: YAML syntax error", msg)
    msg = load_error(tmp_path, "experiment:\n  name: demo\n   bad: indent\n")
    assert f"{tmp_path / 'demo.yaml'}:3:" in msg


def test_top_level_must_be_a_mapping(tmp_path):
    assert "the top level must be a mapping with experiment:, tasks: and cluster: (got a list)" in load_error(
        tmp_path, "- a\n- b\n")
    assert "(got an empty file)" in load_error(tmp_path, "")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError) and ExperimentConfig.model_config["frozen"]


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")))
def test_every_shipped_config_validates(name):
    cfg = load_config(Path(__file__).parents[1] / "configs" / name)
    assert cfg.tasks and len({t.name for t in cfg.tasks}) == len(cfg.tasks)
    for task in cfg.tasks:
        task.batch_plan()  # the batch arithmetic of every task works out


# --- meshes: defaults, overrides, the device pool, and what validation refuses ------------------------------


def test_meshes_default_to_one_device(tmp_path):
    cfg = load_config(write(tmp_path, ADDITION))
    task = cfg.tasks[0]
    assert task.actor.mesh.as_dict() == {"dp": 1, "fsdp": 1, "ep": 1, "tp": 1}
    assert task.rollout.mesh.as_dict() == {"dp": 1, "fsdp": 1, "ep": 1, "tp": 1}  # a rollout mesh has no fsdp axis
    assert cfg.num_devices == 1 and cfg.task_specs()[0].num_devices == 1


def test_mesh_overrides(tmp_path):
    cfg = load_config(write(tmp_path, ADDITION), ["tasks.0.actor.mesh.fsdp=2", "tasks.0.actor.mesh.tp=2",
                                                  "tasks.0.rollout.mesh={dp: 2, tp: 4}"])
    assert cfg.tasks[0].actor.mesh.as_dict() == {"dp": 1, "fsdp": 2, "ep": 1, "tp": 2}
    assert cfg.tasks[0].rollout.mesh.as_dict() == {"dp": 2, "fsdp": 1, "ep": 1, "tp": 4}
    assert "fsdp: 2" in dump_resolved(cfg)


def test_device_pool_is_what_the_meshes_need_unless_given(tmp_path):
    two = ADDITION + ADDITION.split("tasks:\n")[1].replace("name: addition", "name: other")
    meshes = ["tasks.0.actor.mesh.fsdp=4", "tasks.0.rollout.mesh.tp=2",  # task 0: actor 4, engine 2
              "tasks.1.actor.mesh.tp=2", "tasks.1.rollout.mesh={dp: 2, tp: 2}"]  # task 1: actor 2, engine 4
    cfg = load_config(write(tmp_path, two), meshes)
    assert cfg.num_devices == 4  # colocated: the largest mesh, max(4, 2, 2, 4)
    assert [s.num_devices for s in cfg.task_specs()] == [4, 4]
    cfg = load_config(write(tmp_path, two), [*meshes, "cluster.placement=disaggregated"])
    assert cfg.num_devices == 8  # the largest rollout mesh (4) beside the largest actor mesh (4)
    cfg = load_config(write(tmp_path, two), [*meshes, "cluster.num_devices=16"])
    assert cfg.num_devices == 16 and cfg.task_specs()[1].num_devices == 16


def test_rollout_mesh_has_no_fsdp(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["tasks.0.rollout.mesh.fsdp=2"])
    assert msg.startswith(f"{tmp_path / 'demo.yaml'}: tasks.0.rollout.mesh.fsdp: unknown key (got 2)")


@pytest.mark.parametrize(("override", "expected"), [
    ("tasks.0.actor.mesh.tp=0", "tasks.0.actor.mesh.tp: Input should be greater than or equal to 1 (got 0)"),
    ("tasks.0.actor.mesh.dp=true", "tasks.0.actor.mesh.dp: Input should be a valid integer (got True)"),
    ("tasks.0.actor.mesh.sp=2", "tasks.0.actor.mesh.sp: unknown key (got 2)"),
])
def test_bad_mesh_values(tmp_path, override, expected):
    assert expected in load_error(tmp_path, ADDITION, [override])


def test_a_mesh_larger_than_the_pool(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["cluster.num_devices=8", "tasks.0.actor.mesh.fsdp=16"])
    assert msg == (f"{tmp_path / 'demo.yaml'}: tasks.0.actor.mesh: fsdp 16 = 16 devices, but cluster.num_devices is 8 "
                   "(got {'dp': 1, 'fsdp': 16, 'ep': 1, 'tp': 1})")
    msg = load_error(tmp_path, ADDITION, ["cluster.num_devices=2", "tasks.0.rollout.mesh={dp: 2, tp: 2}"])
    assert msg.endswith("tasks.0.rollout.mesh: dp 2 x tp 2 = 4 devices, but cluster.num_devices is 2 "
                        "(got {'dp': 2, 'ep': 1, 'tp': 2}) [from override 'tasks.0.rollout.mesh={dp: 2, tp: 2}']")


def test_disaggregated_groups_must_fit_side_by_side(tmp_path):
    msg = load_error(tmp_path, ADDITION, ["cluster.placement=disaggregated", "cluster.num_devices=8",
                                          "tasks.0.actor.mesh={fsdp: 4, tp: 2}", "tasks.0.rollout.mesh.tp=2"])
    assert msg.endswith("cluster.num_devices: disaggregated puts a rollout group of 2 devices (tasks.0.rollout.mesh: "
                        "tp 2 = 2) beside a train group of 8 (tasks.0.actor.mesh: fsdp 4 x tp 2 = 8): 2 + 8 = 10 "
                        "devices, but cluster.num_devices is 8 (got 8) [from override 'cluster.num_devices=8']")
    # The same meshes colocated time-share 8 devices.
    load_config(write(tmp_path, ADDITION), ["cluster.num_devices=8", "tasks.0.actor.mesh={fsdp: 4, tp: 2}",
                                            "tasks.0.rollout.mesh.tp=2"])


def test_batches_must_split_over_the_meshes(tmp_path):
    # micro-batch 64 over dp 1 x fsdp 3 = 3 rows: 64 / 3 is not whole.
    msg = load_error(tmp_path, ADDITION, ["tasks.0.actor.mesh.fsdp=3"])
    assert msg.endswith("tasks.0.actor.mesh: a micro-batch of 64 samples (grpo.micro_batch_size) does not split over "
                        "dp 1 x fsdp 3 = 3 devices; make the micro-batch a multiple of 3 (got {'dp': 1, 'fsdp': 3, "
                        "'ep': 1, 'tp': 1})")
    load_config(write(tmp_path, ADDITION), ["tasks.0.actor.mesh.tp=3"])  # tp splits no batch
    # 16 prompts x 16 generations = 256 samples over rollout dp 3.
    msg = load_error(tmp_path, ADDITION, ["tasks.0.rollout.mesh.dp=3"])
    assert msg.endswith("tasks.0.rollout.mesh: 256 samples/step (grpo.prompts_per_step 16 x grpo.num_generations 16) "
                        "do not split over dp 3 (got {'dp': 3, 'ep': 1, 'tp': 1})")


def test_the_compile_cache_is_on_by_default_under_the_output_dir_and_null_turns_it_off(tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    from rlsched.config.loading import validate

    raw = yaml.safe_load((Path(__file__).parents[1] / "configs" / "demo_multitask.yaml").read_text())
    raw["experiment"]["output_dir"] = str(tmp_path / "runs")
    specs = validate(raw).task_specs()
    assert {s.compile_cache for s in specs} == {str(tmp_path / "runs" / ".jax_cache")}  # one, shared by the tasks
    raw["cluster"] = {**raw.get("cluster", {}), "compile_cache_dir": None}
    assert {s.compile_cache for s in validate(raw).task_specs()} == {None}
    # A role process (fresh, without the tests' JAX_COMPILATION_CACHE_DIR) writes what it compiles there
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    code = ("import sys, jax, jax.numpy as jnp; from rlsched.cluster import compile_cache; "
            "compile_cache.enable(sys.argv[1]); jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()")
    subprocess.run([sys.executable, "-c", code, specs[0].compile_cache], env=env, check=True, timeout=120)
    assert any(Path(specs[0].compile_cache).iterdir())


def test_the_lock_policy_and_each_tasks_priority_and_weight_reach_the_scheduler(tmp_path):
    from rlsched.run.experiment import build_policy

    cfg = load_config(write(tmp_path, ADDITION), ["cluster.policy=fair", "cluster.starvation_limit=3",
                                                  "tasks.0.priority=2", "tasks.0.weight=2.5"])
    snap = build_policy(cfg)[0].snapshot()
    assert (snap["order"], snap["starvation_limit"]) == ("fair", 3)
    assert (snap["tasks"]["addition"]["priority"], snap["tasks"]["addition"]["weight"]) == (2, 2.5)
    assert "policy: fair" in dump_resolved(cfg)
    with pytest.raises(ConfigError, match="cluster.policy"):
        load_config(write(tmp_path, ADDITION), ["cluster.policy=lottery"])
    with pytest.raises(ConfigError, match="tasks.0.weight"):
        load_config(write(tmp_path, ADDITION), ["tasks.0.weight=0"])


def test_a_mesh_across_hosts_takes_whole_hosts_and_keeps_tp_inside_one(tmp_path):
    hosts = ["cluster.hosts=2", "cluster.num_devices=4"]
    cfg = load_config(write(tmp_path, ADDITION), [*hosts, "tasks.0.actor.mesh={dp: 2, fsdp: 2, tp: 2}"])
    spec = cfg.task_specs()[0]
    assert (spec.hosts, spec.num_devices, spec.role_hosts("actor"), spec.role_hosts("engine")) == (2, 4, 2, 1)
    errors = {
        "a mesh larger than hosts x devices": (["tasks.0.actor.mesh.fsdp=16"],
                                               "fsdp 16 = 16 devices, but cluster.hosts 2 x cluster.num_devices 4 = 8"),
        "part of a host": (["cluster.num_devices=3", "tasks.0.actor.mesh.fsdp=4"], "a multiple of 3 devices"),
        "tp across hosts": (["tasks.0.actor.mesh={fsdp: 1, tp: 8}"],
                            "tasks.0.actor.mesh.tp: tp must stay inside a host"),
        "an engine across hosts": (["tasks.0.rollout.mesh.tp=8"], "an engine runs on one host of 4 devices"),
        "disaggregated": (["cluster.placement=disaggregated"], "cluster.hosts > 1 runs colocated only for now"),
        "per_device_group, a mesh over some of the hosts": (
            ["cluster.hosts=3", "cluster.processes=per_device_group", "tasks.0.actor.mesh={dp: 2, fsdp: 2, tp: 2}"],
            "dp 2 x fsdp 2 x tp 2 = 8 devices spans some of the 3 hosts, but with cluster.processes=per_device_group "
            "the hosts are one JAX job and a mesh across them takes them all: 12 devices"),
    }
    for why, (overrides, expected) in errors.items():
        assert expected in load_error(tmp_path, ADDITION, [*hosts, *overrides]), why
    # one process per host holding every role (the default): a mesh over all the hosts, or one host
    for mesh in ("{dp: 2, fsdp: 2, tp: 2}", "{fsdp: 2, tp: 2}"):
        load_config(write(tmp_path, ADDITION), [*hosts, "cluster.processes=per_device_group",
                                                f"tasks.0.actor.mesh={mesh}"])
    msg = load_error(tmp_path, ADDITION, ["cluster.hosts=2"])
    assert "cluster.num_devices: cluster.hosts is 2: say how many devices each host has" in msg


def test_a_bare_off_in_yaml_is_the_settings_off():
    """YAML 1.1 reads `off` as false: `--set tasks.0.actor.remat=off` (and `remat: off` in a file) mean the setting's
    "off", while a true (`on`) is still refused by name."""
    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo_addition.yaml")
    assert load_config(config, ["tasks.0.actor.remat=off"]).tasks[0].actor.remat == "off"
    with pytest.raises(ConfigError, match=r"tasks\.0\.actor\.remat: Input should be 'layers' or 'off' \(got True\)"):
        load_config(config, ["tasks.0.actor.remat=on"])
