"""The grouped-GEMM engines side by side: cuBLASLt's grouped GEMM (JAXMLP_GEMM_PATH=grouped) against
jaxmlp's CUTLASS engine (cutlass) and the two together (fused: cuBLASLt, FC1 with its activation on the
engine), and `auto`, timed in turn in one process (timing.measure_alternating), with a dense GEMM of the
same FLOPs as the ceiling. Per shape and routing: the bf16 MLP fwd+bwd step of bench.py, its forward alone
(on the engine FC1 computes the activation in its epilogue), and each grouped product of it alone (FC1,
FC2, the data gradients and FC1's weight gradient). With --biases the step and its forward take b1 and b2
(gpt-oss's experts have both; on the engine FC1's epilogue adds b1), with --activation another activation
than swiglu (the products alone stay swiglu's). GPU only.

  python benchmarks/probes/gemm_engines.py --shapes qwen3,128x2048x768x65536 --routings balanced,skewed
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cases  # noqa: E402
import kernel_share  # noqa: E402
from timing import measure_alternating  # noqa: E402

def step_and_args(shape, routing, biases, activation):
  if biases or activation != "swiglu":
    return custom_step(shape, routing, biases, activation)
  return kernel_share.step_and_args(shape, routing, "jaxmlp")


def custom_step(shape, routing, biases, activation):
  """(jitted fwd+bwd step, its arguments): bench.py's step with b1 and b2 (their gradients too) or another
  activation."""
  import jax
  import jax.numpy as jnp
  import jax_impls
  import jaxmlp
  s = cases.shape_named(shape)
  F1 = 2 * s.f if jaxmlp.Activation(activation).gated else s.f
  x, w1, w2, dy = jax_impls.make_inputs(s.E, s.d, s.f, s.M, jnp.bfloat16, seed=0)  # bench.py's operands
  b = (jnp.full((s.E, F1), 0.1, jnp.bfloat16), jnp.full((s.E, s.d), 0.1, jnp.bfloat16)) if biases else ()

  def step(x, w1, w2, dy, gs, *b):
    def mlp(x, w1, w2, *b):
      return jaxmlp.grouped_mlp(x, w1, w2, gs, activation=activation, **dict(zip(("b1", "b2"), b)))
    y, vjp = jax.vjp(mlp, x, w1, w2, *b)
    return (y, *vjp(dy))
  return jax.jit(step), (x, w1[:, :, :F1], w2, dy, jnp.asarray(cases.group_sizes(routing, s.E, s.M)), *b)


def products(shape, routing, biases=False, activation="swiglu"):
  """{name: build} of the step's forward and of its grouped products alone."""
  import jax
  import jax.numpy as jnp
  import jaxmlp
  from jaxmlp import gemm
  s = cases.shape_named(shape)
  gs = jnp.asarray(cases.group_sizes(routing, s.E, s.M))
  key = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(key[0], (s.M, s.d), jnp.bfloat16)
  h = jax.random.normal(key[1], (s.M, 2 * s.f), jnp.bfloat16)
  w1 = jax.random.normal(key[2], (s.E, s.d, 2 * s.f), jnp.bfloat16) * 0.02
  w2 = jax.random.normal(key[3], (s.E, s.f, s.d), jnp.bfloat16) * 0.02
  a = h[:, :s.f]

  def build(op, lhs, rhs, out_shape):
    return lambda: (jax.jit(lambda l, r, g: gemm.grouped_gemm(op, l, r, g, out_shape, jnp.bfloat16)), (lhs, rhs, gs))
  F1 = 2 * s.f if jaxmlp.Activation(activation).gated else s.f
  b1 = jnp.full((s.E, F1), 0.1, jnp.bfloat16) if biases else None
  b2 = jnp.full((s.E, s.d), 0.1, jnp.bfloat16) if biases else None

  def forward():
    fn = jax.jit(lambda x, w1, w2, g, b1, b2: jaxmlp.grouped_mlp(x, w1, w2, g, activation=activation, b1=b1, b2=b2))
    return fn, (x, w1[:, :, :F1], w2, gs, b1, b2)
  return {"MLP fwd": forward, "fc1 nn": build("nn", x, w1, (s.M, 2 * s.f)), "fc2 nn": build("nn", a, w2, (s.M, s.d)),
          "dgrad2 nt": build("nt", x, w2, (s.M, s.f)), "dgrad1 nt": build("nt", h, w1, (s.M, s.d)), "wgrad1 tn": build("tn", x, h, (s.E, s.d, 2 * s.f))}


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default="qwen3,128x2048x768x65536,dsv3,gptoss,mixtral,8x4096x14336x256")
  p.add_argument("--routings", default="balanced,skewed")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--paths", default="grouped,cutlass,fused", help="JAXMLP_GEMM_PATH values; the first is the baseline")
  p.add_argument("--no-products", action="store_true", help="the MLP step only")
  p.add_argument("--biases", action="store_true", help="the MLP with b1 and b2")
  p.add_argument("--activation", default="swiglu", help="the MLP's activation (the step and its forward)")
  p.add_argument("--what", default=None, help="only these products (comma-separated: 'MLP fwd', 'fc1 nn', ...; "
                                                 "with --trace also 'MLP step')")
  p.add_argument("--trace", action="store_true",
                 help="instead: each kernel of one MLP step and of each product on either path (JAX's profiler)")
  a = p.parse_args()
  paths = a.paths.split(",")
  import jax
  if a.trace:
    for shape in a.shapes.split(","):
      for routing in a.routings.split(","):
        builds = {"MLP step": lambda: step_and_args(shape, routing, a.biases, a.activation),
                  **products(shape, routing, a.biases, a.activation)}
        for what, build in builds.items():
          if a.what and what not in a.what.split(","):
            continue
          for path in paths:
            step, args = kernel_share.traced_on(path, build)
            print(f"{shape} {routing} {what} {path}:")
            kernel_share.summarize(
                kernel_share.traced_kernels(lambda: [jax.block_until_ready(step(*args)) for _ in range(2)]))
    return
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, bf16, medians of {a.rounds} rounds in turn; "
        f"speedups over {paths[0]}", flush=True)
  print(f"| shape | routing | what | {' | '.join(f'{q} ms' for q in paths)} | "
        f"{' | '.join(f'{q} speedup' for q in paths[1:])} | dense ms | of dense |")
  print("|---" * (4 + 2 * len(paths)) + "|")

  def row(shape, routing, what, t, dense=None):
    ms = [t[q]["s"] * 1e3 for q in paths]
    tail = f" {dense:.3f} | {', '.join(f'{dense / m:.0%}' for m in ms)} |" if dense else " | |"
    print(f"| {shape} | {routing} | {what} | {' | '.join(f'{m:.3f}' for m in ms)} | "
          f"{' | '.join(f'{ms[0] / m:.3f}x' for m in ms[1:])} |{tail}", flush=True)

  for shape in a.shapes.split(","):
    for routing in a.routings.split(","):
      steps = {path: kernel_share.traced_on(path, lambda: step_and_args(shape, routing, a.biases, a.activation))
               for path in paths}
      dense = kernel_share.step_and_args(shape, routing, "dense")
      calls = {path: (lambda i, fa=fa: fa[0](*fa[1])) for path, fa in steps.items()}
      calls["dense"] = lambda i, fa=dense: fa[0](*fa[1])
      t = measure_alternating(calls, jax.block_until_ready, rounds=a.rounds)
      row(shape, routing, "MLP fwd+bwd", t, t["dense"]["s"] * 1e3)
      del steps, dense, calls
      if a.no_products:
        continue
      for name, build in products(shape, routing, a.biases, a.activation).items():
        if a.what and name not in a.what.split(","):
          continue
        fns = {path: kernel_share.traced_on(path, build) for path in paths}
        t = measure_alternating({path: (lambda i, fa=fa: fa[0](*fa[1])) for path, fa in fns.items()},
                                jax.block_until_ready, rounds=a.rounds)
        row(shape, routing, name, t)


if __name__ == "__main__":
  main()
