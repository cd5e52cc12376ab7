"""Flax NNX modules over jaxmlp.grouped_mlp: the expert MLP (`GroupedMLP`) and a routed MoE layer (`MoE`).

Example::

  from flax import nnx
  import jaxmlp.nnx

  moe = jaxmlp.nnx.MoE(num_experts=8, d_model=512, d_ff=1024, top_k=2, rngs=nnx.Rngs(0))
  y, aux = moe(x)                      # x [batch, seq, 512]; add aux["aux_loss"] to the training loss

Parameters carry logical axis names ("expert", "embed", "mlp"), mapped onto a mesh with
`nnx.logical_axis_rules`. The routing math is written as plain functions (`route`, `sort_by_expert`,
`router_losses`, `moe`) that `jaxmlp.linen` shares.
"""
from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.typing import Dtype, Initializer

from . import reference
from .activations import Activation, resolve
from .api import grouped_mlp

__all__ = ["GroupedMLP", "MoE", "moe", "route", "router_losses", "sort_by_expert"]

# Logical axis names of the parameters (the MaxText convention).
W1_AXES = ("expert", "embed", "mlp")
W2_AXES = ("expert", "mlp", "embed")
B1_AXES = ("expert", "mlp")
B2_AXES = ("expert", "embed")
# The router is small and every token needs the logits of all experts: replicate it across experts.
ROUTER_AXES = ("embed", None)

# Fan-in is axis -2 of both w1 [E, d, F1] and w2 [E, f, d]; the expert axis is a batch of matrices.
default_kernel_init = initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
default_bias_init = initializers.zeros_init()
default_router_init = initializers.lecun_normal()  # nnx.Linear's default

IMPLS = {"jaxmlp": grouped_mlp, "reference": reference.grouped_mlp}
SCORE_FUNCS = ("softmax", "sigmoid")


def _check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl: unknown {impl!r}; expected one of {', '.join(IMPLS)}")


def _partitioned(init: Initializer, names: tuple[str | None, ...]) -> Initializer:
  """`init` with logical axis names, as `nnx.with_partitioning` attaches them.

  Flax 0.12 shards an annotated Variable as it is created ("eager sharding", FLIP 4844), which raises
  when no mesh is set. Shard eagerly only under a mesh, so that the modules also build on one device
  without one; the names are kept either way for `nnx.get_partition_spec`.
  """
  eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
  return nnx.with_partitioning(init, names, eager_sharding=eager)


def _rows_of(table: jax.Array, group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """`table[g]` for each row of group g; 0 for padding rows. Follows jaxmlp's group_sizes policy:
  negative sizes count as 0 and rows past the running total are padding."""
  ends = jnp.cumsum(jnp.clip(group_sizes, 0, num_rows))
  group = jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right")
  return jnp.take(table, group, axis=0, mode="fill", fill_value=0)


class GroupedMLP(nnx.Module):
  """The experts' MLPs applied to rows sorted by expert: `scales * (act(x @ w1[g] + b1[g]) @ w2[g] + b2[g])`.

  Example usage::

    >>> mlp = GroupedMLP(num_experts=4, d_model=8, d_ff=16, rngs=nnx.Rngs(0))
    >>> y = mlp(x, group_sizes)        # x [M, 8] sorted by expert, group_sizes [4] int32

  Args:
    num_experts: E, the number of experts.
    d_model: d, the input and output width.
    d_ff: f, the hidden width of each expert.
    activation: a name (see jaxmlp.ACTIVATIONS) or a jaxmlp.Activation. Gated activations make w1
      2f wide: the first f output columns are the gate, the last f the linear part.
    use_bias: whether to add the biases b1 [E, 2f or f] and b2 [E, d].
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers.
    kernel_init: initializer of w1 and w2 (called with shapes [E, d, F1] and [E, f, d]).
    bias_init: initializer of b1 and b2.
    impl: "jaxmlp" (jaxmlp.grouped_mlp, the FFI kernels) or "reference" (jaxmlp.reference.grouped_mlp,
      the jax.lax.ragged_dot path).
    rngs: rng key.
  """

  def __init__(
    self,
    num_experts: int,
    d_model: int,
    d_ff: int,
    *,
    activation: str | Activation = "swiglu",
    use_bias: bool = False,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    impl: str = "jaxmlp",
    rngs: nnx.Rngs,
  ):
    _check_impl(impl)
    self.activation = resolve(activation)
    fc1_width = 2 * d_ff if self.activation.gated else d_ff
    self.w1 = nnx.Param(_partitioned(kernel_init, W1_AXES)(
      rngs.params(), (num_experts, d_model, fc1_width), param_dtype))
    self.w2 = nnx.Param(_partitioned(kernel_init, W2_AXES)(
      rngs.params(), (num_experts, d_ff, d_model), param_dtype))
    self.b1: nnx.Param[jax.Array] | None
    self.b2: nnx.Param[jax.Array] | None
    if use_bias:
      self.b1 = nnx.Param(_partitioned(bias_init, B1_AXES)(
        rngs.params(), (num_experts, fc1_width), param_dtype))
      self.b2 = nnx.Param(_partitioned(bias_init, B2_AXES)(
        rngs.params(), (num_experts, d_model), param_dtype))
    else:
      self.b1 = nnx.data(None)
      self.b2 = nnx.data(None)

    self.num_experts = num_experts
    self.d_model = d_model
    self.d_ff = d_ff
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.impl = impl

  def __call__(self, x: jax.Array, group_sizes: jax.Array, scales: jax.Array | None = None) -> jax.Array:
    """Applies expert g to its rows.

    Args:
      x: [M, d] rows sorted by expert; rows past sum(group_sizes) are padding (output 0, no gradient).
      group_sizes: [E] integer rows per expert.
      scales: optional [M] router weights; they multiply each row's whole expert output, bias included.

    Returns:
      [M, d] in the computation dtype.
    """
    b1 = self.b1[...] if self.b1 is not None else None
    b2 = self.b2[...] if self.b2 is not None else None
    x, w1, w2, b1, b2, scales = dtypes.promote_dtype(
      (x, self.w1[...], self.w2[...], b1, b2, scales), dtype=self.dtype)
    return _scaled_grouped_mlp(IMPLS[self.impl], x, w1, w2, group_sizes.astype(jnp.int32), self.activation,
                               b1, b2, scales)


def _scaled_grouped_mlp(grouped_mlp_fn, x, w1, w2, group_sizes, activation, b1, b2, scales):
  """GroupedMLP's computation on promoted operands (shared with jaxmlp.linen).

  The op fuses `scales` into the activation output and adds b2 unscaled; an MoE weighs the whole expert
  output, so with scales b2 is left out of the op and added here, scaled.
  """
  if scales is None or b2 is None:
    return grouped_mlp_fn(x, w1, w2, group_sizes, activation=activation, b1=b1, b2=b2, scales=scales)
  y = grouped_mlp_fn(x, w1, w2, group_sizes, activation=activation, b1=b1, scales=scales)
  bias = scales.astype(jnp.float32)[:, None] * _rows_of(b2, group_sizes, x.shape[0]).astype(jnp.float32)
  return (y.astype(jnp.float32) + bias).astype(y.dtype)


class MoE(nnx.Module):
  """A Mixture-of-Experts MLP layer: router, top-k, expert-sorted GroupedMLP, weighted combine.

  Each token goes to its `top_k` highest-scoring experts; the expert outputs are summed weighted by the
  router scores of those experts (renormalised to sum to 1 if `renormalize`). The router weights are
  fused into the grouped MLP as its `scales`.

  Example usage::

    >>> moe = MoE(num_experts=8, d_model=64, d_ff=128, top_k=2, rngs=nnx.Rngs(0))
    >>> y, aux = moe(x)                # x [..., 64] -> y [..., 64]
    >>> loss = task_loss + aux["aux_loss"]

  Args:
    num_experts: E, the number of experts.
    d_model: d, the token width.
    d_ff: f, the hidden width of each expert.
    top_k: experts per token.
    activation, use_bias, kernel_init, bias_init, impl: as for GroupedMLP.
    score_func: "softmax" (over the E logits) or "sigmoid" (each logit on its own, as in DeepSeek-V3).
    renormalize: divide each token's top-k scores by their sum. Note that with top_k=1 and softmax this
      makes every weight 1, so the router then learns from the auxiliary losses alone.
    capacity_factor: None for dropless routing; else each expert takes at most
      ceil(capacity_factor * tokens * top_k / E) rows, served first choices first and then in token
      order. Dropped rows contribute 0 to the output.
    aux_loss_coef: coefficient of the Switch/GShard load-balancing loss.
    z_loss_coef: coefficient of the router z-loss (ST-MoE).
    dtype: the dtype of the expert computation (default: infer from input and params). The router
      always computes in float32: top-k choices are sensitive to rounding.
    param_dtype: the dtype passed to parameter initializers.
    rngs: rng key.
  """

  def __init__(
    self,
    num_experts: int,
    d_model: int,
    d_ff: int,
    top_k: int,
    *,
    activation: str | Activation = "swiglu",
    use_bias: bool = False,
    score_func: str = "softmax",
    renormalize: bool = True,
    capacity_factor: float | None = None,
    aux_loss_coef: float = 1e-2,
    z_loss_coef: float = 1e-3,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    impl: str = "jaxmlp",
    rngs: nnx.Rngs,
  ):
    _check_moe_args(num_experts, top_k, score_func, capacity_factor)
    self.router = nnx.Linear(
      d_model, num_experts, use_bias=False, dtype=jnp.float32, param_dtype=param_dtype,
      kernel_init=_partitioned(default_router_init, ROUTER_AXES), rngs=rngs)
    self.experts = GroupedMLP(
      num_experts, d_model, d_ff, activation=activation, use_bias=use_bias, dtype=dtype,
      param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init, impl=impl, rngs=rngs)

    self.num_experts = num_experts
    self.d_model = d_model
    self.d_ff = d_ff
    self.top_k = top_k
    self.score_func = score_func
    self.renormalize = renormalize
    self.capacity_factor = capacity_factor
    self.aux_loss_coef = aux_loss_coef
    self.z_loss_coef = z_loss_coef
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.impl = impl

  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routes the tokens of x [..., d] through the experts.

    Returns:
      (y, aux): y with the shape of x, in the computation dtype; aux holds "load_balancing_loss" and
      "router_z_loss", already multiplied by their coefficients, and their sum "aux_loss".
    """
    tokens = x.reshape(-1, self.d_model)
    y, aux = moe(tokens, self.router(tokens), self.experts, top_k=self.top_k, score_func=self.score_func,
                 renormalize=self.renormalize, capacity_factor=self.capacity_factor,
                 aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef)
    return y.reshape(x.shape), aux


def _check_moe_args(num_experts: int, top_k: int, score_func: str, capacity_factor: float | None) -> None:
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k: got {top_k}, expected 1 <= top_k <= num_experts = {num_experts}")
  if score_func not in SCORE_FUNCS:
    raise ValueError(f"score_func: unknown {score_func!r}; expected one of {', '.join(SCORE_FUNCS)}")
  if capacity_factor is not None and not capacity_factor > 0:
    raise ValueError(f"capacity_factor: got {capacity_factor}, expected None or > 0")


# The routing math, shared by jaxmlp.nnx.MoE and jaxmlp.linen.MoE.


def route(logits: jax.Array, top_k: int, score_func: str = "softmax", renormalize: bool = True):
  """Picks each token's experts from its router logits [T, E].

  Returns:
    weights [T, k] float32: the combine weights of the chosen experts;
    experts [T, k] int32: their indices, best first;
    probs [T, E] float32: per-token distribution over experts, for the load-balancing loss (the
      softmax, or the sigmoid scores normalised to sum to 1).
  """
  logits = logits.astype(jnp.float32)
  scores = jax.nn.softmax(logits) if score_func == "softmax" else jax.nn.sigmoid(logits)
  weights, experts = jax.lax.top_k(scores, top_k)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  probs = scores / jnp.sum(scores, axis=-1, keepdims=True) if score_func == "sigmoid" else scores
  return weights, experts.astype(jnp.int32), probs


def sort_by_expert(experts: jax.Array, num_experts: int, capacity: int | None = None):
  """Orders the T*k (token, choice) pairs of experts [T, k] by expert, for the grouped MLP.

  Pairs are numbered choice-major, `r = j * T + t`, so that a stable sort serves every token's first
  choice before any token's second one when an expert overflows its capacity (GShard's priority).
  Pairs beyond `capacity` in their expert are moved after all kept pairs: they become padding rows.

  Returns:
    order [T*k]: pair index of each sorted row;
    group_sizes [E] int32: kept rows per expert;
    counts [E] int32: pairs routed to each expert before any drop.
  """
  flat = experts.T.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  if capacity is None:
    return order, counts, counts
  sorted_experts = flat[order]
  starts = jnp.cumsum(counts) - counts
  rank_in_expert = jnp.arange(flat.shape[0]) - starts[sorted_experts]
  # Dropped rows get the key E: the stable sort keeps the kept rows in place and moves them last.
  keys = jnp.where(rank_in_expert < capacity, sorted_experts, num_experts)
  order = order[jnp.argsort(keys, stable=True)]
  return order, jnp.minimum(counts, capacity), counts


def router_losses(logits: jax.Array, probs: jax.Array, counts: jax.Array, top_k: int,
                  aux_loss_coef: float, z_loss_coef: float) -> dict[str, jax.Array]:
  """The router's auxiliary losses, multiplied by their coefficients.

  load_balancing_loss (Switch Transformer / GShard): `E * sum_e f_e * P_e`, where f_e is the fraction
    of the T*k routing choices that picked expert e (before capacity drops) and P_e the mean of
    `probs[:, e]`; 1 when routing is uniform. Only P carries a gradient.
  router_z_loss (ST-MoE): the mean over tokens of `logsumexp(logits)**2`; keeps the logits small.
  """
  num_tokens, num_experts = logits.shape
  fraction_routed = counts.astype(jnp.float32) / (num_tokens * top_k)
  load_balancing = num_experts * jnp.sum(fraction_routed * jnp.mean(probs, axis=0))
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))
  losses = {"load_balancing_loss": aux_loss_coef * load_balancing, "router_z_loss": z_loss_coef * z}
  losses["aux_loss"] = losses["load_balancing_loss"] + losses["router_z_loss"]
  return losses


def moe(tokens: jax.Array, logits: jax.Array, expert_mlp: tp.Callable[..., jax.Array], *, top_k: int,
        score_func: str = "softmax", renormalize: bool = True, capacity_factor: float | None = None,
        aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Routes tokens [T, d] by logits [T, E] through `expert_mlp(rows, group_sizes, scales)` and combines.

  Returns (y [T, d] in expert_mlp's output dtype, the router_losses dict).
  """
  num_tokens, num_experts = logits.shape
  weights, experts, probs = route(logits, top_k, score_func, renormalize)
  capacity = None
  if capacity_factor is not None:
    capacity = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
  order, group_sizes, counts = sort_by_expert(experts, num_experts, capacity)
  token_of_row = order % num_tokens
  rows = expert_mlp(tokens[token_of_row], group_sizes, weights.T.reshape(-1)[order])
  # Padding (dropped) rows are 0, so adding every row is exact; accumulate the top_k terms in float32.
  y = jnp.zeros((num_tokens, rows.shape[1]), jnp.float32).at[token_of_row].add(rows.astype(jnp.float32))
  return y.astype(rows.dtype), router_losses(logits, probs, counts, top_k, aux_loss_coef, z_loss_coef)
