"""The MoE layer's token dispatch and combine as XLA FFI custom calls (CPU and CUDA), with their VJPs.

  rows, group_sizes, plan = dispatch(x, experts, num_experts, capacity=None, pad_to=1)
  scales = row_weights(weights, plan)            # router weights [T, k] -> per row [R], for grouped_mlp
  y = combine(grouped_mlp(rows, ..., group_sizes, scales=scales), plan)
  # or, weighting in the combine instead: y = combine(grouped_mlp(rows, ...), plan, weights)
  # or, the rows taken from x inside the MLP, not kept for its backward: grouped_mlp(x, ..., gather=plan)
  rows = gather(x, plan)                         # dispatch's rows again, from x

dispatch sorts the T*k routing choices of experts [T, k] by expert with a stable counting sort on the
device (no XLA sort, no host sync) and gathers the token rows into that order; combine sums each token's
k rows (optionally weighted) in float32, in a fixed order (no atomics: deterministic). Their VJPs are the
same gathers the other way round, so a layer built on them holds no sort and no scatter-add.

  dispatch -> _dispatch (custom_vjp) -> "jaxmlp_dispatch" (ffi/cpu/dispatch_cpu.cc, ffi/cuda/moe/), and
  likewise combine ("jaxmlp_combine", "jaxmlp_combine_bwd") and top_k ("jaxmlp_top_k").

Semantics (defined by jaxmlp.reference_moe, which runs the same on jnp.argsort and a scatter-add):
  - choices are served choice-major (every token's first choice, then every token's second, ...), then
    in token order: GShard's priority when an expert overflows its capacity;
  - an expert id outside [0, num_experts) is dropped: not counted, no row, contributes nothing;
  - capacity (None: unlimited) keeps each expert's first `capacity` choices in that order; the others are
    dropped (their tokens get nothing from them) but counted in plan.counts, for the load-balancing loss;
  - rows [R, d], R = num_rows(T, k, E, capacity, pad_to) (static): expert e's rows are
    [offsets[e], offsets[e] + group_sizes[e]), offsets the exclusive running sum of group_sizes;
    group_sizes[e] is its kept choices rounded up to a multiple of pad_to (16 or 128 for FP8 GEMMs), and
    the rows past the kept ones, in a group or after the last one, are zero (after the last one:
    unwritten on CUDA where zero_padding=False, for an expert MLP that does not read them).
  - plan (jaxmlp.plan.Plan): row_of_slot [T, k] int32 (-1: dropped), slot_of_row [R] int32 (t * k + j
    of the choice a row holds, -1 for padding rows), counts [E] int32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _library, reference_moe
from .plan import (Plan, check_combine_args, check_dispatch_args, check_gather_args, check_row_weights_args, num_rows,
                   take_or_zero, take_rows)

__all__ = ["Plan", "combine", "dispatch", "gather", "num_rows", "row_weights", "top_k"]


def dispatch(x: jax.Array, experts: jax.Array, num_experts: int, *, capacity: int | None = None,
             pad_to: int = 1, zero_padding: bool = True) -> tuple[jax.Array, jax.Array, Plan]:
  """Sorts the tokens' routing choices by expert and gathers their rows.

  Args:
    x: [T, d] tokens (float32, bfloat16 or float16).
    experts: [T, k] integer expert ids, each token's choices (best first, as jax.lax.top_k gives them).
    num_experts: E.
    capacity: None, or the most rows an expert keeps (see the module docstring for which).
    pad_to: round each group up to a multiple of this with zero rows (1: no padding).
    zero_padding: False: the rows past the last group are left unwritten (any values) on CUDA, for an
      expert MLP that never reads them (jaxmlp.grouped_mlp without fp8): it saves writing them, most of
      the rows where R is sized for the worst case. The rows a group holds past its kept choices (pad_to)
      are zeros either way.

  Returns:
    rows [R, d] in x's dtype, group_sizes [E] int32, plan. Differentiable in x.
  """
  check_dispatch_args(x, experts, num_experts, capacity, pad_to)
  _checks.check_flag("zero_padding", zero_padding)
  T, k = experts.shape
  if T * k == 0 or x.shape[1] == 0 or num_rows(T, k, num_experts, capacity, pad_to) == 0:
    return reference_moe.dispatch(x, experts, num_experts, capacity=capacity, pad_to=pad_to)  # nothing to run
  if jnp.result_type(experts) != jnp.int32:  # out-of-range ids to -1 first, so that the cast cannot wrap them
    experts = jnp.where((experts >= 0) & (experts < num_experts), experts, -1).astype(jnp.int32)
  # The kernel cannot tell a group's padding rows from those past the groups: with pad_to > 1 it zeroes both.
  return _dispatch(x, experts, num_experts, capacity, pad_to, zero_padding or pad_to > 1)


def row_weights(weights: jax.Array, plan: Plan) -> jax.Array:
  """weights [T, k] (the router's, per choice) permuted to the rows: [R], 0 on padding rows. Pass it as
  grouped_mlp's `scales` to weigh the rows inside the expert MLP. Its VJP is the inverse gather."""
  check_row_weights_args(weights, plan)
  return _row_weights(weights, plan)


def combine(rows: jax.Array, plan: Plan, weights: jax.Array | None = None, *,
            zero_padding: bool = True) -> jax.Array:
  """y[t] = sum over token t's kept choices j of weights[t, j] * rows[plan.row_of_slot[t, j]] (weights
  None: 1), accumulated in float32 in choice order; returns [T, d] in rows' dtype. Differentiable in rows
  and weights (their gradient is float32 dot products of the rows with dy). Reads no row that holds no
  choice. zero_padding: False: the rows of rows' gradient that hold no choice are left unwritten (any
  values) on CUDA, for an expert MLP that never reads its result's cotangent there: jaxmlp.grouped_mlp
  without fp8, on rows of a dispatch with pad_to=1 (a group's padding rows lie inside it, and are read)."""
  check_combine_args(rows, plan, weights)
  _checks.check_flag("zero_padding", zero_padding)
  T, k = plan.row_of_slot.shape
  if T * k == 0 or rows.shape[0] == 0 or rows.shape[1] == 0:
    return reference_moe.combine(rows, plan, weights)
  if weights is None:
    return _combine_unweighted(rows, plan, zero_padding)
  return _combine_weighted(rows, plan, weights.astype(jnp.float32), zero_padding)


def gather(x: jax.Array, plan: Plan) -> jax.Array:
  """The rows [R, d] that dispatch made for `plan` from tokens x [T, d], gathered again (XLA's gather): row r
  is token plan.slot_of_row[r] // k, zeros on padding rows. Differentiable in x: its gradient sums each
  token's rows' gradients, as dispatch's (a combine: no scatter-add)."""
  check_gather_args(x, plan)
  return _gather(x, plan)


def top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """jax.lax.top_k over the last axis of the router's scores [T, E] float32, as one custom call: values
  [T, k] float32 (largest first; ties: lowest index first) and indices [T, k] int32. XLA computes a
  top-k of fewer than 1024 elements per row by sorting each row; this is a warp per row on a GPU.
  Differentiable as jax.lax.top_k (the values' gradient reaches the chosen scores)."""
  if jnp.ndim(scores) != 2 or jnp.result_type(scores) != jnp.float32:
    raise ValueError(f"scores: got {jnp.result_type(scores).name} {tuple(jnp.shape(scores))}, "
                     "expected float32 [T, E]")
  if not 1 <= k <= scores.shape[1]:
    raise ValueError(f"k: got {k}, expected 1 <= k <= E = {scores.shape[1]}")
  if scores.shape[0] == 0:
    return jax.lax.top_k(scores, k)
  return _top_k(scores, k)


# ---- the custom calls -------------------------------------------------------------------------------

def _call(target: str, outs: list, *args, workspace_bytes=None, zero_padding=None, **attrs) -> tuple:
  """`target` on the CPU, or on CUDA with a workspace of `workspace_bytes(cuda_module)` bytes where given
  and the zero_padding attribute where not None (the CPU handlers write the padding rows' zeros always)."""
  def cpu(*a):
    return _library.call(target, outs, *a, **attrs)

  def cuda(*a):
    extra = {} if zero_padding is None else {"zero_padding": np.int32(zero_padding)}
    if workspace_bytes is not None:
      extra["workspace"] = workspace_bytes(_library.cuda_module())
    return _library.call(target, outs, *a, **extra, **attrs)

  return _library.on_platforms(*args, cpu=cpu, cuda=cuda)


def _dispatch_call(x, experts, num_experts, capacity, pad_to, zero_padding):
  T, k = experts.shape
  R = num_rows(T, k, num_experts, capacity, pad_to)
  i32 = jnp.int32
  outs = [((R, x.shape[1]), x.dtype), ((num_experts,), i32), ((num_experts,), i32), ((T, k), i32), ((R,), i32)]
  rows, group_sizes, counts, row_of_slot, slot_of_row = _call(
      "jaxmlp_dispatch", outs, x, experts, workspace_bytes=lambda m: m.dispatch_workspace_bytes(T * k, num_experts),
      num_experts=np.int64(num_experts), capacity=np.int64(-1 if capacity is None else capacity),
      pad_to=np.int64(pad_to), zero_padding=zero_padding)
  return rows, group_sizes, Plan(row_of_slot, slot_of_row, counts)


def _combine_call(rows, row_of_slot, weights):
  T = row_of_slot.shape[0]
  return _call("jaxmlp_combine", [((T, rows.shape[1]), rows.dtype)], rows, row_of_slot,
               _library.optional(weights, jnp.float32))[0]


def _combine_backward_call(dy, rows, plan: Plan, weights, zero_padding):
  """(drows, dweights): drows[r] = weights[slot] * dy[token of r] (padding rows: 0, or unwritten on CUDA
  unless zero_padding); dweights[t, j] = <dy[t], rows[row_of_slot[t, j]]> in float32 (0 if dropped).
  Unweighted: rows and dweights are unused."""
  weighted = weights is not None
  outs = [((plan.slot_of_row.shape[0], dy.shape[1]), dy.dtype),
          (plan.row_of_slot.shape if weighted else _library.ABSENT, jnp.float32)]
  drows, dweights = _call("jaxmlp_combine_bwd", outs, dy, _library.optional(rows if weighted else None, dy.dtype),
                          plan.row_of_slot, plan.slot_of_row, _library.optional(weights, jnp.float32),
                          zero_padding=zero_padding)
  return drows, (dweights if weighted else None)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _top_k(scores, k):
  T = scores.shape[0]
  return _call("jaxmlp_top_k", [((T, k), jnp.float32), ((T, k), jnp.int32)], scores)


@_top_k.defjvp
def _top_k_jvp(k, primals, tangents):
  values, indices = _top_k(primals[0], k)
  return (values, indices), (jnp.take_along_axis(tangents[0], indices, axis=-1),
                             np.zeros(indices.shape, jax.dtypes.float0))


def _zero_plan_cotangent(plan: Plan) -> Plan:
  return Plan(*(None for _ in plan))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dispatch(x, experts, num_experts, capacity, pad_to, zero_padding):
  return _dispatch_call(x, experts, num_experts, capacity, pad_to, zero_padding)


def _dispatch_fwd(x, experts, num_experts, capacity, pad_to, zero_padding):
  rows, group_sizes, plan = _dispatch_call(x, experts, num_experts, capacity, pad_to, zero_padding)
  return (rows, group_sizes, plan), plan


def _dispatch_bwd(num_experts, capacity, pad_to, zero_padding, plan, cotangents):
  drows = cotangents[0]
  return _combine_call(drows, plan.row_of_slot, None), None  # dx[t]: the sum of its rows' gradients


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _gather(x, plan):
  return take_rows(x, plan.slot_of_row, plan.row_of_slot.shape[1])


def _gather_fwd(x, plan):
  return _gather(x, plan), plan


def _gather_bwd(plan, drows):
  return combine(drows, plan), _zero_plan_cotangent(plan)  # each token's rows' gradients summed


_gather.defvjp(_gather_fwd, _gather_bwd)


@jax.custom_vjp
def _row_weights(weights, plan):
  return take_or_zero(weights.reshape(-1), plan.slot_of_row)


def _row_weights_fwd(weights, plan):
  return _row_weights(weights, plan), plan


def _row_weights_bwd(plan, dscales):
  # The inverse permutation is a gather too (a choice has at most one row): no scatter-add.
  dw = take_or_zero(dscales, plan.row_of_slot.reshape(-1))
  return dw.reshape(plan.row_of_slot.shape), _zero_plan_cotangent(plan)


_row_weights.defvjp(_row_weights_fwd, _row_weights_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combine_unweighted(rows, plan, zero_padding):
  return _combine_call(rows, plan.row_of_slot, None)


def _combine_unweighted_fwd(rows, plan, zero_padding):
  return _combine_unweighted(rows, plan, zero_padding), plan


def _combine_unweighted_bwd(zero_padding, plan, dy):
  return _combine_backward_call(dy, None, plan, None, zero_padding)[0], _zero_plan_cotangent(plan)


_combine_unweighted.defvjp(_combine_unweighted_fwd, _combine_unweighted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_weighted(rows, plan, weights, zero_padding):
  return _combine_call(rows, plan.row_of_slot, weights)


def _combine_weighted_fwd(rows, plan, weights, zero_padding):
  return _combine_weighted(rows, plan, weights, zero_padding), (rows, plan, weights)


def _combine_weighted_bwd(zero_padding, res, dy):
  rows, plan, weights = res
  drows, dweights = _combine_backward_call(dy.astype(rows.dtype), rows, plan, weights, zero_padding)
  return drows, _zero_plan_cotangent(plan), dweights


_combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)
