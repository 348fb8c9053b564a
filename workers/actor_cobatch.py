"""Co-batched TRAIN in one process: the LoRA actors of a base group that hold the train lock together
(workers.rollout.base.Together) meet in a gathering, and one of their threads runs their optimizer steps as one
vmapped program per step.

    history, cobatched = join(actor, together, minis)   # each member, from its own thread (ActorWorker.train)
    withdraw(actor, together)                           # a member that will not come (it failed before its update)

Design decisions:
- **Why vmap.** The members' adapters are small and their base is one: alone, each optimizer step is a run of the
  whole base for one task's rows, one after the other. `jax.vmap(train_step, in_axes=(0, 0, None))` over the
  members' stacked states and mini-batches, the base unbatched, is one program that reads the base once per step
  for all of them. It is each member's own step, side by side: the same loss, its own gradient (nothing mixes
  across the vmapped axis), its own optimizer state and step count (the schedule runs per member).
- **Where they meet.** One workers.rollout.cobatch.Gatherings per process per shared base (its lease's key): a
  hold's members are tasks of one base group, so they always meet in it, even where their settings differ (they then
  run in separate programs of the same joint run instead of waiting out the gathering for one another).
- **Who runs with whom.** Requests are grouped by the program they need: the actor's signature less the optimizer's
  numeric settings (model, loss settings, adapter spec, mesh), the mini-batch keys and shapes (a length bucket) and
  the number of optimizer steps. A group of one runs the actor's plain program, exactly as alone.
- **A sweep is one program.** The optimizer's numeric settings (workers.train_step.OptimizerValues: learning rate,
  schedule, weight decay, clipping, Adam's betas) are the step's per-member inputs, stacked like the states, and each
  member's optimizer is built from its own inside the vmapped function: tasks that differ only there (the commonest
  sweep) share the program and its compile. What changes the program's structure stays in the signature: the moment's
  dtype (adam_mu_dtype), and the state's tree.
- **Padding to a power of two.** A group's K is padded to the next power of two by repeating member 0's state and
  mini-batches (their results are dropped), so a base group compiles log2(K) programs, not K: K = 3 runs the K = 4
  program. An actor compiles the programs of its task's largest hold (its base group's like tasks whose rows fit one:
  the task's `train_cohort`, padded) in its `prepare`, before the first lock, beside its own and for the batch shape
  it will train: the hold a first step makes, where the tasks start together. The smaller holds' (2, 4, .. below
  it: the tasks drift apart in later steps) compile in the background from the actor's first update on
  (`compile_ahead`), so that the first step neither waits for log2(K) gradient programs more nor shares the cores
  with them, and a later hold finds its program compiled, or being compiled, rather than compiling it in the lock.
  A hold of other shapes compiles on first use, in the hold. Once per process: they are shared across the base
  group's actors by signature (workers.compiling.shared).
- **Layout.** Every program has explicit shardings on the actor's mesh: a stacked state is laid out as a member's
  with a leading unsplit axis (PartitionSpec(None, *spec)), batch arrays (K, A, M, ...) put rows (M) over
  dp x fsdp x ep. Stacking and unstacking are jitted programs with those shardings, so a state is never gathered
  whole onto one device; the stacked state is donated to each step. The members' own states are not donated to the
  stack: a joint run that fails leaves every member's state as it was.
- **Exactness.** A member's update is its own: nothing mixes across the vmapped axis, so whoever its partners are
  (and whether a slot holds padding), a member gets the same bits (tests/test_cotrain.py). Against its update alone
  it agrees to the float rounding of a batched program, not bit for bit: on CPU, XLA sums some row reductions (the
  RMSNorm over a 64-wide hidden size) in another order when a program has more rows, a few ulp (forward logprobs
  <= 4e-6 apart; measured with the tiny model, float32). AdamW then magnifies the rounding of gradient elements
  near 0 (its update is lr * m / (sqrt(v) + 1e-8)): after 3 train calls of 4 optimizer steps at lr 5e-3, metrics
  agree to <= 3e-5 (relative 2e-4), the adapters to <= 1.1e-3 of how far they moved (usually ~5e-6), the moments
  to 6e-6 relative. The optimizer built from values (workers.train_step.optimizer_from) adds its own: 1 - b2 from
  b2 in float32, 1.3e-5 off the constant optax folds alone at b2 0.999, moves an adapter ~7e-6 of how far it moved
  (tests/test_cotrain.py: most members' params_rel went from ~2e-6 to ~7e-6, the worst 6.4e-5 to 6.8e-5). A
  bit-exact co-batched update is not to be had this way: `lax.map` over the members, one member's shapes per
  iteration, rounds differently too (fused into a loop body).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from workers.compiling import compile_once, kept, shapes_key, shared
from workers.models import sharding as S
from workers.multihost import global_array, host_value
from workers.rollout.cobatch import Gatherings
from workers.train_step import OptimizerValues, optimizer_values


class Member(Protocol):
    """What this module reads and sets of a member: a workers.actor.ActorWorker, named here by what it must have
    rather than imported (workers.actor imports this module; the other way round would be a circle)."""

    state: Any  # its TrainState, replaced by the one the joint run gives back
    mesh: Any
    shardings: Any  # its TrainState's
    lora: Any
    base_shardings: Any
    _lease: Any  # its shared base's lease: `key` names the base group
    settings: Any  # its workers.train_step.ActorSettings: the optimizer's values are read from them
    _loss_signature: tuple  # what its co-batched programs depend on besides the batch (workers.compiling.shared's
    # key): its programs' signature less the optimizer's numeric settings
    _prepared: dict  # its executables, which hold the joint programs too
    _abstract: Any  # its TrainState's shapes, dtypes and shardings
    _abstract_base: tuple  # its programs' frozen base argument (shapes)

    def cotrain_function(self) -> Callable: ...

    def _steps(self, minis: list[dict[str, np.ndarray]], history: list) -> None: ...

    def _base_args(self) -> tuple: ...


_LOCK = threading.Lock()
_GATHERINGS: dict[tuple, Gatherings] = kept({})  # by shared base (workers.shared_base key): one per base group


@dataclasses.dataclass(eq=False)
class TrainRequest:
    actor: Member
    minis: list[dict[str, np.ndarray]]  # host mini-batches (A, M, ...), in the order its alone update runs them


def gatherings(actor: Member) -> Gatherings:
    """The process's gatherings of `actor`'s base group (made now if it has none)."""
    key = actor._lease.key  # noqa: SLF001 - the base group's identity
    with _LOCK:
        if key not in _GATHERINGS:
            _GATHERINGS[key] = Gatherings(run)
        return _GATHERINGS[key]


def open_holds() -> list[int]:
    """The holds whose train gathering waits for members now, over every base group (for tools and tests)."""
    with _LOCK:
        every = list(_GATHERINGS.values())
    return [hold for g in every for hold in g.open_holds()]


def join(actor: Member, together, minis: list[dict[str, np.ndarray]]) -> tuple[list[dict], int]:
    """Run `minis` (one optimizer step each) on `actor` with the hold's other members; (its metrics per step, how
    many members' updates ran in that one program). The actor's state is the new one when it returns."""
    return gatherings(actor).join(together.hold, together.tasks, TrainRequest(actor, minis))


def withdraw(actor: Member, together) -> None:
    """`actor`'s task will not train in the hold `together`: the others stop waiting for it."""
    gatherings(actor).withdraw(together.hold, together.tasks)


def run(requests: list[TrainRequest]) -> list:
    """A gathering's run: per request (its metrics per step, cobatched) or the exception of its group's run."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(_group_key(r), []).append(i)
    results: list = [None] * len(requests)
    for members in groups.values():
        try:
            outcome = _run_group([requests[i] for i in members])
        except Exception as e:  # noqa: BLE001 - every member of this group gets it
            outcome = [e] * len(members)
        for i, result in zip(members, outcome, strict=True):
            results[i] = result
    return results


def _group_key(r: TrainRequest) -> tuple:
    first = r.minis[0]
    return (r.actor._loss_signature, len(r.minis),  # noqa: SLF001 - the programs' identity
            tuple(sorted((k, v.shape, v.dtype.str) for k, v in first.items())))


def _run_group(requests: list[TrainRequest]) -> list[tuple[list[dict], int]]:
    """One group's optimizer steps: the plain program alone, else one vmapped program per step."""
    if len(requests) == 1:
        history: list = []
        requests[0].actor._steps(requests[0].minis, history)  # noqa: SLF001
        return [([{k: np.asarray(host_value(v)) for k, v in m.items()} for m in history], 1)]
    actors = [r.actor for r in requests]
    k, padded = len(requests), padded_size(len(requests))
    lead = actors[0]
    keys = tuple(sorted(requests[0].minis[0]))
    shapes = {name: (v.shape, v.dtype) for name, v in requests[0].minis[0].items()}
    programs = _programs(lead, padded, keys, shapes)
    for actor in actors:  # each member holds them (workers.compiling.shared): they live while one of them does
        actor._prepared[program_key(padded, keys, shapes)] = programs  # noqa: SLF001
    stack, step, unstack = programs
    rows = {name: S.batch_sharding(lead.mesh, len(shape) + 1, leading=2) for name, (shape, _) in shapes.items()}
    states = [a.state for a in actors] + [actors[0].state] * (padded - k)
    stacked = stack(*states)
    repl = S.replicated(lead.mesh)
    each = [optimizer_values(a.settings) for a in actors] + [optimizer_values(actors[0].settings)] * (padded - k)
    values = OptimizerValues(*(global_array(np.stack(v), repl) for v in zip(*each, strict=True)))
    metrics = []
    for j in range(len(requests[0].minis)):
        minis = [r.minis[j] for r in requests] + [requests[0].minis[j]] * (padded - k)
        batch = {name: global_array(np.stack([m[name] for m in minis]), rows[name]) for name in keys}
        stacked, m = step(stacked, batch, values, *lead._base_args())  # noqa: SLF001
        metrics.append(m)
    news = unstack(stacked)
    jax.block_until_ready((news, metrics))  # the update ends when the work does, not at dispatch
    for actor, new in zip(actors, news[:k], strict=False):
        actor.state = new
    metrics = [{name: np.asarray(host_value(v)) for name, v in m.items()} for m in metrics]
    return [([{name: v[i] for name, v in m.items()} for m in metrics], k) for i in range(k)]


def _stacked(sharding: NamedSharding) -> NamedSharding:
    """A member's layout with a leading unsplit (members) axis."""
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))


def program_key(padded: int, keys: tuple[str, ...], shapes: dict[str, tuple]) -> tuple:
    """Where an actor holds the (stack, step, unstack) of `padded` members and these mini-batch shapes."""
    return ("cotrain", padded, keys, shapes_key(shapes))


def padded_size(members: int) -> int:
    """The members a hold of `members` tasks runs as: the power of two at or above (padding repeats member 0)."""
    return 1 << (members - 1).bit_length()


def _programs(actor: Member, padded: int, keys: tuple[str, ...], shapes: dict[str, tuple]) -> tuple[Any, ...]:
    """(stack, step, unstack) for `padded` members of `actor`'s signature and these mini-batch shapes: what its
    `prepare` compiled (workers.actor.ActorWorker.prepare, for the holds its task's base group can make), else compiled
    now, in the hold; shared by every actor of the signature in this process that holds them."""
    held = actor._prepared.get(program_key(padded, keys, shapes))  # noqa: SLF001
    if held is not None:
        return held
    return tuple(shared(key, build)[0] for key, build in builds(actor, padded, keys, shapes))


def compile_ahead(actor: Member, sizes: list[int], keys: tuple[str, ...], shapes: dict[str, tuple]
                  ) -> threading.Thread:
    """A daemon thread that compiles the programs of holds of these padded `sizes` for `actor` and these mini-batch
    shapes, one size after another, into the actor's prepared programs (the smaller holds of later steps: see the
    module docstring); a hold that needs one still being compiled waits for it (workers.compiling.shared), one that
    finds it failed compiles it itself, and meets the error there. The thread's `error` is the first it met."""
    def run() -> None:
        for padded in sizes:
            try:  # what `prepare` or a hold made already, else compiled (or waited for) now
                actor._prepared[program_key(padded, keys, shapes)] = _programs(actor, padded, keys, shapes)  # noqa: SLF001
            except Exception as err:  # noqa: BLE001 - the hold that needs it builds it again and raises there
                thread.error = thread.error or err

    thread = threading.Thread(target=run, name="rlsched-cotrain-ahead", daemon=True)
    thread.error = None
    thread.start()
    return thread


def builds(actor: Member, padded: int, keys: tuple[str, ...], shapes: dict[str, tuple]) -> list[tuple[tuple, Any]]:
    """[(workers.compiling.shared's key, build)] of the stack, step and unstack programs of `padded` members of
    `actor`'s signature on mini-batches of these {name: (shape, dtype)}."""
    sig = actor._loss_signature  # noqa: SLF001
    member_sh = actor.shardings
    stacked_sh = jax.tree.map(_stacked, member_sh)
    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct((padded, *x.shape), x.dtype, sharding=sh),
                            actor._abstract, stacked_sh)  # noqa: SLF001
    repl = S.replicated(actor.mesh)
    rows = {name: S.batch_sharding(actor.mesh, len(shape) + 1, leading=2) for name, (shape, _) in shapes.items()}
    batch = {name: jax.ShapeDtypeStruct((padded, *shape), dtype, sharding=rows[name])
             for name, (shape, dtype) in shapes.items()}
    base = actor._abstract_base[:1]  # noqa: SLF001 - the frozen base: unbatched, never donated
    base_sh = () if actor.lora is None else (actor.base_shardings,)
    values = OptimizerValues(*(jax.ShapeDtypeStruct((padded,), v.dtype, sharding=repl)
                               for v in optimizer_values(actor.settings)))

    def build_stack():
        fn = jax.jit(lambda *states: jax.tree.map(lambda *xs: jnp.stack(xs), *states),
                     in_shardings=(member_sh,) * padded, out_shardings=stacked_sh)
        return compile_once(fn.lower(*([actor._abstract] * padded)))  # noqa: SLF001

    def build_step():
        one = actor.cotrain_function()
        fn = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, *(None,) * len(base))),
                     in_shardings=(stacked_sh, rows, repl, *base_sh), out_shardings=(stacked_sh, repl),
                     donate_argnums=0)
        return compile_once(fn.lower(abstract, batch, values, *base))

    def build_unstack():
        fn = jax.jit(lambda s: tuple(jax.tree.map(lambda x, i=i: x[i], s) for i in range(padded)),
                     in_shardings=(stacked_sh,), out_shardings=tuple([member_sh] * padded))
        return compile_once(fn.lower(abstract))

    return [((sig, "cotrain-stack", padded), build_stack),
            ((sig, "cotrain-step", padded, keys, shapes_key(shapes)), build_step),
            ((sig, "cotrain-unstack", padded), build_unstack)]
