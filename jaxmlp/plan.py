"""The MoE dispatch's types and argument checks, shared by jaxmlp.dispatch (the custom calls) and
jaxmlp.reference_moe (their definition): where each routing choice went, how many rows a dispatch makes,
and what a dispatch or combine accepts."""
from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp

from . import _checks


class Plan(tp.NamedTuple):
  """Where each routing choice went; produced by dispatch, consumed by row_weights and combine.

  row_of_slot [T, k] int32: the row of choice (t, j), or -1 if it was dropped;
  slot_of_row [R] int32: the choice t * k + j that row r holds, or -1 for a padding row;
  counts [E] int32: choices routed to each expert before capacity drops (for the load-balancing loss).
  """
  row_of_slot: jax.Array
  slot_of_row: jax.Array
  counts: jax.Array


def num_rows(num_tokens: int, top_k: int, num_experts: int, capacity: int | None = None, pad_to: int = 1) -> int:
  """R, the static number of dispatched rows: every kept choice, plus room for each group's padding."""
  kept = num_tokens * top_k if capacity is None else min(num_tokens * top_k, num_experts * capacity)
  return kept + num_experts * (pad_to - 1)


def check_dispatch_args(x, experts, num_experts: int, capacity: int | None, pad_to: int) -> None:
  """Trace-time validation of dispatch's arguments."""
  if jnp.ndim(x) != 2:
    raise ValueError(f"x: got shape {tuple(jnp.shape(x))}, expected [T, d]")
  if jnp.ndim(experts) != 2 or jnp.shape(experts)[0] != jnp.shape(x)[0]:
    raise ValueError(f"experts: got shape {tuple(jnp.shape(experts))}, expected [T, k] = [{jnp.shape(x)[0]}, k]")
  if not jnp.issubdtype(jnp.result_type(experts), jnp.integer):
    raise TypeError(f"experts: got dtype {jnp.result_type(experts)}, expected an integer dtype")
  if not 1 <= num_experts < 2**31:
    raise ValueError(f"num_experts: got {num_experts}, expected >= 1")
  if capacity is not None and not 0 <= capacity < 2**31:
    raise ValueError(f"capacity: got {capacity}, expected None or >= 0")
  if not 1 <= pad_to <= 4096:
    raise ValueError(f"pad_to: got {pad_to}, expected 1 <= pad_to <= 4096 (e.g. 16 or 128 for FP8)")
  (T, d), k = jnp.shape(x), jnp.shape(experts)[1]
  _checks.check_extents("x", (T, d), T=T, d=d)
  _checks.check_extents("experts", (T, k), k=k, **{"T * k": T * k})
  R = num_rows(T, k, num_experts, capacity, pad_to)
  if _checks.is_static(R) and R >= _checks.INDEX_LIMIT:
    raise ValueError(f"num_experts, pad_to: the dispatched rows, R = {R} (every kept choice and each group's "
                     "padding), must be below 2^31")


def check_combine_args(rows, plan: Plan, weights) -> None:
  T, k = plan.row_of_slot.shape
  if jnp.ndim(rows) != 2 or rows.shape[0] != plan.slot_of_row.shape[0]:
    raise ValueError(f"rows: got shape {tuple(jnp.shape(rows))}, expected [R, d] = [{plan.slot_of_row.shape[0]}, d]")
  _checks.check_extents("rows", jnp.shape(rows), d=jnp.shape(rows)[1])
  if weights is not None and jnp.shape(weights) != (T, k):
    raise ValueError(f"weights: got shape {tuple(jnp.shape(weights))}, expected [T, k] = [{T}, {k}]")


def check_row_weights_args(weights, plan: Plan) -> None:
  T, k = plan.row_of_slot.shape
  if jnp.shape(weights) != (T, k):
    raise ValueError(f"weights: got shape {tuple(jnp.shape(weights))}, expected [T, k] = [{T}, {k}]")


def take_or_zero(values: jax.Array, index: jax.Array) -> jax.Array:
  """values[index] for a 1-D values, and 0 where index is -1 (jnp.take would wrap it) or out of range."""
  index = jnp.where(index < 0, values.shape[0], index)
  return jnp.take(values, index, mode="fill", fill_value=0)


def check_gather_args(x, plan) -> None:
  """Trace-time validation of a gather of x's rows by a dispatch plan (jaxmlp.dispatch.gather)."""
  if not isinstance(plan, Plan):
    raise TypeError(f"gather: expected a jaxmlp.dispatch.Plan (dispatch's third result), got {type(plan).__name__}")
  if jnp.ndim(plan.row_of_slot) != 2:
    raise ValueError(f"gather: the plan's row_of_slot must be [T, k], got shape {tuple(jnp.shape(plan.row_of_slot))}")
  T, k = jnp.shape(plan.row_of_slot)
  if jnp.ndim(x) != 2 or jnp.shape(x)[0] != T:
    raise ValueError(f"x: got shape {tuple(jnp.shape(x))}, expected the plan's tokens [T, d] = [{T}, d]")
  if jnp.ndim(plan.slot_of_row) != 1 or jnp.result_type(plan.slot_of_row) != jnp.int32:
    raise TypeError(f"gather: the plan's slot_of_row must be int32 [R], got {jnp.result_type(plan.slot_of_row)} "
                    f"{tuple(jnp.shape(plan.slot_of_row))}")


def row_tokens(slot_of_row: jax.Array, top_k: int, num_tokens: int) -> jax.Array:
  """The token each row holds: slot_of_row[r] // top_k, and num_tokens (no token) for padding rows."""
  return jnp.where(slot_of_row >= 0, slot_of_row // top_k, num_tokens)


def take_rows(x: jax.Array, slot_of_row: jax.Array, top_k: int) -> jax.Array:
  """The rows a dispatch made from tokens x [T, d]: row r is token slot_of_row[r] // top_k, zeros where
  slot_of_row[r] is -1 (padding) or names no token; all zeros without tokens (jnp.take takes none from an
  empty axis)."""
  if x.shape[0] == 0:
    return jnp.zeros((slot_of_row.shape[0], x.shape[1]), x.dtype)
  return jnp.take(x, row_tokens(slot_of_row, top_k, x.shape[0]), axis=0, mode="fill", fill_value=0)
