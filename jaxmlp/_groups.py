"""The group_sizes policy, shared by every op and its reference: negative sizes count as 0 and the running
total is capped at m, the rows of the ragged operand; rows past the total are padding (output 0, gradient 0).

`Groups` is the policy applied once per call: the clamped sizes and the row facts derived from them, a
small value that the FP8 recipes pass along instead of clamping again at each use. The handlers clamp the
sizes themselves (ffi/group_offsets.h, ffi/cuda/group_scan.cuh), so they take the sizes as given.
"""
from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import is_static


def host_sizes_as_int32(group_sizes, m: int):
  """NumPy group_sizes clamped to [0, m] and narrowed to int32 on the host, meaning the same under the
  policy; anything else unchanged. Without x64, JAX would narrow an int64 array itself, by wrapping
  (2**32 + 5 becomes 5), before sizes_as_int32 could clamp it."""
  if isinstance(group_sizes, (np.ndarray, np.generic)):
    return np.clip(group_sizes, 0, m).astype(np.int32)
  return group_sizes


def sizes_as_int32(group_sizes: jax.Array, m: int) -> jax.Array:
  """group_sizes of any integer dtype as int32, meaning the same under the policy: each size is clamped
  to [0, m] in its own dtype first (m capped at that dtype's largest value), so that no cast wraps (an
  int64 2**32 + 5 would become 5, a uint32 2**31 negative) and no bound wraps (m = 300 as an int8)."""
  dtype = jnp.result_type(group_sizes)
  bound = min(m, jnp.iinfo(dtype).max) if is_static(m) else m  # a symbolic m (jax.export) is an int32 at run time
  return jnp.clip(group_sizes, 0, bound).astype(jnp.int32)


def handler_sizes(group_sizes, m: int) -> jax.Array:
  """group_sizes as the handlers take them, int32. They clamp each size to [0, m] themselves, so int32
  sizes go in as they are, with no XLA kernel ahead of the call; other dtypes are clamped in their own
  dtype first, so that the cast cannot wrap."""
  return group_sizes if jnp.result_type(group_sizes) == jnp.int32 else sizes_as_int32(group_sizes, m)


def clamp_group_sizes(group_sizes: jax.Array, m: int) -> jax.Array:
  """The policy: int32 sizes, each >= 0, that sum to at most m, so no backend can index outside the m rows."""
  sizes = sizes_as_int32(group_sizes, m)
  # A saturating running sum, min(a + b, m), associative for non-negative terms. Written a + min(b, m - a)
  # so that no intermediate exceeds m: adversarial sizes cannot wrap int32 the way a plain cumsum (or
  # a + b, up to 2m, once m > 2^30) could.
  ends = jax.lax.associative_scan(lambda a, b: a + jnp.minimum(b, m - a), sizes)
  starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
  return (ends - starts).astype(jnp.int32)


def row_groups(sizes: jax.Array, m: int) -> jax.Array:
  """Group index of each of the m rows for clamped sizes; padding rows get E."""
  ends = jnp.cumsum(sizes)
  return jnp.searchsorted(ends, jnp.arange(m, dtype=ends.dtype), side="right").astype(jnp.int32)


class Groups(tp.NamedTuple):
  """group_sizes of one call under the policy (a pytree, so it travels through custom_vjp residuals and
  jax.lax.platform_dependent). Fields nothing reads cost nothing: XLA drops them."""
  given: jax.Array  # [E] int32, as the handlers take them (handler_sizes)
  sizes: jax.Array  # [E] int32, clamped (clamp_group_sizes)
  row_group: jax.Array  # [m] int32: each row's group, E past the groups
  valid: jax.Array  # [m] bool: the rows in groups

  @classmethod
  def of(cls, group_sizes, m: int) -> Groups:
    sizes = clamp_group_sizes(group_sizes, m)
    row_group = row_groups(sizes, m)
    return cls(handler_sizes(group_sizes, m), sizes, row_group, row_group < sizes.shape[0])

  @property
  def num_groups(self) -> int:
    return self.sizes.shape[0]

  @property
  def num_rows(self) -> int:
    return self.valid.shape[0]


def check_at_run_time(group_sizes, m: int) -> None:
  """check_group_sizes=True: a ValueError for negative sizes or sizes that sum past m; at once for concrete
  sizes, from a host callback at run time under jit (which JAX reports as a JaxRuntimeError)."""
  def check(sizes):
    sizes = np.asarray(sizes, dtype=np.int64)
    wrong = []
    if (sizes < 0).any():
      wrong.append("negative entries")
    if sizes.clip(0).sum() > m:  # what the policy would cap
      wrong.append(f"sizes sum to {sizes.clip(0).sum()} > M = {m}")
    if wrong:
      raise ValueError(f"group_sizes {sizes.tolist()}: {' and '.join(wrong)} (check_group_sizes=True)")

  if not isinstance(group_sizes, jax.core.Tracer):
    # Concrete: a ValueError at the call (a NumPy array before JAX could narrow an int64 array by wrapping).
    check(np.asarray(group_sizes))
  else:
    jax.debug.callback(check, group_sizes)
