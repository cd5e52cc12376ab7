"""The Mixture-of-Experts layer as plain functions, shared by jaxmlp.nnx and jaxmlp.linen: routing,
dispatch into expert-sorted rows (with an optional capacity; jaxmlp.dispatch), the expert MLP, combine,
and the router's auxiliary losses; plus the parameters' logical axis names and default initialisers.
"""
from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp

from . import _checks, dispatch, reference, reference_moe
from .fp8.mlp import fp8_weights
from .fp8.recipe import Fp8Recipe, Fp8Weights, check_layer_weights
from .mlp import grouped_mlp

# Logical axis names of the parameters (the MaxText convention).
W1_AXES = ("expert", "embed", "mlp")
W2_AXES = ("expert", "mlp", "embed")
B1_AXES = ("expert", "mlp")
B2_AXES = ("expert", "embed")
# The router is small and every token needs the logits of all experts: replicate it across experts.
ROUTER_AXES = ("embed", None)

# Fan-in is axis -2 of both w1 [E, d, F1] and w2 [E, f, d]; the expert axis is a batch of matrices.
default_kernel_init = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
default_bias_init = jax.nn.initializers.zeros
default_router_init = jax.nn.initializers.lecun_normal()  # nnx.Linear's default

IMPLS = {"jaxmlp": grouped_mlp, "reference": reference.grouped_mlp}
# Dispatch and combine of each impl: jaxmlp's custom calls, or the pure-JAX argsort and scatter-add path.
DISPATCHERS = {"jaxmlp": dispatch, "reference": reference_moe}
SCORE_FUNCS = ("softmax", "sigmoid")


def check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl: unknown {impl!r}; expected one of {', '.join(IMPLS)}")


def check_moe_args(num_experts: int, top_k: int, score_func: str, capacity_factor: float | None) -> None:
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k: got {top_k}, expected 1 <= top_k <= num_experts = {num_experts}")
  if score_func not in SCORE_FUNCS:
    raise ValueError(f"score_func: unknown {score_func!r}; expected one of {', '.join(SCORE_FUNCS)}")
  if capacity_factor is not None and not capacity_factor > 0:
    raise ValueError(f"capacity_factor: got {capacity_factor}, expected None or > 0")


def quantized_experts(w1: jax.Array, w2: jax.Array, fp8: Fp8Recipe | None, dtype,
                      quantized=None) -> tuple[Fp8Weights, Fp8Weights]:
  """The modules' fp8_weights(): the experts' w1 and w2 quantized for the layer's recipe from their
  rounding to the computation dtype (jaxmlp.fp8_weights), or, given `quantized` (w1's and w2's (q, scales,
  qt), as the last optimizer step's jaxmlp.fp8_adam_step wrote them: Fp8Weights.quantized), those around
  the parameters (grouped_mlp checks their shapes)."""
  check_layer_weights(fp8, w1, dtype)
  # The parameters themselves, not their 16-bit copies: their gradients then add up in their dtype.
  if quantized is not None:
    return tuple(Fp8Weights(w, *q, recipe=fp8.name) for w, q in zip((w1, w2), quantized))
  return fp8_weights(w1, fp8, dtype), fp8_weights(w2, fp8, dtype)


def history_kwarg(fp8_history) -> dict:
  """fp8_history as the expert MLP's keyword: passed only where given."""
  return {} if fp8_history is None else dict(fp8_history=fp8_history)


def tokens_of(x: jax.Array, d_model: int) -> jax.Array:
  """x [..., d_model] as tokens [T, d_model]; a width that is not d_model is an error, not a reshape
  that would mix features of neighbouring tokens."""
  if x.ndim == 0 or x.shape[-1] != d_model:
    raise ValueError(f"x: got shape {tuple(x.shape)}, expected [..., d_model] = [..., {d_model}]")
  return x.reshape(-1, d_model)


def router_logits(tokens: jax.Array, kernel: jax.Array) -> jax.Array:
  """The router's logits tokens [T, d] @ kernel [d, E] in float32.

  bfloat16 tokens are exact in bfloat16, so the products run on bfloat16 tensor cores with float32
  accumulation, the float32 operand split into two bfloat16 halves (hi + lo, ~16 bits): ~2^-17 relative
  error, against the 2^-11 of TF32 (XLA's default for a float32 product on a GPU) and the 2^-9 of a
  bfloat16 kernel, and read from the 16-bit tokens, not a float32 copy. The backward likewise: dx in one
  product of the gradient's and the kernel's halves (hi·hi + lo·hi + hi·lo), in the tokens' dtype; dkernel
  from the gradient's halves. Other dtypes: one float32 product, as jnp.dot computes it.
  """
  if jnp.ndim(tokens) != 2:
    raise ValueError(f"tokens: got shape {tuple(jnp.shape(tokens))}, expected [T, d]")
  if jnp.ndim(kernel) != 2 or jnp.shape(kernel)[0] != tokens.shape[1]:
    raise ValueError(f"kernel: got shape {tuple(jnp.shape(kernel))}, expected [d, E] = [{tokens.shape[1]}, E]")
  if jnp.result_type(tokens) != jnp.bfloat16:
    return jnp.dot(tokens.astype(jnp.float32), kernel.astype(jnp.float32))
  return _split_logits(tokens, kernel.astype(jnp.float32))


def _halves(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 a as bfloat16 (hi, lo), hi + lo = a to ~16 bits. hi truncates a's bits (exact in bfloat16),
  so that a - hi is exact: rounding to bfloat16 and back would do too, but XLA may drop such a round trip
  (xla_allow_excess_precision) and leave lo zero."""
  hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFF0000),
                                    jnp.float32)
  return hi.astype(jnp.bfloat16), (a - hi).astype(jnp.bfloat16)


def _contract(a: jax.Array, b: jax.Array, axes: tuple[int, int], dtype, like: jax.Array | None = None) -> jax.Array:
  """The product of a and b over a's axis axes[0] and b's axes[1], in dtype (float32 accumulation). A
  gradient passes `like`, its primal: under Explicit mesh axes a product over the tokens (sharded alike in
  a and b) is ambiguous until its result is given a sharding, and a gradient takes its primal's, as JAX's
  own transpose of dot_general does."""
  sharding = None if like is None or jax.typeof(like).sharding.mesh.empty else jax.typeof(like).sharding
  return jax.lax.dot_general(a, b, (((axes[0],), (axes[1],)), ((), ())), preferred_element_type=dtype,
                             out_sharding=sharding)


def _contract_halves(a: jax.Array, hi: jax.Array, lo: jax.Array, axes: tuple[int, int],
                     like: jax.Array | None = None) -> jax.Array:
  """_contract(a, hi + lo) in float32 as one product of hi and lo side by side (2E columns), then the sum of
  its two halves."""
  both = _contract(a, jnp.concatenate([hi, lo], axis=1), axes, jnp.float32, like)
  return both[:, :hi.shape[1]] + both[:, hi.shape[1]:]


@jax.custom_vjp
def _split_logits(tokens, kernel):
  return _contract_halves(tokens, *_halves(kernel), (1, 0))


def _split_logits_fwd(tokens, kernel):
  return _split_logits(tokens, kernel), (tokens, kernel)


def _split_logits_bwd(res, g):
  tokens, kernel = res
  g_hi, g_lo = _halves(g)
  w_hi, w_lo = _halves(kernel)
  # Three products in one, along a reduction of 3E: [g_hi, g_lo, g_hi] @ [w_hi, w_hi, w_lo]^T.
  dx = _contract(jnp.concatenate([g_hi, g_lo, g_hi], axis=1), jnp.concatenate([w_hi, w_hi, w_lo], axis=1), (1, 1),
                 tokens.dtype, tokens)
  return dx, _contract_halves(tokens, g_hi, g_lo, (0, 0), kernel)


_split_logits.defvjp(_split_logits_fwd, _split_logits_bwd)


def route(logits: jax.Array, top_k: int, score_func: str = "softmax", renormalize: bool = True,
          impl: str = "jaxmlp"):
  """Picks each token's experts from its router logits [T, E]; impl picks the top-k: "jaxmlp"
  (jaxmlp.dispatch.top_k's custom call) or "reference" (jax.lax.top_k), the same selection.

  Returns:
    weights [T, k] float32: the combine weights of the chosen experts;
    experts [T, k] int32: their indices, best first;
    probs [T, E] float32: per-token distribution over experts, for the load-balancing loss (the
      softmax, or the sigmoid scores normalised to sum to 1).
  """
  logits = logits.astype(jnp.float32)
  scores = jax.nn.softmax(logits) if score_func == "softmax" else jax.nn.sigmoid(logits)
  check_impl(impl)
  values, experts = DISPATCHERS[impl].top_k(jax.lax.stop_gradient(scores), top_k)
  weights = _chosen(scores, experts, values)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  probs = scores / jnp.sum(scores, axis=-1, keepdims=True) if score_func == "sigmoid" else scores
  return weights, experts.astype(jnp.int32), probs


@jax.custom_jvp
def _chosen(scores, experts, values):
  """scores[t, experts[t, j]] [T, k], which are top_k's `values` (so the forward pass costs nothing), with
  the gradient of a one-hot sum: a dense element-wise op where top_k's own would be a scatter-add into
  [T, E]. One masked sum per choice j: its transpose is k selects fused into one pass over [T, E] (as one
  [T, k, E] select and reduce it took XLA three times as long)."""
  return values


@_chosen.defjvp
def _chosen_jvp(primals, tangents):
  scores, experts, values = primals
  ids = jnp.arange(scores.shape[-1])
  tangent = jnp.stack([jnp.sum(jnp.where(experts[:, j:j + 1] == ids, tangents[0], 0), axis=-1)
                       for j in range(experts.shape[-1])], axis=-1)
  return values, tangent


def _logsumexp(logits: jax.Array) -> jax.Array:
  """logsumexp over the last axis from jax.nn.softmax's own forward ops (its max with initial -inf, the exp
  of the difference, the sum), so that XLA computes them once for the router's softmax and the z-loss;
  jax.nn.logsumexp's guard against an infinite max would make them differ. Such a max makes the softmax
  NaN anyway. Equal to jax.nn.logsumexp, value and gradient, for finite logits."""
  x_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, initial=-jnp.inf, keepdims=True))
  sum_exp = jnp.sum(jnp.exp(logits - x_max), axis=-1, keepdims=True)
  return (jnp.log(sum_exp) + x_max)[..., 0]


def router_losses(logits: jax.Array, probs: jax.Array, counts: jax.Array, top_k: int,
                  aux_loss_coef: float, z_loss_coef: float) -> dict[str, jax.Array]:
  """The router's auxiliary losses, multiplied by their coefficients.

  load_balancing_loss (Switch Transformer / GShard): `E * sum_e f_e * P_e`, where f_e is the fraction
    of the T*k routing choices that picked expert e (before capacity drops) and P_e the mean of
    `probs[:, e]`; 1 when routing is uniform. Only P carries a gradient.
  router_z_loss (ST-MoE): the mean over tokens of `logsumexp(logits)**2`; keeps the logits small.
  """
  num_tokens, num_experts = logits.shape
  if num_tokens == 0:  # no tokens, no loss (a mean over none would be NaN and poison the training loss)
    zero = jnp.zeros((), jnp.float32)
    return {"load_balancing_loss": zero, "router_z_loss": zero, "aux_loss": zero}
  fraction_routed = counts.astype(jnp.float32) / (num_tokens * top_k)
  load_balancing = num_experts * jnp.sum(fraction_routed * jnp.mean(probs, axis=0))
  z = jnp.mean(jnp.square(_logsumexp(logits.astype(jnp.float32))))
  losses = {"load_balancing_loss": aux_loss_coef * load_balancing, "router_z_loss": z_loss_coef * z}
  losses["aux_loss"] = losses["load_balancing_loss"] + losses["router_z_loss"]
  return losses


def moe(tokens: jax.Array, logits: jax.Array, expert_mlp: tp.Callable[..., jax.Array], *, top_k: int,
        score_func: str = "softmax", renormalize: bool = True, capacity_factor: float | None = None,
        aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, impl: str = "jaxmlp",
        zero_padding: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Routes tokens [T, d] by logits [T, E] through `expert_mlp(rows, group_sizes, scales)` and combines.

  The router weights reach the expert MLP as its row `scales`, so the combine is a plain sum of each
  token's rows (float32 accumulation). impl picks dispatch and combine: "jaxmlp" (jaxmlp.dispatch's
  custom calls) or "reference" (jnp.argsort, a gather and a scatter-add: jaxmlp.reference_moe).
  zero_padding: False where expert_mlp reads no row past the groups of its input nor of its result's
  cotangent (jaxmlp.grouped_mlp, with or without fp8): the dispatch and combine may then leave those rows unwritten
  (jaxmlp.dispatch): with a capacity, the rows its experts leave unfilled.

  Returns (y [T, d] in expert_mlp's output dtype, the router_losses dict).
  """
  check_impl(impl)
  _checks.check_flag("zero_padding", zero_padding)
  ops = DISPATCHERS[impl]
  num_tokens, num_experts = logits.shape
  weights, experts, probs = route(logits, top_k, score_func, renormalize, impl)
  capacity = None
  if capacity_factor is not None:
    capacity = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
  rows, group_sizes, plan = ops.dispatch(tokens, experts, num_experts, capacity=capacity, zero_padding=zero_padding)
  y = ops.combine(expert_mlp(rows, group_sizes, ops.row_weights(weights, plan)), plan, zero_padding=zero_padding)
  return y, router_losses(logits, probs, plan.counts, top_k, aux_loss_coef, z_loss_coef)
