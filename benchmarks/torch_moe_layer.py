"""The PyTorch MoE layer built the usual way, part by part, fwd+bwd (autograd), for moe_layer.py: router
(float32 logits, softmax, top-k, renormalised), dispatch (argsort of the choices, index_select of the
token rows), the expert MLP (torch_mlp.mlp over torch._grouped_mm), combine (the rows weighted, then
index_add into float32 tokens), and the whole layer. Same shapes and random routing as the JAX side.

Run by moe_layer.py in its own process; prints one JSON object on stdout.

  python benchmarks/torch_moe_layer.py --T 8192 --d 2048 --E 128 --k 8 --f 768
"""
from __future__ import annotations

import argparse
import json

import torch

from timing import measure
from torch_mlp import mlp


def router(x, wr, k):
  scores = torch.softmax(x.float() @ wr, dim=-1)
  weights, experts = torch.topk(scores, k, dim=-1)
  return weights / weights.sum(-1, keepdim=True), experts


def dispatch(x, weights, experts, E):
  """Choice-major order, as the JAX side (first choices first); stable, so ties keep token order."""
  T = x.shape[0]
  flat = experts.t().reshape(-1)
  order = torch.argsort(flat, stable=True)
  token = order % T
  offs = torch.bincount(flat, minlength=E).cumsum(0, dtype=torch.int32)
  return x.index_select(0, token), weights.t().reshape(-1)[order], token, offs


def combine(y_rows, scales, token, T):
  out = torch.zeros(T, y_rows.shape[1], device=y_rows.device, dtype=torch.float32)
  return out.index_add(0, token, y_rows.float() * scales[:, None]).to(y_rows.dtype)


def layer(x, wr, w1, w2, k):
  weights, experts = router(x, wr, k)
  rows, scales, token, offs = dispatch(x, weights, experts, w1.shape[0])
  return combine(mlp(rows, w1, w2, offs), scales, token, x.shape[0])


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  for name in ("T", "d", "E", "k", "f"):
    p.add_argument(f"--{name}", type=int, required=True)
  p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--budget-s", type=float, default=5.0)
  a = p.parse_args()
  result = {"versions": {"torch": torch.__version__, "torch_cuda": torch.version.cuda}}
  cuda = a.device == "cuda"
  if cuda and not torch.cuda.is_available():
    print(json.dumps({**result, "status": "skipped", "reason": "torch sees no CUDA device"}))
    return
  dtype = torch.bfloat16 if cuda else torch.float32
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  gen = torch.Generator(device=a.device).manual_seed(0)
  randn = lambda *shape, scale=1.0: torch.randn(*shape, device=a.device, generator=gen) * scale
  x = randn(a.T, a.d).to(dtype).requires_grad_()
  wr = randn(a.d, a.E, scale=a.d ** -0.5).requires_grad_()
  w1 = randn(a.E, a.d, 2 * a.f, scale=a.d ** -0.5).to(dtype).requires_grad_()
  w2 = randn(a.E, a.f, a.d, scale=a.f ** -0.5).to(dtype).requires_grad_()
  dy = randn(a.T, a.d).to(dtype)

  with torch.no_grad():  # each part's inputs, from the layer's own forward
    weights, experts = router(x, wr, a.k)
    rows, scales, token, offs = dispatch(x, weights, experts, a.E)
    y_rows = mlp(rows, w1, w2, offs)
  leaf = lambda t: t.detach().requires_grad_()
  weights, rows, scales, y_rows = leaf(weights), leaf(rows), leaf(scales), leaf(y_rows)

  def step(out, inputs, cotangents):
    outs = out if isinstance(out, tuple) else (out,)
    return torch.autograd.grad(outs, inputs, grad_outputs=cotangents)

  parts = {
      "router": lambda: step(router(x, wr, a.k)[0], (x, wr), torch.ones_like(weights)),
      "dispatch": lambda: step(dispatch(x, weights, experts, a.E)[:2], (x, weights),
                               (torch.ones_like(rows), torch.ones_like(scales))),
      "mlp": lambda: step(mlp(rows, w1, w2, offs), (rows, w1, w2), torch.ones_like(y_rows)),
      "combine": lambda: step(combine(y_rows, scales, token, a.T), (y_rows, scales), dy),
      "layer": lambda: step(layer(x, wr, w1, w2, a.k), (x, wr, w1, w2), dy),
  }
  timing = dict(repeats=a.repeats, max_call_s=5.0, budget_s=a.budget_s)
  for name, run in parts.items():
    result[name] = measure(lambda i: run(), lambda _: sync(), **timing)
  result["status"] = "ok"
  print(json.dumps(result))


if __name__ == "__main__":
  main()
