"""What the FP8 tests share: the routing cases, the operands, a vjp of grouped_mlp, the recipes' float64 NumPy
models, how far the CUDA path may lie from them, and the `platform` fixture (each platform that runs FP8)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import check_padding_rows_zero, max_error, rel_error

import jaxmlp
import numpy_fp8_reference as fp8_ref
import numpy_reference as ref
from jaxmlp.fp8 import blockwise, cuda as fp8_cuda

# (M, d, f, group_sizes): empty groups, a skewed group, sizes that are not multiples of 16, padding rows.
CASES = {
    "uneven": (96, 32, 48, [20, 0, 50, 10]),
    "skewed": (160, 64, 32, [0, 131, 3, 0, 1, 17]),
    "one_group": (144, 32, 32, [144]),
    "all_empty": (32, 16, 32, [0, 0]),
}
# For the blockwise recipe also: rows of several 128-column blocks, the last one short (d = 272, F1 = 288),
# and groups of several 128-row blocks, the last one short; then f a multiple of 128 (the CUDA quantizer of
# the gated dh pairs each gate tile with its up tile then).
BLOCK_CASES = {**CASES, "blocks": (448, 272, 144, [300, 0, 37, 63, 1]),
               "whole_blocks": (384, 128, 256, [200, 0, 150])}
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def fp8_reason():
  ok, why = fp8_cuda.fp8_status()
  return None if ok else why


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def platform(request):
  if request.param == "cuda":
    reason = fp8_reason()
    if reason:
      pytest.skip(reason)
  with jax.default_device(jax.devices(request.param)[0]):
    yield request.param


def inputs(rng, M, d, f, sizes, act, dtype, scales=True, b1=False, b2=False):
  E, F1 = len(sizes), (2 * f if act in ref.GATED else f)
  cast = lambda a: jnp.asarray(a, dtype)
  args = dict(x=cast(rng.standard_normal((M, d))), w1=cast(rng.standard_normal((E, d, F1)) / np.sqrt(d)),
              w2=cast(rng.standard_normal((E, f, d)) / np.sqrt(f)), scales=cast(rng.uniform(0.1, 1.0, M)) if scales else None,
              b1=cast(rng.standard_normal((E, F1))) if b1 else None, b2=cast(rng.standard_normal((E, d))) if b2 else None)
  return args, jnp.asarray(sizes, jnp.int32), cast(rng.standard_normal((M, d)))


def run(fn, args, sizes, dy, act, **kw):
  """y and the gradients of x, w1, w2 (and scales) through jax.vjp."""
  names = [k for k in args if args[k] is not None]

  def f(*diff):
    kw_args = dict(zip(names, diff))
    return fn(kw_args.pop("x"), kw_args.pop("w1"), kw_args.pop("w2"), sizes, activation=act, **kw_args, **kw)

  y, vjp = jax.vjp(f, *[args[k] for k in names])
  return y, dict(zip(names, vjp(dy)))


# The recipes without fast accumulation, which only the CUDA tensorwise path has (its error: the test below).
EXACT = {name: jaxmlp.Fp8Recipe(name, fast_accumulation=False) for name in ("tensorwise", "blockwise")}
NUMPY_MODEL = {"tensorwise": fp8_ref.grouped_mlp, "blockwise": fp8_ref.blockwise_grouped_mlp}
# How far the CUDA path may lie from the emulation. Hopper's FP8 tensor cores sum with fewer bits than
# float32 between cuBLAS's promotions (even without fast accumulation), and cuBLAS applies the scales to
# the sum where the emulation sums scaled operands: some elements of h and da round to their other 16-bit
# neighbour, and through them a's and dh's e4m3 roundings move (measured on an H200, cuBLAS 13.10: up to
# 1.2e-2 relative error; single elements up to 6e-2 of the largest). Where the moved element is the
# tensor's largest, its amax moves the whole tensor's e4m3 grid: on an H100, "one_group" with seed
# 895917586 (JAXMLP_TEST_SEED) puts y 3.4e-2 off, with and without fast accumulation alike (the products'
# K = 32 leaves their sums exact; the scales' order differs). On the CPU, where the products are float32
# sums and the model's float64, they agree but where an element lies at an e4m3 rounding boundary: 1.5e-2,
# elements 6e-2 (seed 855 of the biased tensorwise "uneven" case with clamped_swiglu puts one element of dw1
# 0.5 off where the largest is 22.4, 2.2e-2; seed 2482913393 of the biased blockwise "uneven" case with gelu
# one element of a on its other e4m3 neighbour: y 4.2e-2 off in one element, dw2 1.0e-2 in norm; each about
# one seed in a thousand).
CUDA_TOLERANCE = 5e-2


def check_recipe(got, want, platform, name, cpu_tolerance=1.5e-2):
  if platform == "cuda":
    assert rel_error(got, want) < CUDA_TOLERANCE and max_error(got, want) < 4 * CUDA_TOLERANCE, name
  else:
    assert rel_error(got, want) < cpu_tolerance and max_error(got, want) < 4 * cpu_tolerance, name


def blockwise_primitive(name, *static):
  """One of the blockwise recipe's quantizers, CUDA's kernel on a GPU and the JAX definition on the CPU."""
  cpu, cuda = (getattr(p, name) for p in (blockwise.emulated_primitives(None), fp8_cuda.BLOCKWISE_PRIMITIVES))
  return lambda *a: jax.lax.platform_dependent(*a, cpu=lambda *a: cpu(*a, *static), cuda=lambda *a: cuda(*a, *static))


def check_against_model(y, grads, want_y, want, args, platform, M, sizes, cpu_tolerance=1.5e-2):
  """y and every gradient of `run` against the NumPy model's (check_recipe), each in its operand's dtype,
  and y's and dx's rows past the groups zeros."""
  check_recipe(y, want_y, platform, "y", cpu_tolerance)
  assert set(grads) == set(want)
  for k in grads:
    assert grads[k].dtype == args[k].dtype, k
    check_recipe(grads[k], want[k], platform, k, cpu_tolerance)
  check_padding_rows_zero(M, sizes, y, grads["x"])
