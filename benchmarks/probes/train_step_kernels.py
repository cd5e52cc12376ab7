"""Probe (not a benchmark): where a training step's time goes, kernel by kernel. Each variant of
fp8_train_step.py (its step with the optimizer) runs three steps, then two under JAX's profiler; the kernels'
time of one step is summed by kernel name, largest first (docs/fp8-performance.md, "The weights' quantization and
the optimizer"). On a GPU with jaxmlp installed:

  python benchmarks/probes/train_step_kernels.py [--shapes gptoss,dsv3] [--variants bf16,blockwise_adam_default]
"""
import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cases  # noqa: E402
import fp8_train_step  # noqa: E402
import jax_impls  # noqa: E402
import kernel_share  # noqa: E402


def step_kernels(variant: str, s: cases.Shape, x, masters, opt_state, dy, gs) -> collections.Counter:
  """{kernel name: ns} of one step of `variant` (the mean of two traced steps)."""
  step, state = fp8_train_step.step_and_state(variant, x, masters, opt_state, dy, gs)
  call = (fp8_train_step.carried(step, state) if fp8_train_step.carries_state(variant, s.M, s.E)
          else lambda i: step(*state))
  for i in range(3):
    jax.block_until_ready(call(i))
  kernels = kernel_share.traced_kernels(lambda: [jax.block_until_ready(call(i)) for i in range(2)])
  per_step = collections.Counter()
  for name, ns, _ in kernels:
    per_step[name] += ns / 2
  return per_step


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default="gptoss,dsv3")
  p.add_argument("--variants", default="bf16,blockwise_adam_default")
  p.add_argument("--top", type=int, default=12, help="kernels listed per step (default %(default)s)")
  a = p.parse_args()
  for shape in a.shapes.split(","):
    s = cases.shape_named(shape)
    x, w1, w2, dy = jax_impls.make_inputs(s.E, s.d, s.f, s.M, jnp.bfloat16, seed=0)
    masters, opt_state = fp8_train_step.first_state(w1, w2)
    del w1, w2
    gs = jnp.asarray(cases.group_sizes("balanced", s.E, s.M))
    for variant in a.variants.split(","):
      kernels = step_kernels(variant, s, x, masters, opt_state, dy, gs)
      print(f"\n{shape} {variant}: {sum(kernels.values()) / 1e6:.3f} ms of kernels a step")
      for name, ns in kernels.most_common(a.top):
        print(f"{ns / 1e3:10.1f} us  {name[:100]}")


if __name__ == "__main__":
  main()
