// The error helpers of alignopsd._C: fail(parts...) raises ValueError in Python (std::invalid_argument through
// pybind11) with the parts streamed into one message that names the culprit; check_reach refuses sizes and strides
// that would read or write past a buffer the caller passed by address.

#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace alignopsd_c {

template <typename... Args>
[[noreturn]] inline void fail(Args&&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw std::invalid_argument(os.str());
}

// The buffer `name` holds `elements` elements from its address on; a strided view of it with the given (size,
// stride) pairs (sizes >= 1, strides >= 0, in elements) and `row` contiguous elements last reaches
// sum((size - 1) * stride) + row of them: fail unless that fits.
inline void check_reach(const char* name, int64_t elements, std::initializer_list<std::pair<int64_t, int64_t>> dims,
                        int64_t row) {
  int64_t reach = row;
  for (const auto& [size, stride] : dims) {
    if (stride < 0) fail(name, ": negative stride ", stride);
    if (size < 1) return;  // an empty view reads nothing
    reach += (size - 1) * stride;
  }
  if (reach > elements)
    fail(name, ": the sizes and strides given reach ", reach, " elements, the buffer holds ", elements);
}

}  // namespace alignopsd_c
