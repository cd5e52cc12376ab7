"""Flax NNX modules over jaxmlp.grouped_mlp: the expert MLP (`GroupedMLP`) and a routed MoE layer (`MoE`).

Example::

  from flax import nnx
  import jaxmlp.nnx

  moe = jaxmlp.nnx.MoE(num_experts=8, d_model=512, d_ff=1024, top_k=2, rngs=nnx.Rngs(0))
  y, aux = moe(x)                      # x [batch, seq, 512]; add aux["aux_loss"] to the training loss

Parameters carry logical axis names ("expert", "embed", "mlp"), mapped onto a mesh with
`nnx.logical_axis_rules`. The routing math is in `jaxmlp.moe`, shared with `jaxmlp.linen`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

try:
  from flax import nnx
except ModuleNotFoundError as e:  # flax is an extra: say which
  raise ModuleNotFoundError("jaxmlp.nnx needs flax: pip install 'jaxmlp[flax]' "
                            f"(missing: {e.name.partition('.')[0]})", name=e.name) from e
from flax.core import spmd
from flax.nnx.nn import dtypes
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


def _partitioned(init: Initializer, names: tuple[str | None, ...]) -> Initializer:
  """`init` with logical axis names, as `nnx.with_partitioning` attaches them.

  Flax 0.12 shards an annotated Variable as it is created ("eager sharding", FLIP 4844), which raises
  when no mesh is set. Shard eagerly only under a mesh, so that the modules also build on one device
  without one; the names are kept either way for `nnx.get_partition_spec`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not (nnx.using_eager_sharding() and not mesh.empty):
    return nnx.with_partitioning(init, names, eager_sharding=False)
  # Flax takes a logical name that no rule maps for a mesh axis of that name; one the mesh lacks is
  # replicated here, so that a mesh of the expert axis alone (the others unmapped) builds the layer.
  rules = tuple(spmd.get_logical_axis_rules())
  unmapped = tuple((n, None) for n in names
                   if n is not None and n not in mesh.axis_names and all(rule[0] != n for rule in rules))
  return nnx.with_partitioning(init, names, eager_sharding=True, sharding_rules=rules + unmapped)


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
    fp8: None, "tensorwise", "blockwise" or a jaxmlp.Fp8Recipe: the expert MLP's products in FP8 (see
      jaxmlp.grouped_mlp; needs a 16-bit computation dtype). Parameters stay as they are.
      With gradient accumulation, quantize the weights once per optimizer step (`fp8_weights()`) and
      pass them to each micro-batch's call (`fp8_weights=`).
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
    fp8: str | Fp8Recipe | None = None,
    rngs: nnx.Rngs,
  ):
    check_impl(impl)
    self.activation = resolve(activation)
    self.fp8 = resolve_fp8(fp8)
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

  def __call__(self, x: jax.Array, group_sizes: jax.Array, scales: jax.Array | None = None, *,
               fp8_weights: tuple[Fp8Weights, Fp8Weights] | None = None, zero_padding: bool = True,
               fp8_history: jax.Array | None = None) -> jax.Array:
    """Applies expert g to its rows.

    Args:
      x: [M, d] rows sorted by expert; rows past sum(group_sizes) are padding (output 0, no gradient).
      group_sizes: [E] integer rows per expert.
      scales: optional [M] router weights; they multiply each row's whole expert output, bias included.
      fp8_weights: None, or this module's fp8_weights(), taken in place of w1 and w2 (same results; the
        gradient reaches w1 and w2 through them).
      zero_padding: as jaxmlp.grouped_mlp's (False: the padding rows of the result and of x's gradient
        may be left unwritten).
      fp8_history: with fp8=jaxmlp.Fp8Recipe("tensorwise", scaling="delayed"), the layer's amax history
        (jaxmlp.fp8_history()), whose gradient is the next one (jaxmlp.grouped_mlp's; docs/fp8.md).

    Returns:
      [M, d] in the computation dtype.
    """
    b1 = self.b1[...] if self.b1 is not None else None
    b2 = self.b2[...] if self.b2 is not None else None
    if fp8_weights is None:
      x, w1, w2, b1, b2, scales = dtypes.promote_dtype(
        (x, self.w1[...], self.w2[...], b1, b2, scales), dtype=self.dtype)
    else:
      (w1, w2), (x, b1, b2, scales) = fp8_weights, dtypes.promote_dtype((x, b1, b2, scales), dtype=self.dtype)
    return IMPLS[self.impl](x, w1, w2, group_sizes, activation=self.activation, b1=b1, b2=b2, scales=scales,
                            fp8=self.fp8, zero_padding=zero_padding, **history_kwarg(fp8_history))

  def fp8_weights(self, quantized=None) -> tuple[Fp8Weights, Fp8Weights]:
    """(w1, w2) quantized for the fp8 recipe from the computation dtype (jaxmlp.fp8_weights): quantize once
    per optimizer step, inside the differentiated function, and pass them to every micro-batch's call. Or,
    given `quantized` (w1's and w2's Fp8Weights.quantized, as the last step's jaxmlp.fp8_adam_step wrote
    them), those around the parameters: the step quantizes nothing (docs/fp8.md)."""
    return quantized_experts(self.w1[...], self.w2[...], self.fp8, self.dtype, quantized)


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
    activation, use_bias, kernel_init, bias_init, fp8: as for GroupedMLP.
    impl: as for GroupedMLP, and it picks the dispatch and combine too: "jaxmlp" (jaxmlp.dispatch's custom
      calls) or "reference" (jaxmlp.reference_moe: jnp.argsort, a gather and a scatter-add).
    score_func: "softmax" (over the E logits) or "sigmoid" (each logit on its own, as in DeepSeek-V3).
    renormalize: divide each token's top-k scores by their sum. Note that with top_k=1 and softmax this
      makes every weight 1, so the router then learns from the auxiliary losses alone.
    capacity_factor: None for dropless routing; else each expert takes at most
      ceil(capacity_factor * tokens * top_k / E) rows, served first choices first and then in token
      order. Dropped rows contribute 0 to the output.
    aux_loss_coef: coefficient of the Switch/GShard load-balancing loss.
    z_loss_coef: coefficient of the router z-loss (ST-MoE).
    dtype: the dtype of the expert computation (default: infer from input and params). The router's
      logits are float32 at any dtype (jaxmlp.moe.router_logits): top-k choices are sensitive to rounding.
    param_dtype: the dtype passed to parameter initializers.
    expert_axis: None, or a mesh axis name: under a mesh (jax.set_mesh) where that axis has P > 1
      devices, the layer runs expert-parallel over it (jaxmlp.expert_parallel: E and the tokens must
      split evenly over the P devices; map the logical axis "expert" to it so that the expert weights
      are already split). Outside a mesh, or with P = 1, it runs on the local device.
    expert_exchange: how the tokens reach the experts' devices under expert_axis: "all_gather" (every
      device gathers all tokens and the partial sums are reduce-scattered back) or "ragged_all_to_all"
      (only the rows routed to a device travel there and back); see jaxmlp.expert_parallel.
    expert_chunks: the all_gather exchange in that many parts of each device's tokens, so that XLA may
      overlap one part's collectives with another's experts (jaxmlp.expert_parallel); 1: one part.
    fp8_exchange: where the experts run in FP8 (fp8, and its `when` at the rows a device holds), the
      all_gather exchange gathers the tokens and their gradients as e4m3 rows with 1 x 128 power-of-two
      scales, half the bytes (jaxmlp.fp8.exchange); bfloat16 or float32 tokens only (float16's go as they
      are), and not the ragged exchange. False: in the tokens' dtype.
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
    expert_axis: str | None = None,
    expert_exchange: str = "all_gather",
    expert_chunks: int = 1,
    fp8: str | Fp8Recipe | None = None,
    fp8_exchange: bool = True,
    rngs: nnx.Rngs,
  ):
    check_moe_args(num_experts, top_k, score_func, capacity_factor)
    check_exchange(expert_exchange, "expert_exchange", expert_chunks, "expert_chunks")
    check_flag("fp8_exchange", fp8_exchange)
    self.router = nnx.Linear(
      d_model, num_experts, use_bias=False, dtype=jnp.float32, param_dtype=param_dtype,
      kernel_init=_partitioned(default_router_init, ROUTER_AXES), rngs=rngs)
    self.experts = GroupedMLP(
      num_experts, d_model, d_ff, activation=activation, use_bias=use_bias, dtype=dtype,
      param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init, impl=impl, fp8=fp8, rngs=rngs)

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
    self.expert_axis = expert_axis
    self.expert_exchange = expert_exchange
    self.expert_chunks = expert_chunks
    self.fp8_exchange = fp8_exchange

  def __call__(self, x: jax.Array, *, fp8_weights: tuple[Fp8Weights, Fp8Weights] | None = None,
               fp8_history: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routes the tokens of x [..., d] through the experts; fp8_weights: None or this layer's
    fp8_weights() (see GroupedMLP), split over expert_axis with the experts; fp8_history: the experts'
    (see GroupedMLP; with expert_axis one history for all devices, jaxmlp.expert_parallel).

    Returns:
      (y, aux): y with the shape of x, in the computation dtype; aux holds "load_balancing_loss" and
      "router_z_loss", already multiplied by their coefficients, and their sum "aux_loss".
    """
    tokens = tokens_of(x, self.d_model)
    logits = router_logits(tokens, self.router.kernel[...])  # the Linear's parameter, in float32 or better
    options = dict(top_k=self.top_k, score_func=self.score_func, renormalize=self.renormalize,
                   capacity_factor=self.capacity_factor, aux_loss_coef=self.aux_loss_coef,
                   z_loss_coef=self.z_loss_coef)
    # The padding rows around the experts go unwritten where the experts do not read them: jaxmlp's MLP,
    # in bf16 and FP8 alike (tests: *padding_rows_are_never_read). Over 4 devices they are 3/4 of the rows.
    options["zero_padding"] = self.impl != "jaxmlp"
    devices = axis_size(self.expert_axis, self.num_experts, tokens.shape[0])
    if devices > 1:
      # The experts' state (and quantized weights) go into the shard_map split over the axis; each device
      # merges its share.
      graphdef, state = nnx.split(self.experts)
      y, aux = moe_expert_parallel(
          tokens, logits, (state, fp8_weights),
          lambda local, rows, sizes, **history: nnx.merge(graphdef, local[0])(
              rows, sizes, fp8_weights=local[1], zero_padding=False, **history),
          expert_axis=self.expert_axis, exchange=self.expert_exchange, chunks=self.expert_chunks,
          chunks_name="expert_chunks",
          fp8_exchange=fp8_exchange_applies(self.fp8_exchange, self.experts.fp8, self.expert_exchange, tokens,
                                            top_k=self.top_k, num_experts=self.num_experts, devices=devices,
                                            chunks=self.expert_chunks, cached=fp8_weights is not None,
                                            d_ff=self.d_ff, gated=self.experts.activation.gated),
          fp8_history=fp8_history, **options)
    else:
      experts = functools.partial(self.experts, fp8_weights=fp8_weights, zero_padding=False,
                                  fp8_history=fp8_history)
      y, aux = moe(tokens, logits, experts, **options, impl=self.impl)
    return y.reshape(x.shape), aux

  def fp8_weights(self, quantized=None) -> tuple[Fp8Weights, Fp8Weights]:
    """The experts' fp8_weights(quantized) (see GroupedMLP)."""
    return self.experts.fp8_weights(quantized)
