// The error helper of alignopsd._C: fail(parts...) raises ValueError in Python (std::invalid_argument through
// pybind11) with the parts streamed into one message that names the culprit.

#pragma once

#include <sstream>
#include <stdexcept>

namespace alignopsd_c {

template <typename... Args>
[[noreturn]] inline void fail(Args&&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw std::invalid_argument(os.str());
}

}  // namespace alignopsd_c
