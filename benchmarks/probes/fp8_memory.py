"""Probe (not a benchmark): the device memory a fwd+bwd step plans, bf16 against each FP8 implementation, and
FP8's excess over bf16 in bytes per expert weight (the FP8 issue asks for at most 1). XLA's memory analysis
of the compiled step (jax_impls.peak_bytes: arguments, outputs and temporaries), compiled for abstract
inputs: nothing is allocated, so the issue's 256-expert DeepSeek-V3 layer (256x7168x2048x16384) fits any
GPU. The cached implementations take jaxmlp.Fp8Weights: the step reads their two e4m3 layouts and not their
16-bit weights, which jit then leaves out of the arguments, so the layouts stand where bf16's step holds its
16-bit weights (as with fp8_adam_step, which writes the layouts in place of a 16-bit copy).
On a GPU that runs FP8 (the FP8 implementations lower to the CUDA custom calls).

--top-k K measures the whole MoE layer instead (jaxmlp.moe.moe: router, dispatch, the expert MLP with the
router weights as its row scales, combine; M / K tokens of the shape's width, each routed to K experts): the
dispatched rows are then the layer's own, so what the backward keeps of them counts as it does in a model
(bf16's rows against FP8's transposed e4m3 copy), where the plain MLP's step keeps x as its argument either way.

  python benchmarks/probes/fp8_memory.py [--shapes qwen3,dsv3,256x7168x2048x16384] [--impls ...] [--top-k 8]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxmlp  # noqa: E402
from jaxmlp import moe as moe_lib  # noqa: E402

import cases  # noqa: E402
import jax_impls  # noqa: E402

IMPLS = ("jaxmlp,jaxmlp_fp8,jaxmlp_fp8_blockwise,jaxmlp_fp8_blockwise_wgrad16,jaxmlp_fp8_cached,"
         "jaxmlp_fp8_blockwise_cached,jaxmlp_fp8_blockwise_wgrad16_cached")


def planned_bytes(impl: str, s: cases.Shape) -> int | None:
  """peak_bytes of impl's fwd+bwd step at shape s, compiled without autotuning for abstract inputs."""
  inputs = jax.eval_shape(lambda: jax_impls.impl_inputs(impl, jax_impls.make_inputs(s.E, s.d, s.f, s.M,
                                                                                     jnp.bfloat16, 0)))
  sizes = jax.ShapeDtypeStruct((s.E,), jnp.int32)
  step = jax.jit(jax_impls.forward_backward(jax_impls.forward(impl)))
  return jax_impls.peak_bytes(step.lower(*inputs, sizes).compile(compiler_options=jax_impls.NO_AUTOTUNING))


def planned_layer_bytes(impl: str, s: cases.Shape, top_k: int) -> int | None:
  """peak_bytes of the MoE layer's fwd+bwd step (jaxmlp.moe.moe over impl's grouped_mlp, M / top_k tokens,
  the experts' weights differentiated), compiled without autotuning for abstract inputs."""
  mlp = jax_impls.forward(impl)  # jaxmlp.grouped_mlp, with its recipe for the FP8 implementations

  def step(tokens, router, w1, w2, dy):
    def layer(tokens, router, a, b):
      expert_mlp = lambda rows, gs, scales: mlp(rows, jax_impls.with_weights(w1, a), jax_impls.with_weights(w2, b),
                                                gs, scales=scales.astype(rows.dtype))
      return moe_lib.moe(tokens, moe_lib.router_logits(tokens, router), expert_mlp, top_k=top_k)[0]
    y, vjp = jax.vjp(layer, tokens, router, jaxmlp.fp8.weights_of(w1), jaxmlp.fp8.weights_of(w2))
    return (y, *vjp(dy))

  def inputs():
    x, w1, w2, _ = jax_impls.impl_inputs(impl, jax_impls.make_inputs(s.E, s.d, s.f, s.M, jnp.bfloat16, 0))
    tokens = x[:s.M // top_k]
    return tokens, jnp.zeros((s.d, s.E), jnp.float32), w1, w2, tokens  # the last: y's cotangent, [T, d]
  compiled = jax.jit(step).lower(*jax.eval_shape(inputs)).compile(compiler_options=jax_impls.NO_AUTOTUNING)
  return jax_impls.peak_bytes(compiled)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default="qwen3,gptoss,dsv3,mixtral,256x7168x2048x16384")
  p.add_argument("--impls", default=IMPLS, help="comma-separated, the first the baseline (default %(default)s)")
  p.add_argument("--top-k", type=int, help="the whole MoE layer, each token routed to this many experts")
  a = p.parse_args()
  impls = a.impls.split(",")
  what = f"the MoE layer's fwd+bwd step (top {a.top_k})" if a.top_k else "a fwd+bwd step"
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: planned device memory of {what}, GB "
        f"(bytes per expert weight over {impls[0]})\n")
  print("| shape | " + " | ".join(impls) + " |")
  print("|---" * (len(impls) + 1) + "|")
  for name in a.shapes.split(","):
    s = cases.shape_named(name)
    weights = s.E * s.d * 3 * s.f  # w1 [E, d, 2f] and w2 [E, f, d]
    planned = {impl: planned_layer_bytes(impl, s, a.top_k) if a.top_k else planned_bytes(impl, s) for impl in impls}
    base = planned[impls[0]]
    if None in planned.values():
      sys.exit("XLA gave no memory analysis for this backend")
    cells = [f"{planned[impls[0]] / 1e9:.2f}"] + [
        f"{planned[i] / 1e9:.2f} ({(planned[i] - base) / weights:+.2f})" for i in impls[1:]]
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
