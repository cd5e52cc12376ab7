"""Pure-JAX reference: defines what jaxmlp.dispatch computes (dispatch, row_weights, combine).

Built from the MoE layer's original code path (jnp.argsort, a row gather, a float32 scatter-add), and
differentiated by JAX autodiff. It is also "the argsort path" that the benchmark (benchmarks/moe_layer.py)
and the Flax layers' impl="reference" run.

Semantics (shared with jaxmlp.dispatch):
  - The T*k routing choices of experts [T, k] are served choice-major: every token's first choice before
    any token's second one, then in token order (GShard's priority). A "slot" names one choice by its
    place in experts: slot = t * k + j.
  - An expert id outside [0, E) (negative, or >= E) is dropped: it is not counted, gets no row, and its
    token receives nothing from it.
  - capacity (None: unlimited) keeps the first `capacity` choices of each expert in that order; the rest
    are dropped (counted in `counts`, but given no row).
  - Expert e's kept rows are rows [offsets[e], offsets[e] + kept[e]) of the dispatched rows, in priority
    order; group_sizes[e] is kept[e] rounded up to a multiple of pad_to, offsets its exclusive running
    sum. Rows of a group past its kept rows, and the rows past sum(group_sizes), are padding rows: zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .plan import (Plan, check_combine_args, check_dispatch_args, check_gather_args, check_row_weights_args, num_rows,
                   row_tokens, take_or_zero, take_rows)


def expert_keys(experts: jax.Array, num_experts: int) -> jax.Array:
  """The choices in priority order (choice-major), each an expert id or E where it is out of range."""
  flat = experts.T.reshape(-1)
  return jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts).astype(jnp.int32)


def sort_by_expert(experts: jax.Array, num_experts: int, capacity: int | None = None):
  """Orders the T*k choices of experts [T, k] by expert with jnp.argsort (the layer's original path).

  Choices are numbered choice-major, `p = j * T + t`, so that a stable sort serves every token's first
  choice before any token's second one when an expert overflows its capacity (GShard's priority).
  Choices beyond `capacity` in their expert, and out-of-range expert ids, are moved after all kept ones.

  Returns:
    order [T*k]: choice index p of each sorted row;
    group_sizes [E] int32: kept rows per expert;
    counts [E] int32: choices routed to each expert before any drop.
  """
  keys = expert_keys(experts, num_experts)
  order = jnp.argsort(keys, stable=True)
  counts = jnp.bincount(keys, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  if capacity is None:
    return order, counts, counts
  sorted_keys = keys[order]
  starts = jnp.cumsum(counts) - counts
  rank_in_expert = jnp.arange(keys.shape[0]) - jnp.take(starts, sorted_keys, mode="fill", fill_value=0)
  # Dropped choices get the key E: the stable sort keeps the kept rows in place and moves them last.
  keys = jnp.where(rank_in_expert < capacity, sorted_keys, num_experts)
  order = order[jnp.argsort(keys, stable=True)]
  return order, jnp.minimum(counts, capacity), counts


def dispatch(x: jax.Array, experts: jax.Array, num_experts: int, *, capacity: int | None = None,
             pad_to: int = 1, zero_padding: bool = True) -> tuple[jax.Array, jax.Array, Plan]:
  """Reference for jaxmlp.dispatch.dispatch (same arguments and semantics; zeros in every padding row, as
  zero_padding=False allows)."""
  check_dispatch_args(x, experts, num_experts, capacity, pad_to)
  T, k = experts.shape
  R = num_rows(T, k, num_experts, capacity, pad_to)
  order, kept, counts = sort_by_expert(experts, num_experts, capacity)
  group_sizes = (kept + pad_to - 1) // pad_to * pad_to
  # Sorted position i < sum(kept) is rank i - kept_start[e] of its expert e; it moves to offsets[e] + rank.
  kept_start = jnp.cumsum(kept) - kept
  offsets = jnp.cumsum(group_sizes) - group_sizes
  expert_of = jnp.repeat(jnp.arange(num_experts, dtype=jnp.int32), kept, total_repeat_length=T * k)
  i = jnp.arange(T * k, dtype=jnp.int32)
  is_kept = i < jnp.sum(kept)
  row = jnp.where(is_kept, offsets[expert_of] + i - kept_start[expert_of], R)  # R: nowhere
  slot = (order % T) * k + order // T
  slot_of_row = jnp.full((R,), -1, jnp.int32).at[row].set(slot.astype(jnp.int32), mode="drop")
  row_of_slot = jnp.full((T * k,), -1, jnp.int32).at[slot].set(jnp.where(is_kept, row, -1).astype(jnp.int32))
  plan = Plan(row_of_slot.reshape(T, k), slot_of_row, counts)
  return take_rows(x, slot_of_row, k), group_sizes.astype(jnp.int32), plan


def top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Reference for jaxmlp.dispatch.top_k: jax.lax.top_k over the last axis of scores [T, E] float32."""
  return jax.lax.top_k(scores, k)


def row_weights(weights: jax.Array, plan: Plan) -> jax.Array:
  """Reference for jaxmlp.dispatch.row_weights: weights [T, k] permuted to the rows, 0 on padding rows."""
  check_row_weights_args(weights, plan)
  return take_or_zero(weights.reshape(-1), plan.slot_of_row)


def gather(x: jax.Array, plan: Plan) -> jax.Array:
  """Reference for jaxmlp.dispatch.gather: the rows [R, d] that dispatch made for plan from tokens x [T, d]
  (row r token slot_of_row[r] // k, zeros on padding rows); its gradient a scatter-add."""
  check_gather_args(x, plan)
  return take_rows(x, plan.slot_of_row, plan.row_of_slot.shape[1])


def combine(rows: jax.Array, plan: Plan, weights: jax.Array | None = None, *,
            zero_padding: bool = True) -> jax.Array:
  """Reference for jaxmlp.dispatch.combine: y[t] = sum_j weights[t, j] * rows[row_of_slot[t, j]] over the
  kept choices, accumulated in float32 (a scatter-add), in rows' dtype. Its gradient is zero in the rows
  that hold no choice, as zero_padding=False allows."""
  check_combine_args(rows, plan, weights)
  T, k = plan.row_of_slot.shape
  vals = rows.astype(jnp.float32)
  if weights is not None:
    vals = vals * row_weights(weights.astype(jnp.float32), plan)[:, None]
  token = row_tokens(plan.slot_of_row, k, T)  # T: padding rows go nowhere
  y = jnp.zeros((T, rows.shape[1]), jnp.float32).at[token].add(vals, mode="drop")
  return y.astype(rows.dtype)
