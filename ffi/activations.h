// Activation values and exact derivatives in float32, shared by the CPU handlers and the CUDA kernels.
// The formulas match jaxmlp/activations.py, which defines them; the derivatives are written by hand
// (tests compare them with float64 NumPy and with JAX autodiff of the reference).
#pragma once

#include <cmath>
#include <type_traits>

#include "codes.h"

#ifdef __CUDACC__
#define JAXMLP_HD __host__ __device__ __forceinline__
#else
#define JAXMLP_HD inline
#endif

namespace jaxmlp {

// On the GPU through the hardware's fast exponential and reciprocal: a few float32 ulp, far below a 16-bit
// output's rounding, for a fraction of the instructions of the IEEE-exact division and expf.
JAXMLP_HD float Sigmoid(float x) {
#ifdef __CUDA_ARCH__
  return __fdividef(1.0f, 1.0f + __expf(-x));
#else
  return 1.0f / (1.0f + expf(-x));
#endif
}

// One scalar activation (ungated) or the gate nonlinearity of a gated one: value and derivative.
struct ValGrad {
  float val, grad;
};

JAXMLP_HD ValGrad Silu(float x) {
  float s = Sigmoid(x);
  return {x * s, s * (1.0f + x * (1.0f - s))};
}

// 0.5 x (1 + tanh(u)) written as x sigmoid(2u): the same function, but 1 + tanh(u) cancels to 0 in float32
// for x below about -4, where gelu is still ~1e-7, while sigmoid(2u) keeps its relative accuracy there.
JAXMLP_HD ValGrad GeluTanh(float x) {
  constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kA = 0.044715f;
  float s = Sigmoid(2.0f * kC * (x + kA * x * x * x));
  return {x * s, s + 2.0f * x * s * (1.0f - s) * kC * (1.0f + 3.0f * kA * x * x)};
}

// Comparisons written so that NaN passes through (x <= 0 is false for NaN), as in jax.nn.relu: a NaN
// must reach the loss, where a finiteness check can see it, not turn into a finite output.
JAXMLP_HD ValGrad Relu(float x) { return {x <= 0.0f ? 0.0f : x, x > 0.0f ? 1.0f : 0.0f}; }

JAXMLP_HD ValGrad SquaredRelu(float x) { return {x <= 0.0f ? 0.0f : x * x, x > 0.0f ? 2.0f * x : 0.0f}; }

// A gated activation's output and its partial derivatives; for ungated ones `up` is unused, dup = 0.
struct ActGrad {
  float val, dgate, dup;
};

// The output and partial derivatives (ActGrad) of the activation kAct, fixed at compile time so that a
// kernel's inner loop holds no dispatch.
template <Act kAct>
JAXMLP_HD ActGrad ActivationGradOf(const ActParams& p, float gate, float up) {
  if constexpr (kAct == Act::kSwiglu) {
    ValGrad g = Silu(gate);
    return {g.val * up, g.grad * up, g.val};
  } else if constexpr (kAct == Act::kGeglu) {
    ValGrad g = GeluTanh(gate);
    return {g.val * up, g.grad * up, g.val};
  } else if constexpr (kAct == Act::kReglu) {
    ValGrad g = Relu(gate);
    return {g.val * up, g.grad * up, g.val};
  } else if constexpr (kAct == Act::kClampedSwiglu) {
    // GPT-OSS: the gate is clamped above, the linear part to [-limit, limit] and shifted by +1. The
    // gradient passes at the limit itself (as jnp.where(x > limit, limit, x) does), and so does NaN.
    bool gate_free = !(gate > p.limit);
    bool up_free = !(up < -p.limit || up > p.limit);
    float g = gate_free ? gate : p.limit;
    float u = (up_free ? up : (up > 0.0f ? p.limit : -p.limit)) + 1.0f;
    float s = Sigmoid(p.alpha * g);
    float glu = g * s;
    float dglu = s + g * p.alpha * s * (1.0f - s);
    return {glu * u, gate_free ? dglu * u : 0.0f, up_free ? glu : 0.0f};
  } else if constexpr (kAct == Act::kGelu) {
    ValGrad g = GeluTanh(gate);
    return {g.val, g.grad, 0.0f};
  } else if constexpr (kAct == Act::kRelu) {
    ValGrad g = Relu(gate);
    return {g.val, g.grad, 0.0f};
  } else if constexpr (kAct == Act::kSilu) {
    ValGrad g = Silu(gate);
    return {g.val, g.grad, 0.0f};
  } else {
    static_assert(kAct == Act::kSquaredRelu);
    ValGrad g = SquaredRelu(gate);
    return {g.val, g.grad, 0.0f};
  }
}

// Calls fn(std::integral_constant<Act, a>{}): the activation as a compile-time constant. On the host and in
// kernels (the engine's epilogues).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <typename Fn>
JAXMLP_HD decltype(auto) ByAct(Act a, Fn&& fn) {
  switch (a) {
    case Act::kSwiglu: return fn(std::integral_constant<Act, Act::kSwiglu>{});
    case Act::kGeglu: return fn(std::integral_constant<Act, Act::kGeglu>{});
    case Act::kReglu: return fn(std::integral_constant<Act, Act::kReglu>{});
    case Act::kClampedSwiglu: return fn(std::integral_constant<Act, Act::kClampedSwiglu>{});
    case Act::kGelu: return fn(std::integral_constant<Act, Act::kGelu>{});
    case Act::kRelu: return fn(std::integral_constant<Act, Act::kRelu>{});
    case Act::kSilu: return fn(std::integral_constant<Act, Act::kSilu>{});
    case Act::kSquaredRelu:
    default: return fn(std::integral_constant<Act, Act::kSquaredRelu>{});
  }
}

// The same with the activation chosen at run time: the CPU handlers' form.
inline ActGrad ActivationGrad(const ActParams& p, float gate, float up) {
  return ByAct(p.act, [&](auto a) { return ActivationGradOf<decltype(a)::value>(p, gate, up); });
}

}  // namespace jaxmlp
