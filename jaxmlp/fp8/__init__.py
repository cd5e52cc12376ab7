"""FP8 training of the grouped MLP: `jaxmlp.grouped_mlp(..., fp8="tensorwise" | "blockwise")`.

  recipe.py      Fp8Recipe, Fp8Weights and every trace-time check of an FP8 call
  quantize.py    what the recipes share: e4m3 rounding, the biases' terms, the Scheme and Implementation
                 interface every recipe provides
  tensorwise.py  the tensorwise recipe's definition (one scale per tensor), as an emulation in JAX
  blockwise.py   the blockwise recipe's definition (DeepSeek-V3's 1 x 128 and 128 x 128 blocks)
  cuda.py        both recipes on a GPU: their custom calls
  mlp.py         the one custom_vjp over them, and jaxmlp.fp8_weights
  adam.py        jaxmlp.fp8_adam_step: adam's step that writes the FP8 weights in its pass
  delayed.py     the tensorwise recipe's delayed scaling: the amax history a call scales by and updates
  exchange.py    the expert-parallel layer's gathers in e4m3 (MoE(fp8_exchange=True))

docs/fp8.md has the recipes' rationale and measurements.
"""
from .recipe import RECIPES, Fp8Recipe, Fp8Weights, resolve, weights_of

__all__ = ["RECIPES", "Fp8Recipe", "Fp8Weights", "resolve", "weights_of"]
