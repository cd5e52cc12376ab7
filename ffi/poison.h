// The test switch that both backends' handlers honour (Poison, in cpu/buffers.h and for the CUDA handlers).
#pragma once

#include <cstdlib>
#include <string>

namespace jaxmlp {

// JAXMLP_POISON_OUTPUTS=1 (the tests set it): handlers fill every output and intermediate with 0xFF bytes
// (NaN for floats) before computing, so an element the kernels forget to write fails the comparison.
inline bool PoisonOutputs() {
  static const bool poison = [] {
    const char* v = std::getenv("JAXMLP_POISON_OUTPUTS");
    return v && *v && std::string(v) != "0";
  }();
  return poison;
}

}  // namespace jaxmlp
