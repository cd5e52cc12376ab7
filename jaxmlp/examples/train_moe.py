"""Trains a small Mixture-of-Experts transformer language model on a synthetic Markov chain, with the
experts computed by jaxmlp.grouped_mlp and by the jax.lax.ragged_dot reference, and compares the two.

  jaxmlp-train-moe                          # both paths; tiny on CPU, small on GPU
  jaxmlp-train-moe --impl jaxmlp --config small --steps 300 --dtype float32
  jaxmlp-train-moe --expert-parallel        # the MoE layers expert-parallel over all devices
  jaxmlp-train-moe --fp8 tensorwise --micro-batches 4   # FP8 experts, weights quantized once per step
  jaxmlp-train-moe --fp8 tensorwise --fp8-scaling delayed   # the activations scaled by amax histories
(or python -m jaxmlp.examples.train_moe, from outside the source tree).

Both paths train the same model from the same initialisation on the same batches. The run checks that
they compute the same gradients at the start (a wrong gradient shows there at once) and end at the same
loss, and exits with status 1 otherwise; the last line says which: "OK: ..." or "FAILED: ...". Their
curves in between are not expected to coincide (the comment at GRADIENT_TOLERANCE says why).

Needs the flax extra: pip install 'jaxmlp[flax]' (flax, optax, tqdm).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

try:
  import optax
  from flax import nnx
  from tqdm.auto import tqdm
except ModuleNotFoundError as e:  # the flax extra brings all three
  raise ModuleNotFoundError("jaxmlp-train-moe needs the flax extra: pip install 'jaxmlp[flax]' "
                            f"(missing: {e.name.partition('.')[0]})", name=e.name) from e

from jaxmlp import fp8_adam_step, fp8_history, fp8_weights as quantize_weights
from jaxmlp.fp8 import RECIPES as FP8_RECIPES
from jaxmlp.fp8 import Fp8Recipe, delayed
from jaxmlp.nnx import MoE


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int
  d_model: int
  num_heads: int
  num_layers: int
  num_experts: int
  top_k: int
  d_ff: int
  seq_len: int
  batch_size: int
  steps: int
  learning_rate: float


CONFIGS = {
  "tiny": Config(vocab_size=64, d_model=64, num_heads=4, num_layers=2, num_experts=8, top_k=2, d_ff=64,
                 seq_len=64, batch_size=8, steps=40, learning_rate=3e-3),
  "small": Config(vocab_size=4096, d_model=512, num_heads=8, num_layers=4, num_experts=32, top_k=4, d_ff=1024,
                  seq_len=512, batch_size=32, steps=200, learning_rate=1e-3),
}
# How far apart the two paths may be. They are different but correct float programs, and training is
# chaotic in their rounding: AdamW's first steps move each weight by about +-lr whatever its gradient's
# size, so weights whose gradient is zero up to rounding move in the direction of that rounding, and top-k
# routing turns such differences into other expert choices: the curves part on the way down and meet again
# at the same loss (docs/features.md, "The main job", has the numbers). So the curves are printed, and the
# checks are:
#   - the gradients of the first batch against float32 ones (the reference path at full precision): the
#     largest relative error over all parameters must stay within GRADIENT_TOLERANCE, or within twice the
#     reference path's own error in the same dtype (in bfloat16 rounding flips expert choices, so both
#     paths can be far off on some parameter);
GRADIENT_TOLERANCE = 1e-4
#   - the relative difference of the mean loss over the last tenth of the steps (at least 5).
FINAL_LOSS_TOLERANCE = {"float32": 0.02, "bfloat16": 0.05}
# Successors of each token in the Markov chain: the lower this is, the lower the loss can go.
BRANCHING = 4
# AdamW's weight decay, for every parameter.
WEIGHT_DECAY = 0.01


class MarkovChain:
  """A random sparse Markov chain over the vocabulary: each token has BRANCHING possible successors."""

  def __init__(self, vocab_size: int, seed: int):
    rng = np.random.default_rng(seed)
    self.successors = np.stack([rng.choice(vocab_size, BRANCHING, replace=False) for _ in range(vocab_size)])
    self.probs = rng.dirichlet(np.ones(BRANCHING), size=vocab_size)
    self.rng = rng

  def entropy(self) -> float:
    """Mean next-token entropy in nats over the tokens: the loss a perfect model approaches."""
    return float(-np.sum(self.probs * np.log(self.probs), axis=1).mean())

  def sample(self, batch_size: int, length: int) -> np.ndarray:
    tokens = np.empty((batch_size, length), np.int32)
    tokens[:, 0] = self.rng.integers(0, len(self.successors), batch_size)
    cumulative = np.cumsum(self.probs, axis=1)
    for t in range(1, length):
      current = tokens[:, t - 1]
      choice = (self.rng.random(batch_size)[:, None] > cumulative[current]).sum(axis=1)
      tokens[:, t] = self.successors[current, np.minimum(choice, BRANCHING - 1)]
    return tokens


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention, then the MoE layer, each with a residual."""

  def __init__(self, cfg: Config, *, dtype, impl: str, expert_axis: str | None, fp8: str | Fp8Recipe | None,
               rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(cfg.num_heads, cfg.d_model, use_bias=False, decode=False,
                                            dtype=dtype, keep_rngs=False, rngs=rngs)
    self.moe_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.moe = MoE(cfg.num_experts, cfg.d_model, cfg.d_ff, cfg.top_k, dtype=dtype, impl=impl,
                   expert_axis=expert_axis, fp8=fp8, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array, fp8_weights=None, fp8_history=None) -> tuple[jax.Array, jax.Array]:
    x = x + self.attention(self.attention_norm(x), mask=mask)
    y, aux = self.moe(self.moe_norm(x), fp8_weights=fp8_weights, fp8_history=fp8_history)
    return x + y, aux["aux_loss"]


class MoETransformer(nnx.Module):
  """Decoder-only language model: embedding, MoE transformer blocks, final norm, untied output head."""

  def __init__(self, cfg: Config, *, dtype, impl: str, rngs: nnx.Rngs, expert_axis: str | None = None,
               fp8: str | Fp8Recipe | None = None):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, dtype=dtype, impl=impl, expert_axis=expert_axis, fp8=fp8, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)
    self.fp8 = fp8

  def __call__(self, tokens: jax.Array, fp8_weights=None, fp8_history=None) -> tuple[jax.Array, jax.Array]:
    """tokens [B, S] -> (float32 logits [B, S, vocab], the summed router auxiliary losses); fp8_weights:
    None, or fp8_weights(); fp8_history: None, or the blocks' amax histories [layers, 4, H] (delayed
    scaling)."""
    x = self.embed(tokens)
    mask = nnx.make_causal_mask(tokens)
    aux_loss = jnp.zeros((), jnp.float32)
    for i, block in enumerate(self.blocks):
      x, block_aux = block(x, mask, None if fp8_weights is None else fp8_weights[i],
                           None if fp8_history is None else fp8_history[i])
      aux_loss += block_aux
    return self.lm_head(self.final_norm(x)).astype(jnp.float32), aux_loss

  def fp8_weights(self, quantized=None):
    """With FP8 experts, each block's expert weights quantized (for all micro-batches of a step): here, or
    given as `quantized` ([(w1's, w2's) (q, scales, qt)] a block, as the last step's fp8_adam_step wrote
    them) around the parameters, which the gradient reaches; else None."""
    if self.fp8 is None:
      return None
    return [block.moe.fp8_weights(None if quantized is None else quantized[i]) for i, block in enumerate(self.blocks)]


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, batch: jax.Array,
            micro_batches: int = 1, quantized=None, history=None) -> tuple[jax.Array, jax.Array]:
  """(cross-entropy + router losses, cross-entropy) of next-token prediction on batch [B, S + 1]: the mean
  over `micro_batches` equal parts of it, run one after the other (gradient accumulation), with FP8 expert
  weights quantized once for all of them (or given: MoETransformer.fp8_weights' `quantized`). history: None,
  or the blocks' amax histories of delayed scaling [layers, 4, H], shared by the micro-batches (its gradient:
  the update, the largest amaxes any of them observed; jaxmlp.fp8.delayed.shared)."""
  model = nnx.merge(graphdef, params)
  fp8_weights = model.fp8_weights(quantized)

  def micro_batch(batch, history):
    logits, aux_loss = model(batch[:, :-1], fp8_weights, history)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return cross_entropy + aux_loss, cross_entropy

  if micro_batches == 1:
    return micro_batch(batch, history)
  rows = None if history is None else delayed.shared(history, micro_batches)
  losses, cross_entropies = jax.lax.map(lambda a: micro_batch(*a),
                                        (batch.reshape(micro_batches, -1, batch.shape[-1]), rows))
  return losses.mean(), cross_entropies.mean()


def expert_weights(params: nnx.State) -> list[int]:
  """The positions among params' leaves of the MoE layers' expert weights w1 and w2, block by block (w1 before
  w2, as MoETransformer.fp8_weights pairs them)."""
  names = [[getattr(k, "key", getattr(k, "name", None)) for k in path]
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  found = [(i, keys[keys.index("experts") + 1]) for i, keys in enumerate(names) if "experts" in keys[:-1]]
  found = [(i, name) for i, name in found if name in ("w1", "w2")]
  assert [name for _, name in found] == ["w1", "w2"] * (len(found) // 2), found
  return [i for i, _ in found]


def initial_gradients(cfg: Config, batch: np.ndarray, *, impl: str, dtype, seed: int) -> nnx.State:
  """Gradients of the loss of `batch` for a fresh model initialised from `seed`."""
  graphdef, params = nnx.split(MoETransformer(cfg, dtype=dtype, impl=impl, rngs=nnx.Rngs(seed)))
  return jax.jit(jax.grad(lambda p: loss_fn(graphdef, p, batch)[0]))(params)


def gradient_error(grads: nnx.State, reference: nnx.State) -> float:
  """Largest relative error (Frobenius norm, float64) of any parameter's gradient."""
  errors = [np.linalg.norm(np.float64(a) - np.float64(b)) / max(np.linalg.norm(np.float64(b)), 1e-30)
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference))]
  return float(max(errors))


def final_loss(losses: list[float]) -> float:
  """Mean loss over the last tenth of the steps (at least 5, or all there are)."""
  return float(np.mean(losses[-max(5, len(losses) // 10):]))


@dataclasses.dataclass
class Run:
  impl: str
  losses: list[float]  # cross-entropy of each step, before its update
  tokens_per_s: float  # after the first (compiling) step


def train(cfg: Config, batches: np.ndarray, *, impl: str, dtype, seed: int, expert_axis: str | None = None,
          fp8: str | None = None, micro_batches: int = 1, fp8_scaling: str = "current") -> Run:
  """Trains a fresh model (initialised from `seed`) on batches [steps, B, S + 1] with AdamW, each step's
  gradient accumulated over `micro_batches` parts of its batch. fp8: a recipe name, run in FP8 at every
  shape (the example shows FP8 training's accuracy, also at configs too small for FP8 to be faster), the
  experts' FP8 weights written by their update (fp8_adam_step; tensorwise by the last weights' maximum; over
  the expert axis, each device its own experts). fp8_scaling: the activations' (Fp8Recipe.scaling); delayed,
  the blocks' amax histories carried from step to step, each the largest of its micro-batches' updates."""
  recipe = Fp8Recipe(fp8, when="always", scaling=fp8_scaling) if fp8 else None
  model = MoETransformer(cfg, dtype=dtype, impl=impl, rngs=nnx.Rngs(seed), expert_axis=expert_axis, fp8=recipe)
  graphdef, params = nnx.split(model)
  leaves, treedef = jax.tree.flatten(params)
  # The experts' FP8 weights are written by their optimizer's update (jaxmlp.fp8_adam_step: adamw's step, as
  # optax's for the rest), not quantized in the loss.
  experts = expert_weights(params) if recipe is not None else []
  labels = jax.tree.unflatten(treedef, ["experts" if i in experts else "rest" for i in range(len(leaves))])
  optimizer = optax.multi_transform({"rest": optax.adamw(cfg.learning_rate, weight_decay=WEIGHT_DECAY),
                                     "experts": optax.set_to_zero()}, labels)
  opt_state = optimizer.init(params)
  # Per expert weight: its adam state, and its quantized weights for the next step (Fp8Weights without the
  # weights themselves, which the parameters hold; tensorwise's carry the maximum the next update scales by).
  expert_state = ([optax.scale_by_adam().init(leaves[i]) for i in experts],
                  [dataclasses.replace(quantize_weights(leaves[i], recipe, dtype), weights=None) for i in experts])

  histories = None
  if recipe is not None and recipe.scaling == "delayed":
    histories = jnp.stack([fp8_history() for _ in range(cfg.num_layers)])

  @jax.jit
  def train_step(params, opt_state, expert_state, histories, batch):
    adam, quantized = expert_state
    triples = [q.quantized for q in quantized]
    blocks = list(zip(triples[0::2], triples[1::2])) if experts else None  # (w1's, w2's) a block
    (_, cross_entropy), (grads, histories) = jax.value_and_grad(loss_fn, argnums=(1, 5), has_aux=True)(
        graphdef, params, batch, micro_batches, blocks, histories)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new = [w if i in experts else optax.apply_updates(w, u)
           for i, (w, u) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(updates)))]
    g = jax.tree.leaves(grads)
    for k, i in enumerate(experts):
      new[i], adam[k], fp8 = fp8_adam_step(new[i], g[i], adam[k], learning_rate=cfg.learning_rate,
                                           weight_decay=WEIGHT_DECAY, dtype=dtype, expert_axis=expert_axis,
                                           fp8=quantized[k] if recipe.name == "tensorwise" else recipe)
      quantized[k] = dataclasses.replace(fp8, weights=None)
    return jax.tree.unflatten(treedef, new), opt_state, (adam, quantized), histories, cross_entropy

  log_every = max(1, len(batches) // 10)
  losses = []
  start = None
  label = impl + (" fp8" if fp8 else "")
  with tqdm(total=len(batches), desc=f"{label:>9}", unit="step", leave=True) as progress:
    for step, batch in enumerate(batches):
      params, opt_state, expert_state, histories, loss = train_step(params, opt_state, expert_state, histories,
                                                                    batch)
      losses.append(loss)
      if step == 0:
        # The first step compiles: time from its end.
        jax.block_until_ready(loss)
        start = time.perf_counter()
      if step % log_every == 0 or step == len(batches) - 1:
        progress.set_postfix(loss=f"{float(loss):.4f}")  # a sync: only every tenth of the run
      progress.update()
    jax.block_until_ready((params, losses))
  elapsed = time.perf_counter() - start
  timed_tokens = (len(batches) - 1) * cfg.batch_size * cfg.seq_len
  return Run(label, [float(x) for x in losses], timed_tokens / elapsed if elapsed > 0 else float("nan"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
  parser.add_argument("--config", choices=["auto", *CONFIGS], default="auto",
                      help="model and batch size (auto: small on GPU, tiny otherwise). small is for GPUs: on "
                           "CPU, jax.lax.ragged_dot (the reference) expands to one dense product per expert")
  parser.add_argument("--impl", choices=["jaxmlp", "reference", "both"], default="both",
                      help="expert MLP: jaxmlp.grouped_mlp, the jax.lax.ragged_dot reference, or both")
  parser.add_argument("--dtype", choices=["auto", *FINAL_LOSS_TOLERANCE], default="auto",
                      help="computation dtype; parameters stay float32 (auto: bfloat16 on GPU, float32 otherwise)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the data and the initialisation")
  parser.add_argument("--fp8", choices=FP8_RECIPES, default=None,
                      help="train the expert MLPs in FP8 (jaxmlp.grouped_mlp's fp8=) beside the same model in "
                           "bfloat16 (same seed, same batches), and check that FP8 ends within "
                           f"{FP8_FINAL_LOSS_TOLERANCE:.0%}".replace("%", "%%")  # argparse formats help with %
                           + " of its final loss; needs --dtype bfloat16 (auto picks it)")
  parser.add_argument("--fp8-scaling", choices=["current", "delayed"], default="current",
                      help="with --fp8 tensorwise: the activations' scales from their own amaxes (current) or from "
                           "amax histories carried between steps (delayed: no amax passes)")
  parser.add_argument("--micro-batches", type=int, default=1,
                      help="accumulate each step's gradient over this many equal parts of its batch, one after "
                           "the other; with --fp8 the experts' weights are quantized once per step "
                           "(by the last step's optimizer update, jaxmlp.fp8_adam_step)")
  parser.add_argument("--expert-parallel", action="store_true",
                      help=f"run the MoE layers expert-parallel over all devices ({HOST_DEVICES} host devices "
                           "on a CPU), and check the first batch's loss and gradients against one device")
  args = parser.parse_args(argv)
  if args.steps is not None and args.steps < 2:
    parser.error("--steps: need at least 2 (the first one compiles and is not timed)")
  if args.fp8 and args.dtype == "float32":
    parser.error("--fp8: FP8 takes bfloat16 operands; leave --dtype at auto or bfloat16")
  if args.micro_batches < 1:
    parser.error("--micro-batches: need at least 1")
  if args.fp8_scaling == "delayed" and args.fp8 != "tensorwise":
    parser.error("--fp8-scaling delayed: needs --fp8 tensorwise")
  return args


# FP8 against bfloat16, same model, seed and batches: how far apart their final losses may be.
FP8_FINAL_LOSS_TOLERANCE = 0.02

# Expert parallelism: the mesh axis, the CPU devices it splits over on a machine without accelerators, and
# how close its first loss and gradients (float32, full precision) must be to one device's.
EXPERT_AXIS = "expert"
HOST_DEVICES = 8
EXPERT_PARALLEL_TOLERANCE = 1e-5
# The first batch's gradients, expert-parallel against one device's. The all-gather exchange adds each
# token's expert outputs in another order (each device's share, then the devices'), so a block's output
# moves in its last float32 bits, and a later block's router may then pick another expert where two were
# within rounding of a tie: the whole model's gradients move by far more than one layer's, in the small
# config (docs/expert-parallel.md has the numbers); the tiny config meets no such tie.
EXPERT_PARALLEL_GRADIENT_TOLERANCE = {"tiny": 1e-5, "small": 2e-2}


def expert_mesh() -> jax.sharding.Mesh:
  """A mesh of all devices along EXPERT_AXIS; on a CPU, HOST_DEVICES of them unless XLA_FLAGS or JAX
  already chose (the count is fixed once JAX has started its backends)."""
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    with contextlib.suppress(RuntimeError):
      jax.config.update("jax_num_cpu_devices", HOST_DEVICES)
  return jax.make_mesh((jax.device_count(),), (EXPERT_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


@contextlib.contextmanager
def on(mesh: jax.sharding.Mesh | None):
  """Under `mesh`, with the experts' weights split over its axis; nothing without one."""
  if mesh is None:
    yield
    return
  with jax.set_mesh(mesh), nnx.logical_axis_rules((("expert", EXPERT_AXIS), ("embed", None), ("mlp", None))):
    yield


def expert_parallel_checks(config_name: str, batch: np.ndarray, *, impl: str, seed: int,
                           mesh: jax.sharding.Mesh) -> dict[str, tuple[float, float]]:
  """The first batch's loss and gradients expert-parallel over `mesh` against one device's, in float32."""
  cfg = CONFIGS[config_name]
  def loss_and_grads(expert_axis):
    graphdef, params = nnx.split(MoETransformer(cfg, dtype=jnp.float32, impl=impl, rngs=nnx.Rngs(seed),
                                                expert_axis=expert_axis))
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch)[0]))(params)

  with jax.default_matmul_precision("highest"):
    one_loss, one_grads = loss_and_grads(None)
    with on(mesh):
      loss, grads = loss_and_grads(EXPERT_AXIS)
  print(f"expert-parallel over {mesh.devices.size} devices, first batch: loss with router losses "
        f"{float(loss):.6f} (one device: {float(one_loss):.6f})")
  return {"expert-parallel loss diff": (abs(float(loss) - float(one_loss)) / abs(float(one_loss)),
                                        EXPERT_PARALLEL_TOLERANCE),
          "expert-parallel grad error": (gradient_error(grads, one_grads),
                                         EXPERT_PARALLEL_GRADIENT_TOLERANCE[config_name])}


def main(argv: list[str] | None = None) -> dict:
  """Runs the example; returns {"runs": {impl: Run}, "checks": {name: (value, tolerance)},
  "max_loss_diff", "match"} (checks when both paths ran or with --expert-parallel, max_loss_diff when
  both paths ran)."""
  args = parse_args(argv)
  mesh = expert_mesh() if args.expert_parallel else None
  gpu = jax.default_backend() == "gpu"
  config_name = args.config if args.config != "auto" else ("small" if gpu else "tiny")
  dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if gpu or args.fp8 else "float32")
  cfg, dtype = CONFIGS[config_name], jnp.dtype(dtype_name)
  steps = args.steps or cfg.steps
  if cfg.batch_size % args.micro_batches:
    raise SystemExit(f"--micro-batches: {args.micro_batches} does not divide the {config_name} config's batch "
                     f"of {cfg.batch_size}")
  impls = ["jaxmlp", "reference"] if args.impl == "both" else [args.impl]
  if args.fp8:  # FP8 against bfloat16 on one path (jaxmlp's, unless --impl reference names the emulation)
    impls = impls[:1]

  chain = MarkovChain(cfg.vocab_size, args.seed)
  batches = np.stack([chain.sample(cfg.batch_size, cfg.seq_len + 1) for _ in range(steps)])
  print(f"config {config_name} ({cfg}), {steps} steps, {dtype_name} on {jax.default_backend()}")
  print(f"loss floor (entropy of the Markov chain): {chain.entropy():.4f}; uniform guess: "
        f"{np.log(cfg.vocab_size):.4f}")

  # In float32 both paths multiply in full float32: XLA's default on GPUs (TF32 products) would round
  # the reference path and the rest of the model but not jaxmlp's float32 GEMMs.
  precision = "highest" if dtype_name == "float32" else "default"
  grads = {}
  if len(impls) == 2:
    with jax.default_matmul_precision(precision):
      grads = {impl: initial_gradients(cfg, batches[0], impl=impl, dtype=dtype, seed=args.seed) for impl in impls}
    with jax.default_matmul_precision("highest"):
      exact = initial_gradients(cfg, batches[0], impl="reference", dtype=jnp.float32, seed=args.seed)
  expert_axis = EXPERT_AXIS if mesh else None
  with jax.default_matmul_precision(precision), on(mesh):
    runs = {impl: train(cfg, batches, impl=impl, dtype=dtype, seed=args.seed, expert_axis=expert_axis,
                        micro_batches=args.micro_batches) for impl in impls}
    if args.fp8:
      fp8_run = train(cfg, batches, impl=impls[0], dtype=dtype, seed=args.seed, expert_axis=expert_axis,
                      fp8=args.fp8, micro_batches=args.micro_batches, fp8_scaling=args.fp8_scaling)
      runs[fp8_run.impl] = fp8_run
  result = {"runs": runs, "match": all(np.isfinite(run.losses).all() for run in runs.values())}
  _print_table(runs)
  if args.fp8:
    bf16, fp8 = (final_loss(run.losses) for run in runs.values())
    checks = {"FP8 final loss rel. diff": (abs(fp8 - bf16) / abs(bf16), FP8_FINAL_LOSS_TOLERANCE)}
    result.update(checks=checks, match=result["match"] and all(v <= tol for v, tol in checks.values()))
    for name, (value, tol) in checks.items():
      print(f"{name:<28}{value:>10.2e}  (tolerance {tol:.0e})")
    speedup = fp8_run.tokens_per_s / runs[impls[0]].tokens_per_s
    print(f"{'FP8 speedup':<28}{speedup:>9.2f}x  (FP8 tokens/s over bfloat16 tokens/s)")
  elif len(runs) == 2:
    final = {impl: final_loss(run.losses) for impl, run in runs.items()}
    checks = {
        "gradient error at start": (gradient_error(grads["jaxmlp"], exact),
                                    max(GRADIENT_TOLERANCE, 2 * gradient_error(grads["reference"], exact))),
        "final loss rel. diff": (abs(final["jaxmlp"] - final["reference"]) / abs(final["reference"]),
                                 FINAL_LOSS_TOLERANCE[dtype_name]),
    }
    max_diff = float(np.max(np.abs(np.subtract(runs["jaxmlp"].losses, runs["reference"].losses))))
    result.update(checks=checks, max_loss_diff=max_diff, match=all(v <= tol for v, tol in checks.values()))
    for name, (value, tol) in checks.items():
      print(f"{name:<28}{value:>10.2e}  (tolerance {tol:.0e})")
    print(f"{'max |loss diff|':<28}{max_diff:>10.2e}  (along the curves; not checked: training amplifies rounding)")
    speedup = runs["jaxmlp"].tokens_per_s / runs["reference"].tokens_per_s
    print(f"{'speedup':<28}{speedup:>9.2f}x  (jaxmlp tokens/s over reference tokens/s)")
    if not gpu:
      print("(On the CPU jaxmlp runs its C++ handlers: OpenBLAS GEMMs over XLA's CPU thread pool.)")
  if mesh is not None:
    ep_checks = expert_parallel_checks(config_name, batches[0], impl=impls[0], seed=args.seed, mesh=mesh)
    for name, (value, tol) in ep_checks.items():
      print(f"{name:<28}{value:>10.2e}  (tolerance {tol:.0e})")
    ep_match = all(v <= tol for v, tol in ep_checks.values())
    result.update(checks={**result.get("checks", {}), **ep_checks}, match=result["match"] and ep_match)
  print(_verdict(result))
  return result


def _verdict(result: dict) -> str:
  """One line: "OK: ..." or "FAILED: ..." and why."""
  runs, checks = result["runs"], result.get("checks", {})
  failed = [f"{impl} reached a non-finite loss" for impl, run in runs.items() if not np.isfinite(run.losses).all()]
  failed += [f"{name} {value:.2e} > {tol:.0e}" for name, (value, tol) in checks.items() if not value <= tol]
  if failed:
    return "FAILED: " + "; ".join(failed)
  passed = []
  if any(name.startswith("FP8") for name in checks):
    passed.append("FP8 training ends at the bfloat16 run's loss")
  elif len(runs) == 2:
    passed.append("gradients and losses match (jaxmlp against the ragged_dot reference)")
  if any(name.startswith("expert-parallel") for name in checks):
    passed.append("expert-parallel matches one device")
  if not passed:
    impl, run = next(iter(runs.items()))
    passed.append(f"{impl} trained to loss {final_loss(run.losses):.4f} (--impl both compares the two paths)")
  return "OK: " + "; ".join(passed)


def _print_table(runs: dict[str, Run]) -> None:
  print(f"\n{'':<28}" + "".join(f"{impl:>14}" for impl in runs))
  print(f"{'first loss':<28}" + "".join(f"{run.losses[0]:>14.4f}" for run in runs.values()))
  print(f"{'final loss (mean, last 10%)':<28}" + "".join(f"{final_loss(run.losses):>14.4f}" for run in runs.values()))
  print(f"{'tokens/s':<28}" + "".join(f"{run.tokens_per_s:>14,.0f}" for run in runs.values()))


def cli() -> None:
  """The `jaxmlp-train-moe` command: exit status 1 when the two paths disagree (see main)."""
  sys.exit(0 if main()["match"] else 1)


if __name__ == "__main__":
  cli()
