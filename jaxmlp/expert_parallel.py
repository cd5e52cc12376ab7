"""The MoE layer of jaxmlp.moe run expert-parallel: the E experts split over a mesh axis of size P, each
device holding E/P of them and a 1/P share of the tokens, inside jax.shard_map. Each device routes its
own tokens; then one of two exchanges:

  - "all_gather" (the default, every backend): every device gathers all T tokens with their routing
    choices (jax.lax.all_gather), runs its E/P experts on the choices that picked them, sums each token's
    local choices weighted (jaxmlp.combine) and the devices' partial sums are added and split back to the
    tokens' devices (jax.lax.psum_scatter). Each token crosses a link once per device whatever k is, and
    both collectives are NCCL's plain ring ones on GPUs. Capacity drops follow from seeing all the
    routing choices in the global order: jaxmlp.dispatch's own capacity, on the local experts.
    In `chunks` > 1 parts, each device's tokens split into that many runs of the above, independent of
    each other, so that XLA's scheduler may overlap one chunk's collectives with another's experts
    (asynchronous collectives on GPUs); with a capacity, the pairs kept are then chosen ahead of the
    chunks, in the same global order (as the ragged exchange does). With `fp8_exchange` (FP8 experts,
    bfloat16 or float32 tokens) the gathers, of the tokens forward and of their output gradients
    backward, carry e4m3 rows with their scales (jaxmlp.fp8.exchange), half the bytes.
  - "ragged_all_to_all": each device sorts its (token, choice) rows by expert and sends each peer only
    the rows routed to it (jax.lax.ragged_all_to_all, NCCL through XLA; XLA:CPU lacks it), which sorts
    them a second time by local expert; the results travel back and are combined where the tokens are.
    It moves (P-1)/P * T/P * k rows a device each way where the gather moves (P-1) * T/P tokens (fewer
    bytes only where k < P), but XLA's exchange measured far slower over NVLink with jax 0.11.2
    (docs/expert-parallel.md; XLA_FLAGS=--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true
    speeds it up and works around a fault in its gradient, marin-community/marin#8077, openxla/xla#33386).

Both give the single-device layer's results (jaxmlp.moe.moe) on all T tokens, up to float rounding:
  - capacity: C = ceil(cf * T * k / E) per expert over the global batch, served in the single-device
    order (all first choices before any second one, then in global token order: device by device);
  - the router losses are those of all T tokens (global counts, probabilities averaged over devices);
  - the router weights multiply the expert outputs at the combine, not inside the grouped MLP; with
    "all_gather" each device's partial sums are rounded to the computation dtype before they are added;
  - FP8 delayed scaling (an fp8_history): every device and chunk scales by the one history (where a row of
    it holds no amax yet, each by its own rows' amax), and its update holds the largest amaxes any of them
    observed (jaxmlp.fp8.delayed.shared), those of all rows.
Static bounds (T tokens in all, T/P per device, k = top_k, E/P local experts): the grouped MLP runs on
R = T * min(k, E/P) rows (a token's k experts are distinct), bounded by E/P * C with a capacity; the
gathered tokens take T rows. Dropless routing thus sizes the buffers for every token picking this
device's experts: P * min(k, E/P) / k times the rows a device gets on average.
"""
from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp
from jax.lax import all_gather, psum_scatter, ragged_all_to_all
from jax.sharding import PartitionSpec as P

from . import _checks, _gemm_path
from .dispatch import combine, dispatch
from .fp8 import delayed
from .fp8 import exchange as fp8_exchange_ops
from .fp8.recipe import expert_weights, resolve as resolve_fp8
from .moe import history_kwarg, route, router_losses
from .reference_moe import sort_by_expert

EXCHANGES = ("all_gather", "ragged_all_to_all")


def axis_size(expert_axis: str | None, num_experts: int, num_tokens: int, experts_name: str = "num_experts") -> int:
  """P, the size of `expert_axis` in the current mesh (jax.set_mesh); 1 without an axis or a mesh.

  Raises a ValueError naming the argument when the mesh lacks the axis or E or the tokens do not split
  evenly over it (experts_name: the argument that holds the experts, in that error)."""
  mesh = jax.sharding.get_abstract_mesh()
  if expert_axis is None or mesh.empty:
    return 1
  if expert_axis not in mesh.axis_names:
    raise ValueError(f"expert_axis: {expert_axis!r} is not an axis of the current mesh "
                     f"(axes {mesh.axis_names})")
  size = mesh.shape[expert_axis]
  if size > 1 and mesh.axis_types[mesh.axis_names.index(expert_axis)] == jax.sharding.AxisType.Manual:
    raise ValueError(f"expert_axis: {expert_axis!r} is already manual here (inside a shard_map over it); "
                     "call this outside, on the arrays of all devices")
  if size > 1 and num_experts % size:
    raise ValueError(f"{experts_name}: {num_experts} experts do not split over the {size} devices of "
                     f"expert_axis {expert_axis!r}; expected a multiple of {size}")
  if size > 1 and num_tokens % size:
    raise ValueError(f"x: {num_tokens} tokens do not split over the {size} devices of expert_axis "
                     f"{expert_axis!r}; expected a multiple of {size} tokens")
  return size


def check_exchange(exchange: str, name: str = "exchange", chunks: int = 1, chunks_name: str = "chunks") -> None:
  """Raises a clear error for an unknown exchange, or for chunks that are not a positive int or are
  asked of the ragged exchange (which runs in one part)."""
  if exchange not in EXCHANGES:
    raise ValueError(f"{name}: unknown {exchange!r}; expected one of {', '.join(EXCHANGES)}")
  if not isinstance(chunks, int) or isinstance(chunks, bool):
    raise TypeError(f"{chunks_name}: expected a positive int, got {chunks!r}")
  if chunks < 1:
    raise ValueError(f"{chunks_name}: expected a positive int, got {chunks}")
  if chunks > 1 and exchange != "all_gather":
    raise ValueError(f"{chunks_name}: {chunks} chunks need the all_gather exchange, not {exchange!r}")


def moe_expert_parallel(tokens: jax.Array, logits: jax.Array, expert_params: tp.Any,
                        expert_mlp: tp.Callable[..., jax.Array], *, expert_axis: str, top_k: int,
                        score_func: str = "softmax", renormalize: bool = True,
                        capacity_factor: float | None = None, aux_loss_coef: float = 0.0,
                        z_loss_coef: float = 0.0, exchange: str = "all_gather", chunks: int = 1,
                        chunks_name: str = "chunks", zero_padding: bool = True, fp8_exchange: bool = False,
                        fp8_history: jax.Array | None = None):
  """jaxmlp.moe.moe expert-parallel over `expert_axis` of the current mesh (see the module docstring).

  Args:
    tokens [T, d], logits [T, E]: split over the axis by their leading dimension.
    expert_params: a pytree of arrays with leading dimension E, split over the axis (the "expert" axis),
      and of scalars, which every device takes whole (the scale of weights quantized by the tensorwise
      recipe, jaxmlp.Fp8Weights).
    expert_mlp: `expert_mlp(local_params, rows, group_sizes) -> rows`, the local experts' MLP (no scales);
      with fp8_history, `expert_mlp(local_params, rows, group_sizes, fp8_history=h)`.
    exchange: "all_gather" or "ragged_all_to_all" (module docstring).
    chunks: the all_gather exchange in that many parts of each device's tokens (module docstring); the
      T/P tokens of a device must split evenly into them. chunks_name: the argument's name in errors.
    zero_padding: as jaxmlp.moe.moe's, for the rows around expert_mlp: False where it reads no row past
      the groups of its input nor of its result's cotangent (jaxmlp.grouped_mlp). Dropless
      routing sizes those buffers at P * min(k, E/P) / k times the rows they hold (module docstring).
    fp8_exchange: the all_gather exchange's gathers in e4m3 (for FP8 experts; bfloat16 or float32 tokens,
      d a multiple of 16; jaxmlp.fp8.exchange).
    fp8_history: the experts' amax history [4, H] (FP8 delayed scaling), replicated: the gradient it
      takes is its update, the largest amaxes of all devices and chunks (module docstring).
  Returns (y [T, d], the router_losses dict of all T tokens).
  """
  check_exchange(exchange, chunks=chunks, chunks_name=chunks_name)
  _checks.check_flag("zero_padding", zero_padding)
  _checks.check_flag("fp8_exchange", fp8_exchange)
  if fp8_exchange and exchange != "all_gather":
    raise ValueError(f"fp8_exchange: the {exchange!r} exchange sends its rows in their dtype; e4m3 rows "
                     "need the all_gather exchange")
  if fp8_exchange and not _e4m3_rows_fit(tokens):
    raise TypeError(f"fp8_exchange: e4m3 rows need bfloat16 or float32 tokens of a width that is a multiple "
                    f"of 16, got {tokens.dtype} [{tokens.shape[0]}, {tokens.shape[1]}]")
  num_tokens, num_experts = logits.shape
  mesh = jax.sharding.get_abstract_mesh()
  per_device = num_tokens // mesh.shape[expert_axis]
  if per_device % chunks:
    raise ValueError(f"{chunks_name}: the {per_device} tokens of each device do not split into {chunks} "
                     "chunks; expected a divisor of the tokens per device")
  capacity = None
  if capacity_factor is not None:  # as in moe.moe: per expert, over the global batch
    capacity = math.ceil(capacity_factor * num_tokens * top_k / num_experts)

  # A row of the history for each device (their updates' maximum is its gradient), split over the axis.
  histories = () if fp8_history is None else (delayed.shared(fp8_history, mesh.shape[expert_axis]),)

  def shard(tokens, logits, params, *histories):
    return _moe_shard(tokens, logits, params, expert_mlp, axis=expert_axis, top_k=top_k,
                      score_func=score_func, renormalize=renormalize, capacity=capacity,
                      aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, exchange=exchange, chunks=chunks,
                      zero_padding=zero_padding, fp8_exchange=fp8_exchange,
                      history=histories[0][0] if histories else None)

  split = P(expert_axis)
  specs = (split, split, jax.tree.map(lambda a: split if jnp.ndim(a) else P(), expert_params),
           *(split,) * len(histories))
  y, losses = split_over(shard, expert_axis, specs, (split, P()))(tokens, logits, expert_params, *histories)
  if is_explicit(expert_axis):  # y as the tokens were, so that the caller's reshape is the one it does without EP
    y = jax.sharding.reshard(y, jax.typeof(tokens).sharding.spec)
  return y, losses


def is_explicit(axis: str) -> bool:
  """Whether `axis` of the current mesh is Explicit (its arrays' shardings are part of their types)."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.axis_types[mesh.axis_names.index(axis)] == jax.sharding.AxisType.Explicit


def split_over(fn, axis: str, in_specs, out_specs):
  """fn on each device's share of `axis` of the current mesh: jax.shard_map over that axis, its operands
  first resharded to in_specs where the axis is Explicit (shard_map moves Auto operands itself, Explicit
  ones not). Compiled as one program also when called outside jit (a Linen init): op by op, jax 0.11.2's
  XLA:CPU crashed (segmentation fault) compiling the ops of the expert-parallel layer's shard."""
  mapped = jax.jit(jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names={axis}))
  explicit = is_explicit(axis)

  def call(*args):
    return mapped(*(jax.sharding.reshard(args, in_specs) if explicit else args))
  return call


def fp8_exchange_applies(asked: bool, fp8, exchange: str, tokens: jax.Array, *, top_k: int, num_experts: int,
                         devices: int, chunks: int, cached: bool, d_ff: int, gated: bool) -> bool:
  """Whether the MoE modules' `fp8_exchange=asked` takes effect: the experts run their FP8 recipe `fp8`
  (Fp8Recipe.runs_fp8 at the rows a device's grouped MLP holds on average, the T k choices of all T tokens
  over its E/P experts of d (F1 + f) weights each, in each of `chunks`: what _gathered_experts' buffers are
  expected to hold, _padded; cached: their weights given as Fp8Weights), the all_gather exchange, and tokens
  whose rows e4m3 carries exactly on arrival (_e4m3_rows_fit). Experts that run in the tokens' dtype get
  their rows in it."""
  recipe = resolve_fp8(fp8)
  local_experts, d = num_experts // devices, tokens.shape[1]
  return (asked and recipe is not None and exchange == "all_gather" and _e4m3_rows_fit(tokens)
          and recipe.runs_fp8(tokens.shape[0] * top_k // devices // chunks, local_experts, cached,
                              expert_weights(local_experts, d, d_ff, (2 if gated else 1) * d_ff)))


def _e4m3_rows_fit(tokens) -> bool:
  """bfloat16 or float32 tokens (float16's from 63488 up would arrive as infinities, jaxmlp.fp8.exchange)
  of a width in 16-byte rows of e4m3."""
  return tokens.dtype in (jnp.bfloat16, jnp.float32) and tokens.shape[1] % 16 == 0


def _moe_shard(tokens, logits, params, expert_mlp, *, axis, top_k, score_func, renormalize, capacity,
               aux_loss_coef, z_loss_coef, exchange, chunks, zero_padding, fp8_exchange, history):
  """One device's part: its T/P tokens, its E/P experts (`params`), the experts' amax history or None."""
  num_experts = logits.shape[1]
  weights, experts, probs = route(logits, top_k, score_func, renormalize)
  # Routing choices per (choice j, expert) on every device: the global counts (and capacity ranks). A
  # one-hot sum over the tokens, not jnp.bincount, which XLA runs as a scatter-add.
  choice_counts = jnp.sum(experts[:, :, None] == jnp.arange(num_experts), axis=0, dtype=jnp.int32)
  all_counts = all_gather(choice_counts, axis)  # [P, k, E]
  losses = _global_router_losses(logits, probs, all_counts.sum((0, 1)), top_k, aux_loss_coef,
                                 z_loss_coef, axis)
  if exchange == "all_gather" and chunks > 1:
    keep = None if capacity is None else _within_capacity(experts, all_counts, capacity, axis)
    experts = experts if keep is None else jnp.where(keep, experts, -1)  # an expert out of range: no row
    parts = zip(*(jnp.split(v, chunks) for v in (tokens, weights, experts)))
    histories = [None] * chunks if history is None else delayed.shared(history, chunks)
    return jnp.concatenate([_gathered_experts(*part, num_experts, params, expert_mlp, axis, None, zero_padding,
                                              fp8_exchange, h) for part, h in zip(parts, histories)]), losses
  if exchange == "all_gather":
    return _gathered_experts(tokens, weights, experts, num_experts, params, expert_mlp, axis, capacity,
                             zero_padding, fp8_exchange, history), losses
  return _ragged_experts(tokens, weights, experts, all_counts, params, expert_mlp, axis, capacity,
                         zero_padding, history), losses


def _gathered_experts(tokens, weights, experts, num_experts, params, expert_mlp, axis, capacity, zero_padding,
                      fp8_exchange, history):
  """y [T/P, d] of the "all_gather" exchange: all devices' tokens through this device's experts, the
  partial sums added over the devices and split back."""
  local_experts, me = num_experts // jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  all_weights, all_experts = (all_gather(v, axis, tiled=True) for v in (weights, experts))
  all_tokens = fp8_exchange_ops.gather(tokens, axis) if fp8_exchange else all_gather(tokens, axis, tiled=True)
  # Other devices' experts fall outside [0, E/P): dispatch drops them. A token's experts are distinct, so
  # an expert gets at most one row per token: capacity T bounds the rows to T * min(k, E/P), dropping none.
  bound = all_tokens.shape[0] if capacity is None else min(capacity, all_tokens.shape[0])
  rows, group_sizes, plan = dispatch(all_tokens, all_experts - me * local_experts, local_experts, capacity=bound,
                                     zero_padding=zero_padding)
  with _padded(rows, all_experts.size // jax.lax.axis_size(axis)):  # all tokens' choices, 1/P of them here
    out = expert_mlp(params, rows, group_sizes, **history_kwarg(history))
  partial = combine(out, plan, all_weights, zero_padding=zero_padding)
  return fp8_exchange_ops.scatter_sum(partial, axis) if fp8_exchange else psum_scatter(partial, axis, tiled=True)


def _ragged_experts(tokens, weights, experts, all_counts, params, expert_mlp, axis, capacity, zero_padding,
                    history):
  """y [T/P, d] of the "ragged_all_to_all" exchange: the rows to their experts' devices and back."""
  num_peers = jax.lax.axis_size(axis)
  num_tokens, top_k = experts.shape
  num_experts = all_counts.shape[-1]
  local_experts = num_experts // num_peers
  keep = None if capacity is None else _within_capacity(experts, all_counts, capacity, axis)
  rows, group_sizes, plan = _local_dispatch(tokens, experts, num_experts, keep)

  # Per-peer row counts: sent[i, p, e] rows go from device i to peer p's local expert e.
  sent = all_gather(group_sizes.reshape(num_peers, local_experts), axis)  # [P, P, E/P]
  me = jax.lax.axis_index(axis)
  recv_counts = sent[:, me]  # [P, E/P]: rows each peer sends to my local experts
  # The static bound of the module docstring: R rows received in all.
  max_rows = num_peers * num_tokens * min(top_k, local_experts)
  if capacity is not None:
    max_rows = min(max_rows, local_experts * capacity)
  send = _RaggedExchange(sent, me, axis, max_rows)

  received, starts = send.forward(rows)
  slot_expert = _slot_experts(received.shape[0], starts, recv_counts)
  local_rows, local_sizes, local_plan = _local_dispatch(received, slot_expert[:, None], local_experts,
                                                        zero_padding=zero_padding)
  with _padded(local_rows, experts.size):  # as many choices come here as this device's tokens make
    out = expert_mlp(params, local_rows, local_sizes, **history_kwarg(history))
  out = _local_combine(out, local_plan, zero_padding=zero_padding)
  return _local_combine(send.backward(out, rows.shape[0]), plan, weights)


def _padded(rows, in_use: int):
  """The expert MLP's buffer `rows` against the `in_use` rows it holds on average (routing choices that
  reach this device's experts): the GEMM path is chosen by the average (jaxmlp._gemm_path.padded_buffers),
  not by the buffer sized for the worst case."""
  return _gemm_path.padded_buffers(rows.shape[0] / max(1, in_use))


def _local_dispatch(tokens, experts, num_experts, keep=None, zero_padding=True):
  """Rows of tokens [T, d] for the pairs of experts [T, k] sorted by expert (jaxmlp.dispatch: no sort);
  pairs not kept (keep [T, k] False) get no row. Returns (rows [T*k, d], group_sizes [num_experts] of kept
  rows, the plan that _local_combine needs to undo it)."""
  if keep is not None:  # an expert id out of range is dropped: not counted, no row
    experts = jnp.where(keep, experts, -1)
  return dispatch(tokens, experts, num_experts, zero_padding=zero_padding)


def _local_combine(rows, plan, weights=None, zero_padding=True):
  """y [T, d]: the rows [T*k, d] of _local_dispatch summed into their tokens, each times its weight
  (weights [T, k]; None: 1), accumulated in float32 (jaxmlp.combine: no scatter-add)."""
  return combine(rows, plan, weights, zero_padding=zero_padding)


def _global_router_losses(logits, probs, counts, top_k, aux_loss_coef, z_loss_coef, axis):
  """router_losses of all devices' tokens: with the global counts scaled to one device's share, each
  device's loss is linear in its mean probabilities and its mean z term, so the mean over the devices
  (equal token counts) is the loss of all tokens."""
  local = router_losses(logits, probs, counts / jax.lax.axis_size(axis), top_k, aux_loss_coef, z_loss_coef)
  return jax.tree.map(lambda v: jax.lax.pmean(v, axis), local)


def _within_capacity(experts, all_counts, capacity, axis):
  """keep [T, k]: whether each pair is among the first `capacity` of its expert in the single-device
  layer's order over all devices: by choice j, then device, then token."""
  num_tokens, top_k = experts.shape
  me = jax.lax.axis_index(axis)
  counts = all_counts.sum(0)  # [k, E] over all devices
  mine = all_counts[me]
  # Pairs of expert e ahead of this device's pairs of choice j: all devices' earlier choices and the
  # earlier devices' choice j, less this device's earlier choices, which its own rank below counts.
  ahead = (jnp.cumsum(counts, axis=0) - counts) + (jnp.cumsum(all_counts, axis=0) - all_counts)[me] \
      - (jnp.cumsum(mine, axis=0) - mine)
  # The rank among this device's pairs of the same expert, in sort_by_expert's choice-major order.
  order, local_counts, _ = sort_by_expert(experts, all_counts.shape[-1])
  sorted_experts = experts.T.reshape(-1)[order]
  rank = jnp.arange(order.shape[0]) - (jnp.cumsum(local_counts) - local_counts)[sorted_experts]
  rank = rank + ahead[order // num_tokens, sorted_experts]
  return jnp.zeros(order.shape, bool).at[order].set(rank < capacity).reshape(top_k, num_tokens).T


def _slot_experts(num_slots, starts, recv_counts):
  """The local expert of each received row (slot), or E/P for a slot no row landed in: peer p's rows
  start at slot starts[p], sorted by local expert with recv_counts[p] rows each."""
  local_experts = recv_counts.shape[1]
  group_starts = (starts[:, None] + jnp.cumsum(recv_counts, axis=1) - recv_counts).reshape(-1)
  group_ends = group_starts + recv_counts.reshape(-1)
  slots = jnp.arange(num_slots)
  group = jnp.clip(jnp.searchsorted(group_starts, slots, side="right") - 1, 0, group_starts.shape[0] - 1)
  return jnp.where(slots < group_ends[group], group % local_experts, local_experts).astype(jnp.int32)


class _RaggedExchange:
  """jax.lax.ragged_all_to_all: the rows for each peer move as one slice into a max_rows buffer, where
  the slices from peers 0, 1, ... lie one after the other."""

  def __init__(self, sent, me, axis, max_rows):
    sizes = sent.sum(2)  # [P, P]: rows device i sends to device p
    self.send_sizes, self.recv_sizes = sizes[me], sizes[:, me]
    self.send_offsets = jnp.cumsum(self.send_sizes) - self.send_sizes  # where my slices start in my rows
    self.recv_offsets = jnp.cumsum(self.recv_sizes) - self.recv_sizes  # where peers' slices land in mine
    # Where my slice lands on each peer p, after the slices of devices before me: sum_{i<me} sizes[i, p].
    self.remote_recv_offsets = (jnp.cumsum(sizes, axis=0) - sizes)[me]
    # Where peer p's results come back to in my rows: my slice for p began at send_offsets[p]; for p's
    # return trip it sends to me at the offset where its slice for me began in its rows.
    self.remote_send_offsets = (jnp.cumsum(sizes, axis=1) - sizes)[:, me]
    self.axis, self.max_rows = axis, max_rows

  def _buffer(self, num_rows, like):
    """The zeros the exchange writes into, typed as varying over the axis like the rows that land there
    (a plain zeros array is invariant, and so would be the exchange's result, whose gradient varies)."""
    return jax.lax.pcast(jnp.zeros((num_rows, like.shape[1]), like.dtype), self.axis, to="varying")

  def forward(self, rows):
    output = self._buffer(self.max_rows, rows)
    received = ragged_all_to_all(rows, output, self.send_offsets, self.send_sizes,
                                 self.remote_recv_offsets, self.recv_sizes, axis_name=self.axis)
    return received, self.recv_offsets

  def backward(self, out, num_rows):
    output = self._buffer(num_rows, out)
    return ragged_all_to_all(out, output, self.recv_offsets, self.recv_sizes, self.remote_send_offsets,
                             self.send_sizes, axis_name=self.axis)
