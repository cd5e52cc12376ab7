"""A training step of the expert MLP with its optimizer, FP8 against bf16, samples taken in turn: one
micro-batch a step, where the weights' quantization is not spread over micro-batches and the optimizer's
own pass over the weights counts as well.

Every variant runs grouped_mlp's fwd+bwd at a model shape (x and dy fixed, as fp8_in_turn.py's) and then
optax.adam over float32 master weights w1, w2, in one jitted step that returns the next step's state and what
the rest of a network would take, y and dx (unused outputs would let XLA drop their products where a recipe
runs them as calls of their own: the blockwise recipe's FC2 forward and data gradient):

  bf16     the update also writes the weights' bfloat16 copy, which the next step's call reads (what a
           mixed-precision optimizer does: XLA fuses the rounding into adam's pass)
  RECIPE   the loss quantizes the master weights (jaxmlp.fp8_weights(w, recipe, bf16), inside the
           differentiated function): the quantizer's pass over the weights in every step

RECIPE: tensorwise, blockwise, blockwise_wgrad16 (16-bit weight gradients), all six products in FP8
(when="always"). Speedups over bf16; medians of --rounds rounds in a shuffled order (timing.measure_alternating).

  python benchmarks/fp8_train_step.py --shapes dsv3,mixtral,gptoss,qwen3 --rounds 5
"""
import argparse
import sys
from pathlib import Path

import cases
import fp8_in_turn
import jax_impls

RECIPES = ("tensorwise", "blockwise", "blockwise_wgrad16")
VARIANTS = ("bf16",) + RECIPES
LEARNING_RATE = 1e-4


def _recipe(name: str):
  import jaxmlp
  if name == "blockwise_wgrad16":
    return jaxmlp.Fp8Recipe("blockwise", when="always", fp8_weight_gradients=False)
  return jaxmlp.Fp8Recipe(name, when="always")


def optimizer():
  import optax
  return optax.adam(LEARNING_RATE)


def first_state(w1, w2):
  """The float32 master weights {"w1", "w2"} of make_inputs' weights, and their adam state: shared by every
  variant (no step writes into its inputs), so that dsv3's fit beside each other."""
  import jax.numpy as jnp
  masters = {"w1": w1.astype(jnp.float32), "w2": w2.astype(jnp.float32)}
  return masters, optimizer().init(masters)


def step_and_state(variant: str, x, masters, opt_state, dy, gs):
  """(jitted step(state) -> (next state, (y, dx)), the first state) of `variant`, from make_inputs' x, dy and
  first_state."""
  import jax
  import jax.numpy as jnp
  import optax

  import jaxmlp
  tx = optimizer()

  if variant == "bf16":
    def step(state):
      w, opt, w16 = state
      y, vjp = jax.vjp(lambda x, a, b: jaxmlp.grouped_mlp(x, a, b, gs), x, w16["w1"], w16["w2"])
      dx, *g = vjp(dy)
      updates, opt = tx.update(dict(zip(("w1", "w2"), (v.astype(jnp.float32) for v in g))), opt, w)
      w = optax.apply_updates(w, updates)
      return (w, opt, {k: v.astype(jnp.bfloat16) for k, v in w.items()}), (y, dx)
    return jax.jit(step), (masters, opt_state, {k: v.astype(jnp.bfloat16) for k, v in masters.items()})

  recipe = _recipe(variant)

  def step(state):
    w, opt = state
    y, vjp = jax.vjp(lambda x, a, b: jaxmlp.grouped_mlp(x, jaxmlp.fp8_weights(a, recipe, jnp.bfloat16),
                                                        jaxmlp.fp8_weights(b, recipe, jnp.bfloat16), gs, fp8=recipe),
                     x, w["w1"], w["w2"])
    dx, *g = vjp(dy)
    updates, opt = tx.update(dict(zip(("w1", "w2"), g)), opt, w)
    return (optax.apply_updates(w, updates), opt), (y, dx)
  return jax.jit(step), (masters, opt_state)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default="dsv3,mixtral,gptoss,qwen3")
  p.add_argument("--routing", default="balanced")
  p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, the first is the baseline")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", type=Path, default=None, help="also write fp8_train_step.json there")
  a = p.parse_args()
  import jax.numpy as jnp
  variants = a.variants.split(",")
  for v in variants:
    if v not in VARIANTS:
      sys.exit(f"--variants: {v!r}: expected one of {', '.join(VARIANTS)}")
  results = fp8_in_turn.new_results()
  for shape in a.shapes.split(","):
    s = cases.shape_named(shape)
    x, w1, w2, dy = jax_impls.make_inputs(s.E, s.d, s.f, s.M, jnp.bfloat16, seed=0)
    masters, opt_state = first_state(w1, w2)
    del w1, w2
    gs = jnp.asarray(cases.group_sizes(a.routing, s.E, s.M))
    steps = {v: step_and_state(v, x, masters, opt_state, dy, gs) for v in variants}
    fp8_in_turn.measure_shape(results, shape, {v: (lambda i, st=st: st[0](st[1])) for v, st in steps.items()},
                              a.rounds)
    del steps, masters, opt_state
  fp8_in_turn.report(results, variants, a, "fwd+bwd + adam", "fp8_train_step.json")

if __name__ == "__main__":
  main()
