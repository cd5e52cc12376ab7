"""The activation functions of the grouped MLP.

The handlers know each activation by its name: the extension exports their C++ enum (`ffi/codes.h`, `Act`)
with members of these names. The JAX functions here define the semantics; `jaxmlp.reference` uses them
and the CUDA and CPU kernels implement the same formulas with hand-written derivatives.

Gated activations read the FC1 output `h` of width 2f: the first f columns are the gate, the last f
the linear ("up") part.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

NAMES = ("swiglu", "geglu", "reglu", "gelu", "relu", "silu", "squared_relu", "clamped_swiglu")
GATED = frozenset({"swiglu", "geglu", "reglu", "clamped_swiglu"})


@dataclasses.dataclass(frozen=True)
class Activation:
  """An activation and its parameters.

  `alpha` and `limit` are used by `clamped_swiglu` only (GPT-OSS form):
  `gate = min(gate, limit)`, `up = clip(up, -limit, limit)`,
  `out = gate * sigmoid(alpha * gate) * (up + 1)`.
  """

  name: str = "swiglu"
  alpha: float = 1.702
  limit: float = 7.0

  def __post_init__(self):
    if self.name not in NAMES:
      raise ValueError(f"activation: unknown name {self.name!r}; expected one of {', '.join(NAMES)}")
    if self.name == "clamped_swiglu" and not (math.isfinite(self.alpha) and self.limit > 0):
      raise ValueError(f"activation: clamped_swiglu needs a finite alpha and limit > 0, got "
                       f"alpha={self.alpha}, limit={self.limit}")

  @property
  def gated(self) -> bool:
    return self.name in GATED

  def __call__(self, h: jax.Array) -> jax.Array:
    """Applies the activation to the FC1 output h ([..., 2f] if gated, else [..., f])."""
    if not self.gated:
      return _UNGATED[self.name](h)
    f = h.shape[-1] // 2
    gate, up = h[..., :f], h[..., f:]
    if self.name == "clamped_swiglu":
      # jnp.where (not jnp.minimum/clip) so that the gradient at the limit itself passes, as in the kernels.
      gate = jnp.where(gate > self.limit, self.limit, gate)
      up = jnp.where(up > self.limit, self.limit, jnp.where(up < -self.limit, -self.limit, up))
      return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)
    return _UNGATED[_GATE_OF[self.name]](gate) * up


def _gelu_tanh(x):
  # 0.5 x (1 + tanh(u)) as x sigmoid(2u), which keeps its relative accuracy in the negative tail, where
  # 1 + tanh(u) cancels.
  return x * jax.nn.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))


_UNGATED = {
    "gelu": _gelu_tanh,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "squared_relu": lambda x: jnp.square(jax.nn.relu(x)),
}
_GATE_OF = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}


def resolve(activation: str | Activation) -> Activation:
  """Accepts a name or an Activation; raises a clear error for anything else."""
  if isinstance(activation, Activation):
    return activation
  if isinstance(activation, str):
    return Activation(activation)
  raise TypeError(f"activation: expected a name ({', '.join(NAMES)}) or jaxmlp.Activation, "
                  f"got {type(activation).__name__}")
