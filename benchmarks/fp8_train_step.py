"""A training step of the expert MLP with its optimizer, FP8 against bf16, samples taken in turn: one
micro-batch a step, where the weights' quantization is not spread over micro-batches and the optimizer's
own pass over the weights counts as well.

Every variant runs grouped_mlp's fwd+bwd at a model shape (x and dy fixed, as fp8_in_turn.py's) and then
optax.adam over float32 master weights w1, w2, in one jitted step that returns the next step's state and what
the rest of a network would take, y and dx (unused outputs would let XLA drop their products where a recipe
runs them as calls of their own: the blockwise recipe's FC2 forward and data gradient):

  bf16     the update also writes the weights' bfloat16 copy, which the next step's call reads (what a
           mixed-precision optimizer does: XLA fuses the rounding into adam's pass)
  bf16_donated  the same with its state donated (the update in place, as blockwise_adam's; the baseline
           does not depend on it: 1.00x at dsv3 and gptoss on an H200)
  RECIPE   the loss quantizes the master weights (jaxmlp.fp8_weights(w, recipe, bf16), inside the
           differentiated function): the quantizer's pass over the weights in every step
  RECIPE_adam  the recipe with the weights' FP8 copy written by the last step's update (jaxmlp.fp8_adam_step,
           in adam's pass: no quantizer's pass in the step; tensorwise by the last weights' maximum), which
           takes the weights' 16-bit gradients as the call gives them; its state is donated, so the update
           writes in place, as a training loop's would
  tensorwise_delayed_adam  tensorwise_adam with delayed scaling (Fp8Recipe(scaling="delayed")): the amax
           history [4, 16] carried from step to step, each step's gradient of it the next one
  RECIPE_adam_default  what a user who turns FP8 on gets (docs/fp8.md, "Weights written by the
           optimizer"): the recipe's default rule (when="faster", products in FP8 only at the rows per expert
           where they measured faster), and RECIPE_adam's step where Fp8Recipe.optimizer_writes_fp8, else
           bf16's (the call, fp8= the recipe, runs in FP8 only where the per-call rule says)

RECIPE: tensorwise, blockwise, blockwise_wgrad16 (16-bit weight gradients), all six products in FP8
(when="always"). The calls of the steps that donate their state (carries_state) carry the state their last
step returned; the others run from the first state each time (one copy of the weights and moments for all of
them: dsv3's fit). Speedups over bf16; medians of --rounds rounds in a shuffled order
(timing.measure_alternating).

  python benchmarks/fp8_train_step.py --shapes dsv3,mixtral,gptoss,qwen3 --rounds 5
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import cases
import fp8_in_turn
import jax_impls

RECIPES = ("tensorwise", "blockwise", "blockwise_wgrad16")
ADAM = tuple(f"{r}_adam{rule}" for r in ("tensorwise", "blockwise") for rule in ("", "_default")) + (
    "tensorwise_delayed_adam",)
VARIANTS = ("bf16", "bf16_donated") + RECIPES + ADAM
LEARNING_RATE = 1e-4


def _recipe(name: str):
  import jaxmlp
  if name.endswith("_adam_default"):
    return jaxmlp.Fp8Recipe(name.removesuffix("_adam_default"))
  name = name.removesuffix("_adam")
  if name == "blockwise_wgrad16":
    return jaxmlp.Fp8Recipe("blockwise", when="always", fp8_weight_gradients=False)
  if name == "tensorwise_delayed":
    return jaxmlp.Fp8Recipe("tensorwise", when="always", scaling="delayed")
  return jaxmlp.Fp8Recipe(name, when="always")


def carries_state(variant: str, M: int, E: int) -> bool:
  """Whether the variant's step carries its state from call to call, donated: bf16_donated's, and those whose
  FP8 weights fp8_adam_step writes (RECIPE_adam_default's where Fp8Recipe.optimizer_writes_fp8)."""
  if variant.endswith("_adam_default"):
    return _recipe(variant).optimizer_writes_fp8(M, E)
  return variant.endswith("_adam") or variant == "bf16_donated"


def optimizer():
  import optax
  return optax.adam(LEARNING_RATE)


def first_state(w1, w2):
  """The float32 master weights {"w1", "w2"} of make_inputs' weights, and their adam state: shared by every
  variant whose step does not carry its state (no other step writes into its inputs), so that dsv3's fit beside
  each other."""
  import jax.numpy as jnp
  masters = {"w1": w1.astype(jnp.float32), "w2": w2.astype(jnp.float32)}
  return masters, optimizer().init(masters)


def step_and_state(variant: str, x, masters, opt_state, dy, gs):
  """(jitted step(*state) -> (next state, (y, dx)), the first state, a tuple) of `variant`, from make_inputs'
  x, dy and first_state (with fp8_adam_step: (weights, adam's state, quantized weights), the first two a copy
  of first_state's, which its step donates; the quantized weights it does not donate: XLA would copy them where
  the products still read the old ones)."""
  import jax
  import jax.numpy as jnp
  import optax

  import jaxmlp
  tx = optimizer()

  recipe = None if variant.startswith("bf16") else _recipe(variant)
  if variant.startswith("bf16") or (variant in ADAM and not carries_state(variant, x.shape[0], gs.shape[0])):
    def step(state):
      w, opt, w16 = state
      y, vjp = jax.vjp(lambda x, a, b: jaxmlp.grouped_mlp(x, a, b, gs, fp8=recipe), x, w16["w1"], w16["w2"])
      dx, *g = vjp(dy)
      updates, opt = tx.update(dict(zip(("w1", "w2"), (v.astype(jnp.float32) for v in g))), opt, w)
      w = optax.apply_updates(w, updates)
      return (w, opt, {k: v.astype(jnp.bfloat16) for k, v in w.items()}), (y, dx)
    first = (masters, opt_state, {k: v.astype(jnp.bfloat16) for k, v in masters.items()})
    if variant == "bf16_donated":  # the state as three arguments, donated and carried
      return jax.jit(lambda *state: step(state), donate_argnums=(0, 1, 2)), jax.tree.map(jnp.copy, first)
    return jax.jit(step), (first,)

  if variant in ADAM:  # the state as three arguments (four with delayed scaling's history): the quantized
    # weights (Fp8Weights without their `weights`, which the step puts the master weights in) are not donated
    delayed = recipe.scaling == "delayed"

    def step(w, opt, quantized, *history):
      fp8 = lambda a, k: dataclasses.replace(quantized[k], weights=a)
      call = lambda x, a, b, *h: jaxmlp.grouped_mlp(x, fp8(a, "w1"), fp8(b, "w2"), gs, fp8=recipe,
                                                    **({"fp8_history": h[0]} if h else {}))
      # 16-bit gradients: no conversion
      y, vjp = jax.vjp(call, x, *(w[k].astype(jnp.bfloat16) for k in ("w1", "w2")), *history)
      dx, *g = vjp(dy)
      history, g = tuple(g[2:]), g[:2]
      new = {k: jaxmlp.fp8_adam_step(w[k], gk, opt[k], learning_rate=LEARNING_RATE, dtype=jnp.bfloat16,
                                     fp8=quantized[k] if recipe.name == "tensorwise" else recipe)
             for k, gk in zip(("w1", "w2"), g)}
      w, opt = ({k: v[i] for k, v in new.items()} for i in range(2))
      return (w, opt, {k: dataclasses.replace(v[2], weights=None) for k, v in new.items()}, *history), (y, dx)
    adam = opt_state[0]  # optax.adam's state: (ScaleByAdamState over the dict, EmptyState)
    per_weight = {k: adam._replace(mu=adam.mu[k], nu=adam.nu[k]) for k in masters}
    quantized = {k: dataclasses.replace(jaxmlp.fp8_weights(v, recipe, jnp.bfloat16), weights=None)
                 for k, v in masters.items()}
    history = (jaxmlp.fp8_history(16),) if delayed else ()
    return jax.jit(step, donate_argnums=(0, 1)), (*jax.tree.map(jnp.copy, (masters, per_weight)), quantized, *history)

  def step(state):
    w, opt = state
    y, vjp = jax.vjp(lambda x, a, b: jaxmlp.grouped_mlp(x, jaxmlp.fp8_weights(a, recipe, jnp.bfloat16),
                                                        jaxmlp.fp8_weights(b, recipe, jnp.bfloat16), gs, fp8=recipe),
                     x, w["w1"], w["w2"])
    dx, *g = vjp(dy)
    updates, opt = tx.update(dict(zip(("w1", "w2"), g)), opt, w)
    return (optax.apply_updates(w, updates), opt), (y, dx)
  return jax.jit(step), ((masters, opt_state),)


def carried(step, state):
  """measure_alternating's call(i) of a step that donates its state: each call runs on the state the last one
  returned, and returns (y, dx), which are ready when the step's whole program has run."""
  box = [state]

  def call(i):
    box[0], outputs = step(*box[0])
    return outputs
  return call


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
    calls = {v: carried(*st) if carries_state(v, s.M, s.E) else (lambda i, st=st: st[0](*st[1]))
             for v, st in steps.items()}
    fp8_in_turn.measure_shape(results, shape, calls, a.rounds)
    del steps, masters, opt_state
  fp8_in_turn.report(results, variants, a, "fwd+bwd + adam", "fp8_train_step.json")

if __name__ == "__main__":
  main()
