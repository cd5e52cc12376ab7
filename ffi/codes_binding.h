// The codes of codes.h as Python enums (enum.IntEnum: int() gives the value), their members spelled as
// the Python side spells them: Act.swiglu, GemmOp.tn_padded, DType.bfloat16. Header-only, so that any
// extension module can bind them; jaxmlp._cpu (always built) does.
#pragma once

#include <nanobind/nanobind.h>

#include "codes.h"

namespace jaxmlp {

inline void BindCodes(nanobind::module_& m) {
  namespace nb = nanobind;
  static_assert(int(Act::kCount) == 8, "a new activation needs its member here");
  nb::enum_<Act>(m, "Act", nb::is_arithmetic(), "The \"activation\" attribute: jaxmlp/activations.py NAMES.")
      .value("swiglu", Act::kSwiglu)
      .value("geglu", Act::kGeglu)
      .value("reglu", Act::kReglu)
      .value("gelu", Act::kGelu)
      .value("relu", Act::kRelu)
      .value("silu", Act::kSilu)
      .value("squared_relu", Act::kSquaredRelu)
      .value("clamped_swiglu", Act::kClampedSwiglu);
  nb::enum_<GemmOp>(m, "GemmOp", nb::is_arithmetic(), "The \"op\" attribute of the grouped products.")
      .value("nn", GemmOp::kNN)
      .value("nt", GemmOp::kNT)
      .value("tn", GemmOp::kTN)
      .value("tn_padded", GemmOp::kTNPadded);
  nb::enum_<DType>(m, "DType", nb::is_arithmetic(), "The dtype argument of jaxmlp._cuda's workspace sizes.")
      .value("float32", DType::kFloat32)
      .value("bfloat16", DType::kBfloat16)
      .value("float16", DType::kFloat16);
}

}  // namespace jaxmlp
