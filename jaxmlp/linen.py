"""Flax Linen versions of jaxmlp.nnx.GroupedMLP and jaxmlp.nnx.MoE: same arguments, same computation
(the routing functions of jaxmlp.moe) and the same parameter layout:

  GroupedMLP: {"w1": [E, d, 2f or f], "w2": [E, f, d], "b1": [E, 2f or f], "b2": [E, d]}
  MoE:        {"router": {"kernel": [d, E]}, "experts": {GroupedMLP's params}}

Parameters are boxed in nn.LogicallyPartitioned with the logical axis names of jaxmlp.nnx; read them with
nn.get_partition_spec and map them onto a mesh with nn.logical_axis_rules.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

try:
  import flax.linen as nn
except ModuleNotFoundError as e:  # flax is an extra: say which
  raise ModuleNotFoundError("jaxmlp.linen needs flax: pip install 'jaxmlp[flax]' "
                            f"(missing: {e.name.partition('.')[0]})", name=e.name) from e
from flax.linen.dtypes import promote_dtype
from flax.typing import Dtype, Initializer

from ._checks import check_flag
from .activations import Activation, resolve
from .fp8 import Fp8Recipe, Fp8Weights
from .fp8 import resolve as resolve_fp8
from .expert_parallel import axis_size, check_exchange, fp8_exchange_applies, moe_expert_parallel
from .moe import (B1_AXES, B2_AXES, IMPLS, ROUTER_AXES, W1_AXES, W2_AXES, check_impl,
                  check_moe_args, default_bias_init, default_kernel_init, default_router_init, history_kwarg, moe,
                  quantized_experts, router_logits, tokens_of)

__all__ = ["GroupedMLP", "MoE"]


class GroupedMLP(nn.Module):
  """The experts' MLPs applied to rows sorted by expert: `scales * (act(x @ w1[g] + b1[g]) @ w2[g] + b2[g])`.

  Example usage::

    >>> mlp = GroupedMLP(num_experts=4, d_model=8, d_ff=16)
    >>> params = mlp.init(jax.random.key(0), x, group_sizes)
    >>> y = mlp.apply(params, x, group_sizes)
    >>> q = mlp.apply(params, method="fp8_weights")        # with fp8=: once per optimizer step
    >>> y = mlp.apply(params, x, group_sizes, fp8_weights=q)  # in each micro-batch

  Attributes: as the arguments of jaxmlp.nnx.GroupedMLP.
  """

  num_experts: int
  d_model: int
  d_ff: int
  activation: str | Activation = "swiglu"
  use_bias: bool = False
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = default_bias_init
  impl: str = "jaxmlp"
  fp8: str | Fp8Recipe | None = None

  @nn.compact
  def __call__(self, x: jax.Array, group_sizes: jax.Array, scales: jax.Array | None = None,
               fp8_weights: tuple[Fp8Weights, Fp8Weights] | None = None, zero_padding: bool = True,
               fp8_history: jax.Array | None = None) -> jax.Array:
    """x [M, d] sorted by expert, group_sizes [E], optional scales [M], optional fp8_weights (this module's
    fp8_weights(), used in place of w1 and w2), zero_padding (jaxmlp.grouped_mlp's), fp8_history (delayed
    scaling's amax history, whose gradient is the next one) -> [M, d]; see jaxmlp.nnx.GroupedMLP."""
    check_impl(self.impl)
    activation = resolve(self.activation)
    fc1_width = 2 * self.d_ff if activation.gated else self.d_ff
    shape1 = (self.num_experts, self.d_model, fc1_width)
    shape2 = (self.num_experts, self.d_ff, self.d_model)
    w1 = self.param("w1", nn.with_logical_partitioning(self.kernel_init, W1_AXES), shape1, self.param_dtype)
    w2 = self.param("w2", nn.with_logical_partitioning(self.kernel_init, W2_AXES), shape2, self.param_dtype)
    b1 = b2 = None
    if self.use_bias:
      b1 = self.param("b1", nn.with_logical_partitioning(self.bias_init, B1_AXES),
                      (self.num_experts, fc1_width), self.param_dtype)
      b2 = self.param("b2", nn.with_logical_partitioning(self.bias_init, B2_AXES),
                      (self.num_experts, self.d_model), self.param_dtype)
    if fp8_weights is None:
      x, w1, w2, b1, b2, scales = promote_dtype(x, w1, w2, b1, b2, scales, dtype=self.dtype)
    else:
      (w1, w2), (x, b1, b2, scales) = fp8_weights, promote_dtype(x, b1, b2, scales, dtype=self.dtype)
    return IMPLS[self.impl](x, w1, w2, group_sizes, activation=activation, b1=b1, b2=b2, scales=scales,
                            fp8=self.fp8, zero_padding=zero_padding, **history_kwarg(fp8_history))

  def fp8_weights(self, quantized=None) -> tuple[Fp8Weights, Fp8Weights]:
    """(w1, w2) quantized for the fp8 recipe from the computation dtype: `apply(params, method="fp8_weights")`;
    or those of `quantized` around the parameters (see jaxmlp.nnx.GroupedMLP.fp8_weights)."""
    params = nn.meta.unbox(self.variables["params"])
    return quantized_experts(params["w1"], params["w2"], resolve_fp8(self.fp8), self.dtype, quantized)


class _Router(nn.Module):
  """The router's kernel [d, E] (nn.Dense's parameter name and layout) and its float32 logits."""
  num_experts: int
  param_dtype: Dtype

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    kernel = self.param("kernel", nn.with_logical_partitioning(default_router_init, ROUTER_AXES),
                        (tokens.shape[-1], self.num_experts), self.param_dtype)
    return router_logits(tokens, kernel)


class MoE(nn.Module):
  """A Mixture-of-Experts MLP layer: router, top-k, expert-sorted GroupedMLP, weighted combine.

  Example usage::

    >>> moe = MoE(num_experts=8, d_model=64, d_ff=128, top_k=2)
    >>> params = moe.init(jax.random.key(0), x)
    >>> y, aux = moe.apply(params, x)  # x [..., 64] -> y [..., 64]; aux as for jaxmlp.nnx.MoE

  Attributes: as the arguments of jaxmlp.nnx.MoE.
  """

  num_experts: int
  d_model: int
  d_ff: int
  top_k: int
  activation: str | Activation = "swiglu"
  use_bias: bool = False
  score_func: str = "softmax"
  renormalize: bool = True
  capacity_factor: float | None = None
  aux_loss_coef: float = 1e-2
  z_loss_coef: float = 1e-3
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = default_bias_init
  impl: str = "jaxmlp"
  expert_axis: str | None = None
  expert_exchange: str = "all_gather"
  expert_chunks: int = 1
  fp8: str | Fp8Recipe | None = None
  fp8_exchange: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, fp8_weights: tuple[Fp8Weights, Fp8Weights] | None = None,
               fp8_history: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routes the tokens of x [..., d]; returns (y like x, aux dict); see jaxmlp.nnx.MoE. fp8_weights: None
    or `apply(params, method="fp8_weights")` (see GroupedMLP); fp8_history: the experts' (see GroupedMLP;
    with expert_axis one history for all devices, jaxmlp.expert_parallel)."""
    check_moe_args(self.num_experts, self.top_k, self.score_func, self.capacity_factor)
    check_exchange(self.expert_exchange, "expert_exchange", self.expert_chunks, "expert_chunks")
    check_flag("fp8_exchange", self.fp8_exchange)
    tokens = tokens_of(x, self.d_model)
    # The router computes in float32 or better (jaxmlp.moe.router_logits), as in jaxmlp.nnx.MoE: top-k
    # choices are sensitive to rounding.
    logits = _Router(self.num_experts, self.param_dtype, name="router")(tokens)
    experts = GroupedMLP(self.num_experts, self.d_model, self.d_ff, activation=self.activation,
                         use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                         kernel_init=self.kernel_init, bias_init=self.bias_init, impl=self.impl,
                         fp8=self.fp8, name="experts")
    options = dict(top_k=self.top_k, score_func=self.score_func, renormalize=self.renormalize,
                   capacity_factor=self.capacity_factor, aux_loss_coef=self.aux_loss_coef,
                   z_loss_coef=self.z_loss_coef,
                   # Padding rows unwritten where the experts do not read them (see jaxmlp.nnx.MoE).
                   zero_padding=self.impl != "jaxmlp")
    devices = axis_size(self.expert_axis, self.num_experts, tokens.shape[0])
    if devices > 1:
      if self.is_initializing():  # creates the experts' parameters (no rows: no expert computation)
        experts(jnp.zeros((0, self.d_model), tokens.dtype), jnp.zeros((self.num_experts,), jnp.int32),
                **history_kwarg(fp8_history))
      # The parameters go into the shard_map split over the axis; each device applies its share.
      unbound = experts.clone(parent=None, num_experts=self.num_experts // devices)
      y, aux = moe_expert_parallel(
          tokens, logits, (nn.meta.unbox(experts.variables["params"]), fp8_weights),
          lambda local, rows, sizes, **history: unbound.apply({"params": local[0]}, rows, sizes,
                                                              fp8_weights=local[1], zero_padding=False, **history),
          expert_axis=self.expert_axis, exchange=self.expert_exchange, chunks=self.expert_chunks,
          chunks_name="expert_chunks",
          fp8_exchange=fp8_exchange_applies(self.fp8_exchange, self.fp8, self.expert_exchange, tokens,
                                            top_k=self.top_k, num_experts=self.num_experts, devices=devices,
                                            chunks=self.expert_chunks, cached=fp8_weights is not None,
                                            d_ff=self.d_ff, gated=resolve(self.activation).gated),
          fp8_history=fp8_history, **options)
    else:
      y, aux = moe(tokens, logits, functools.partial(experts, fp8_weights=fp8_weights, zero_padding=False,
                                                     fp8_history=fp8_history), **options, impl=self.impl)
    return y.reshape(x.shape), aux

  def fp8_weights(self, quantized=None) -> tuple[Fp8Weights, Fp8Weights]:
    """The experts' weights quantized for the fp8 recipe (see GroupedMLP): `apply(params, method="fp8_weights")`."""
    params = nn.meta.unbox(self.variables["params"]["experts"])
    return quantized_experts(params["w1"], params["w2"], resolve_fp8(self.fp8), self.dtype, quantized)
