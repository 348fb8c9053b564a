"""Several LoRA adapters in one forward: `AdapterBatch` (K adapters stacked, and the adapter of each batch row),
built by `stack` from flat adapters (workers.models.lora's layout) and fresh ones from `init_adapter`. The
decoder calls `AdapterBatch.delta` in each projection an adapter targets, and on the final hidden state for the
output head ("lm_head": the logits get the delta, in float32).

    batch = stack([adapter_0, adapter_1], [spec_0, spec_1], rows=[-1, 0, 1, 1])   # row 0 runs the base
    logits = model(tokens, attention_mask=mask, adapters=batch)

Design decisions:
- **Per-row gather.** Row b computes scale[k] * (x_b A_k) B_k with k = rows[b]: A[rows] (B, in, r) and
  B[rows] (B, r, out) are gathered, so the cost is that of B small matmuls of rank r whatever K is (no
  K-fold work, no dense (K, B) one-hot product), and one program serves any mix of rows.
- **One adapter for every row: no gather** (`stack(..., dense=True)`, a LoRA actor's: K = 1, rows 0 or -1).
  x A B is then one matmul over all rows, and its gradient one matmul, where the gather's is a scatter-add of B
  per-row (in, r) copies: a LoRA actor's gradient program traces in 4.8-5.3 s and compiles in 16.2-16.7 s where
  it took 5.6-6.0 and 17.7-19.5 s (two runs each; Qwen3-0.6B, rank 16 on every projection, 16 x 512, for an H100
  without one, benchmarks/compile_cost.py's programs), with 0.27 GiB fewer temporaries. The same values, summed in
  another order: a shared sampler keeps the gather whatever its K, so a task's tokens alone and co-batched stay
  the same bits.
- **Padding to one rank.** Adapters of ranks r_k are stacked to r = max r_k with zero columns of A and rows
  of B: the zero columns contribute exactly 0, so a padded adapter computes what it computes alone.
- **Float32, exact zero for the base.** The update is computed in float32 and cast to the activation dtype
  before it is added (bf16 models); rows of -1 get `where(.., 0)`, an exact 0 (so does a zero B). In one
  program, rows of -1 and rows of a fresh adapter therefore compute the same bits; against the program
  without adapters (`adapters=None`) they agree to float rounding only (a few 1e-6 in float32): XLA fuses the
  added 0 into the q/k norms' reductions and sums in another order. A KL reference that must equal the
  policy exactly at step 0 is computed by the same program with `with_rows(batch, [-1] * B)`.
- **Values are arguments.** a, b, scale and rows are pytree leaves: new adapter values or a new row mix never
  recompile; only K, r and the batch size are shapes.

Shapes: K adapters, B batch rows, T tokens, r the (padded) rank, in/out a projection's input/output width.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from workers.models.config import ModelConfig, ModelConfigError
from workers.models.lora import HEAD, LAYER_TARGETS, MLP_TARGETS, LoraSpec, adapted_modules


def init_adapter(cfg: ModelConfig, spec: LoraSpec, key: jax.Array) -> dict[str, jax.Array]:
    """A fresh adapter's flat float32 parameters, as PEFT initialises LoRA: A kaiming-uniform (a = sqrt(5) over
    fan_in = in, i.e. uniform in +-1/sqrt(in)) and B zero, so it adds exactly 0: it computes the base."""
    out = {}
    modules = adapted_modules(cfg, spec)
    for module, k in zip(modules, jax.random.split(key, len(modules)), strict=True):
        d_in, d_out = modules[module]
        bound = 1.0 / np.sqrt(d_in)  # gain sqrt(2 / (1 + 5)) * sqrt(3 / fan_in)
        out[f"{module}.lora_a"] = jax.random.uniform(k, (d_in, spec.rank), jnp.float32, -bound, bound)
        out[f"{module}.lora_b"] = jnp.zeros((spec.rank, d_out), jnp.float32)
    return out


@functools.partial(jax.tree_util.register_dataclass, data_fields=["a", "b", "scale", "rows"], meta_fields=["dense"])
@dataclasses.dataclass(frozen=True)
class AdapterBatch:
    """K adapters stacked for one forward, and the adapter of each batch row. A pytree of arrays: pass it into
    jitted functions as an argument (new values or rows never recompile; K, r and B are its shapes).

    a:     {module path: (K, in, r)} float32, e.g. "model.layers.0.self_attn.q_proj"
    b:     {module path: (K, r, out)} float32
    scale: (K,) float32, alpha / rank of each adapter
    rows:  (B,) int32, the adapter of each row; -1 runs the base (its rows get exactly nothing added)

    Ranks differ between adapters: each is padded with zero columns of A and rows of B to the largest r.
    A module an adapter does not target holds zeros for it. To differentiate w.r.t. the adapters, take the
    gradient w.r.t. (a, b) (jax.grad refuses the integer `rows`): `dataclasses.replace(batch, a=a, b=b)`.
    """

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scale: jax.Array
    rows: jax.Array
    dense: bool = False  # K = 1, applied to all rows by one matmul (rows of -1 masked): no per-row gather

    def delta(self, module: str, x: jax.Array) -> jax.Array | None:
        """What the adapters add to `module`'s output for input x (B, T, in): per row b,
        scale[rows[b]] * x[b] A[rows[b]] B[rows[b]], in float32, cast to x's dtype (B, T, out); exactly 0 on rows
        of -1. None where no adapter targets `module`."""
        if module not in self.a:
            return None
        on = self.rows >= 0  # (B,)
        if self.dense:  # the one adapter, every row: (B x T, in) @ (in, r) @ (r, out)
            xa = jnp.einsum("bti,ir->btr", x.astype(jnp.float32), self.a[module][0])  # (B, T, r)
            y = jnp.einsum("btr,ro->bto", xa, self.b[module][0]) * self.scale[0]  # (B, T, out)
            return jnp.where(on[:, None, None], y, 0.0).astype(x.dtype)
        k = jnp.maximum(self.rows, 0)  # (B,) a valid index for the gather; -1 rows are masked below
        a = jnp.take(self.a[module], k, axis=0)  # (B, in, r)
        b = jnp.take(self.b[module], k, axis=0)  # (B, r, out)
        xa = jnp.einsum("bti,bir->btr", x.astype(jnp.float32), a)  # (B, T, r)
        y = jnp.einsum("btr,bro->bto", xa, b) * jnp.take(self.scale, k)[:, None, None]  # (B, T, out)
        return jnp.where(on[:, None, None], y, 0.0).astype(x.dtype)

    def renamed(self, prefix: str, to: str) -> AdapterBatch:
        """The adapters of the modules under `prefix` (a module path, e.g. "model.layers.3"), that prefix of their
        paths replaced by `to`: what a function that calls one layer whatever its index reads (the decoder traces a
        layer once for all layers: workers.models.decoder._layer)."""
        cut = len(prefix)

        def pick(d: dict[str, jax.Array]) -> dict[str, jax.Array]:
            return {to + k[cut:]: v for k, v in d.items() if k.startswith(prefix + ".")}

        return dataclasses.replace(self, a=pick(self.a), b=pick(self.b))

    def adapter(self, k: int, shapes: Mapping[str, tuple[int, int]]) -> dict[str, jax.Array]:
        """Adapter k back in the flat layout (`<module>.lora_a` / `.lora_b` of `shapes`), its rank's padding cut:
        what `stack` stacked, as the forward reads it."""
        out = {}
        for name, (rows, cols) in shapes.items():
            module, part = name.rsplit(".", 1)
            out[name] = (self.a if part == "lora_a" else self.b)[module][k, :rows, :cols]
        return out


def stack(adapters: Sequence[Mapping[str, object]], specs: Sequence[LoraSpec], rows, *,
          dense: bool = False) -> AdapterBatch:
    """K flat adapters (`<module>.lora_a` (in, r_k), `.lora_b` (r_k, out)) and their specs -> an AdapterBatch
    whose row b runs adapter rows[b] (-1: the base). Works on numpy or jax arrays (traced ones included).
    `dense`: one adapter (K = 1), applied without a per-row gather (the module docstring)."""
    if len(adapters) != len(specs) or not adapters:
        raise ValueError(f"stack: {len(adapters)} adapters and {len(specs)} specs; give one spec per adapter "
                         "(and at least one)")
    if dense and len(adapters) != 1:
        raise ValueError(f"stack: dense is one adapter for every row; got {len(adapters)} adapters")
    rank = max(s.rank for s in specs)
    dims: dict[str, tuple[int, int]] = {}
    for i, (flat, spec) in enumerate(zip(adapters, specs, strict=True)):
        modules = {name.rsplit(".", 1)[0] for name in flat}
        for module in modules:
            a, b = flat.get(f"{module}.lora_a"), flat.get(f"{module}.lora_b")
            if a is None or b is None or len(a.shape) != 2 or len(b.shape) != 2:
                raise ValueError(f"stack: adapter {i} needs {module}.lora_a (in, r) and {module}.lora_b (r, out); "
                                 f"got names {sorted(n for n in flat if n.startswith(module + '.'))}")
            if a.shape[1] != spec.rank or b.shape[0] != spec.rank:
                raise ValueError(f"stack: adapter {i}'s {module} is A {tuple(a.shape)}, B {tuple(b.shape)}, "
                                 f"not of its spec's rank {spec.rank}")
            if dims.setdefault(module, (a.shape[0], b.shape[1])) != (a.shape[0], b.shape[1]):
                raise ValueError(f"stack: adapter {i}'s {module} is ({a.shape[0]} -> {b.shape[1]}), another "
                                 f"adapter's is {dims[module]}: adapters of one batch share one base")
    stacked_a, stacked_b = {}, {}
    for module in sorted(dims, key=_module_order):
        d_in, d_out = dims[module]
        pa, pb = [], []
        for flat in adapters:
            a = flat.get(f"{module}.lora_a")
            b = flat.get(f"{module}.lora_b")
            if a is None:  # this adapter does not target the module: zeros add nothing
                pa.append(jnp.zeros((d_in, rank), jnp.float32))
                pb.append(jnp.zeros((rank, d_out), jnp.float32))
                continue
            r = a.shape[1]
            pa.append(jnp.pad(jnp.asarray(a, jnp.float32), ((0, 0), (0, rank - r))))
            pb.append(jnp.pad(jnp.asarray(b, jnp.float32), ((0, rank - r), (0, 0))))
        stacked_a[module], stacked_b[module] = jnp.stack(pa), jnp.stack(pb)
    scale = jnp.asarray([s.scale for s in specs], jnp.float32)
    return with_rows(AdapterBatch(stacked_a, stacked_b, scale, jnp.zeros((0,), jnp.int32), dense), rows)


def with_rows(batch: AdapterBatch, rows) -> AdapterBatch:
    """The same adapters for other rows. Concrete rows are checked against K (-1 <= row < K)."""
    if not isinstance(rows, jax.core.Tracer):
        host = np.asarray(rows) if len(rows) else np.zeros(0, np.int32)
        k = int(batch.scale.shape[0])
        if host.ndim != 1 or not np.issubdtype(host.dtype, np.integer) or (host.size and (
                host.min() < -1 or host.max() >= k)):
            raise ValueError(f"adapter rows must be a 1-d list of integers in [-1, {k}) (-1: the base), got {rows!r}")
    return dataclasses.replace(batch, rows=jnp.asarray(rows, jnp.int32))


def _module_order(module: str) -> tuple:
    parts = module.split(".")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def check_modules(cfg: ModelConfig, batch: AdapterBatch, batch_size: int) -> None:
    """The decoder's check of an AdapterBatch against the model it runs in (at trace time: shapes and names are
    static): every module is an adaptable projection of this model, and there is one row per batch row."""
    allowed = {f"model.layers.{i}.{LAYER_TARGETS[t]}" for i in range(cfg.num_hidden_layers) for t in LAYER_TARGETS
               if not (t in MLP_TARGETS and cfg.moe_layer(i))} | {HEAD}
    unknown = sorted(set(batch.a) - allowed, key=_module_order)
    if unknown:
        moe = [m for m in unknown if m.rsplit(".", 2)[-2] == "mlp"]
        hint = (" (MLP projections of mixture-of-experts layers cannot be adapted; target q, k, v and o there)"
                if moe else "")
        raise ModelConfigError(f"adapters target {unknown[:4]}{'...' if len(unknown) > 4 else ''}, which "
                               f"{cfg.describe()} has no single projection for{hint}")
    if batch.rows.shape != (batch_size,):
        raise ValueError(f"adapter rows have shape {tuple(batch.rows.shape)}; the batch has {batch_size} rows "
                         "(give one adapter index per row, -1 for the base)")
