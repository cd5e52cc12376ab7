// CPU handler: the router's top-k selection per row (ffi/top_k.h has the order it selects in).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "top_k.h"
#include "cpu/buffers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {
namespace {

using ffi::Error;
using ffi::Result;

Error TopK(AnyBuffer scores, Result<AnyBuffer> values, Result<AnyBuffer> indices) {
  TopKDims m;
  JAXMLP_RETURN_IF_ERROR(CheckTopK(scores, *values, *indices, &m));
  Poison({&*values, &*indices});
  const float* s = static_cast<const float*>(scores.untyped_data());
  auto* v = static_cast<float*>(values->untyped_data());
  auto* idx = static_cast<int32_t*>(indices->untyped_data());
  std::vector<int64_t> keys(m.E);
  for (int64_t t = 0; t < m.T; ++t) {
    for (int64_t e = 0; e < m.E; ++e) keys[e] = TopKKey(s[t * m.E + e], e);
    std::partial_sort(keys.begin(), keys.begin() + m.k, keys.end(), std::greater<int64_t>());
    for (int64_t j = 0; j < m.k; ++j) {
      idx[t * m.k + j] = int32_t(TopKIndexOf(keys[j]));
      v[t * m.k + j] = TopKScoreOf(keys[j]);
    }
  }
  return Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopKCpu, TopK,
                              ffi::Ffi::Bind()
                                  .Arg<AnyBuffer>()    // scores
                                  .Ret<AnyBuffer>()    // values
                                  .Ret<AnyBuffer>());  // indices

}  // namespace jaxmlp
