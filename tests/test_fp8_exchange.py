"""The expert-parallel layer's gathers in e4m3 (jaxmlp.fp8.exchange, MoE(fp8=..., fp8_exchange=True)) on
CPU devices (conftest's 8), against a NumPy model of the 1 x 128 power-of-two quantization, and over the
GPUs of a machine with several."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import gpus, rel_error
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxmlp
import jaxmlp.linen
import jaxmlp.nnx
from jaxmlp import expert_parallel
from jaxmlp.fp8 import exchange
from jaxmlp.fp8.recipe import MIN_ROWS_PER_EXPERT, MIN_WEIGHTS_STREAMED

AXIS = "expert"
E, D, F = 16, 144, 32  # D: a row of one whole 128-column block and one cut short


def mesh_of(n, devices=None, axis_type=AxisType.Explicit):
  return jax.make_mesh((n,), (AXIS,), axis_types=(axis_type,), devices=devices or jax.devices("cpu")[:n])


def e4m3_rows(v):
  """float64 NumPy model: v [R, C] quantized in 1 x 128 blocks, scale 2^e the least power of two >= amax /
  448 (1 for a zero block), the quotient rounded to e4m3 (nearest even), and dequantized."""
  v = np.asarray(v, np.float64)
  out = np.empty_like(v)
  for c in range(0, v.shape[1], 128):
    block = v[:, c:c + 128]
    amax = np.abs(block).max(axis=1, keepdims=True)
    e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448)), 0)
    e = np.where(2.0 ** (e - 1) >= amax / 448, e - 1, e)  # log2's rounding at a power of two
    out[:, c:c + 128] = (block / 2.0**e).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0**e
  return out


def run_sharded(fn, *args, devices=4):
  """fn inside a shard_map over `devices` CPU devices, every operand and result split by rows."""
  with jax.set_mesh(mesh_of(devices)):
    args = jax.sharding.reshard(args, (P(AXIS),) * len(args))
    return jax.jit(jax.shard_map(fn, in_specs=(P(AXIS),) * len(args), out_specs=P(AXIS)))(*args)


def rows_of_magnitudes(rng, rows, dtype):
  """Rows of magnitudes 2^-20 to 2^20, one zero block, a block of one value, and rows near 2^100 and
  2^-100. (Not below: XLA's CPU flushes float32's subnormals to zero, values under 2^-126 and a block's
  amax / 448 there, whose exponent then reads 0.)"""
  v = rng.standard_normal((rows, D)) * 2.0 ** rng.integers(-20, 21, (rows, 1))
  v[1, :128] = 0
  v[2, 128:] = 3.0
  v[3] = rng.standard_normal(D) * 2.0**100
  v[4] = rng.standard_normal(D) * 2.0**-100
  return jnp.asarray(v, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gather_carries_each_row_quantized_once(rng, dtype):
  """Every device gets all rows as their e4m3 blocks dequantized, exactly, but a block holding an
  infinity (with or without a NaN), which arrives non-finite, every value of it; the gradient passes
  straight through to the rows' devices, summed over the devices (the plain gather's transpose)."""
  n, per_device = 4, 6
  v = rows_of_magnitudes(rng, n * per_device, dtype).at[7, 3].set(jnp.inf)
  v = v.at[8, 130].set(-jnp.inf).at[8, 131].set(jnp.nan)
  c = jnp.asarray(rng.standard_normal((n * n * per_device, D)), dtype)  # each device's cotangent of all rows
  gathered = np.asarray(run_sharded(lambda v: exchange.gather(v, AXIS), v), np.float64).reshape(n, -1, D)
  assert not np.isfinite(gathered[:, 7, :128]).any() and not np.isfinite(gathered[:, 8, 128:]).any()
  want = e4m3_rows(np.nan_to_num(np.asarray(v, np.float64)).clip(-1e300, 1e300))  # those blocks: above
  gathered[:, 7, :128], gathered[:, 8, 128:] = want[7, :128], want[8, 128:]
  np.testing.assert_array_equal(gathered, np.broadcast_to(want, gathered.shape))
  grad = run_sharded(lambda v, c: jax.grad(lambda v: jnp.sum((exchange.gather(v, AXIS) * c).astype(jnp.float32)))(v),
                     v, c)
  terms = np.asarray(c, np.float64).reshape(n, n * per_device, D)
  bound = (2.0**-7 if dtype == "bfloat16" else 2.0**-21) * np.abs(terms).sum(0)  # sums in another order
  assert np.all(np.abs(np.asarray(grad, np.float64) - terms.sum(0)) <= bound)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_scatter_sum_gathers_its_cotangent_in_e4m3(rng, dtype):
  """The partial sums' reduce-scatter as jax.lax.psum_scatter; its transpose gathers the cotangent's rows
  quantized (float16's as they are: its range holds not every dequantized block)."""
  n, per_device = 4, 6
  v = jnp.asarray(rng.standard_normal((n * n * per_device, D)), dtype)
  c = rows_of_magnitudes(rng, n * per_device, dtype) if dtype != "float16" else jnp.asarray(
      rng.standard_normal((n * per_device, D)), dtype)
  got = run_sharded(lambda v: exchange.scatter_sum(v, AXIS), v)
  want = run_sharded(lambda v: jax.lax.psum_scatter(v, AXIS, tiled=True), v)
  np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
  grad = run_sharded(lambda v, c: jax.grad(lambda v: jnp.sum((exchange.scatter_sum(v, AXIS) * c).astype(
      jnp.float32)))(v), v, c)
  rows = np.asarray(c, np.float64) if dtype == "float16" else e4m3_rows(c)
  np.testing.assert_array_equal(np.asarray(grad, np.float64), np.tile(rows, (n, 1)))


def layer_run(recipe, fp8_exchange, x, dy, seed, devices=8, mesh=None):
  """(y, gradients of x and of the experts) of the MoE layer over `devices` (none: one device, float32,
  without recipe), and its lowered text."""
  fp8 = recipe and jaxmlp.Fp8Recipe(recipe, when="always")
  module = jaxmlp.nnx.MoE(E, D, F, 2, rngs=nnx.Rngs(seed), expert_axis=AXIS if fp8 else None,
                          dtype=jnp.bfloat16 if fp8 else jnp.float32, fp8=fp8, fp8_exchange=fp8_exchange)

  def loss(module, x):
    y, aux = module(x)
    return jnp.sum(y.astype(jnp.float32) * dy) + aux["aux_loss"], y

  step = jax.jit(nnx.grad(loss, argnums=(0, 1), has_aux=True))
  with jax.set_mesh(mesh or mesh_of(devices, axis_type=AxisType.Auto)):
    (grads, dx), y = step(module, x if fp8 else x.astype(jnp.float32))
    text = step.lower(module, x).as_text()
  return {"y": y, "x": dx, **nnx.to_pure_dict(grads)["experts"]}, text


def gathers_bytes(text):
  """The all-gathers of bytes in a lowered step: the tokens' and their output gradients'."""
  return sum("all_gather" in line and "ui8" in line for line in text.splitlines())


@pytest.mark.parametrize("recipe, axis_type", [("tensorwise", AxisType.Auto), ("blockwise", AxisType.Auto),
                                               ("blockwise", AxisType.Explicit)])
def test_fp8_exchange_moves_e4m3_rows(rng, recipe, axis_type):
  """The layer's gathers move bytes with fp8_exchange, 16-bit rows without. Blockwise: y is the layer's
  without the exchange bit for bit (FC1's operand is quantized in the same blocks). Every result as close
  to the float32 layer's as the layer's without the exchange (the gathered output gradient, times the
  router weights, and the tensorwise recipe's operands quantized once more)."""
  seed = int(rng.integers(1 << 30))
  x = jnp.asarray(rng.standard_normal((64, D)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((64, D)), jnp.float32)
  mesh = mesh_of(8, axis_type=axis_type)
  got, text = layer_run(recipe, True, x, dy, seed, mesh=mesh)
  without, text0 = layer_run(recipe, False, x, dy, seed, mesh=mesh)
  exact, _ = layer_run(None, False, x, dy, seed)
  assert gathers_bytes(text) == 2 and gathers_bytes(text0) == 0
  if recipe == "blockwise":
    np.testing.assert_array_equal(np.asarray(got["y"], np.float32), np.asarray(without["y"], np.float32))
  check_as_accurate(got, without, exact)


def check_as_accurate(got, without, exact):
  """Every result of the layer with the e4m3 gathers as close to the float32 layer's as without them."""
  for name, want in exact.items():
    assert np.abs(np.asarray(want)).max() > 0, name
    error, error0 = rel_error(got[name], want), rel_error(without[name], want)
    assert error < 0.12 and error < 1.25 * error0 + 0.01, (name, error, error0)


def test_fp8_exchange_applies_where_the_experts_run_fp8():
  """The modules' fp8_exchange=True takes effect where the experts run their recipe (its `when` at the
  rows a device holds on average: T k / P rows over E / P experts), with the all_gather exchange and
  bfloat16 or float32 tokens of a width in 16-byte e4m3 rows; elsewhere the rows go in their dtype."""
  always = jaxmlp.Fp8Recipe("blockwise", when="always")

  def applies(fp8=always, exchange_="all_gather", dtype=jnp.bfloat16, d=D, tokens=64, asked=True, cached=False,
              chunks=1, d_ff=F):
    return expert_parallel.fp8_exchange_applies(asked, fp8, exchange_, jnp.zeros((tokens, d), dtype), top_k=8,
                                                num_experts=128, devices=4, chunks=chunks, cached=cached,
                                                d_ff=d_ff, gated=True)

  assert applies() and applies(jaxmlp.Fp8Recipe("tensorwise", when="always"), dtype=jnp.float32)
  assert not applies(None) and not applies(asked=False)
  assert not applies(exchange_="ragged_all_to_all")
  assert not applies(dtype=jnp.float16) and not applies(d=24)
  # when="faster": from the recipe's rows per expert on, 32 experts a device, T k / 4 rows
  faster = jaxmlp.Fp8Recipe("blockwise", when="faster")
  tokens = MIN_ROWS_PER_EXPERT["blockwise", False] * 32 * 4 // 8
  assert not applies(faster, tokens=tokens - 4) and applies(faster, tokens=tokens)
  assert applies(faster, tokens=MIN_ROWS_PER_EXPERT["blockwise", True] * 32 * 4 // 8, cached=True)
  # Tensorwise with the weights given, below its rows: where a device's 32 experts hold MIN_WEIGHTS_STREAMED
  # weights, d (2 f + f) each, as the experts' own rule decides
  faster_tw, streamed = jaxmlp.Fp8Recipe("tensorwise", when="faster"), MIN_WEIGHTS_STREAMED["tensorwise"]
  d_ff = -(-streamed // (32 * D * 3))
  assert applies(faster_tw, tokens=64, cached=True, d_ff=d_ff)
  assert not applies(faster_tw, tokens=64, cached=True, d_ff=d_ff - 1)
  assert not applies(faster_tw, tokens=64, d_ff=d_ff)  # the weights quantized in the call: by rows alone
  # in chunks, each chunk's rows (as many as the experts' buffers are expected to hold: _padded)
  assert applies(faster, tokens=2 * tokens, chunks=2) and not applies(faster, tokens=2 * tokens - 8, chunks=2)


def test_fp8_exchange_off_where_the_experts_run_bf16(rng):
  """With when="faster" at a shape below the recipe's rows the experts run in bf16 and the rows travel
  in bf16: the layer's y is that of fp8=None, bit for bit."""
  x = jnp.asarray(rng.standard_normal((64, D)), jnp.bfloat16)
  seed = int(rng.integers(1 << 30))
  make = lambda fp8: jaxmlp.nnx.MoE(E, D, F, 2, rngs=nnx.Rngs(seed), expert_axis=AXIS, dtype=jnp.bfloat16, fp8=fp8)
  forward = jax.jit(lambda module, x: module(x)[0])
  with jax.set_mesh(mesh_of(8, axis_type=AxisType.Auto)):
    faster = make(jaxmlp.Fp8Recipe("blockwise", when="faster"))
    y, want = forward(faster, x), forward(make(None), x)
    assert gathers_bytes(forward.lower(faster, x).as_text()) == 0
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


def test_fp8_exchange_bad_arguments_name_it():
  with pytest.raises(TypeError, match="fp8_exchange: expected True or False, got 'yes'"):
    jaxmlp.nnx.MoE(E, D, F, 2, rngs=nnx.Rngs(0), fp8_exchange="yes")
  with pytest.raises(TypeError, match="fp8_exchange: expected True or False, got 1"):
    jaxmlp.linen.MoE(E, D, F, 2, fp8_exchange=1).init(jax.random.key(0), jnp.zeros((8, D)))
  tokens, logits = jnp.zeros((16, D), jnp.bfloat16), jnp.zeros((16, E))
  call = lambda tokens, **kw: expert_parallel.moe_expert_parallel(
      tokens, logits, {}, lambda p, rows, sizes: rows, expert_axis=AXIS, top_k=2, fp8_exchange=True, **kw)
  with jax.set_mesh(mesh_of(4)):
    with pytest.raises(ValueError, match="fp8_exchange: the 'ragged_all_to_all' exchange"):
      call(tokens, exchange="ragged_all_to_all")
    with pytest.raises(TypeError, match=r"fp8_exchange: e4m3 rows need bfloat16 or float32 tokens .* float16"):
      call(tokens.astype(jnp.float16))


@pytest.mark.gpu
@pytest.mark.skipif(len(gpus()) < 2, reason="needs 2 or more GPUs")
def test_fp8_exchange_over_gpus(rng):
  """Over the GPUs (NCCL's all-gather of bytes, the CUDA recipe): blockwise y equal to the layer's
  without the exchange, bit for bit; every result as close to the float32 layer's (on one GPU)."""
  if not jaxmlp.backend_info().get("cuda", {}).get("fp8_available"):
    pytest.skip("no FP8 on this GPU")
  n, seed = len(gpus()), int(rng.integers(1 << 30))
  x = jnp.asarray(rng.standard_normal((n * 32, D)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((n * 32, D)), jnp.float32)
  mesh = mesh_of(n, gpus())
  got, text = layer_run("blockwise", True, x, dy, seed, mesh=mesh)
  without, _ = layer_run("blockwise", False, x, dy, seed, mesh=mesh)
  exact, _ = layer_run(None, False, x, dy, seed, mesh=mesh)
  assert gathers_bytes(text) == 2
  np.testing.assert_array_equal(np.asarray(got["y"], np.float32), np.asarray(without["y"], np.float32))
  check_as_accurate(got, without, exact)
