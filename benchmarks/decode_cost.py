"""What one decode step of the built-in sampler reads and writes, from the compiled program, without a GPU.

    python -m benchmarks.decode_cost [--preset qwen3-0.6b] [--batch 128] [--prompt-len 256] [--new-tokens 256]
                                     [--target h100 | h200 | present | FILE] [--mesh tp=2] [--top 15] [--out DIR]

The sampler's generate program (workers.rollout.jax_sampler._program: prefill, then `lax.while_loop`s of decode
steps, one per segment of the new tokens, over a KV cache of prompt-len + new-tokens slots) for `--batch` rows,
compiled from abstract weights (nnx.eval_shape) for the target as benchmarks.gpu_memory does (deviceless for h100 /
h200: see its docstring for the venv with the CUDA plugin, which also needs safetensors here: the sampler's module
imports it). Reported:
- the program's memory analysis (arguments, outputs, temporaries: the KV cache lives in the temporaries);
- XLA's cost analysis of the whole program where the backend gives one (XLA:CPU does; the deviceless XLA:GPU
  compile returns none);
- one decode step: the top-level ops of the decode loop's body in the optimized HLO (the mean of the loops' where
  the program has one per segment of the new tokens), each counted as the bytes of its operands plus its output
  (what a memory-bound kernel moves), except where the fused computation says less is touched: a
  dynamic-update-slice into an operand writes only the update (the operand is the output's buffer, in place), a
  slice, gather or dynamic-slice of an operand (its only use), directly or through elementwise ops of its shape,
  reads only what it takes (a loop kernel computes those ops at the elements taken). Summed, beside the floor
  of one step (the weights once, the KV cache of the filled slots once) and the time both take at the target's
  bandwidth.
This is an estimate of HBM traffic from shapes, not a profile: caches, re-reads inside a kernel and a kernel's own
efficiency are not in it. It says which ops move the bytes.
`--mesh` (e.g. `tp=2`, `dp=2,tp=2`) compiles the engine on a mesh of that many devices of one host (deviceless GPUs,
or the present backend's first devices), laid out as a JaxSampler on that mesh lays it out: the optimized HLO is one
device's program, so every byte above is one device's (its shard of the weights and of the KV cache), and the
report counts the program's collectives.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import save_results  # first: sets JAX to CPU, hubs offline
from benchmarks.gpu_memory import TARGETS, environment, stats, target_devices, target_name
from rlsched.base.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
# `[ROOT ]%name = SHAPE op(operands), attributes`: SHAPE may be a tuple, operands are %names or literals
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[^\s=]+) = (?P<shape>.*?) (?P<op>[a-z][a-z0-9-]*)"
                          r"\((?P<args>[^)]*)\)(?P<attrs>.*)$")
_FREE = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant"}  # no kernel, no bytes moved
# ops a loop kernel computes element by element: where only some elements of their result are taken (a slice's
# source), only those of their operands are read
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "select", "convert", "exponential", "log", "negate", "abs",
                "maximum", "minimum", "compare", "and", "or", "not", "clamp", "power", "sqrt", "rsqrt", "tanh"}
KERNEL = "rlsched_decode_attention"  # the name of workers.models.decode_attention's kernel in the HLO


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (a tuple's: the sum of its arrays')."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def computations(hlo: str) -> dict[str, list[dict]]:
    """Optimized HLO text -> {computation name: its instructions (name, shape, op, operands, attrs, root)}; the entry
    computation is also under "ENTRY"."""
    comps: dict[str, list[dict]] = {}
    current: list[dict] | None = None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if head:
            current = comps.setdefault(head.group(2), [])
            if head.group(1):
                comps["ENTRY"] = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            current.append(dict(name=m["name"], shape=m["shape"], op=m["op"], attrs=m["attrs"],
                                operands=re.findall(r"%([^\s,)]+)", m["args"]), root=line.lstrip().startswith("ROOT")))
    return comps


def _touched(fused: list[dict]) -> tuple[dict[int, int], tuple[int, int] | None]:
    """In a fused computation: {parameter number: bytes read of it} for a parameter only sliced, gathered or
    dynamic-sliced (what those take), directly or through elementwise ops of its shape (a loop kernel computes those
    only at the elements taken: sampling's log-probability gathers the token's logit of the temperature-divided
    logits), and, for a dynamic-update-slice into a parameter, (that parameter's number, the update's bytes)."""
    by_name = {i["name"]: i for i in fused}
    users: dict[str, list[tuple[dict, int]]] = {}
    for inst in fused:
        for k, operand in enumerate(inst["operands"]):
            users.setdefault(operand, []).append((inst, k))
    in_place = None
    for inst in fused:
        p = _param_number(by_name, inst["operands"][0]) if inst["op"] == "dynamic-update-slice" else None
        if p is not None:
            in_place = (p, shape_bytes(by_name[inst["operands"][1]]["shape"]))

    def taken(name: str) -> set[str] | None:
        """The slices that take elements of `name`'s value, where every use of it is a slice's source, an in-place
        update's buffer or an elementwise op of its shape whose own value is taken so; None where any use reads it
        whole (the fusion's output among them)."""
        if by_name[name]["root"]:
            return None
        slices: set[str] = set()
        for user, k in users.get(name, []):
            if k == 0 and user["op"] in ("gather", "dynamic-slice", "slice"):
                slices.add(user["name"])
            elif user["op"] == "bitcast" or (user["op"] in _ELEMENTWISE
                                              and _elements(user["shape"]) == _elements(by_name[name]["shape"])):
                more = taken(user["name"])
                if more is None:
                    return None
                slices |= more
            elif not (k == 0 and user["op"] == "dynamic-update-slice"):
                return None
        return slices

    partial_reads = {}
    for inst in fused:
        if inst["op"] == "parameter" and "number" in inst and inst["number"] != (in_place or (None,))[0]:
            slices = taken(inst["name"])
            elements = None if slices is None else sum(_elements(by_name[n]["shape"]) for n in slices)
            if elements is not None and elements < _elements(inst["shape"]):
                partial_reads[inst["number"]] = elements * shape_bytes(inst["shape"]) // _elements(inst["shape"])
    return partial_reads, in_place


def _elements(shape: str) -> int:
    dims = _ARRAY.search(shape)
    return math.prod(int(d) for d in dims.group(2).split(",") if d) if dims else 0


def _param_number(by_name: dict, name: str) -> int | None:
    inst = by_name.get(name)
    while inst is not None and inst["op"] == "bitcast" and inst["operands"]:
        inst = by_name.get(inst["operands"][0])
    if inst is None or inst["op"] != "parameter":
        return None
    return inst["number"]


def _number_parameters(comps: dict[str, list[dict]], hlo: str) -> None:
    """Each parameter instruction's number (`parameter(3)`: the operand it binds)."""
    numbers = dict(re.findall(r"%([^\s=]+) = [^\n]*? parameter\((\d+)\)", hlo))
    for insts in comps.values():
        for inst in insts:
            if inst["op"] == "parameter":
                inst["number"] = int(numbers.get(inst["name"], -1))


def _label(attrs: str, op: str) -> str:
    """The op's source, from its metadata: what jax named it, the program's prefix dropped; an op XLA added
    (a copy, a layout change) has none: its kind, in parentheses."""
    m = re.search(r'op_name="([^"]*)"', attrs)
    if not m:
        return f"({op})"
    return re.sub(r"^jit\([^)]*\)/(while/body/)?", "", m.group(1))


def loop_bodies(comps: dict[str, list[dict]]) -> list[str]:
    """The bodies of the entry computation's while loops with the largest carry (the decode loops: one, or one
    per segment of the new tokens), in program order."""
    loops = [i for i in comps["ENTRY"] if i["op"] == "while"]
    if not loops:
        raise ValueError("the program has no while loop in its entry computation")
    largest = max(shape_bytes(i["shape"]) for i in loops)
    return [re.search(r"body=%([^\s,]+)", i["attrs"]).group(1) for i in loops if shape_bytes(i["shape"]) == largest]


def step_ops(hlo: str, loop: int = 0, kernel_share: float = 1.0) -> list[dict]:
    """The kernels of decode loop `loop`'s body: per top-level op, {name, op, label, read, written} in bytes (see
    the module docstring for what is counted). `kernel_share`: the share of its KV cache operands the decode
    attention kernel reads (`kernel_slots`)."""
    comps = computations(hlo)
    _number_parameters(comps, hlo)
    body = comps[loop_bodies(comps)[loop]]
    shapes = {i["name"]: i["shape"] for i in body}
    ops = []
    for inst in body:
        if inst["op"] in _FREE:
            continue
        operand_bytes = [shape_bytes(shapes.get(o, "")) for o in inst["operands"]]
        written = shape_bytes(inst["shape"])
        if inst["op"] == "custom-call" and KERNEL in inst["attrs"]:  # (q, k, v, first, end): k and v in part
            operand_bytes[1:3] = [n * kernel_share for n in operand_bytes[1:3]]
        called = re.search(r"calls=%([^\s,]+)", inst["attrs"])
        if inst["op"] == "fusion" and called and called.group(1) in comps:
            partial_reads, in_place = _touched(comps[called.group(1)])
            for p, nbytes in partial_reads.items():
                if 0 <= p < len(operand_bytes):
                    operand_bytes[p] = min(operand_bytes[p], nbytes)
            if in_place is not None and 0 <= in_place[0] < len(operand_bytes):
                operand_bytes[in_place[0]] = 0  # the output's own buffer: only the update is written
                written = in_place[1]
        ops.append(dict(name=inst["name"], op=inst["op"], label=_label(inst["attrs"], inst["op"]),
                        read=sum(operand_bytes), written=written))
    return ops


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collective_ops(hlo: str, ops: list[dict] | None = None) -> dict[str, int]:
    """{kind: count} of the collectives (COLLECTIVES; an async one counted at its start) among `ops` (step_ops's:
    one decode step's), or in every computation of the program where None."""
    if ops is None:
        ops = [i for name, insts in computations(hlo).items() if name != "ENTRY" for i in insts]  # ENTRY: an alias
    out: dict[str, int] = {}
    for op in ops:
        kind = op["op"].removesuffix("-start")
        if kind in COLLECTIVES:
            out[kind] = out.get(kind, 0) + 1
    return out


def kernel_slots(prompt_len: int, new_tokens: int, prompt_tokens: int) -> float:
    """The slots the decode attention kernel (workers.models.decode_attention) reads a step, on average over a
    generation's decode steps, for rows of `prompt_tokens` real prompt tokens left-padded to `prompt_len`: from
    the block holding a row's first prompt token to the block holding the slot written that step (every row live:
    a row that has stopped reads none)."""
    from workers.models.decode_attention import BLOCK

    slots = prompt_len + new_tokens
    block = math.gcd(BLOCK, slots & -slots)
    first = (prompt_len - prompt_tokens) // block
    steps = range(1, new_tokens)  # step t writes slot prompt_len + t - 1 (the prefill sampled token 0)
    return block * sum(-(-(prompt_len + t) // block) - first for t in steps) / max(1, len(steps))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_cost", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-0.6b", help="a workers.models.presets preset")
    p.add_argument("--vocab-size", type=int, default=None, help="the vocabulary of a preset without its own (tiny...)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch", type=int, default=128, help="rows of one generate program (16 prompts x 8)")
    p.add_argument("--prompt-len", type=int, default=256, help="the prompt's padded length (prompt_padding max)")
    p.add_argument("--new-tokens", type=int, default=256, help="the new-token bucket: the loop's steps")
    p.add_argument("--prompt-tokens", type=int, default=96,
                   help="a row's real prompt tokens (GSM8K chat prompts: ~96), the rest left padding: what a decode "
                        "attention kernel skips, and the floor without padding")
    p.add_argument("--decode-attention", default="auto", choices=("auto", "xla", "pallas"),
                   help="the sampler's decode attention (workers.models.decode_attention; auto: as the engine on "
                        "the target resolves it, the Pallas kernel on a GPU)")
    p.add_argument("--target", default="h100", help="h100, h200, present (the first device JAX sees) or a file")
    p.add_argument("--mesh", type=mesh_arg, default={}, help="the engine's mesh, e.g. tp=2 or dp=2,tp=2 (axes dp, "
                   "tp; default one device)")
    p.add_argument("--top", type=int, default=15, help="the body's ops listed, largest first")
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/decode_cost-<target, or the platform with present>-<preset>")
    return p.parse_args(argv)


def mesh_arg(text: str) -> dict[str, int]:
    """'tp=2' / 'dp=2,tp=2' -> {"tp": 2} / {"dp": 2, "tp": 2}: a rollout mesh's axes."""
    out = {}
    for part in filter(None, text.split(",")):
        axis, _, size = part.partition("=")
        if axis not in ("dp", "tp") or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: give the engine's mesh as axis=size, axes dp and tp (e.g. "
                                             f"tp=2 or dp=2,tp=2)")
        out[axis] = int(size)
    return out


def compile_generate(config, device, batch: int, prompt_len: int, new_tokens: int, decode_attention: str = "auto",
                     *, mesh=None):
    """The sampler's generate program for `batch` rows on one `device` (or `mesh`), compiled from abstract weights;
    and one device's bytes of the weights."""
    lower, weight_bytes = lower_generate(config, device, batch, prompt_len, new_tokens, decode_attention, mesh=mesh)
    return lower().compile(), weight_bytes


def lower_generate(config, device, batch: int, prompt_len: int, new_tokens: int, decode_attention: str = "auto",
                   *, mesh=None, lora=None, lora_slots: int = 1):
    """(a function that traces and lowers the sampler's generate program for `batch` rows on one `device` (or on
    `mesh`, a jax Mesh of the rollout's axes: workers.models.sharding.mesh), from abstract weights, its decode
    attention as a JaxSampler there resolves `decode_attention`; one device's bytes of the weights). `lora` (a
    workers.models.lora.LoraSpec): a LoRA base group's program, `lora_slots` adapters of that spec stacked
    (workers.rollout.shared_engine: every task's slot, whichever rows run)."""
    import jax
    import numpy as np
    from flax import nnx

    from workers.models import lora_batch as LB
    from workers.models import sharding as S
    from workers.models.decode_attention import resolve
    from workers.models.decoder import CausalLM
    from workers.rollout.jax_sampler import _STOP_SLOTS, _program

    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    mesh = S.mesh({}, [device]) if mesh is None else mesh
    graphdef, state = nnx.split(model)
    shardings = S.state_shardings(state, mesh, kv_heads=config.num_key_value_heads)
    weights = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    sds = jax.ShapeDtypeStruct
    rows, prompt = (batch,), (batch, prompt_len)
    # as JaxSampler._joint_chunks makes them: tokens, mask, active, seed, prompt_idx, sample_idx, temperature,
    # top_p, max_new, stop, adapters, the static new-token bucket, and no nucleus (a run's top_p 1)
    adapters = None
    if lora is not None:  # as SharedSampler stacks its slots (replicated on the mesh), each row's adapter its own
        repl = S.replicated(mesh)
        adapter = jax.eval_shape(lambda: LB.init_adapter(config, lora, jax.random.key(0)))
        adapters = jax.eval_shape(lambda a: LB.stack([a] * lora_slots, [lora] * lora_slots,
                                                     np.zeros(batch, np.int32)), adapter)
        adapters = jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding=repl), adapters)
    args = (sds(prompt, np.int32), sds(prompt, np.bool_), sds(rows, np.bool_), sds(rows, np.uint32),
            sds(rows, np.int32), sds(rows, np.int32), sds((), np.float32), sds((), np.float32), sds((), np.int32),
            sds((_STOP_SLOTS,), np.int32), adapters, new_tokens, False)
    attention = resolve(decode_attention, platform=device.platform, head_dim=config.head_dim)
    program = _program(graphdef, mesh, config.num_key_value_heads, shardings, attention)
    shard_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(weights))
    return (lambda: program.lower(weights, *args)), shard_bytes


def kv_bytes(config, batch: int, slots: int, sharding=None) -> int:
    """The KV cache of `slots` slots: keys and values of every layer; with `sharding` (the cache's,
    workers.models.sharding.kv_cache_sharding), one device's shard of it."""
    itemsize = 2 if config.dtype == "bfloat16" else 4
    shape = (batch, config.num_key_value_heads, slots, config.head_dim)
    if sharding is not None:
        shape = sharding.shard_shape(shape)
    return 2 * config.num_hidden_layers * math.prod(shape) * itemsize


def target_bandwidth(target: str) -> float | None:
    """The GPU's memory bandwidth in bytes/s, as its description gives it; None for the present backend."""
    if target == "present":
        return None
    config = TARGETS[target] if target in TARGETS else Path(target).read_text()
    return float(re.search(r"memory_bandwidth: (\d+)", config).group(1))


def main(argv=None) -> dict:
    args = parse_args(argv)
    from workers.models import sharding as S
    from workers.models.presets import preset_config

    if args.batch % S.batch_rows(args.mesh):
        raise SystemExit(f"--batch {args.batch} does not split over the mesh's rows ({S.describe_rows(args.mesh)})")
    devices = target_devices(args.target, S.num_devices(args.mesh))
    device, mesh = devices[0], S.mesh(args.mesh, devices)
    vocab = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
    config = preset_config(args.preset, dtype=args.dtype, **vocab)
    kv_sharding = S.kv_cache_sharding(mesh, kv_heads=config.num_key_value_heads)
    t0 = time.perf_counter()
    compiled, weight_bytes = compile_generate(config, device, args.batch, args.prompt_len, args.new_tokens,
                                              args.decode_attention, mesh=mesh)
    memory = stats(compiled, time.perf_counter() - t0)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    program_cost = None if not cost else {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}
    hlo = compiled.as_text()
    # the decode loops (one per segment of the new tokens, workers.rollout.jax_sampler._segment_ends: equal
    # parts, so a step's mean is the loops' mean)
    slots = args.prompt_len + args.new_tokens
    read = kernel_slots(args.prompt_len, args.new_tokens, args.prompt_tokens)
    kernel = KERNEL in hlo
    loops = [step_ops(hlo, i, kernel_share=read / slots) for i in range(len(loop_bodies(computations(hlo))))]
    by_label: dict[str, dict] = defaultdict(lambda: dict(read=0, written=0, ops=0))
    for ops in loops:
        for op in ops:
            entry = by_label[op["label"]]
            entry["read"] += op["read"] / len(loops)
            entry["written"] += op["written"] / len(loops)
            entry["ops"] += 1 / len(loops)
    loop_bytes = [sum(op["read"] + op["written"] for op in ops) for ops in loops]
    step = sum(loop_bytes) / len(loops)
    ops = loops[0]
    kv_full = kv_bytes(config, args.batch, slots, kv_sharding)
    kv_mean = kv_bytes(config, args.batch, args.prompt_len + (args.new_tokens + 1) // 2, kv_sharding)  # filled
    floor = weight_bytes + kv_mean
    # without the left padding: the slots of the prompt's real tokens and the new ones, on average
    floor_unpadded = weight_bytes + kv_bytes(config, args.batch, args.prompt_tokens + (args.new_tokens + 1) // 2,
                                             kv_sharding)
    collectives = dict(program=collective_ops(hlo), step=collective_ops(hlo, ops))
    bandwidth = target_bandwidth(args.target)
    ms = (lambda n: None) if bandwidth is None else (lambda n: 1e3 * n / bandwidth)
    top = sorted(by_label.items(), key=lambda kv: -(kv[1]["read"] + kv[1]["written"]))[: args.top]
    results = dict(
        args={k: str(v) for k, v in vars(args).items()}, env=environment(device, args.target), memory=memory,
        program_cost=program_cost, weight_bytes=weight_bytes, kv_cache_bytes=kv_full, kv_filled_mean_bytes=kv_mean,
        step=dict(bytes=step, ops=len(ops), loop_bytes=loop_bytes, floor_bytes=floor, bytes_over_floor=step / floor,
                  ms_at_bandwidth=ms(step), floor_ms_at_bandwidth=ms(floor), unpadded_floor_bytes=floor_unpadded,
                  unpadded_floor_ms_at_bandwidth=ms(floor_unpadded)),
        decode_attention=dict(kernel=kernel, slots_read_mean=read if kernel else None),
        mesh=dict(shape=S.mesh_shape(args.mesh), devices=len(devices), collectives=collectives),
        step_by_source=[dict(label=k, **v) for k, v in top],
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    rows = [f"| {k} | {v['ops']:.0f} | {format_bytes(v['read'])} | {format_bytes(v['written'])} |" for k, v in top]
    at = (lambda n: "") if bandwidth is None else (lambda n: f" ({ms(n):.2f} ms at {bandwidth / 1e12:.2f} TB/s)")
    count = lambda found: ", ".join(f"{n} {kind}" for kind, n in found.items()) or "none"  # noqa: E731
    on_mesh = [] if len(devices) == 1 else [
        f"On a mesh of {S.describe(args.mesh)} ({len(devices)} devices): every byte below is one device's (its shard "
        f"of the weights and of the KV cache). Collectives: in the program {count(collectives['program'])}; in a "
        f"decode step {count(collectives['step'])}.", ""]
    report = "\n".join([
        f"{args.preset} ({args.dtype}) generate program, batch {args.batch}, {args.prompt_len} prompt + "
        f"{args.new_tokens} new slots, compiled for {results['env']['target']} ({args.target}) in "
        f"{memory['compile_s']:.1f} s", "", *on_mesh,
        "| program | bytes |", "|---|---:|",
        *(f"| {k} | {format_bytes(memory[k])} |" for k in ("argument_bytes", "output_bytes", "temp_bytes")),
        f"| weights | {format_bytes(weight_bytes)} |", f"| KV cache ({slots} slots) | {format_bytes(kv_full)} |",
        "", f"XLA cost analysis of the whole program: {program_cost or 'none from this backend'}", "",
        f"One decode step (the mean of {len(loops)} decode loop bodies: "
        f"{', '.join(format_bytes(n) for n in loop_bytes)}; {len(ops)} kernels): {format_bytes(step)}{at(step)}; "
        f"floor (weights + the "
        f"KV cache of the filled slots, {args.prompt_len} + {(args.new_tokens + 1) // 2} on average): "
        f"{format_bytes(floor)}{at(floor)}; {step / floor:.2f} x the floor; without the prompts' left padding "
        f"({args.prompt_tokens} real tokens a prompt): {format_bytes(floor_unpadded)}{at(floor_unpadded)}", "",
        (f"Decode attention: the Pallas kernel, its KV cache reads counted as the {read:.0f} of {slots} slots it "
         f"reads a step on average" if kernel else "Decode attention: XLA's, over the static slots of its loop"),
        "",
        "| source (jax op name) | kernels | read | written |", "|---|---:|---:|---:|", *rows])
    suffix = "".join(f"-{axis}{n}" for axis, n in args.mesh.items() if n > 1)
    out = args.out or ROOT / "benchmarks" / "results" / \
        f"decode_cost-{target_name(device, args.target)}-{args.preset}{suffix}"
    save_results(out, "One decode step of the sampler: bytes by XLA's compiled program", results, report)
    return results


if __name__ == "__main__":
    main()
