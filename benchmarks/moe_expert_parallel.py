"""The MoE layer expert-parallel over the GPUs of one host against one GPU, fwd+bwd, and its exchanges alone.

  layer, 1 device    jaxmlp.nnx.MoE on one GPU with all E experts and T tokens;
  layer, P devices   the same layer with expert_axis over P GPUs (jaxmlp.expert_parallel), each exchange:
                     T tokens and E/P experts per GPU, the experts' weights split over the axis, so each
                     GPU does the one-GPU layer's work plus the exchanges: the difference is what expert
                     parallelism costs;
  exchange alone     the data of one layer's forward between the GPUs, there and back: all_gather (T
                     tokens per GPU gathered, then as many partial sums reduce-scattered) and
                     ragged_all_to_all (T * k rows per GPU, balanced over the experts, to their experts'
                     GPUs and back); GB/s: the bytes one GPU sends to the others per trip over the time of
                     one trip.

  in turn            on GPUs, the one-GPU layer and the layer over all GPUs with each --chunks count
                     (expert_chunks: the exchange split so that XLA may overlap it with the experts'
                     work), with --fp8 also with its gathers in bf16 (fp8_exchange=False; the default
                     moves e4m3 rows), their samples taken in turn (timing.measure_alternating): the
                     ratio over one GPU is what expert parallelism costs, out of reach of the clock's
                     drift.

bf16 (the expert MLP in FP8 with --fp8), random routing; on a CPU (host devices, float32 or with --fp8
bf16, the tiny shape, the all_gather layer alone) it checks that the script runs.

  python benchmarks/moe_expert_parallel.py --out /tmp/ep --chunks 1,2,4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

import jaxmlp.nnx
from jaxmlp import expert_parallel
from jaxmlp.fp8 import exchange as fp8_exchange
from timing import measure, measure_alternating

# name: (T tokens per device, d model width, E experts, k top-k, f expert hidden width)
SHAPES = {"qwen3": (8192, 2048, 128, 8, 768), "tiny": (64, 32, 8, 2, 48)}
AXIS = "expert"


def layer_seconds(shape, devices, dtype, timing, exchange="all_gather", chunks=1, fp8=None) -> dict:
  """fwd+bwd of the layer over `devices` (one: no mesh), T tokens per device."""
  return measure(layer_step(shape, devices, dtype, exchange, chunks, fp8), jax.block_until_ready, **timing)


def layer_step(shape, devices, dtype, exchange="all_gather", chunks=1, fp8=None, fp8_exchange=True):
  """call(i): one fwd+bwd of the layer over `devices` (one: no mesh), T tokens per device; fp8: None or a
  recipe's name, run in FP8 at every shape (Fp8Recipe when="always"), the gathers in e4m3 unless not
  fp8_exchange."""
  T, d, E, k, f = shape
  n = len(devices)
  keys = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(keys[0], (n * T, d), dtype)
  dy = jax.random.normal(keys[1], (n * T, d), dtype)

  def loss(module, x):
    y, aux = module(x)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + aux["aux_loss"]

  step = jax.jit(nnx.grad(loss, argnums=(0, 1)))
  make = lambda axis: jaxmlp.nnx.MoE(E, d, f, k, rngs=nnx.Rngs(0), expert_axis=axis, dtype=dtype,
                                     expert_exchange=exchange, expert_chunks=chunks,
                                     fp8=fp8 and jaxmlp.Fp8Recipe(fp8, when="always"), fp8_exchange=fp8_exchange)
  if n == 1:
    with jax.default_device(devices[0]):
      module = make(None)
      x = jax.device_put(x, devices[0])
    return lambda i: step(module, x)
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,), devices=devices)
  with jax.set_mesh(mesh), nnx.logical_axis_rules((("expert", AXIS), ("embed", None), ("mlp", None))):
    module = make(AXIS)
    x = jax.sharding.reshard(x, jax.P(AXIS))

  def call(i):
    with jax.set_mesh(mesh):
      return step(module, x)
  return call


def exchange_seconds(shape, devices, dtype, timing, exchange: str) -> dict:
  """One layer's forward exchanges alone, there and back (module docstring)."""
  T, d, E, k, _ = shape
  n = len(devices)
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,), devices=devices)
  per_device = T * k if exchange == "ragged_all_to_all" else T
  rows = jax.random.normal(jax.random.key(1), (n * per_device, d), dtype)
  group_sizes = jnp.full((n * E,), T * k // E, jnp.int32)

  def shard(rows, group_sizes):
    if exchange == "all_gather":
      return jax.lax.psum_scatter(jax.lax.all_gather(rows, AXIS, tiled=True), AXIS, tiled=True)
    if exchange == "e4m3 all_gather":  # the FP8 layer's: the tokens in e4m3, the partial sums in bf16
      return jax.lax.psum_scatter(fp8_exchange.gather(rows, AXIS), AXIS, tiled=True)
    sent = jax.lax.all_gather(group_sizes.reshape(n, E // n), AXIS)
    ragged = expert_parallel._RaggedExchange(sent, jax.lax.axis_index(AXIS), AXIS, max_rows=T * min(k, E // n) * n)
    return ragged.backward(ragged.forward(rows)[0], rows.shape[0])

  with jax.set_mesh(mesh):
    rows, group_sizes = jax.sharding.reshard((rows, group_sizes), (jax.P(AXIS), jax.P(AXIS)))
    step = jax.jit(jax.shard_map(shard, in_specs=(jax.P(AXIS), jax.P(AXIS)), out_specs=jax.P(AXIS)))
    result = measure(lambda i: step(rows, group_sizes), jax.block_until_ready, **timing)
  sent_bytes = per_device * (n - 1) // n * d * jnp.dtype(dtype).itemsize  # one GPU to the others, one trip
  if exchange != "ragged_all_to_all":  # the gather sends its T tokens to every other GPU
    sent_bytes *= n
  if exchange == "e4m3 all_gather":  # GB/s of the trip's mean bytes: the gather's at 1 + 4 / 128 bytes a value
    itemsize = jnp.dtype(dtype).itemsize
    sent_bytes = sent_bytes * (itemsize + 1 + 4 / 128) / (2 * itemsize)
  result["GB/s"] = sent_bytes / (result["s"] / 2) / 1e9
  return result


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shape", choices=list(SHAPES), default=None, help="default: qwen3 on GPUs, tiny on a CPU")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--budget-s", type=float, default=5.0)
  p.add_argument("--out", type=Path, default=Path("."))
  p.add_argument("--chunks", default="1", help="comma-separated expert_chunks counts of the all_gather layer")
  p.add_argument("--rounds", type=int, default=8, help="rounds of the in-turn comparison (GPUs)")
  p.add_argument("--fp8", choices=("tensorwise", "blockwise"), default=None,
                 help="the layers' expert MLP in FP8 with this recipe (default: in the dtype, bf16 on GPUs)")
  p.add_argument("--exchanges", default=",".join(expert_parallel.EXCHANGES),
                 help="comma-separated exchanges to time (the in-turn comparison needs all_gather); e.g. "
                      "ragged_all_to_all alone, once per XLA_FLAGS setting of XLA's ragged exchange")
  a = p.parse_args()
  chunk_counts = [int(c) for c in a.chunks.split(",")]
  exchanges = a.exchanges.split(",")
  for exchange in exchanges:
    expert_parallel.check_exchange(exchange, "--exchanges")

  gpu = jax.default_backend() == "gpu"
  devices = jax.devices()
  if len(devices) < 2:
    sys.exit(f"needs 2 or more devices; this machine has {len(devices)} {jax.default_backend()} device(s)")
  name = a.shape or ("qwen3" if gpu else "tiny")
  shape, dtype = SHAPES[name], (jnp.bfloat16 if gpu or a.fp8 else jnp.float32)
  timing = dict(repeats=a.repeats, max_call_s=5.0, budget_s=a.budget_s)
  counts = sorted({1, 2, len(devices)} | ({4} if len(devices) >= 4 else set()))
  rows = {}
  for n in counts:
    runs = {}
    if "all_gather" in exchanges:
      runs["layer, all_gather"] = lambda: layer_seconds(shape, devices[:n], dtype, timing, fp8=a.fp8)
      for c in (c for c in chunk_counts if c > 1 and n > 1):
        runs[f"layer, all_gather in {c} chunks"] = lambda c=c: layer_seconds(shape, devices[:n], dtype, timing,
                                                                             chunks=c, fp8=a.fp8)
    # On a CPU the layer only: XLA:CPU has no ragged-all-to-all, and many exchanges in flight at once (the
    # timing's back-to-back calls) left its all-gather waiting for a device thread that never came.
    if n > 1 and gpu and "all_gather" in exchanges:
      runs["all_gather there and back"] = lambda: exchange_seconds(shape, devices[:n], dtype, timing, "all_gather")
      if a.fp8:
        runs["e4m3 all_gather there and back"] = lambda: exchange_seconds(shape, devices[:n], dtype, timing,
                                                                          "e4m3 all_gather")
    if n > 1 and gpu and "ragged_all_to_all" in exchanges:
      runs["layer, ragged_all_to_all"] = lambda: layer_seconds(shape, devices[:n], dtype, timing, "ragged_all_to_all",
                                                               fp8=a.fp8)
      runs["ragged_all_to_all there and back"] = lambda: exchange_seconds(shape, devices[:n], dtype, timing,
                                                                          "ragged_all_to_all")
    for what, run in runs.items():
      try:
        rows[f"{what}, {n} devices"] = run()
      except Exception as e:  # an XLA fault of one variant (see jaxmlp.expert_parallel) must not end the run
        rows[f"{what}, {n} devices"] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:600]}
      print(f"{what}, {n} devices: {rows[f'{what}, {n} devices']}", file=sys.stderr)

  # The one-GPU layer and the layer over all GPUs at each chunk count, in turn.
  if gpu and "all_gather" in exchanges:
    calls = {"1 GPU": layer_step(shape, devices[:1], dtype, fp8=a.fp8)}
    calls.update({f"{len(devices)} GPUs, {c} chunks": layer_step(shape, devices, dtype, chunks=c, fp8=a.fp8)
                  for c in chunk_counts})
    if a.fp8:
      calls[f"{len(devices)} GPUs, bf16 gathers"] = layer_step(shape, devices, dtype, fp8=a.fp8, fp8_exchange=False)
    for what, t in measure_alternating(calls, jax.block_until_ready, rounds=a.rounds).items():
      rows[f"in turn: {what}"] = t
      print(f"in turn: {what}: {t}", file=sys.stderr)

  T, d, E, k, f = shape
  lines = [f"## MoE layer expert-parallel ({devices[0].device_kind} x{len(devices)}, jax {jax.__version__})", "",
           f"Per device T={T} tokens, d={d}, E={E} experts in all, top-{k}, f={f}, {jnp.dtype(dtype).name}"
           f"{f', FP8 {a.fp8}' if a.fp8 else ''}; "
           "fwd+bwd for the layers", "", "| what | ms | GB/s per GPU, one way |", "|---|---|---|"]
  one = rows.get("in turn: 1 GPU")
  for what, r in rows.items():
    ms = f"{r['s'] * 1e3:.3f}" if "s" in r else f"{r['status']}: {r.get('error', '')[:200]}"
    if one and what.startswith("in turn:"):
      ms += f" ({r['s'] / one['s']:.3f}x one GPU)"
    lines.append(f"| {what} | {ms} | {r['GB/s']:.0f} |" if "GB/s" in r else f"| {what} | {ms} | |")
  a.out.mkdir(parents=True, exist_ok=True)
  (a.out / "moe_expert_parallel.json").write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))
  (a.out / "moe_expert_parallel.md").write_text("\n".join(lines))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
