"""Turns bench.py's results (the dict it writes as bench.json) into Markdown tables and a PNG plot.

Also a command of its own, to rebuild the report from one or more bench.json files, e.g. runs split
over several sessions on one device (later files win for the same shape and routing):

  python benchmarks/report.py run1/bench.json run2/bench.json --out benchmarks/results --write-results
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

IMPL_ORDER = ("jaxmlp", "jaxmlp_fp8", "jaxmlp_fp8_blockwise", "jaxmlp_fp8_cached", "jaxmlp_fp8_blockwise_cached",
              "jaxmlp_fp8_cached_fast_bwd", "ragged_dot", "tokamax", "torch", "torch_compile",
              "torch_fp8", "torch_fp8_compile", "dense")
IMPL_LABELS = {"jaxmlp": "jaxmlp", "jaxmlp_fp8": "jaxmlp FP8 (tensorwise)",
               "jaxmlp_fp8_blockwise": "jaxmlp FP8 (blockwise)",
               "jaxmlp_fp8_cached": "jaxmlp FP8 (tensorwise, weights quantized before the step)",
               "jaxmlp_fp8_blockwise_cached": "jaxmlp FP8 (blockwise, weights quantized before the step)",
               "jaxmlp_fp8_cached_fast_bwd": "jaxmlp FP8 (tensorwise, weights quantized before the step, "
                                             "fast accumulation in the backward)",
               "ragged_dot": "jax.lax.ragged_dot", "tokamax": "tokamax.ragged_dot",
               "torch": "torch._grouped_mm (eager)", "torch_compile": "torch._grouped_mm (torch.compile)",
               "torch_fp8": "torch._scaled_grouped_mm FP8 (row-wise, eager)",
               "torch_fp8_compile": "torch._scaled_grouped_mm FP8 (row-wise, torch.compile)",
               "dense": "dense GEMM (ceiling)"}
COLORS = {"jaxmlp": "#d62728", "jaxmlp_fp8": "#8c1515", "jaxmlp_fp8_blockwise": "#e7969c",
          "jaxmlp_fp8_cached": "#5a0d0d", "jaxmlp_fp8_blockwise_cached": "#c45a62",
          "jaxmlp_fp8_cached_fast_bwd": "#2b0505", "ragged_dot": "#1f77b4",
          "tokamax": "#9467bd", "torch": "#ff7f0e", "torch_compile": "#bcbd22", "torch_fp8": "#8c564b",
          "torch_fp8_compile": "#e377c2", "dense": "#7f7f7f"}
OVERHEAD_TARGET_US = 10.0  # per layer, fwd+bwd, with command buffers, on an H100/H200
OVERHEAD_LABELS = {"jaxmlp": "jaxmlp", "ragged_dot": "jax.lax.ragged_dot",
                   "elementwise": "element-wise layer (for comparison)"}


def flop_unit(mode: str) -> tuple[str, float]:
  # CPU numbers are GFLOP/s; printing them as 0.00x TFLOP/s would hide the digits that matter.
  return ("TFLOP/s", 1e12) if mode == "gpu" else ("GFLOP/s", 1e9)


def rate(case: dict, impl: str, mode: str, scale: float) -> float | None:
  """FLOP rate of a measured implementation, or None if it did not produce a time."""
  t = case["impls"].get(impl, {}).get(mode)
  return case["flops"][mode] / t["s"] / scale if t and "s" in t else None


# FP8 implementations: compared among themselves and with jaxmlp's bf16 path in a section of their own.
FP8_IMPLS = ("jaxmlp_fp8", "jaxmlp_fp8_blockwise", "jaxmlp_fp8_cached", "jaxmlp_fp8_blockwise_cached",
             "jaxmlp_fp8_cached_fast_bwd", "torch_fp8", "torch_fp8_compile")


def speedup(case: dict, impl: str, mode: str, base: str = "jaxmlp") -> float | None:
  """How many times faster `base` (jaxmlp) is than `impl`: time(impl) / time(base)."""
  mine, theirs = (case["impls"].get(i, {}).get(mode) for i in (base, impl))
  if not mine or not theirs or "s" not in mine or "s" not in theirs:
    return None
  return theirs["s"] / mine["s"]


def num(v, fmt=None) -> str:
  """3 significant digits without switching to e-notation for large values (1234, 56.7, 0.0123)."""
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return "—"
  if fmt:
    return fmt.format(v)
  return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _ms(t: dict | None) -> str:
  if not t or "s" not in t:
    return "—"
  return num(t["s"] * 1e3) + (" (1 call, too slow)" if t.get("status") == "too slow" else "")


def _bytes(n: int | None) -> str:
  if n is None:
    return "—"
  return f"{num(n / 2**30)} GiB" if n >= 2**30 else f"{num(n / 2**20)} MiB"


def _impls_present(results: dict, fp8: bool = False) -> list[str]:
  """The measured implementations, in IMPL_ORDER: the 16-bit ones, or (fp8) the FP8 ones."""
  seen = {impl for case in results["cases"] for impl, r in case["impls"].items() if "fwd" in r}
  return [i for i in IMPL_ORDER if i in seen and (i in FP8_IMPLS) == fp8]


def header(results: dict) -> str:
  m = results["meta"]
  v = m["versions"]
  lines = []
  if m["mode"] == "cpu":
    lines.append("> **CPU numbers.** No GPU was visible to JAX, so this ran tiny shapes on the CPU backend, "
                 "where jaxmlp uses simple reference loops. These numbers only show that the benchmark "
                 "works; run it on a GPU for the real comparison.\n")
  lines.append(f"- Device: **{m['device']}** ({m['platform']}), {m['dtype']}, {m['date']}")
  lines.append("- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
  if m.get("cublas"):
    lines.append("- cuBLAS (jaxmlp.backend_info): " + ", ".join(f"{k}={val}" for k, val in m["cublas"].items()))
  if m.get("gemm_path"):
    lines.append(f"- jaxmlp GEMM path: {m['gemm_path']}")
  lines.append(f"- Timing: median of up to {m['timing']['repeats']} device-synchronised samples after "
               f"warm-up, rotating {m['timing']['sets']} input sets; a call slower than "
               f"{m['timing']['max_call_s']} s is timed once and marked too slow.")
  runs = m.get("runs") or [{"command": m["command"], "date": m["date"]}]
  if len(runs) == 1:
    lines.append(f"- Command: `{runs[0]['command']}`")
  else:
    lines.append(f"- Merged from {len(runs)} runs (later runs win for the same shape and routing):")
    lines += [f"  - {r['date']}: `{r['command']}`" for r in runs]
  return "\n".join(lines)


def headline(results: dict) -> str:
  """One sentence per comparison: the range of jaxmlp's fwd+bwd speedup over all cases."""
  lines = []
  for impl in _impls_present(results):
    ratios = [s for c in results["cases"] if (s := speedup(c, impl, "fwd_bwd")) is not None]
    if impl == "jaxmlp" or not ratios:
      continue
    if impl == "dense":
      span = _span([f"{100 * s:.0f}" for s in ratios])
      lines.append(f"- reaches **{span}%** of the throughput of a dense GEMM of the same FLOPs")
    else:
      lines.append(f"- is **{_span([f'{s:.2f}' for s in ratios])}×** as fast as {IMPL_LABELS[impl]}")
  return "jaxmlp, forward + backward, over the shapes below:\n\n" + "\n".join(lines) if lines else ""


def fp8_section(results: dict) -> str:
  """jaxmlp's FP8 implementations against its bf16 path and against the PyTorch FP8 MLP, fwd+bwd."""
  fp8 = _impls_present(results, fp8=True)
  ours = [i for i in fp8 if i.startswith("jaxmlp")]
  if not ours:
    return ""
  unit, scale = flop_unit(results["meta"]["mode"])
  # The PyTorch FP8 MLP to compare with: compiled where it ran, else eager.
  torch_fp8 = next((i for i in ("torch_fp8_compile", "torch_fp8") if i in fp8), None)
  bases = [b for b in ("jaxmlp", torch_fp8) if b in {*fp8, *_impls_present(results)}]
  lines = []
  for impl in ours:
    for base in bases:
      ratios = [s for c in results["cases"] if (s := speedup(c, base, "fwd_bwd", impl)) is not None]
      if ratios:
        lines.append(f"- {IMPL_LABELS[impl]} is **{_span([f'{s:.2f}' for s in ratios])}×** as fast as "
                     f"{IMPL_LABELS[base]}")
  impls = ["jaxmlp"] * ("jaxmlp" in bases) + fp8
  cols = ["shape (E, d, f, M)", "routing"] + [IMPL_LABELS[i] for i in impls]
  rows = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
  ratio_cols = ["shape", "routing"] + [IMPL_LABELS[i] for i in ours]
  ratio_rows = [f"| {' | '.join(ratio_cols)} |", "|" + "---|" * len(ratio_cols)]
  for c in results["cases"]:
    case = [f"{c['shape']} ({c['E']}, {c['d']}, {c['f']}, {c['M']})", c["routing"]]
    rows.append(f"| {' | '.join(case + [num(rate(c, i, 'fwd_bwd', scale)) + _wrong(c, i) for i in impls])} |")
    ratios = [" / ".join(num(speedup(c, b, "fwd_bwd", i), "{:.2f}×") for b in bases) for i in ours]
    ratio_rows.append(f"| {' | '.join([c['shape'], c['routing']] + ratios)} |")
  return ("## FP8\n\nForward + backward:\n\n" + "\n".join(lines) +
          f"\n\nfwd+bwd throughput in {unit} (FLOPs counted as for bf16):\n\n" + "\n".join(rows) +
          "\n\nSpeedup of each jaxmlp FP8 implementation over " + " / ".join(IMPL_LABELS[b] for b in bases) +
          " (time of the other / its time):\n\n" + "\n".join(ratio_rows))


def _span(values: list[str]) -> str:
  """'lo–hi' of formatted numbers, or one number when they agree."""
  lo, hi = min(values, key=float), max(values, key=float)
  return lo if lo == hi else f"{lo}–{hi}"


def summary_table(results: dict) -> str:
  """One row per case: fwd+bwd rate of each implementation and jaxmlp's speedup over each."""
  unit, scale = flop_unit(results["meta"]["mode"])
  impls = _impls_present(results)
  others = [i for i in impls if i not in ("jaxmlp", "dense")]
  cols = ["shape (E, d, f, M)", "routing"] + [f"{IMPL_LABELS[i]}" for i in impls]
  cols += [f"jaxmlp vs {IMPL_LABELS[i]}" for i in others]
  if "dense" in impls:
    cols.append("jaxmlp % of dense")
  rows = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
  for c in results["cases"]:
    cells = [f"{c['shape']} ({c['E']}, {c['d']}, {c['f']}, {c['M']})", c["routing"]]
    cells += [num(rate(c, i, "fwd_bwd", scale)) + _wrong(c, i) for i in impls]
    cells += [num(speedup(c, i, "fwd_bwd"), "{:.2f}×") for i in others]
    if "dense" in impls:
      s = speedup(c, "dense", "fwd_bwd")
      cells.append(num(None if s is None else 100 * s, "{:.0f}%"))
    rows.append(f"| {' | '.join(cells)} |")
  return f"fwd+bwd throughput in {unit} (higher is better) and jaxmlp's speedup (time of the other / " \
         f"time of jaxmlp):\n\n" + "\n".join(rows)


def _wrong(case: dict, impl: str) -> str:
  check = case["impls"].get(impl, {}).get("check") or {}
  return " (WRONG)" if check.get("ok") is False else ""


def detail_table(results: dict) -> str:
  unit, scale = flop_unit(results["meta"]["mode"])
  cols = ["shape", "routing", "implementation", "fwd ms", f"fwd {unit}", "fwd+bwd ms", f"fwd+bwd {unit}",
          "jaxmlp speedup fwd", "jaxmlp speedup fwd+bwd", "fwd+bwd peak memory", "check (rel. err.)"]
  rows = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
  for c in results["cases"]:
    for impl in IMPL_ORDER:
      r = c["impls"].get(impl)
      if r is None or r.get("status") == "skipped":
        continue
      if r.get("status") == "error":
        rows.append(f"| {c['shape']} | {c['routing']} | {IMPL_LABELS[impl]} | error: {_cell(r['error'])} |"
                    + " |" * (len(cols) - 4))
        continue
      cells = [c["shape"], c["routing"], IMPL_LABELS[impl],
               _ms(r.get("fwd")), num(rate(c, impl, "fwd", scale)),
               _ms(r.get("fwd_bwd")), num(rate(c, impl, "fwd_bwd", scale)),
               "—" if impl == "jaxmlp" else num(speedup(c, impl, "fwd"), "{:.2f}×"),
               "—" if impl == "jaxmlp" else num(speedup(c, impl, "fwd_bwd"), "{:.2f}×"),
               _bytes(r.get("peak_bytes")), _check(r.get("check"))]
      rows.append(f"| {' | '.join(cells)} |")
  return "\n".join(rows)


def _cell(text: str, limit: int = 100) -> str:
  """An error message fit for one table cell."""
  return " ".join(text.split())[:limit].replace("|", "\\|")


def _check(check: dict | None) -> str:
  if check is None:
    return "—"
  if "note" in check:
    return check["note"]
  text = f"{check['max']:.1e}" + ("" if check["ok"] else " **FAILED**")
  if check.get("against", "jaxmlp.reference") != "jaxmlp.reference":
    text += " (vs per-expert loop)"
  return text


def overhead_table(results: dict) -> str:
  ov = results.get("overhead")
  if not ov:
    return ""
  cfg = ov["config"]
  gpu = results["meta"]["mode"] == "gpu"
  cols = ["implementation", "command buffers", "fwd µs/layer", "fwd+bwd µs/layer"]
  if gpu:
    cols += ["host µs/layer: fwd", "host µs/layer: train step",
             f"≤ {OVERHEAD_TARGET_US:g} µs/layer: fwd+bwd / host train step"]
  rows = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
  for name, v in ov["variants"].items():
    if "error" in v:
      rows.append(f"| all | {name} | error: {_cell(v['error'])} |" + " |" * (len(cols) - 3))
      continue
    for impl in [i for i in OVERHEAD_LABELS if i in v]:
      r = v[impl]
      setting = name + (f" (`{v['flag']}`)" if v["flag"] else "")
      cells = [OVERHEAD_LABELS[impl], setting, num(r["fwd"]["us_per_layer"]), num(r["fwd_bwd"]["us_per_layer"])]
      if gpu:
        # Runs from before the host time was measured have neither it nor the train step.
        host = [r.get(mode, {}).get("host", {}).get("us_per_layer") for mode in ("fwd", "train_step")]
        met = lambda us: "—" if us is None else "yes" if us <= OVERHEAD_TARGET_US else "no"
        cells += [num(host[0]), num(host[1]), f"{met(r['fwd_bwd']['us_per_layer'])} / {met(host[1])}"]
      rows.append(f"| {' | '.join(cells)} |")
  text = (f"A jitted stack of {cfg['layers']} MoE MLP layers (E={cfg['E']}, d={cfg['d']}, f={cfg['f']}, "
          f"M={cfg['M']}, {cfg['dtype']}), per layer at steady state. *fwd* and *fwd+bwd* are wall time "
          "per call, calls dispatched back to back: the larger of the host's work and the GPU's.")
  if not gpu:
    return (text + " Command buffers are a GPU feature, so there is one CPU row per implementation.\n\n"
            + "\n".join(rows))
  return (text + " *host* is the host's own time per call, dispatched while the GPU is still busy with "
          "earlier work, so that no dispatch waits for it: the CPU cost of the layer, which the wall time "
          "hides wherever the GPU is slower. The *train step* is what a training loop runs: the loss "
          "<y, dy>, its gradients and an SGD update of the weights in place (donated buffers); *fwd+bwd* "
          "returns every gradient in new buffers. The element-wise layer (`x * w1[0, :, 0] + w2[0, 0]`) "
          "shows what JAX and XLA cost for the same programs when the layers are next to nothing. Target "
          f"for jaxmlp with command buffers: ≤ {OVERHEAD_TARGET_US:g} µs per layer fwd+bwd.\n\n" + "\n".join(rows))


def skipped_notes(results: dict) -> str:
  notes = {f"{IMPL_LABELS[impl]}: {r['reason']}" for case in results["cases"]
           for impl, r in case["impls"].items() if r.get("status") == "skipped"}
  return "\n".join(f"- Not measured: {n}" for n in sorted(notes))


def failed_checks(results: dict) -> list[str]:
  return [f"{c['shape']}/{c['routing']}/{impl}: relative error {r['check']['max']:.2e}"
          for c in results["cases"] for impl, r in c["impls"].items()
          if r.get("check") and not r["check"].get("ok", True)]


def markdown(results: dict, image: str | None) -> str:
  parts = ["# jaxmlp: grouped MoE MLP benchmark", header(results)]
  if headline(results):
    parts.append(headline(results))
  if image:
    parts.append(f"![fwd+bwd throughput per shape and implementation]({image})")
  parts.append("## Throughput\n\n" + summary_table(results))
  if fp8_section(results):
    parts.append(fp8_section(results))
  parts.append("## Details\n\n" + detail_table(results))
  parts.append("Speedup = time of that implementation / time of jaxmlp (above 1: jaxmlp is faster). "
               "Peak memory: XLA's compiled memory analysis (arguments + outputs + temporaries) for JAX, "
               "torch.cuda.max_memory_allocated for torch, both for one fwd+bwd call with one input set. "
               "Check: largest relative error (Frobenius norm) of y (forward and fwd+bwd), dx, dw1, dw2 against "
               "jaxmlp.reference (torch: against a per-expert float32 loop differentiated by autograd).")
  if results.get("overhead"):
    parts.append("## Host overhead\n\n" + overhead_table(results))
  notes = skipped_notes(results)
  if notes:
    parts.append(notes)
  return "\n\n".join(parts) + "\n"


def plot(results: dict, path, fp8: bool = False) -> tuple[bool, str]:
  """Grouped bars of fwd+bwd throughput per shape and implementation, one panel per routing: the 16-bit
  implementations, or (fp8) the FP8 ones beside jaxmlp's bf16. Returns (written, a line for the log)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False, "matplotlib is not installed: no plot (pip install matplotlib)"
  unit, scale = flop_unit(results["meta"]["mode"])
  impls = _impls_present(results)
  if fp8:
    impls = [i for i in impls if i == "jaxmlp"] + _impls_present(results, fp8=True)
  if not impls:
    return False, "no implementation produced a time: no plot"
  routings = list(dict.fromkeys(c["routing"] for c in results["cases"]))
  shapes = {c["shape"]: f"{c['shape']}\nE={c['E']} d={c['d']}\nf={c['f']} M={c['M']}" for c in results["cases"]}
  # One panel per routing, stacked, so five shapes still fit the width of a README.
  width_in = max(6.0, 2.2 * len(shapes))
  fig, axes = plt.subplots(len(routings), 1, figsize=(width_in, 1.0 + 4.2 * len(routings)),
                           squeeze=False, sharey=True)
  axes = axes[:, 0]
  width = 0.8 / len(impls)
  any_too_slow = False
  for ax, routing in zip(axes, routings):
    by_shape = {c["shape"]: c for c in results["cases"] if c["routing"] == routing}
    for j, impl in enumerate(impls):
      xs, ys, texts = [], [], []
      for i, s in enumerate(shapes):
        v = rate(by_shape[s], impl, "fwd_bwd", scale) if s in by_shape else None
        if v is not None:
          too_slow = by_shape[s]["impls"][impl]["fwd_bwd"].get("status") == "too slow"
          any_too_slow |= too_slow
          xs.append(i + (j - (len(impls) - 1) / 2) * width)
          ys.append(v)
          texts.append(num(v) + ("*" if too_slow else ""))
      bars = ax.bar(xs, ys, width, label=IMPL_LABELS[impl], color=COLORS[impl])
      ax.bar_label(bars, texts, fontsize=7, rotation=90, padding=2)
    ax.set_xticks(range(len(shapes)), list(shapes.values()), fontsize=8)
    ax.set_title(f"{routing} routing")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
  for ax in axes:
    ax.set_ylabel(f"fwd+bwd {unit}\n(higher is better)")
  handles, labels = axes[0].get_legend_handles_labels()
  legend_rows = math.ceil(len(impls) / 3)
  fig.legend(handles, labels, loc="lower center", ncol=min(len(impls), 3), fontsize=9, frameon=False)
  m = results["meta"]
  title = f"SwiGLU MoE expert MLP, forward + backward, {m['dtype']}, on {m['device']} ({m['date'][:10]})"
  if fp8:
    title += "\nFP8 recipes; TFLOP/s counted as the bf16 MLP's FLOPs"
  if m["mode"] == "cpu":
    title += "\nCPU numbers: tiny shapes, only a check that the benchmark runs"
  if any_too_slow:
    title += "\n* timed once: slower than the per-call limit"
  # Wrapped to the figure's width (about 13 characters per inch at 10 pt), so a narrow plot keeps it all.
  fig.suptitle("\n".join(textwrap.fill(line, int(13 * width_in)) for line in title.split("\n")), fontsize=10)
  fig.tight_layout(rect=(0, 0.01 + 0.03 * legend_rows, 1, 1))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return True, f"wrote {path}"


def write_outputs(results: dict, out: Path, write_results: bool) -> None:
  """bench.json, bench.md and bench.png (and bench-fp8.png where FP8 implementations ran) in `out`, the
  Markdown on stdout; with `write_results` also benchmarks/RESULTS.md and RESULTS.png."""
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
  png = out / "bench.png"
  plotted, plot_msg = plot(results, png)
  if not plotted:
    png.unlink(missing_ok=True)  # an older run's plot must not pass for this one's
  md = markdown(results, png.name if plotted else None)
  (out / "bench.md").write_text(md)
  print(md)
  print(f"{plot_msg}\nwrote {out / 'bench.json'} and {out / 'bench.md'}", file=sys.stderr)
  if _impls_present(results, fp8=True):  # the FP8 implementations in their own plot, beside bf16
    print(plot(results, out / "bench-fp8.png", fp8=True)[1], file=sys.stderr)
  if write_results:
    image = None
    if plotted:
      shutil.copyfile(png, HERE / "RESULTS.png")
      image = "RESULTS.png"
    else:
      (HERE / "RESULTS.png").unlink(missing_ok=True)
    (HERE / "RESULTS.md").write_text(markdown(results, image))
    print(f"wrote {HERE / 'RESULTS.md'}" + (f" and {HERE / 'RESULTS.png'}" if image else ""), file=sys.stderr)


def merge(runs: list[dict]) -> dict:
  """One results dict from several runs on the same device, measured the same way; the metadata
  lists each run's command and date."""
  for what in ("device", "dtype", "timing"):
    values = {json.dumps(r["meta"][what], sort_keys=True) for r in runs}
    if len(values) > 1:
      sys.exit(f"refusing to merge runs with different {what}: {', '.join(sorted(values))}")
  meta = dict(runs[-1]["meta"])
  meta["runs"] = [run for r in runs for run in r["meta"].get("runs") or
                  [{"command": r["meta"]["command"], "date": r["meta"]["date"]}]]
  meta["versions"] = {k: v for r in runs for k, v in r["meta"]["versions"].items() if v}
  cases = {(c["shape"], c["routing"]): c for r in runs for c in r["cases"]}
  overhead = [r["overhead"] for r in runs if r.get("overhead")]
  return {"meta": meta, "cases": list(cases.values()), "overhead": overhead[-1] if overhead else None}


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("runs", nargs="+", type=Path, help="bench.json files written by bench.py")
  p.add_argument("--out", type=Path, default=HERE / "results", help="where bench.json/.md/.png go")
  p.add_argument("--write-results", action="store_true",
                 help="also write benchmarks/RESULTS.md and benchmarks/RESULTS.png")
  a = p.parse_args()
  write_outputs(merge([json.loads(path.read_text()) for path in a.runs]), a.out, a.write_results)


if __name__ == "__main__":
  main()
