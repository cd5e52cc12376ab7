"""What biases cost the FP8 recipes: fwd+bwd of the grouped MLP at a shape with and without b1 and b2
(gpt-oss's experts have both), bf16 and each recipe with its weights quantized once (jaxmlp.fp8_weights,
not timed), in one run. Balanced routing, router-weight scales on.

  python benchmarks/fp8_biases.py [--shape gptoss] [--activation clamped_swiglu]
"""
import argparse
import dataclasses

import jax
import jax.numpy as jnp

import cases
import jaxmlp
from timing import measure


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shape", default="gptoss" if jax.default_backend() == "gpu" else "tiny")
  p.add_argument("--activation", default="clamped_swiglu")
  p.add_argument("--repeats", type=int, default=10)
  a = p.parse_args()
  s = cases.shape_named(a.shape)
  dtype = jnp.bfloat16
  keys = jax.random.split(jax.random.key(0), 7)
  x = jax.random.normal(keys[0], (s.M, s.d), dtype)
  w1 = (jax.random.normal(keys[1], (s.E, s.d, 2 * s.f)) * s.d ** -0.5).astype(dtype)
  w2 = (jax.random.normal(keys[2], (s.E, s.f, s.d)) * s.f ** -0.5).astype(dtype)
  b1 = jax.random.normal(keys[3], (s.E, 2 * s.f), dtype)
  b2 = jax.random.normal(keys[4], (s.E, s.d), dtype)
  scales = jax.random.uniform(keys[5], (s.M,), dtype, 0.1, 1.0)
  dy = jax.random.normal(keys[6], (s.M, s.d), dtype)
  sizes = jnp.asarray(cases.group_sizes("balanced", s.E, s.M))
  print(f"{a.shape}: E={s.E} d={s.d} f={s.f} M={s.M}, {a.activation}, {jax.devices()[0].device_kind}, "
        f"fwd+bwd ms")
  for recipe in (None, "tensorwise", "blockwise"):
    w1q, w2q = (w1, w2) if recipe is None else (jaxmlp.fp8_weights(w1, recipe), jaxmlp.fp8_weights(w2, recipe))
    row = []
    for biases in (False, True):
      def step(x, w1q, w2q, b1, b2, scales, dy):
        def f(x, w1, w2, b1, b2, scales):  # the gradients of the weights reach Fp8Weights.weights
          w1, w2 = [dataclasses.replace(q, weights=w) if recipe else w for q, w in ((w1q, w1), (w2q, w2))]
          return jaxmlp.grouped_mlp(x, w1, w2, sizes, activation=a.activation, b1=b1, b2=b2, scales=scales,
                                    fp8=recipe and jaxmlp.Fp8Recipe(recipe, when="always"))
        y, vjp = jax.vjp(f, x, *(jaxmlp.fp8.weights_of(w) for w in (w1q, w2q)), b1, b2, scales)
        return y, vjp(dy)
      args = (x, w1q, w2q, b1 if biases else None, b2 if biases else None, scales, dy)
      step = jax.jit(step)
      row.append(measure(lambda i: step(*args), jax.block_until_ready, repeats=a.repeats, max_call_s=5.0,
                         budget_s=2.0)["s"] * 1e3)
    print(f"{recipe or 'bf16':12s} no biases {row[0]:8.3f}   b1 and b2 {row[1]:8.3f}   (+{row[1] / row[0] - 1:.1%})")


if __name__ == "__main__":
  main()
