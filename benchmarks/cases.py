"""What is measured: the MoE shapes, the routing (group sizes) and the FLOP counts.

Plain Python and NumPy only, so the torch subprocess and the driver agree on the same group sizes
without either importing JAX.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  E: int  # experts
  d: int  # model width
  f: int  # expert hidden width (w1 is [E, d, 2f] for SwiGLU)
  M: int  # tokens routed to this layer (rows of x)


# Expert MLP shapes of public MoE models, at a batch of M routed tokens.
GPU_SHAPES = {s.name: s for s in (
    Shape("small", 8, 1024, 2048, 4096),
    Shape("qwen3", 128, 2048, 768, 32768),    # Qwen3-30B-A3B
    Shape("dsv3", 32, 7168, 2048, 32768),     # DeepSeek-V3, 256 experts over 8 devices
    Shape("gptoss", 32, 2880, 2880, 16384),   # gpt-oss-20b
    Shape("mixtral", 8, 4096, 14336, 16384),  # Mixtral 8x7B
)}
# Without a GPU, tiny shapes keep the run on the CPU handlers (OpenBLAS over XLA's CPU thread pool) short.
CPU_SHAPES = {s.name: s for s in (
    Shape("tiny", 4, 64, 128, 256),
    Shape("tiny-wide", 8, 128, 256, 256),
)}
ALL_SHAPES = {**GPU_SHAPES, **CPU_SHAPES}
ROUTINGS = ("balanced", "skewed", "ragged")
DEFAULT_ROUTINGS = ("balanced", "skewed")  # bench.py's, the RESULTS tables' routings
# Largest acceptable relative error against a reference, per dtype: rounding the stored intermediates
# to bf16 gives ~4e-3; a wrong group offset or a missing term gives O(1).
# FP8 (e4m3, 3 mantissa bits) products of bf16 data: ~3-5e-2 against the bf16 reference (tests/test_fp8.py
# bounds it by the recipe's float64 model instead).
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4, "fp8": 1e-1}

CUSTOM_SHAPE = "ExdxfxM (e.g. 128x2048x768x1024: your own E, d, f and M)"


def shape_named(name: str) -> Shape:
  """One of ALL_SHAPES, or a shape of your own written ExdxfxM; ValueError for anything else."""
  if name in ALL_SHAPES:
    return ALL_SHAPES[name]
  sizes = name.split("x")
  if len(sizes) == 4 and all(n.isascii() and n.isdigit() and int(n) > 0 for n in sizes):
    return Shape(name, *map(int, sizes))
  raise ValueError(f"{name!r}: expected one of {', '.join(ALL_SHAPES)} or {CUSTOM_SHAPE}")


def group_sizes(routing: str, E: int, M: int) -> np.ndarray:
  """[E] int32 sizes summing to M. Deterministic, so every implementation and process gets the same."""
  if routing == "balanced":
    sizes = np.full(E, M // E, np.int64)
    sizes[:M % E] += 1  # spread the remainder over the first experts
  elif routing == "ragged":
    # A router's balance: each expert about M / E rows (a load of 1 +- 1/8 at random), so that the groups
    # are not multiples of 16; balanced's are at every reference shape, which takes kernels' aligned fast
    # paths where a router's sizes take their general ones (benchmarks/RESULTS-fp8.md, the tile quantizer
    # under skewed routing).
    rng = np.random.default_rng(1)
    load = 1.0 + rng.uniform(-0.125, 0.125, E)
    sizes = np.floor(load / load.sum() * M).astype(np.int64)
    sizes[:M - sizes.sum()] += 1  # fewer than E rows left over: one more to each of the first experts
  elif routing == "skewed":
    # Zipf-like load (expert of rank r gets ~ 1/r^1.2 of the tokens) in a fixed random expert order,
    # with one expert in eight receiving nothing: routers do leave experts idle, and empty groups are a
    # case every grouped GEMM has to handle.
    rng = np.random.default_rng(0)
    load = 1.0 / np.arange(1, E + 1) ** 1.2
    load[-max(1, E // 8):] = 0.0
    load = load[rng.permutation(E)]
    sizes = np.floor(load / load.sum() * M).astype(np.int64)
    sizes[np.argmax(sizes)] += M - sizes.sum()  # rounding leftovers go to the hottest expert
  else:
    raise ValueError(f"routing {routing!r}: expected one of {ROUTINGS}")
  assert sizes.sum() == M and (sizes >= 0).all()
  return sizes.astype(np.int32)


def flops(shape: Shape, sizes: np.ndarray) -> dict[str, float]:
  """SwiGLU expert MLP FLOPs over the routed rows: FC1 2*M*d*2f + FC2 2*M*f*d = 6*M*d*f forward; the
  backward does two products per forward product, so fwd+bwd is 3x."""
  rows = int(np.sum(sizes))
  fwd = 6.0 * rows * shape.d * shape.f
  return {"fwd": fwd, "fwd_bwd": 3.0 * fwd}
