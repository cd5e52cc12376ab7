"""The JAX implementations compared, each built as the same SwiGLU expert MLP, and their measurements:
correctness against the reference, compiled memory, forward and fwd+bwd functions.

  jaxmlp      jaxmlp.grouped_mlp (the FFI custom calls)
  jaxmlp_fp8  jaxmlp.grouped_mlp(fp8="tensorwise"): FC1 and FC2, fwd and bwd, as FP8 e4m3 products
  jaxmlp_fp8_blockwise  jaxmlp.grouped_mlp(fp8="blockwise"): block scales, products on cuBLASLt's
              block-scaled FP8 grouped GEMM
  jaxmlp_fp8_cached, jaxmlp_fp8_blockwise_cached  the same with the weights quantized before the step
              (jaxmlp.fp8_weights, not timed): a micro-batch's cost where the weights are quantized once per
              optimizer step over many micro-batches
  jaxmlp_fp8_default_cached  jaxmlp_fp8_cached under the recipe's own rule (when="faster": in FP8 or bf16,
              and each product's precision, as a user gets them; jaxmlp_fp8_cached runs when="always")
  jaxmlp_fp8_cached_fast_bwd  jaxmlp_fp8_cached with fast accumulation in the backward's products too
              (Fp8Recipe.backward_fast_accumulation)
  jaxmlp_fp8_delayed, jaxmlp_fp8_delayed_cached  jaxmlp_fp8(_cached) with delayed scaling
              (Fp8Recipe.scaling="delayed"), over a fixed amax history (its update, 4 values, is not taken);
              jaxmlp_fp8_delayed_cached_fast_bwd the latter with jaxmlp_fp8_cached_fast_bwd's accumulation,
              jaxmlp_fp8_delayed_wgrad16_cached with jaxmlp_fp8_wgrad16_cached's weight gradients
  jaxmlp_fp8_wgrad16, jaxmlp_fp8_wgrad16_cached, jaxmlp_fp8_blockwise_wgrad16,
  jaxmlp_fp8_blockwise_wgrad16_cached  jaxmlp_fp8(_cached), jaxmlp_fp8_blockwise(_cached) with 16-bit
              weight gradients (Fp8Recipe.fp8_weight_gradients=False)
  jaxmlp_master, jaxmlp_fp8_master, jaxmlp_fp8_blockwise_master, jaxmlp_fp8_blockwise_wgrad16_master  the
              weights as an optimizer holds them, float32 master weights, rounded to x's dtype in the step
              (bf16: astype; FP8: jaxmlp.fp8_weights(w, recipe, x.dtype), the weights' gradients float32)
  ragged_dot  jaxmlp.reference.grouped_mlp, i.e. jax.lax.ragged_dot: what a JAX user writes today
  tokamax     the same MLP over tokamax.ragged_dot (when tokamax is installed)
  dense       the same MLP as one dense expert over all M rows (jnp.dot): equal FLOPs, no routing;
              the ceiling a grouped kernel can approach
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxmlp
from cases import TOLERANCE
from timing import measure

JAX_IMPLS = ("jaxmlp", "jaxmlp_fp8", "jaxmlp_fp8_blockwise", "jaxmlp_fp8_cached", "jaxmlp_fp8_blockwise_cached",
             "jaxmlp_fp8_default_cached",
             "jaxmlp_fp8_cached_fast_bwd", "jaxmlp_fp8_delayed", "jaxmlp_fp8_delayed_cached",
             "jaxmlp_fp8_delayed_cached_fast_bwd", "jaxmlp_fp8_delayed_wgrad16_cached", "jaxmlp_fp8_wgrad16", "jaxmlp_fp8_wgrad16_cached",
             "jaxmlp_fp8_blockwise_wgrad16", "jaxmlp_fp8_blockwise_wgrad16_cached", "jaxmlp_master",
             "jaxmlp_fp8_master", "jaxmlp_fp8_blockwise_master", "jaxmlp_fp8_blockwise_wgrad16_master", "ragged_dot",
             "tokamax", "dense")
# The recipe of each FP8 implementation that takes its weights quantized (jaxmlp.fp8_weights) as inputs.
CACHED_WEIGHTS = {"jaxmlp_fp8_cached": "tensorwise", "jaxmlp_fp8_blockwise_cached": "blockwise",
                  "jaxmlp_fp8_default_cached": "tensorwise",
                  "jaxmlp_fp8_cached_fast_bwd": "tensorwise", "jaxmlp_fp8_delayed_cached": "tensorwise",
                  "jaxmlp_fp8_delayed_cached_fast_bwd": "tensorwise", "jaxmlp_fp8_delayed_wgrad16_cached": "tensorwise",
                  "jaxmlp_fp8_wgrad16_cached": "tensorwise",
                  "jaxmlp_fp8_blockwise_wgrad16_cached": "blockwise"}


def swiglu_mlp(x, w1, w2, matmul):
  """The MLP of jaxmlp.reference over any `matmul(rows, weights)`: FC1, silu(gate) * up in float32
  rounded to the input dtype, FC2."""
  f = w2.shape[-2]
  h = matmul(x, w1)
  a = jax.nn.silu(h[:, :f].astype(jnp.float32)) * h[:, f:].astype(jnp.float32)
  return matmul(a.astype(x.dtype), w2)


def forward(impl: str):
  """f(x, w1, w2, group_sizes) -> y. Group sizes are an argument, not a constant, as in training:
  a compiler must not specialise on one routing."""
  if impl == "jaxmlp":
    return jaxmlp.grouped_mlp
  if impl == "jaxmlp_master":
    return lambda x, w1, w2, gs: jaxmlp.grouped_mlp(x, w1.astype(x.dtype), w2.astype(x.dtype), gs)
  if impl.endswith("_master"):  # an FP8 implementation, its weights quantized in the step from float32
    fp8 = forward(impl[:-len("_master")]).keywords["fp8"]
    return lambda x, w1, w2, gs: jaxmlp.grouped_mlp(x, jaxmlp.fp8_weights(w1, fp8, x.dtype),
                                                    jaxmlp.fp8_weights(w2, fp8, x.dtype), gs, fp8=fp8)
  if impl in ("jaxmlp_fp8", "jaxmlp_fp8_cached"):
    return functools.partial(jaxmlp.grouped_mlp, fp8=jaxmlp.Fp8Recipe("tensorwise", when="always"))
  if impl == "jaxmlp_fp8_default_cached":
    return functools.partial(jaxmlp.grouped_mlp, fp8=jaxmlp.Fp8Recipe("tensorwise", when="faster"))
  if impl == "jaxmlp_fp8_cached_fast_bwd":
    return functools.partial(jaxmlp.grouped_mlp, fp8=jaxmlp.Fp8Recipe("tensorwise", backward_fast_accumulation=True,
                                                                      when="always"))
  if impl.startswith("jaxmlp_fp8_delayed"):
    history = jnp.full((4, 16), 4.0, jnp.float32)  # the activations' amaxes: any values time the same
    recipe = jaxmlp.Fp8Recipe("tensorwise", when="always", scaling="delayed",
                              backward_fast_accumulation=impl.endswith("_fast_bwd"),
                              fp8_weight_gradients=False if "wgrad16" in impl else None)
    return functools.partial(jaxmlp.grouped_mlp, fp8=recipe, fp8_history=history)
  if impl in ("jaxmlp_fp8_wgrad16", "jaxmlp_fp8_wgrad16_cached"):
    return functools.partial(jaxmlp.grouped_mlp, fp8=jaxmlp.Fp8Recipe("tensorwise", when="always",
                                                                      fp8_weight_gradients=False))
  if impl in ("jaxmlp_fp8_blockwise", "jaxmlp_fp8_blockwise_cached"):
    return functools.partial(jaxmlp.grouped_mlp, fp8=jaxmlp.Fp8Recipe("blockwise", when="always"))
  if impl in ("jaxmlp_fp8_blockwise_wgrad16", "jaxmlp_fp8_blockwise_wgrad16_cached"):
    return functools.partial(jaxmlp.grouped_mlp, fp8=jaxmlp.Fp8Recipe("blockwise", when="always",
                                                                      fp8_weight_gradients=False))
  if impl == "ragged_dot":
    return jaxmlp.reference.grouped_mlp
  if impl == "tokamax":
    import tokamax
    return lambda x, w1, w2, gs: swiglu_mlp(x, w1, w2, lambda a, w: tokamax.ragged_dot(a, w, gs))
  if impl == "dense":
    return lambda x, w1, w2, gs: swiglu_mlp(x, w1, w2, jnp.dot)  # w1 [d, 2f], w2 [f, d]
  raise ValueError(f"unknown JAX implementation {impl!r}")


def forward_backward(fwd):
  """(y, dx, dw1, dw2) for a random output cotangent dy: the backward starts from dy as a layer inside
  a model would (a loss computed here would add its own passes over y; a plain sum would hand XLA a
  constant cotangent it could fold). y is returned, as torch's step holds it: a model uses the layer's
  output, and without it XLA would drop FC2's forward product from the programs it can see into
  (ragged_dot, dense), which then do 8/9 of the FLOPs counted."""
  def fwd_bwd(x, w1, w2, dy, gs):
    # Quantized weights (jaxmlp.Fp8Weights) are differentiated in their weights alone, as in training.
    def f(x, a, b):
      return fwd(x, with_weights(w1, a), with_weights(w2, b), gs)
    y, vjp = jax.vjp(f, x, jaxmlp.fp8.weights_of(w1), jaxmlp.fp8.weights_of(w2))
    return (y, *vjp(dy))
  return fwd_bwd


def with_weights(w, weights):
  """w with `weights` in place of its 16-bit weights where w is a jaxmlp.Fp8Weights, else `weights`."""
  return dataclasses.replace(w, weights=weights) if isinstance(w, jaxmlp.Fp8Weights) else weights


def per_expert(sizes):
  """jaxmlp.reference's math with the group sizes known on the host: one jnp.dot per expert over its
  rows. Needs no ragged_dot, so it still runs where XLA's ragged_dot runs out of memory."""
  ends = np.cumsum(sizes)
  starts = ends - np.asarray(sizes)

  def fwd(x, w1, w2, gs):
    del gs
    return jnp.concatenate([swiglu_mlp(x[s:e], w1[g], w2[g], jnp.dot)
                            for g, (s, e) in enumerate(zip(starts, ends))])
  return fwd


NO_AUTOTUNING = {"xla_gpu_autotune_level": 0}


def compile_pair(fwd, inputs, gs, limit_bytes: int | None = None, autotune: bool = True):
  """(forward, fwd+bwd) of the MLP `fwd`, compiled for these input shapes; `inputs` is (x, w1, w2, dy).

  With `limit_bytes`, each program is first compiled without autotuning, and one that plans more device
  memory than that raises MemoryError before the real compile: XLA's autotuner would otherwise try, and
  fail for lack of memory, every kernel config of it (jax.lax.ragged_dot at qwen3 on an 80 GB H100 took
  ~3 minutes to fail that way). autotune=False is for programs that are never timed.
  """
  x, w1, w2, dy = inputs
  lowered = {"fwd": jax.jit(fwd).lower(x, w1, w2, gs),
             "fwd+bwd": jax.jit(forward_backward(fwd)).lower(x, w1, w2, dy, gs)}
  if limit_bytes is not None:
    for mode, program in lowered.items():
      need = peak_bytes(program.compile(compiler_options=NO_AUTOTUNING))
      if need is not None and need > limit_bytes:
        raise MemoryError(f"{mode} needs {need / 2**30:.1f} GiB of device memory; JAX may use "
                          f"{limit_bytes / 2**30:.1f} GiB here")
  options = None if autotune else NO_AUTOTUNING
  return tuple(program.compile(compiler_options=options) for program in lowered.values())


def device_memory_limit() -> int | None:
  """Bytes JAX's allocator may hand out on the default device (None where it does not say, e.g. the CPU)."""
  stats = jax.devices()[0].memory_stats()
  return stats.get("bytes_limit") if stats else None


def make_inputs(E: int, d: int, f: int, M: int, dtype, seed: int):
  """(x, w1, w2, dy) on the default device, scaled so activations stay O(1) in 16-bit types."""
  return _random_inputs(jax.random.key(seed), E, d, f, M, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))  # one compile per shape, not per seed
def _random_inputs(key, E, d, f, M, dtype):
  kx, k1, k2, kdy = jax.random.split(key, 4)
  x = jax.random.normal(kx, (M, d), dtype)
  w1 = (jax.random.normal(k1, (E, d, 2 * f), jnp.float32) / np.sqrt(d)).astype(dtype)
  w2 = (jax.random.normal(k2, (E, f, d), jnp.float32) / np.sqrt(f)).astype(dtype)
  dy = jax.random.normal(kdy, (M, d), dtype)
  return x, w1, w2, dy


def impl_inputs(impl: str, inputs):
  """The operands (x, w1, w2, dy) `impl` takes, from make_inputs'."""
  if impl == "dense":
    return dense_inputs(inputs)
  if impl.endswith("_master"):
    x, w1, w2, dy = inputs
    return x, w1.astype(jnp.float32), w2.astype(jnp.float32), dy
  if impl in CACHED_WEIGHTS:
    x, w1, w2, dy = inputs
    quantize = jax.jit(jaxmlp.fp8_weights, static_argnums=1)
    return x, quantize(w1, CACHED_WEIGHTS[impl]), quantize(w2, CACHED_WEIGHTS[impl]), dy
  return inputs


def dense_inputs(inputs):
  """The dense ceiling's operands: expert 0's weights as one [d, 2f] and one [f, d] matrix."""
  x, w1, w2, dy = inputs
  return x, jnp.array(w1[0]), jnp.array(w2[0]), dy


def rel_err(got, want) -> float:
  """Frobenius-norm relative error, in float32."""
  got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
  return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


def peak_bytes(compiled) -> int | None:
  """Device memory XLA plans for one call: arguments + outputs + temporaries (minus outputs that
  alias arguments). This is what the allocator is asked for, independent of other live arrays."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
             - stats.alias_size_in_bytes)


# Executables per (implementation, dtype, shape), or why compiling them failed: group sizes are an
# argument, so the routings of one shape share them (and a failure is not paid for twice).
_COMPILED: dict = {}


def _compiled(impl: str, dtype, shape, inputs, gs):
  """(fwd, fwd_bwd) executables, or the error message of the compile that failed. The message, not the
  exception: its traceback would keep the failing case's input arrays alive on the device."""
  key = (impl, dtype, shape)
  if key not in _COMPILED:
    try:
      _COMPILED[key] = compile_pair(forward(impl), inputs, gs, device_memory_limit())
    except Exception as e:  # an implementation that cannot handle this shape must not stop the run
      _COMPILED[key] = f"{type(e).__name__}: {e}"
  return _COMPILED[key]


def run_case(shape, sizes, impls, dtype, timing: dict, progress) -> dict:
  """Checks, then times, every implementation in `impls` on one shape and routing.

  Returns {impl: {"fwd": timing, "fwd_bwd": timing, "peak_bytes": int, "check": {...}, "status": "ok"}},
  or {"status": "error", "error": ...} for one that failed. `progress(impl, mode, timing_or_error)` is
  called once per implementation and mode. The reference runs first, and each implementation's own
  inputs (quantized weights) live only while it is checked and timed: with all of them alive at once,
  mixtral with two input sets ran an 80 GB H100 out of memory.
  """
  gs = jnp.asarray(sizes)
  sets = [make_inputs(shape.E, shape.d, shape.f, shape.M, dtype, seed=i) for i in range(timing["sets"])]
  reference = None
  if any(impl not in ("ragged_dot", "dense") for impl in impls):
    try:  # kept on the host: the timings get the device's memory
      against, outputs = _reference_outputs(sets[0], gs, sizes, dtype, shape)
      reference = against, jax.device_get(outputs)
    except Exception as e:
      reference = type(e).__name__
  kw = dict(repeats=timing["repeats"], max_call_s=timing["max_call_s"], budget_s=timing["budget_s"])
  results = {}
  for impl in impls:
    inputs = [impl_inputs(impl, s) for s in sets]
    pair = _compiled(impl, dtype, shape, inputs[0], gs)
    if isinstance(pair, str):
      results[impl] = _error(pair, progress, impl)
      continue
    check = _check(impl, pair, inputs[0], gs, reference, dtype)
    if "error" in check:
      results[impl] = _error(check["error"], progress, impl)
      continue
    results[impl] = {"check": check, "peak_bytes": peak_bytes(pair[1])}  # known even if timing fails
    modes = ("fwd", "fwd_bwd")
    for k, (mode, fn, n_args) in enumerate(zip(modes, pair, (3, 4))):
      try:
        t = measure(lambda i: fn(*inputs[i % len(inputs)][:n_args], gs), jax.block_until_ready, **kw)
      except Exception as e:  # e.g. out of memory: keep what was measured, report the rest as failed
        results[impl].update(_error(e, progress, impl, modes[k:]))
        break
      results[impl][mode] = t
      progress(impl, mode, t)
    else:
      results[impl]["status"] = "ok"
  return results


def _check(impl: str, pair, impl_inputs, gs, reference, dtype) -> dict:
  """Forward output and gradients of `impl` (compiled `pair`, on its impl_inputs) against `reference`
  (_reference_outputs on the same data, or why it failed), before anything is timed."""
  if impl in ("ragged_dot", "dense"):
    return {"note": "reference" if impl == "ragged_dot" else "n/a (one expert)"}
  if isinstance(reference, str):  # still time it, but say loudly that nothing vouches for it
    return {"note": f"NOT CHECKED: reference failed ({reference})"}
  against, want = reference
  tolerance = TOLERANCE["fp8" if "fp8" in impl else jnp.dtype(dtype).name]
  fwd, fwd_bwd = pair
  x, w1, w2, dy = impl_inputs
  try:
    got = (fwd(x, w1, w2, gs), *fwd_bwd(x, w1, w2, dy, gs))
    errs = {name: rel_err(g, w) for name, g, w in zip(("y", "y (fwd+bwd)", "dx", "dw1", "dw2"), got, want)}
    return {**errs, "max": max(errs.values()), "tolerance": tolerance, "ok": max(errs.values()) <= tolerance,
            "against": against}
  except Exception as e:
    return {"error": f"{type(e).__name__}: {e}"}


def _reference_outputs(inputs, gs, sizes, dtype, shape):
  """(name, (y, y, dx, dw1, dw2)) from jaxmlp.reference (the forward's y, then the fwd+bwd step's
  outputs), or from the per-expert loop where XLA cannot run the reference (its ragged_dot may
  materialise [E, M, k] operands and run out of memory)."""
  x, w1, w2, dy = inputs
  pair = _compiled("ragged_dot", dtype, shape, inputs, gs)
  if isinstance(pair, str):
    failure = pair.split(":")[0]  # the exception's name
  else:
    try:
      fwd, fwd_bwd = pair
      return "jaxmlp.reference", (fwd(x, w1, w2, gs), *fwd_bwd(x, w1, w2, dy, gs))
    except Exception as e:
      failure = type(e).__name__
  # Not autotuned: a reference is never timed, and with skewed routing each expert's row count is a
  # shape of its own (at qwen3, hundreds of GEMMs to autotune: minutes on an H100).
  fwd, fwd_bwd = compile_pair(per_expert(sizes), inputs, gs, autotune=False)
  return (f"per-expert jnp.dot loop (jaxmlp.reference failed: {failure})",
          (fwd(x, w1, w2, gs), *fwd_bwd(x, w1, w2, dy, gs)))


def _error(e, progress, impl: str, modes=("fwd", "fwd_bwd")) -> dict:
  """The error entry for `impl`, reported to `progress` for each mode it leaves unmeasured."""
  msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
  for mode in modes:
    progress(impl, mode, {"error": msg})
  return {"status": "error", "error": msg}
