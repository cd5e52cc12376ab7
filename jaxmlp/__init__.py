"""jaxmlp: the Mixture-of-Experts grouped MLP for JAX, as XLA FFI custom calls over cuBLAS grouped GEMM.

  jaxmlp.grouped_mlp   fused FC1 -> activation -> FC2 over expert-sorted rows, forward and backward
  jaxmlp.ragged_dot    drop-in for jax.lax.ragged_dot
  jaxmlp.reference     pure-JAX definitions of both (the semantics)
  jaxmlp.fp8_weights   expert weights quantized once for grouped_mlp(fp8=...), reused over micro-batches
  jaxmlp.fp8_adam_step adam's step of master expert weights that also writes their FP8 weights, one pass
  jaxmlp.fp8_history   an amax history for grouped_mlp(fp8=Fp8Recipe(scaling="delayed"))
  jaxmlp.dispatch      the MoE layer's token dispatch and combine (dispatch, row_weights, combine, gather),
                       with jaxmlp.reference_moe their pure-JAX definitions
  jaxmlp.backend_info  which backend and GEMM path are in use
  jaxmlp.export_disabled_checks   what jax.export needs to serialize functions that call jaxmlp's ops
  jaxmlp.nnx, jaxmlp.linen   Flax modules (import separately; need flax)
"""
from . import dispatch, reference, reference_moe
from .activations import NAMES as ACTIVATIONS, Activation
from ._library import export_disabled_checks
from .backend import backend_info
from .fp8 import Fp8Recipe, Fp8Weights
from .fp8.adam import fp8_adam_step
from .fp8.delayed import history as fp8_history
from .fp8.mlp import fp8_weights
from .gemm import ragged_dot
from .mlp import grouped_mlp

__version__ = "0.1.0"
__all__ = ["ACTIVATIONS", "Activation", "Fp8Recipe", "Fp8Weights", "backend_info", "dispatch", "export_disabled_checks",
           "fp8_adam_step", "fp8_history", "fp8_weights", "grouped_mlp", "ragged_dot", "reference", "reference_moe"]
