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
# the gated dh pairs each gate tile with its up tile then). "blocks" also takes the tensorwise recipe's
# backward activation over several 128 x 128 tiles of a, the last ones short in both directions.
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
  """y and the gradients of x, w1, w2 (and scales) through jax.vjp, in one jitted call: as a training step
  runs them, and one compilation rather than one per operation of the recipe's emulation."""
  names = [k for k in args if args[k] is not None]

  @jax.jit
  def y_and_grads(diff, sizes, dy):
    def f(*diff):
      kw_args = dict(zip(names, diff))
      return fn(kw_args.pop("x"), kw_args.pop("w1"), kw_args.pop("w2"), sizes, activation=act, **kw_args, **kw)

    y, vjp = jax.vjp(f, *diff)
    return y, dict(zip(names, vjp(dy)))

  return y_and_grads([args[k] for k in names], sizes, dy)


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
# K = 32 leaves their sums exact; the scales' order differs).
CUDA_TOLERANCE = 5e-2
# On the CPU the emulation computes h, a, da and dh in float32 and the model in float64: an element within
# float32's error of a rounding boundary rounds to either neighbour. An e4m3 one moves a whole row of the next
# product (seed 680181855 of the 16-bit weight gradients' "uneven" case: a[23, 25] within 1e-7 of one, y's row
# 23 2.5e-3 off; about one seed in a thousand per test): the model at +-NUDGE (numpy_fp8_reference) rounds such
# elements the other way, and the check takes whichever of the three models agrees. 1e-6 is 17 float32
# ulps; an element as near a boundary that the emulation rounds as the model is rare (none within 1e-5
# in that case's a). What remains is the results' own rounding to the 16-bit dtype, the float32 sums' order
# deciding an element's neighbour: 2^-8 = 3.9e-3 of that element at most, under CPU_TOLERANCE. Measured over
# 150 seeds of each recipe, activation and bias setting of the "uneven" case (2,100 calls): at most 1.4e-3
# (db1: one element on its other bfloat16 neighbour), elements 5.4e-3.
CPU_TOLERANCE = 5e-3
NUDGE = 1e-6


def check_recipe(got, want, platform, name):
  assert recipe_error(got, want, platform) is None, name


def recipe_error(got, want, platform):
  """None where got lies within the platform's tolerance of want (its norm, and 4x that for the largest
  element's), else the two errors."""
  tolerance = CUDA_TOLERANCE if platform == "cuda" else CPU_TOLERANCE
  errors = rel_error(got, want), max_error(got, want)
  return None if errors[0] < tolerance and errors[1] < 4 * tolerance else errors


def blockwise_primitive(name, *static):
  """One of the blockwise recipe's quantizers, CUDA's kernel on a GPU and the JAX definition on the CPU."""
  cpu, cuda = (getattr(p, name) for p in (blockwise.emulated_primitives(None), fp8_cuda.BLOCKWISE_PRIMITIVES))
  return lambda *a: jax.lax.platform_dependent(*a, cpu=lambda *a: cpu(*a, *static), cuda=lambda *a: cuda(*a, *static))


def check_against_model(y, grads, model, args, platform, M, sizes):
  """y and every gradient of `run` against the (y, gradients) of model(nudge=...) at nudge 0 or +-NUDGE
  (recipe_error), each in its operand's dtype, and y's and dx's rows past the groups zeros."""
  assert all(grads[k].dtype == args[k].dtype for k in grads)
  failed = {}
  for nudge in (0.0, NUDGE, -NUDGE):
    want_y, want = model(nudge=nudge)
    assert set(grads) == set(want)
    failed[nudge] = {k: e for k, got, w in [("y", y, want_y)] + [(k, grads[k], want[k]) for k in grads]
                     if (e := recipe_error(got, w, platform)) is not None}
    if not failed[nudge]:
      break
  else:
    raise AssertionError(f"(relative, largest element's) errors past the tolerance, by nudge: {failed}")
  check_padding_rows_zero(M, sizes, y, grads["x"])
