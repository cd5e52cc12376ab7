// Activation values and exact derivatives in float32, shared by the CPU handlers and the CUDA kernels.
// The formulas match jaxmlp/activations.py, which defines them; the derivatives are written by hand
// (tests compare them with float64 NumPy and with JAX autodiff of the reference).
#pragma once

#include <cmath>

#include "common.h"

#ifdef __CUDACC__
#define JAXMLP_HD __host__ __device__ __forceinline__
#else
#define JAXMLP_HD inline
#endif

namespace jaxmlp {

JAXMLP_HD float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// One scalar activation (ungated) or the gate nonlinearity of a gated one: value and derivative.
struct ValGrad {
  float val, grad;
};

JAXMLP_HD ValGrad Silu(float x) {
  float s = Sigmoid(x);
  return {x * s, s * (1.0f + x * (1.0f - s))};
}

JAXMLP_HD ValGrad GeluTanh(float x) {
  constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kA = 0.044715f;
  float t = tanhf(kC * (x + kA * x * x * x));
  return {0.5f * x * (1.0f + t), 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kC * (1.0f + 3.0f * kA * x * x)};
}

JAXMLP_HD ValGrad Relu(float x) { return {x > 0.0f ? x : 0.0f, x > 0.0f ? 1.0f : 0.0f}; }

JAXMLP_HD ValGrad SquaredRelu(float x) { return {x > 0.0f ? x * x : 0.0f, x > 0.0f ? 2.0f * x : 0.0f}; }

// A gated activation's output and its partial derivatives; for ungated ones `up` is unused, dup = 0.
struct ActGrad {
  float val, dgate, dup;
};

JAXMLP_HD ActGrad ActivationGrad(const ActParams& p, float gate, float up) {
  switch (p.act) {
    case Act::kSwiglu: {
      ValGrad g = Silu(gate);
      return {g.val * up, g.grad * up, g.val};
    }
    case Act::kGeglu: {
      ValGrad g = GeluTanh(gate);
      return {g.val * up, g.grad * up, g.val};
    }
    case Act::kReglu: {
      ValGrad g = Relu(gate);
      return {g.val * up, g.grad * up, g.val};
    }
    case Act::kClampedSwiglu: {
      // GPT-OSS: the gate is clamped above, the linear part to [-limit, limit] and shifted by +1. The
      // gradient passes at the limit itself (as jnp.where(x > limit, limit, x) does).
      bool gate_free = gate <= p.limit;
      bool up_free = up >= -p.limit && up <= p.limit;
      float g = gate_free ? gate : p.limit;
      float u = (up_free ? up : (up > 0.0f ? p.limit : -p.limit)) + 1.0f;
      float s = Sigmoid(p.alpha * g);
      float glu = g * s;
      float dglu = s + g * p.alpha * s * (1.0f - s);
      return {glu * u, gate_free ? dglu * u : 0.0f, up_free ? glu : 0.0f};
    }
    case Act::kGelu: {
      ValGrad g = GeluTanh(gate);
      return {g.val, g.grad, 0.0f};
    }
    case Act::kRelu: {
      ValGrad g = Relu(gate);
      return {g.val, g.grad, 0.0f};
    }
    case Act::kSilu: {
      ValGrad g = Silu(gate);
      return {g.val, g.grad, 0.0f};
    }
    case Act::kSquaredRelu:
    default: {
      ValGrad g = SquaredRelu(gate);
      return {g.val, g.grad, 0.0f};
    }
  }
}

}  // namespace jaxmlp
