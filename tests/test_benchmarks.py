"""The benchmark command runs end to end (CPU mode here): tables, JSON and the overhead stack."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


@pytest.mark.full
def test_benchmark_runs_on_the_cpu(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  # A shape of the user's own, written ExdxfxM.
  cmd = [sys.executable, str(BENCH), "--shapes", "4x64x128x200", "--routing", "balanced", "--impls", "jaxmlp,ragged_dot",
         "--repeats", "1", "--budget-s", "0.1", "--layers", "2", "--out", str(tmp_path)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  results = json.loads((tmp_path / "bench.json").read_text())
  assert results["meta"]["mode"] == "cpu"
  (case,) = results["cases"]
  assert (case["shape"], case["E"], case["d"], case["f"], case["M"]) == ("4x64x128x200", 4, 64, 128, 200)
  for impl in ("jaxmlp", "ragged_dot"):
    for mode in ("fwd", "fwd_bwd"):
      assert case["impls"][impl][mode]["s"] > 0
  assert case["impls"]["jaxmlp"]["check"]["ok"]
  (overhead,) = results["overhead"]["variants"].values()
  for impl in ("jaxmlp", "ragged_dot", "elementwise"):
    for mode in ("fwd", "fwd_bwd", "train_step"):
      assert overhead[impl][mode]["us_per_layer"] > 0
      assert "host" not in overhead[impl][mode]  # the host's own time needs a device to hold busy
  md = (tmp_path / "bench.md").read_text()
  assert "## Host overhead" in md and "- Command: `" in md


def test_benchmark_rejects_bad_arguments(tmp_path):
  for args, message in ((["--sets", "0"], "--sets must be at least 1"),
                        (["--shapes", "qwen3,nope"], "--shapes: 'nope': expected one of small"),
                        (["--shapes", "8x64x0x256"], "or ExdxfxM (e.g. 128x2048x768x1024")):
    proc = subprocess.run([sys.executable, str(BENCH), *args, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_routings_sum_to_the_rows_and_ragged_is_no_multiple_of_16(monkeypatch):
  """cases.group_sizes: every routing's sizes are non-negative and sum to M; "ragged" keeps each expert within
  15% of M / E but, unlike "balanced" at the reference shapes, off multiples of 16."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import numpy as np
  import cases

  for shape in cases.GPU_SHAPES:
    s = cases.ALL_SHAPES[shape]
    for routing in cases.ROUTINGS:
      sizes = cases.group_sizes(routing, s.E, s.M)
      assert sizes.sum() == s.M and (sizes >= 0).all() and len(sizes) == s.E, (shape, routing)
    ragged, mean = cases.group_sizes("ragged", s.E, s.M), s.M / s.E
    assert (np.abs(ragged - mean) <= 0.15 * mean).all(), shape
    assert (ragged % 16 != 0).mean() > 0.5 and (cases.group_sizes("balanced", s.E, s.M) % 16 == 0).all(), shape


def test_benchmark_refuses_programs_larger_than_the_device_once(monkeypatch):
  """A program that plans more memory than the device has is refused before XLA's autotuner runs, and
  the refusal is remembered: the second routing of a shape and the reference check do not compile it again."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import gc
  import jax
  import cases
  import jax_impls

  gated = []
  compile_pair = jax_impls.compile_pair
  def counting_compile_pair(fwd, inputs, gs, limit_bytes=None, **kw):
    if limit_bytes is not None:
      gated.append(fwd)
    return compile_pair(fwd, inputs, gs, limit_bytes, **kw)
  monkeypatch.setattr(jax_impls, "compile_pair", counting_compile_pair)
  monkeypatch.setattr(jax_impls, "device_memory_limit", lambda: 1)  # one byte: nothing fits
  monkeypatch.setattr(jax_impls, "_COMPILED", {})

  shape = cases.ALL_SHAPES["tiny"]
  timing = dict(repeats=1, max_call_s=1.0, budget_s=0.1, sets=1)
  reported = []
  arrays_before = {id(a) for a in jax.live_arrays()}
  for routing in cases.ROUTINGS:
    results = jax_impls.run_case(shape, cases.group_sizes(routing, shape.E, shape.M), ["jaxmlp", "ragged_dot"],
                                 "float32", timing, lambda impl, mode, t: reported.append((impl, mode, t)))
    for impl in ("jaxmlp", "ragged_dot"):
      assert results[impl]["status"] == "error"
      assert "MemoryError: fwd needs" in results[impl]["error"] and "JAX may use 0.0 GiB" in results[impl]["error"]
  assert len(gated) == 2, gated  # jaxmlp and ragged_dot, once each over all routings
  assert len(reported) == 2 * 2 * len(cases.ROUTINGS) and all("error" in t for _, _, t in reported)
  # What is remembered of a failure must not keep the case's inputs on the device (an exception's
  # traceback would: on an 80 GB H100 that ran the last shapes out of memory).
  del results
  gc.collect()
  kept = [a.shape for a in jax.live_arrays() if id(a) not in arrays_before]
  assert (shape.E, shape.d, 2 * shape.f) not in kept, kept


def test_benchmark_compiles_programs_that_fit(monkeypatch):
  """Under the memory gate the programs are the benchmark's MLP: checked against the float64 reference."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import jax.numpy as jnp
  import numpy as np
  import jax_impls
  import numpy_reference as ref

  inputs = jax_impls.make_inputs(4, 64, 128, 256, jnp.float32, seed=int(np.random.default_rng().integers(1 << 30)))
  sizes = [100, 0, 56, 90]  # an empty group and 10 padding rows
  gs = jnp.asarray(sizes, jnp.int32)
  fwd, fwd_bwd = jax_impls.compile_pair(jax_impls.forward("jaxmlp"), inputs, gs, limit_bytes=1 << 40)
  x, w1, w2, dy = inputs
  want_y, want = ref.grouped_mlp(x, w1, w2, sizes, "swiglu", dy=dy)
  np.testing.assert_allclose(fwd(x, w1, w2, gs), want_y, rtol=1e-4, atol=1e-4)
  y, *grads = fwd_bwd(x, w1, w2, dy, gs)  # the step returns y, as a layer's caller holds it
  np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-4)
  for got, name in zip(grads, ("x", "w1", "w2")):
    np.testing.assert_allclose(got, want[name], rtol=1e-4, atol=1e-4)


@pytest.mark.full
def test_benchmark_fp8_impls_with_weights_quantized_before_the_step(monkeypatch):
  """The FP8 implementations in bfloat16 (the CPU mode's float32 skips them): each checked against the
  reference, and those that take jaxmlp.fp8_weights as inputs give the errors of those that quantize in
  the step (the same results)."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import cases
  import jax_impls

  shape = cases.ALL_SHAPES["tiny"]
  timing = dict(repeats=1, max_call_s=1.0, budget_s=0.01, sets=1)
  impls = ["jaxmlp_fp8", "jaxmlp_fp8_cached", "jaxmlp_fp8_blockwise", "jaxmlp_fp8_blockwise_cached",
           "jaxmlp_fp8_cached_fast_bwd", "jaxmlp_fp8_default_cached"]
  results = jax_impls.run_case(shape, cases.group_sizes("skewed", shape.E, shape.M), impls, "bfloat16", timing,
                               lambda *_: None)
  for impl in impls:
    assert results[impl]["status"] == "ok" and results[impl]["check"]["ok"], (impl, results[impl])
    assert results[impl]["fwd_bwd"]["s"] > 0
  for recipe in ("jaxmlp_fp8", "jaxmlp_fp8_blockwise"):
    errors = [{k: v for k, v in results[i]["check"].items() if k in ("y", "dx", "dw1", "dw2")}
              for i in (recipe, recipe + "_cached")]
    assert errors[0] == errors[1] and errors[0]["dw1"] > 1e-3, errors


def test_report_gives_each_fp8_implementation_its_speedups(monkeypatch):
  """The FP8 section: every jaxmlp FP8 implementation against jaxmlp bf16 and the compiled PyTorch FP8 MLP."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import report

  times = {"jaxmlp": 2.0, "jaxmlp_fp8": 1.6, "jaxmlp_fp8_cached": 1.25, "torch_fp8_compile": 2.5, "torch_fp8": 5.0}
  case = {"shape": "dsv3", "routing": "balanced", "E": 32, "d": 7168, "f": 2048, "M": 32768,
          "flops": {"fwd": 1e12, "fwd_bwd": 3e12},
          "impls": {i: {"fwd": {"s": t / 3}, "fwd_bwd": {"s": t}, "check": {"ok": True}} for i, t in times.items()}}
  section = report.fp8_section({"meta": {"mode": "gpu"}, "cases": [case]})
  label = report.IMPL_LABELS
  assert f"- {label['jaxmlp_fp8_cached']} is **1.60×** as fast as {label['jaxmlp']}" in section
  assert f"- {label['jaxmlp_fp8']} is **1.56×** as fast as {label['torch_fp8_compile']}" in section
  assert "| dsv3 | balanced | 1.25× / 1.56× | 1.60× / 2.00× |" in section, section


def test_report_plots_the_fp8_implementations_beside_bf16(monkeypatch, tmp_path):
  """bench-fp8.png: the FP8 implementations with jaxmlp bf16; bench.png keeps the 16-bit ones."""
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  from matplotlib.figure import Figure
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import report

  times = {"jaxmlp": 2.0, "jaxmlp_fp8": 1.6, "torch_fp8_compile": 2.5}
  case = {"shape": "dsv3", "routing": "balanced", "E": 32, "d": 7168, "f": 2048, "M": 32768,
          "flops": {"fwd": 1e12, "fwd_bwd": 3e12},
          "impls": {i: {"fwd": {"s": t / 3}, "fwd_bwd": {"s": t}, "check": {"ok": True}} for i, t in times.items()}}
  results = {"meta": {"mode": "gpu", "dtype": "bfloat16", "device": "H100", "date": "2026-11-26"}, "cases": [case]}
  legends = []
  savefig = Figure.savefig
  monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (
      legends.append([t.get_text() for t in fig.legends[0].get_texts()]), savefig(fig, *a, **k)))
  for fp8 in (False, True):
    assert report.plot(results, tmp_path / f"plot-{fp8}.png", fp8=fp8)[0]
  label = report.IMPL_LABELS
  assert legends == [[label["jaxmlp"]], [label["jaxmlp"], label["jaxmlp_fp8"], label["torch_fp8_compile"]]], legends


def test_torch_check_catches_a_wrong_gradient(monkeypatch):
  """torch_mlp.check compares y and every gradient with the float32 loop: right for the real MLP, and
  failing for one whose backward drops the gate's gradient (a forward check alone would pass it)."""
  torch = __import__("pytest").importorskip("torch")
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import torch_mlp

  sizes = [100, 0, 56, 100]
  x, w1, w2, dy = torch_mlp.make_inputs(4, 64, 128, sum(sizes), "cpu", torch.float32, seed=int(torch.seed() % 2**31))
  offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
  errs = torch_mlp.check(torch_mlp.mlp, (x, w1, w2, dy), offs, sizes)
  assert set(errs) == {"y", "y (fwd+bwd)", "dx", "dw1", "dw2"} and max(errs.values()) < 1e-4, errs

  def gate_without_gradient(x, w1, w2, offs):
    f = w2.shape[1]
    h = torch._grouped_mm(x, w1, offs=offs)
    return torch._grouped_mm(torch.nn.functional.silu(h[:, :f].detach()) * h[:, f:], w2, offs=offs)
  errs = torch_mlp.check(gate_without_gradient, (x, w1, w2, dy), offs, sizes)
  assert errs["y"] < 1e-4 and errs["dw1"] > 1e-2, errs


def _emulated_scaled_grouped_mm(calls):
  """torch._scaled_grouped_mm's row-wise FP8 form in float32 on the CPU, with the argument checks of
  PyTorch's CUDA op (aten/src/ATen/native/cuda/GroupedBlas.cpp) and of its kernel's device asserts;
  rows of no group are NaN, as unwritten memory may be. Appends each call's form to `calls`."""
  import torch

  def op(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    e4m3 = torch.float8_e4m3fn
    assert a.dtype == b.dtype == e4m3 and scale_a.dtype == scale_b.dtype == torch.float32
    assert out_dtype == torch.bfloat16 and offs.dtype == torch.int32 and a.dim() == 2
    assert a.stride(-1) == 1 and b.stride(-2) == 1, "mat_a row-major, mat_b the transposed view of a contiguous"
    assert a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    A, B = a.float(), b.float()
    if b.dim() == 3:  # 2D x 3D: groups of a's rows
      assert scale_a.shape == (a.shape[0],) and scale_a.is_contiguous()
      assert scale_b.shape == (b.shape[0], b.shape[2]) and scale_b.stride(1) == 1
      out = torch.full((a.shape[0], b.shape[2]), float("nan"))
      for g, (s, e) in enumerate(zip(starts, ends)):
        out[s:e] = (A[s:e] * scale_a[s:e, None]) @ (B[g] * scale_b[g])
    else:  # 2D x 2D: groups along the contraction, one set of scales per group
      K, N, G = a.shape[0], b.shape[1], len(ends)
      assert scale_a.shape == (K * G,) and scale_b.shape == (N * G,)
      assert all((e - s) % 16 == 0 for s, e in zip(starts[:-1], ends[:-1])), "TMA alignment of fp8 groups"
      out = torch.stack([(A[:, s:e] * scale_a[g * K:(g + 1) * K, None]) @ (B[s:e] * scale_b[g * N:(g + 1) * N])
                         for g, (s, e) in enumerate(zip(starts, ends))])
    calls.append(f"{a.dim()}d-{b.dim()}d")
    return out.to(out_dtype)
  return op


def test_torch_fp8_mlp_on_an_emulated_scaled_grouped_mm(monkeypatch):
  """torch_fp8_mlp's layer on the CPU, its FP8 products emulated: the padding to 16 rows per expert, the
  operands' layouts and scale shapes as torch._scaled_grouped_mm takes them, and y and every gradient
  within the FP8 tolerance of torch_mlp's float32 reference, at unaligned and empty groups. Above 1e-3:
  the operands were quantized to e4m3."""
  torch = __import__("pytest").importorskip("torch")
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import cases
  import torch_fp8_mlp
  import torch_mlp

  calls = []
  monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm(calls), raising=False)
  sizes = [37, 0, 100, 19, 16]
  inputs = torch_mlp.make_inputs(5, 64, 32, sum(sizes), "cpu", torch.bfloat16, seed=int(torch.seed() % 2**31))
  offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
  errs = torch_mlp.check(torch_fp8_mlp.fp8_mlp, inputs, offs, sizes)
  assert set(errs) == {"y", "y (fwd+bwd)", "dx", "dw1", "dw2"}, errs
  assert all(1e-3 < e < cases.TOLERANCE["fp8"] for e in errs.values()), errs
  assert calls == ["2d-3d"] * 4 + ["2d-3d", "2d-2d"] * 2, calls  # y alone, then y and the backward


def test_host_time_discards_samples_that_waited_for_the_device(monkeypatch):
  """timing.host_seconds on a simulated device: each call costs the host 1 s of a fake clock, and the work
  held ahead lasts `hold_s`. A sample counts only if its dispatches ended while that work still ran;
  otherwise the next samples dispatch half as many calls, down to none."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import timing

  clock = [0.0]
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

  def measure(hold_s):
    def call():
      clock[0] += 1.0
    return timing.host_seconds(call, lambda: clock[0] + hold_s, lambda end: clock[0] < end, lambda out: None,
                               calls=8, samples=7)

  assert measure(100.0) == {"s": 1.0, "min_s": 1.0, "samples": 7, "calls_per_sample": 8, "status": "ok"}
  # 1 untimed call + 8 or 4 outlast a hold of 5 s; 1 + 2 do not.
  assert measure(5.0) == {"s": 1.0, "min_s": 1.0, "samples": 7, "calls_per_sample": 2, "status": "ok"}
  assert measure(1.5)["status"] == "not measured"


def test_overhead_train_step_is_one_sgd_step_of_the_stack(monkeypatch, rng):
  """overhead.train_step on jaxmlp (CPU backend, float32, random inputs): the loss <y, dy> of a 2-layer
  stack and the weights after one SGD step, against the float64 NumPy reference chained through the
  layers. The weights are donated; the step returns new ones."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import jax.numpy as jnp
  import numpy as np
  import numpy_reference as ref
  import overhead

  E, d, f, M, lr = 4, 32, 48, 96, 2.0 ** -4
  sizes = [40, 0, 30, 20]  # an empty group and 6 padding rows
  x, dy = rng.standard_normal((M, d)), rng.standard_normal((M, d))
  w1s = [rng.standard_normal((E, d, 2 * f)) / d ** 0.5 for _ in range(2)]
  w2s = [rng.standard_normal((E, f, d)) / f ** 0.5 for _ in range(2)]

  y1 = ref.grouped_mlp(x, w1s[0], w2s[0], sizes, "swiglu")
  y2, g2 = ref.grouped_mlp(y1, w1s[1], w2s[1], sizes, "swiglu", dy=dy)
  _, g1 = ref.grouped_mlp(x, w1s[0], w2s[0], sizes, "swiglu", dy=g2["x"])

  f32 = lambda a: jnp.asarray(a, jnp.float32)
  loss, new_w1s, new_w2s = overhead.train_step("jaxmlp", lr)(
      [f32(w) for w in w1s], [f32(w) for w in w2s], f32(x), f32(dy), jnp.asarray(sizes, jnp.int32))
  # The loss sums 3072 terms that may cancel (to 0.02 where the terms' magnitudes sum to ~2000): its float32
  # error is bounded relative to the terms' magnitudes, not to the sum.
  assert abs(float(loss) - np.vdot(y2, dy)) <= 1e-5 * np.sum(np.abs(y2 * dy)), (float(loss), np.vdot(y2, dy))
  for got, w, g in zip([*new_w1s, *new_w2s], [*w1s, *w2s], [g1["w1"], g2["w1"], g1["w2"], g2["w2"]]):
    np.testing.assert_allclose(np.asarray(got), w - lr * g, rtol=1e-4, atol=1e-5)


def test_kernel_share_summarizes_an_nsight_compute_csv(tmp_path, capsys, monkeypatch):
  """kernel_share.py --summarize: time per kernel of ours (one line each, the rest summed) over the two
  profiled steps, and the second step's kernels in launch order."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import kernel_share

  step = [("jaxmlp::<unnamed>::AbsMaxKernel<__nv_bfloat16, 8>(const T1 *, const long *, long)", "us", "150"),
          ("nvjet_sm90_qqtst_128x128_ptrGroup_TNT", "ms", "1.5"),
          ("jaxmlp::<unnamed>::QuantizeTileKernel<__nv_bfloat16>(const T1 *, long, long)", "ns", "2,000")]
  head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
  rows = [f'"{i}","{name}","gpu__time_duration.sum","{unit}","{value}"'
          for i, (name, unit, value) in enumerate(step + step[::-1])]
  csv = tmp_path / "ncu.csv"
  csv.write_text("==PROF== Connected\n" + "\n".join([head, *rows]) + "\n")
  kernel_share.summarize(kernel_share.ncu_kernels(str(csv)))
  out = capsys.readouterr().out.splitlines()
  assert out[0].split()[:4] == ["cuBLAS", "GEMMs", "and", "XLA"] and "1500.0 us" in out[0]
  assert out[1].startswith("AbsMaxKernel") and "150.0 us" in out[1]
  assert out[2].startswith("QuantizeTileKernel") and "2.0 us" in out[2]
  assert "jaxmlp's own kernels: 152.0 us of 1652.0 us" in out[3]
  assert [line.split(None, 2)[2] for line in out[-3:]] == [
      "QuantizeTileKernel", "nvjet_sm90_qqtst_128x128_ptrGroup_TNT", "AbsMaxKernel"]


def test_kernel_share_reports_the_idle_time_of_a_traced_step(capsys, monkeypatch):
  """kernel_share.py --trace: with the kernels' start times (JAX's profiler), the second step's span and the
  GPU's idle time before each kernel, counted from the latest end before it (kernels may overlap)."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import kernel_share

  def step(t0):  # (name, ns, start ns): a gap of 5 us, then a kernel inside the one before, then 2 us
    return [("gemm_a", 10_000, t0), ("gemm_b", 4_000, t0 + 15_000), ("gemm_c", 1_000, t0 + 16_000),
            ("gemm_d", 3_000, t0 + 21_000)]
  kernel_share.summarize(step(0) + step(100_000))
  out = capsys.readouterr().out.splitlines()
  assert "the second step: 24.0 us from its first kernel's start to its last's end, 18.0 us of kernels" in out[-5]
  assert [line.split()[3:] for line in out[-4:]] == [["0.0", "gemm_a"], ["5.0", "gemm_b"], ["0.0", "gemm_c"],
                                                     ["2.0", "gemm_d"]]


@pytest.mark.full
def test_fp8_quantizers_benchmark_runs_on_the_cpu(tmp_path):
  """benchmarks/fp8_quantizers.py times the blockwise quantizers, the activations' among them, the tensorwise
  weights' and adam's step with the weights' quantization (both recipes) and without it at a shape of the
  user's own (the JAX code alone without a GPU)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, str(BENCH.parent / "fp8_quantizers.py"), "--shape", "2x128x128x256"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line.split() for line in proc.stdout.splitlines()[2:]]
  assert [" ".join(r[:-2]) for r in rows] == ["rows + columns of x", "rows + columns of dh", "a = swiglu(h)",
                                              "dh of swiglu(h), da", "weights w1 (bf16)", "weights w1 (f32)",
                                              "tensorwise w1 (bf16)", "adam + weights w1", "adam + tensorwise w1",
                                              "adam alone (XLA)"]
  assert all(float(r[-2]) > 0 and float(r[-1]) >= 0 for r in rows)  # ms, GB/s (0 at this size)


@pytest.mark.full
def test_fp8_biases_benchmark_runs_on_the_cpu(tmp_path):
  """benchmarks/fp8_biases.py times bf16 and both recipes with and without biases at a shape of the user's
  own."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, str(BENCH.parent / "fp8_biases.py"), "--shape", "2x64x64x128", "--repeats", "3"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line.split() for line in proc.stdout.splitlines()[1:]]
  assert [r[0] for r in rows] == ["bf16", "tensorwise", "blockwise"]
  assert all(float(r[3]) > 0 and float(r[7]) > 0 for r in rows), rows  # ms without and with biases


@pytest.mark.full
def test_fp8_in_turn_benchmark_runs_on_the_cpu(tmp_path):
  """benchmarks/fp8_in_turn.py times bf16 and FP8 steps in turn at a shape of the user's own (the emulation
  without a GPU) and reports each one's speedup over the first; IMPL@PATH is IMPL traced under that GEMM path."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, str(BENCH.parent / "fp8_in_turn.py"), "--shapes", "2x64x64x128", "--impls",
         "jaxmlp,jaxmlp_fp8_cached,jaxmlp_fp8_blockwise,jaxmlp_fp8_cached@cutlass", "--rounds", "2", "--out",
         str(tmp_path)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  times = json.loads((tmp_path / "fp8_in_turn.json").read_text())["shapes"]["2x64x64x128"]
  assert set(times) == {"jaxmlp", "jaxmlp_fp8_cached", "jaxmlp_fp8_blockwise", "jaxmlp_fp8_cached@cutlass"}
  assert all(t["samples"] == 2 and t["s"] > 0 for t in times.values())
  row = proc.stdout.strip().splitlines()[-1].split("|")
  assert row[1].strip() == "2x64x64x128" and row[3].strip().endswith(")") and "x (" in row[3]


def test_measure_alternating_samples_every_call_each_round_in_a_shuffled_order():
  sys.path.insert(0, str(BENCH.parent))
  import timing
  log = []
  calls = {name: (lambda i, name=name: log.append(name)) for name in "abcd"}
  got = timing.measure_alternating(calls, lambda _: None, rounds=6, sample_s=0.0)
  assert set(got) == set("abcd") and all(t["samples"] == 6 and t["calls_per_sample"] == 1 for t in got.values())
  rounds = [log[8 + 4 * r: 12 + 4 * r] for r in range(6)]  # after each call's warm-up and sizing call
  assert all(sorted(r) == list("abcd") for r in rounds)
  assert len({"".join(r) for r in rounds}) > 1  # the order is not fixed


def test_torch_in_turn_says_it_needs_a_gpu(tmp_path):
  """benchmarks/torch_in_turn.py (GPU only) stops with a message, not a traceback, where torch or its CUDA
  device is missing."""
  proc = subprocess.run([sys.executable, str(BENCH.parent / "torch_in_turn.py"), "--shapes", "small"],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""})
  assert proc.returncode != 0 and "(GPU only)" in proc.stderr and "Traceback" not in proc.stderr


def test_ep_overlap_splits_the_nccl_time_into_overlapped_and_exposed(monkeypatch):
  """probes/ep_overlap.py: per GPU and step, an NCCL kernel's time during which another stream's kernel
  ran (overlapped) and the rest (exposed), kernels of one stream merged where they overlap."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  monkeypatch.syspath_prepend(str(BENCH.parent / "probes"))
  import ep_overlap
  # (start, end, stream, name) in ns: over 2 steps, NCCL 0-10 under compute 5-20 and 8-12 (merged: 5 of
  # it overlapped); NCCL 30-40 alone; on GPU 1 NCCL 0-4 inside compute 0-10.
  kernels = {"/device:GPU:0": [(0, 10, 2, "ncclDevKernel_AllGather"), (5, 20, 1, "gemm"), (8, 12, 3, "copy"),
                               (30, 40, 2, "ncclDevKernel_ReduceScatter")],
             "/device:GPU:1": [(0, 4, 2, "ncclKernel"), (0, 10, 1, "gemm")]}
  rows = ep_overlap.summarize(kernels, steps=2)
  assert rows["/device:GPU:0"] == {"nccl ms": 20 / 2 / 1e6, "overlapped ms": 5 / 2 / 1e6,
                                   "exposed ms": 15 / 2 / 1e6, "busy ms": 30 / 2 / 1e6, "nccl kernels": 1,
                                   "streams": 3}
  assert rows["/device:GPU:1"]["exposed ms"] == 0 and rows["/device:GPU:1"]["overlapped ms"] == 4 / 2 / 1e6


def test_fp8_train_step_variants_update_the_master_weights(monkeypatch):
  """fp8_train_step.py's steps, one each from the same state: bf16's update writes the new master weights'
  bfloat16 copy; every step moves the weights by adam's first step (lr g / (|g| + eps): at most lr, and lr
  where the gradient is not tiny), in a direction the variant's own gradient gives (the FP8 variants' differ
  from bf16's: their products ran; the default rule's equals bf16's at this shape), and return y and dx, whose
  products XLA would otherwise drop where a recipe runs them as calls of their own."""
  monkeypatch.syspath_prepend(str(BENCH.parent))
  monkeypatch.delenv("JAXMLP_FP8_WHEN", raising=False)  # the default rule, as the benchmark runs it
  import cases
  import fp8_train_step
  import jax
  import jax.numpy as jnp
  import jax_impls
  import numpy as np

  s = cases.ALL_SHAPES["tiny"]
  x, w1, w2, dy = jax_impls.make_inputs(s.E, s.d, s.f, s.M, jnp.bfloat16, seed=0)
  gs = jnp.asarray(cases.group_sizes("balanced", s.E, s.M))
  masters, opt_state = fp8_train_step.first_state(w1, w2)
  moved = {}
  for variant in fp8_train_step.VARIANTS:
    step, state = fp8_train_step.step_and_state(variant, x, masters, opt_state, dy, gs)
    compiled = step.lower(*state).compile()
    new, outputs = compiled(*state)
    if fp8_train_step.carries_state(variant, s.M, s.E):  # donated: the weights and adam's state, updated in place
      assert all(v.is_deleted() for v in jax.tree.leaves(state[:2])), variant
    assert [o.shape for o in outputs] == [x.shape, x.shape], variant
    if variant == "tensorwise_delayed_adam":  # the next step's history: this step's four amaxes, then zeros
      assert np.all(np.asarray(new[3])[:, 0] > 0) and not np.any(np.asarray(new[3])[:, 1:])
    if variant in fp8_train_step.RECIPES + ("blockwise_adam", "tensorwise_adam", "tensorwise_delayed_adam") \
        and jax.default_backend() == "cpu":
      # the recipe's six products, one call each, all run
      assert compiled.as_text().count('custom_call_target="jaxmlp_gemm"') == 6, variant
    if variant == "bf16":
      for k in ("w1", "w2"):
        np.testing.assert_array_equal(np.asarray(new[2][k]), np.asarray(new[0][k].astype(jnp.bfloat16)), err_msg=k)
    moved[variant] = {k: np.asarray(new[0][k], np.float64) - np.asarray(masters[k], np.float64) for k in masters}
    for k, delta in moved[variant].items():
      lr = fp8_train_step.LEARNING_RATE
      assert np.all(np.abs(delta) <= lr * 1.001) and abs(np.median(np.abs(delta)) - lr) < 1e-3 * lr, (variant, k)
  for variant in fp8_train_step.RECIPES:
    assert any(np.any(np.sign(moved[variant][k]) != np.sign(moved["bf16"][k])) for k in masters), variant
  # By the default rule 64 rows per expert run in bf16, and the step is bf16's: the same update.
  defaults = ("blockwise_adam_default", "tensorwise_adam_default")
  for variant in defaults:
    assert not fp8_train_step.carries_state(variant, s.M, s.E)
    for k in masters:
      np.testing.assert_array_equal(moved[variant][k], moved["bf16"][k], err_msg=(variant, k))
  monkeypatch.setenv("JAXMLP_FP8_WHEN", "always")  # where the rule runs FP8: RECIPE_adam's step
  assert all(fp8_train_step.carries_state(variant, s.M, s.E) for variant in defaults)
