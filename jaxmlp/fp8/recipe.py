"""The FP8 recipes' public types, Fp8Recipe and Fp8Weights, and every trace-time check of an FP8 call."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks
from . import blockwise, tensorwise
from .quantize import Scheme

SCHEMES: dict[str, Scheme] = {s.name: s for s in (tensorwise.SCHEME, blockwise.SCHEME)}
RECIPES = tuple(SCHEMES)
WHEN = ("faster", "always")
SCALINGS = ("current", "delayed")

# when="faster": the rows per expert (M / E) from which each recipe's fwd+bwd measured at least as fast as
# bf16 (docs/fp8.md, "When FP8 runs"), with the weights quantized in the call or given quantized
# (Fp8Weights: "cached"); below, the call runs in x's dtype.
MIN_ROWS_PER_EXPERT = {("tensorwise", False): 1024, ("tensorwise", True): 256,
                       ("blockwise", False): 2048, ("blockwise", True): 512}
# when="faster", per product: the rows per expert from which each recipe's step measured as fast with FP8
# weight gradients as with 16-bit ones, with the weights quantized in the call or given (docs/fp8.md, "When
# FP8 runs": below, the FP8 products are slower or no faster, and their operands' transposed or 128 x 1
# quantizations cost passes; a tensorwise call that quantizes its weights at 1024 rows fell under bf16 with
# skewed routing); below, a call that runs in FP8 runs its weight gradients in x's dtype.
MIN_ROWS_FP8_WEIGHT_GRADIENTS = {("tensorwise", False): 2048, ("tensorwise", True): 1024,
                                 ("blockwise", False): 1024, ("blockwise", True): 1024}
# when="faster", weights given (Fp8Weights): the expert weights (E d (F1 + f)) from which a call of the recipe
# runs in FP8 below MIN_ROWS_PER_EXPERT too, its weight gradients 16-bit (unless asked in FP8). With few rows an
# expert the forward's and the data gradients' products stream the weights, and e4m3 halves those bytes; at
# ~2e8 weights and fewer the call's added passes and launches cancel that (docs/fp8.md, "When FP8 runs"). The
# blockwise recipe measured too thin a margin there for a rule.
MIN_WEIGHTS_STREAMED = {"tensorwise": 1 << 28}
# when="faster", a training step of one micro-batch: the rows per expert of its calls from which the step with
# jaxmlp.fp8_adam_step writing the weights' FP8 copy measured at least as fast as bf16's, optax's update
# writing their 16-bit copy (docs/fp8.md, "Weights written by the optimizer": below, the optimizer's kernel
# gives back more than the calls gain).
MIN_ROWS_OPTIMIZER_WRITES_FP8 = {"tensorwise": 1024, "blockwise": 1024}


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """An FP8 recipe of the grouped MLP.

  name: "tensorwise" (one scale per tensor, current scaling: jaxmlp.fp8.tensorwise) or "blockwise" (one
    scale per 1 x 128 block of activations and gradients, per 128 x 128 block of weights:
    jaxmlp.fp8.blockwise).
  fast_accumulation: the forward's products accumulate in the tensor cores' faster, less precise FP8
    accumulator (cuBLASLt's FAST_ACCUM), as TransformerEngine's recipes do. Only the CUDA kernels of the
    tensorwise recipe have it; their results then differ from the emulation by ~1e-2 (tests/test_fp8.py).
  backward_fast_accumulation: the same for the backward's four products (data and weight gradients). Off by
    default, as in TransformerEngine, which keeps the precise accumulator for gradients; on, the weight
    gradients' products run faster (docs/fp8.md).
  when: "faster": FP8 only where it was measured at least as fast as bf16 at the call's rows per expert
    (MIN_ROWS_PER_EXPERT, or with the weights given their number, MIN_WEIGHTS_STREAMED; elsewhere the call
    runs in x's dtype, with its results), and per product
    (fp8_weight_gradients); "always": all six products in FP8 at every shape, for its numerics regardless
    of speed. None: the environment's JAXMLP_FP8_WHEN, else "faster".
  fp8_weight_gradients: whether the two weight gradients of a call that runs in FP8 are FP8 products (True)
    or products of x's dtype (False: dw1 = x^T dh and dw2 = a^T dy of 16-bit operands, dh and a rounded to
    x's dtype, as fp8=None computes them from this call's h and da). None: by when: "always", FP8; "faster",
    FP8 from MIN_ROWS_FP8_WEIGHT_GRADIENTS rows per expert (with the weights quantized in the call or
    given).
  scaling: the tensorwise recipe's activations (x, a, dy, dh): "current", each by its own amax in the same
    call (stateless); "delayed", by an amax history the call takes as grouped_mlp's fp8_history and
    updates through its gradient (jaxmlp.fp8.delayed): no amax passes. The blockwise recipe's block scales
    are always current (each block's own, in the pass that quantizes it).
  """

  name: str = "tensorwise"
  fast_accumulation: bool = True
  backward_fast_accumulation: bool = False
  when: str | None = None
  fp8_weight_gradients: bool | None = None
  scaling: str = "current"

  def __post_init__(self):
    if self.name not in SCHEMES:
      raise ValueError(f"fp8: unknown recipe {self.name!r}; expected None or one of {', '.join(RECIPES)}")
    if self.when is not None and self.when not in WHEN:
      raise ValueError(f"fp8: when={self.when!r}; expected one of {', '.join(WHEN)} or None")
    if self.scaling not in SCALINGS:
      raise ValueError(f"fp8: scaling={self.scaling!r}; expected one of {', '.join(SCALINGS)}")
    if self.scaling == "delayed" and self.name != tensorwise.SCHEME.name:
      raise ValueError(f"fp8: scaling='delayed' is the tensorwise recipe's; {self.name!r} scales each block by "
                       "its own maximum")
    if self.fp8_weight_gradients is not None:
      if not isinstance(self.fp8_weight_gradients, (bool, np.bool_)):  # 0 == False, but 0 is no answer
        raise TypeError(f"fp8: fp8_weight_gradients={self.fp8_weight_gradients!r}; expected None, True or False")
      object.__setattr__(self, "fp8_weight_gradients", bool(self.fp8_weight_gradients))  # np.False_ too

  def runs_fp8(self, M: int, E: int, cached: bool, weights: int | None = None) -> bool:
    """Whether a call over M rows and E experts runs in FP8 (cached: both weights given as Fp8Weights;
    weights: how many expert weights the call holds, E d (F1 + f), where known: MIN_WEIGHTS_STREAMED)."""
    if self._by_rows(M, E, MIN_ROWS_PER_EXPERT[self.name, cached]):
      return True
    streamed = MIN_WEIGHTS_STREAMED.get(self.name)
    # Below MIN_ROWS_PER_EXPERT the rule's weight gradients are 16-bit (MIN_ROWS_FP8_WEIGHT_GRADIENTS): the
    # measured gain is theirs.
    return (cached and streamed is not None and weights is not None and weights >= streamed
            and self.fp8_weight_gradients is not True)

  def optimizer_writes_fp8(self, M: int, E: int) -> bool:
    """Whether a training step of one micro-batch, over calls of M rows and E experts, should take its FP8
    weights from jaxmlp.fp8_adam_step (the calls given them run in FP8) rather than take optax's step, whose
    update writes the weights' 16-bit copy for calls in x's dtype: by default where such a step measured at
    least as fast as bf16's (MIN_ROWS_OPTIMIZER_WRITES_FP8 rows per expert and the calls' own rule,
    runs_fp8 with the weights given). With several micro-batches a step the calls' gain repeats over one
    optimizer pass, and runs_fp8(M, E, cached=True) is the bound."""
    return self.runs_fp8(M, E, cached=True) and self._by_rows(M, E, MIN_ROWS_OPTIMIZER_WRITES_FP8[self.name])

  def as_run(self, M: int, E: int, cached: bool, weights: int | None = None) -> Fp8Recipe | None:
    """The recipe as a call over M rows and E experts (and `weights` expert weights, where known) runs it:
    None where it runs in x's dtype (runs_fp8), else with fp8_weight_gradients decided."""
    if not self.runs_fp8(M, E, cached, weights):
      return None
    fp8_wgrad = self.fp8_weight_gradients
    if fp8_wgrad is None:
      fp8_wgrad = self._by_rows(M, E, MIN_ROWS_FP8_WEIGHT_GRADIENTS[self.name, cached])
    return dataclasses.replace(self, fp8_weight_gradients=fp8_wgrad)

  def _by_rows(self, M: int, E: int, rows_per_expert: int) -> bool:
    """`when`'s answer: always, or from rows_per_expert rows per expert on."""
    when = self.when or default_when()
    if when not in WHEN:
      raise ValueError(f"JAXMLP_FP8_WHEN={when!r}: expected one of {', '.join(WHEN)}")
    # A symbolic M (jax.export) has no size to decide by: the recipe runs as asked.
    return when == "always" or not _checks.is_static(M) or M >= rows_per_expert * E

  @property
  def scheme(self) -> Scheme:
    return SCHEMES[self.name]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weights:
  """Expert weights quantized once for an FP8 recipe (jaxmlp.fp8_weights), which grouped_mlp takes in place
  of w1 or w2: quantize the weights once per optimizer step and reuse them over the step's micro-batches
  (TransformerEngine's weight caching on the first micro-batch), instead of once per call.

  weights: the weights [E, K, N] they were quantized from, as the optimizer holds them (float32 master
    weights too): grouped_mlp's gradient of w1 or w2 flows to this field, in its dtype (so gradients of
    micro-batches add up in float32 there); the quantized fields take none (constants of the step).
  q: [E, K, N] float8_e4m3fn.
  scales: the recipe's scales: tensorwise, the float32 absolute maximum q was quantized by (a scalar: the
    weights' own, or for jaxmlp.fp8_adam_step's the last weights');
    blockwise, the int32 exponents [E, ceil(K / 128), ceil(N / 128)] of the 128 x 128 blocks.
  qt: q transposed, [E, N, K]: the layout FP8 tensor cores read in the forward.
  recipe: the recipe's name.
  amax: tensorwise, the float32 absolute maximum of the weights in the computation dtype, which the next
    optimizer step's quantization scales by (jaxmlp.fp8_adam_step: delayed scaling). It equals `scales`
    where the weights were quantized by their own maximum (jaxmlp.fp8_weights); fp8_adam_step's weights were
    quantized by the last step's. None for blockwise (each block's scale is its own) and where unknown
    (Fp8Weights built from their quantized fields alone, as the Flax modules' fp8_weights(quantized)).
  """

  weights: jax.Array
  q: jax.Array
  scales: jax.Array
  qt: jax.Array
  recipe: str = dataclasses.field(metadata=dict(static=True))
  amax: jax.Array | None = None

  @property
  def quantized(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    return self.q, self.scales, self.qt


def resolve(fp8: str | Fp8Recipe | None) -> Fp8Recipe | None:
  """None, a recipe name or an Fp8Recipe; raises a clear error for anything else."""
  if fp8 is None or isinstance(fp8, Fp8Recipe):
    return fp8
  if isinstance(fp8, str):
    return Fp8Recipe(fp8)
  raise TypeError(f"fp8: expected None, a recipe name ({', '.join(RECIPES)}) or jaxmlp.Fp8Recipe, "
                  f"got {type(fp8).__name__}")


def resolve_with_weights(fp8: str | Fp8Recipe | None, w1, w2) -> Fp8Recipe | None:
  """The recipe of a grouped_mlp call: `fp8`, or where it is None the recipe w1 and w2 were quantized for
  (Fp8Weights); an Fp8Weights of another recipe raises ValueError naming it."""
  recipe = resolve(fp8)
  for name, w in (("w1", w1), ("w2", w2)):
    if isinstance(w, Fp8Weights):
      if recipe is None:
        recipe = Fp8Recipe(w.recipe)
      elif w.recipe != recipe.name:
        raise ValueError(f"{name}: Fp8Weights quantized for fp8={w.recipe!r}, but the call runs "
                         f"fp8={recipe.name!r}; quantize it with jaxmlp.fp8_weights(w, {recipe.name!r})")
  return recipe


def default_when() -> str:
  """The `when` of a recipe that leaves it None: JAXMLP_FP8_WHEN, else "faster"."""
  return os.environ.get("JAXMLP_FP8_WHEN", "faster")


def fp8_when() -> str:
  """What backend_info reports of the default `when`: the environment's setting and the thresholds."""
  when = default_when()
  if when == "always":
    return "always (JAXMLP_FP8_WHEN): every call with an FP8 recipe runs in FP8"
  rows = ", ".join(f"{name} {need}{' with Fp8Weights' if cached else ''}"
                   for (name, cached), need in MIN_ROWS_PER_EXPERT.items())
  wgrad = ", ".join(f"{name} {need}{' with Fp8Weights' if cached else ''}"
                    for (name, cached), need in MIN_ROWS_FP8_WEIGHT_GRADIENTS.items())
  step = ", ".join(f"{name} {need}" for name, need in MIN_ROWS_OPTIMIZER_WRITES_FP8.items())
  streamed = ", ".join(f"{name} {need}" for name, need in MIN_WEIGHTS_STREAMED.items())
  return (f"{when}: a call with an FP8 recipe runs in FP8 from these rows per expert on ({rows}), in x's dtype "
          f"below them unless its Fp8Weights number at least ({streamed}) expert weights (then with 16-bit "
          f"weight gradients); its weight gradients are FP8 products from these on ({wgrad}), "
          "products of x's dtype below; unless its Fp8Recipe says when='always' or fp8_weight_gradients. "
          f"Fp8Recipe.optimizer_writes_fp8, a step of one micro-batch with fp8_adam_step: from ({step})")


def as_run(recipe: Fp8Recipe | None, shape: _checks.MlpShape, w1, w2) -> Fp8Recipe | None:
  """The recipe as a checked grouped_mlp call runs it (Fp8Recipe.as_run, by the rows expected in use: an
  expert-parallel layer's buffer holds more, jaxmlp._gemm_path.padded_buffers); None where the call runs in
  x's dtype, or without a recipe."""
  cached = isinstance(w1, Fp8Weights) and isinstance(w2, Fp8Weights)
  weights = expert_weights(shape.E, shape.d, shape.f, shape.F1)
  return None if recipe is None else recipe.as_run(shape.rows_in_use, shape.E, cached, weights)


def expert_weights(E: int, d: int, f: int, F1: int) -> int:
  """How many weights E experts hold: w1's E d F1 and w2's E f d (MIN_WEIGHTS_STREAMED)."""
  return E * d * (F1 + f)


def weights_of(w):
  """The weights array of w: Fp8Weights' `weights`, or w itself."""
  return w.weights if isinstance(w, Fp8Weights) else w


def split_weights(w, dtype):
  """(weights in the call's dtype, their quantized form (q, scales, qt) or None where the call quantizes
  them). Fp8Weights' weights are cast (read by nothing when quantized: the cast is there for its
  transpose, which hands the gradient to the weights in their own dtype, float32 master weights too)."""
  return (w.weights.astype(dtype), w.quantized) if isinstance(w, Fp8Weights) else (w, None)


def checked_as(w, dtype):
  """What grouped_mlp's operand checks see of w: an Fp8Weights as its weights' shape in the call's dtype
  (its weights may be wider: the products read only the quantized fields)."""
  return jax.ShapeDtypeStruct(w.weights.shape, dtype) if isinstance(w, Fp8Weights) else w


def check_call(x, recipe: Fp8Recipe, shape: _checks.MlpShape, w1=None, w2=None) -> None:
  """Trace-time checks of an FP8 call, with the reason in the error; w1 and w2 as given (arrays or
  Fp8Weights, whose `weights` passed check_mlp)."""
  for name, w in (("w1", w1), ("w2", w2)):
    if isinstance(w, Fp8Weights):
      _check_quantized(name, w, recipe)
  if jnp.result_type(x) == jnp.float32:
    raise TypeError("fp8: x.dtype float32 is not supported; FP8 training takes bfloat16 or float16 operands")
  if shape.d % 16 or shape.f % 16:
    raise ValueError(f"fp8: d = {shape.d} and f = {shape.f} must be multiples of 16 (FP8 rows are 16-byte "
                     "aligned for the tensor cores)")
  # The weight gradients read transposed copies with every group's rows rounded up to the recipe's pad,
  # M + (pad - 1) E rows in all, indexed with int32.
  pad = recipe.scheme.pad
  length = recipe.scheme.padded_length(shape.M, shape.E)
  if _checks.is_static(length) and length >= _checks.INDEX_LIMIT:
    raise ValueError(f"fp8: x has M = {shape.M} rows and w1 E = {shape.E} experts; M + {pad - 1} E must stay "
                     f"below 2^31 (the weight gradients pad each group's rows to a multiple of {pad})")


def _check_quantized(name: str, w: Fp8Weights, recipe: Fp8Recipe) -> None:
  """An Fp8Weights holds what fp8_weights makes of its `weights` (one built by hand might not)."""
  E, K, N = np.shape(w.weights)
  want = {"q": ((E, K, N), jnp.float8_e4m3fn), "qt": ((E, N, K), jnp.float8_e4m3fn),
          "scales": recipe.scheme.weight_scales(E, K, N)}
  for field, (shape, dtype) in want.items():
    got = getattr(w, field)
    if np.shape(got) != shape or jnp.result_type(got) != dtype:
      raise ValueError(f"{name}: Fp8Weights.{field} is {jnp.result_type(got).name} {list(np.shape(got))}, expected "
                       f"{jnp.dtype(dtype).name} {list(shape)} for weights {list(np.shape(w.weights))} "
                       "(make it with jaxmlp.fp8_weights)")


def check_weights_args(w, fp8, dtype) -> tuple[Fp8Recipe, jnp.dtype]:
  """jaxmlp.fp8_weights' arguments: returns (the recipe, the computation dtype)."""
  recipe = resolve(fp8)
  if recipe is None:
    raise ValueError("fp8_weights: fp8 must name a recipe (tensorwise or blockwise), got None")
  shape = np.shape(w)
  if len(shape) != 3 or shape[1] % 16 or shape[2] % 16:
    raise ValueError(f"fp8_weights: w has shape {list(shape)}, expected [E, K, N] with K and N multiples of 16")
  dtype = jnp.dtype(jnp.result_type(w) if dtype is None else dtype)
  if dtype not in (jnp.bfloat16, jnp.float16):
    raise TypeError(f"fp8_weights: computation dtype {dtype} is not supported; FP8 weights are quantized from "
                    "bfloat16 or float16 (pass dtype= for wider weights)")
  if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
    raise TypeError(f"fp8_weights: w.dtype {jnp.result_type(w)} is not a floating-point type")
  return recipe, dtype


def check_layer_weights(fp8: Fp8Recipe | None, w1, dtype) -> None:
  """The Flax modules' fp8_weights(): the layer has a recipe, and a 16-bit dtype to quantize from."""
  if fp8 is None:
    raise ValueError("fp8_weights: the layer was built with fp8=None; give it a recipe (fp8='tensorwise' or "
                     "'blockwise')")
  if dtype is None and jnp.result_type(w1) == jnp.float32:
    raise TypeError("fp8_weights: the parameters are float32 and the layer's dtype is None; FP8 weights are "
                    "quantized from the 16-bit computation dtype (build the layer with dtype=jnp.bfloat16)")
