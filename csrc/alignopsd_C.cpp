// alignopsd._C: C++ CPU paths for the sequential parts of Mechanism 2 (ALGORITHM.md §3.5, §3.8).
//
// segment_batch   segmentation of ALL trajectories of a batch in one call: strongest-first semantic
//                 boundaries (d > tau, strict), then max-length repair (correspondence-guided fallback
//                 with d >= tau_min, else the forced boundary closest to the midpoint).
// project_batch   box projection with budget conservation of every trajectory in one call:
//                 argmin sum c (x - h)^2  s.t. lo <= x <= hi, sum c x = sum c.
//
// Both mirror the Python reference in alignopsd/credit.py operation by operation so that results are
// bit-identical:
//   * distances d arrive as float32 and are compared as double (float -> double is exact; Python does
//     the same through float(d)); tau, tau_min, lo, hi, tol are double.
//   * the projection works in float64 (double): bisection on lambda to 1e-7 * max(N, 1) needs more
//     than float32's 24 bits at N ~ 25,000 tokens. Every sum is a plain left-to-right accumulation
//     starting at 0.0 (the Python path uses a sequential cumulative sum); every other step is one
//     IEEE operation per element. Build with -ffp-contract=off so no multiply-add is fused.
// Every input is checked; errors raise ValueError naming the argument (std::invalid_argument).
// Layout: K = total length of the flat per-turn (or per-token) arrays, T = number of trajectories,
// offsets[T+1] = start of each trajectory in the flat arrays (offsets[0] = 0, offsets[T] = K).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "errors.h"

namespace py = pybind11;

namespace {

using alignopsd_c::fail;

// A 1-D C-contiguous numpy array of exactly dtype T.
template <typename T>
py::array_t<T, py::array::c_style> check_array(const py::handle& obj, const char* name, const char* dtype_name) {
  if (!py::isinstance<py::array>(obj)) {
    fail(name, ": expected a numpy array of ", dtype_name, ", got ", std::string(py::str(py::type::of(obj))));
  }
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!py::isinstance<py::array_t<T, py::array::c_style>>(arr)) {
    fail(name, ": expected a C-contiguous ", dtype_name, " array, got dtype ", std::string(py::str(arr.dtype())),
         arr.ndim() == 1 ? "" : " (or not contiguous)");
  }
  if (arr.ndim() != 1) fail(name, ": expected a 1-D array, got ", arr.ndim(), " dimensions");
  return py::reinterpret_borrow<py::array_t<T, py::array::c_style>>(arr);
}

// offsets: int64 [T+1], 0 = o[0] <= o[1] <= ... <= o[T] = K.
std::vector<int64_t> check_offsets(const py::handle& obj, int64_t k) {
  auto arr = check_array<int64_t>(obj, "offsets", "int64");
  const int64_t n = arr.shape(0);
  if (n < 1) fail("offsets: expected at least one entry (T+1 with T >= 0), got 0");
  const int64_t* o = arr.data();
  if (o[0] != 0) fail("offsets: must start at 0, got ", o[0]);
  for (int64_t i = 1; i < n; ++i) {
    if (o[i] < o[i - 1]) fail("offsets: must be non-decreasing; offsets[", i, "] = ", o[i], " < ", o[i - 1]);
  }
  if (o[n - 1] != k) fail("offsets: last entry must equal the flat length ", k, ", got ", o[n - 1]);
  return std::vector<int64_t>(o, o + n);
}

void check_length(int64_t got, int64_t want, const char* name, const char* like) {
  if (got != want) fail(name, ": expected length ", want, " like ", like, ", got ", got);
}

// ---------------------------------------------------------------------------------------------------
// Segmentation of one trajectory (local positions 0..n-1). kinds: 1 semantic, 2 guided, 3 forced.
// ---------------------------------------------------------------------------------------------------
struct Boundary {
  int64_t pos;
  int8_t kind;
};

void insert_sorted(std::vector<int64_t>& b, int64_t p) { b.insert(std::upper_bound(b.begin(), b.end(), p), p); }

void repair(const float* d, const bool* valid, int64_t n, int64_t min_len, int64_t max_len, double tau_min,
            std::vector<int64_t>& bnd, std::vector<Boundary>& out) {
  (void)n;
  while (true) {
    size_t gi = 0;
    bool found = false;
    for (; gi + 1 < bnd.size(); ++gi) {
      if (bnd[gi + 1] - bnd[gi] > max_len) {
        found = true;
        break;
      }
    }
    if (!found) return;
    const int64_t l = bnd[gi], r = bnd[gi + 1];
    int64_t best = -1;
    for (int64_t p = l + min_len; p <= r - min_len; ++p) {
      if (valid[p] && static_cast<double>(d[p]) >= tau_min) {
        if (best < 0 || d[p] > d[best]) best = p;  // strict: ties keep the smaller position
      }
    }
    int8_t kind = 2;
    if (best < 0) {
      kind = 3;
      const double mid = static_cast<double>(l + r) / 2.0;
      double best_dist = std::numeric_limits<double>::infinity();
      for (int64_t p = l + min_len; p <= r - min_len; ++p) {
        const double dist = std::fabs(static_cast<double>(p) - mid);
        if (dist < best_dist) {
          best_dist = dist;
          best = p;
        }
      }
    }
    insert_sorted(bnd, best);
    out.push_back({best, kind});
  }
}

void segment_one(const float* d, const bool* valid, int64_t n, double tau, int64_t min_len, int64_t max_len,
                 double tau_min, std::vector<Boundary>& out) {
  std::vector<int64_t> bnd = {0, n};
  std::vector<int64_t> cand;
  for (int64_t p = 1; p < n; ++p) {
    if (valid[p] && static_cast<double>(d[p]) > tau) cand.push_back(p);
  }
  std::sort(cand.begin(), cand.end(), [d](int64_t a, int64_t b) {
    if (d[a] != d[b]) return d[a] > d[b];
    return a < b;
  });
  for (int64_t p : cand) {
    auto it = std::upper_bound(bnd.begin(), bnd.end(), p);
    const int64_t right = *it;
    const int64_t left = *(it - 1);
    if (p - left >= min_len && right - p >= min_len) {
      bnd.insert(it, p);
      out.push_back({p, 1});
    }
  }
  repair(d, valid, n, min_len, max_len, tau_min, bnd, out);
}

py::tuple segment_batch(const py::handle& d_obj, const py::handle& valid_obj, const py::handle& offsets_obj,
                        double tau, int64_t min_len, int64_t max_len, double tau_min) {
  auto d_arr = check_array<float>(d_obj, "d", "float32");
  auto v_arr = check_array<bool>(valid_obj, "boundary_valid", "bool");
  const int64_t k = d_arr.shape(0);
  check_length(v_arr.shape(0), k, "boundary_valid", "d");
  const std::vector<int64_t> off = check_offsets(offsets_obj, k);
  if (std::isnan(tau) || tau == -std::numeric_limits<double>::infinity()) {
    fail("tau: expected a real number or +inf, got ", tau);
  }
  if (min_len < 1) fail("min_len: must be >= 1, got ", min_len);
  if (max_len < 2 * min_len - 1) fail("max_len: must be >= 2*min_len - 1 = ", 2 * min_len - 1, ", got ", max_len);
  if (!std::isfinite(tau_min)) fail("tau_min: expected a finite number, got ", tau_min);
  const float* d = d_arr.data();
  const bool* valid = v_arr.data();
  for (int64_t i = 0; i < k; ++i) {
    if (!std::isfinite(d[i])) fail("d: non-finite value at flat position ", i);
  }
  const int64_t t = static_cast<int64_t>(off.size()) - 1;
  std::vector<int64_t> pos;
  std::vector<int8_t> kinds;
  std::vector<int64_t> bo(static_cast<size_t>(t) + 1, 0);
  {
    py::gil_scoped_release release;
    std::vector<Boundary> buf;
    for (int64_t j = 0; j < t; ++j) {
      const int64_t s = off[j], n = off[j + 1] - off[j];
      buf.clear();
      segment_one(d + s, valid + s, n, tau, min_len, max_len, tau_min, buf);
      std::sort(buf.begin(), buf.end(), [](const Boundary& a, const Boundary& b) { return a.pos < b.pos; });
      for (const Boundary& b : buf) {
        pos.push_back(b.pos);
        kinds.push_back(b.kind);
      }
      bo[j + 1] = static_cast<int64_t>(pos.size());
    }
  }
  py::array_t<int64_t> pos_out(static_cast<py::ssize_t>(pos.size()));
  py::array_t<int8_t> kind_out(static_cast<py::ssize_t>(kinds.size()));
  py::array_t<int64_t> bo_out(static_cast<py::ssize_t>(bo.size()));
  std::copy(pos.begin(), pos.end(), pos_out.mutable_data());
  std::copy(kinds.begin(), kinds.end(), kind_out.mutable_data());
  std::copy(bo.begin(), bo.end(), bo_out.mutable_data());
  return py::make_tuple(pos_out, kind_out, bo_out);
}

// ---------------------------------------------------------------------------------------------------
// Box projection of one trajectory (§3.8), float64 throughout, sequential sums.
// Returns 0 on success; on failure writes a message and returns 1.
// ---------------------------------------------------------------------------------------------------
int project_one(const double* h, const double* c, int64_t n, double lo, double hi, double tol, double* x,
                std::string& err) {
  double total = 0.0;
  double budget = 0.0;
  for (int64_t i = 0; i < n; ++i) total += c[i];
  for (int64_t i = 0; i < n; ++i) budget += c[i] * h[i];
  const double eps32 = static_cast<double>(FLT_EPSILON);
  const double allowed = std::max(std::max(tol * total, 32.0 * eps32 * total * static_cast<double>(n)), 1e-5);
  if (std::fabs(budget - total) > allowed) {
    std::ostringstream os;
    os << "raw budget sum(counts*h) = " << budget << " differs from sum(counts) = " << total << " by more than "
       << allowed;
    err = os.str();
    return 1;
  }
  if (lo == 1.0 || hi == 1.0) {
    for (int64_t i = 0; i < n; ++i) x[i] = 1.0;
    return 0;
  }
  bool inside = true;
  for (int64_t i = 0; i < n; ++i) {
    if (!(h[i] >= lo && h[i] <= hi)) {
      inside = false;
      break;
    }
  }
  if (inside) {
    for (int64_t i = 0; i < n; ++i) x[i] = h[i];
    return 0;
  }
  double a = h[0] - hi, b = h[0] - lo;
  for (int64_t i = 1; i < n; ++i) {
    a = std::min(a, h[i] - hi);
    b = std::max(b, h[i] - lo);
  }
  const double stop = 1e-7 * std::max(total, 1.0);
  double mid = 0.5 * (a + b);
  for (int it = 0; it < 100; ++it) {
    mid = 0.5 * (a + b);
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += c[i] * std::min(std::max(h[i] - mid, lo), hi);
    const double e = s - total;
    if (std::fabs(e) <= stop) break;
    if (e > 0.0) {
      a = mid;
    } else {
      b = mid;
    }
  }
  for (int64_t i = 0; i < n; ++i) x[i] = std::min(std::max(h[i] - mid, lo), hi);
  for (int pass = 0; pass < 3; ++pass) {
    double denom = 0.0;
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] > lo && x[i] < hi) denom += c[i];
    }
    if (!(denom > 0.0)) break;
    for (int64_t i = 0; i < n; ++i) s += c[i] * x[i];
    const double step = (total - s) / denom;
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] > lo && x[i] < hi) x[i] = x[i] + step;
    }
  }
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::min(std::max(x[i], lo), hi);
    s += c[i] * x[i];
  }
  if (std::fabs(s - total) > 5.0 * tol * total) {
    std::ostringstream os;
    os << "projection lost the budget: sum(counts*x) = " << s << " vs " << total;
    err = os.str();
    return 1;
  }
  return 0;
}

py::array_t<double> project_batch(const py::handle& h_obj, const py::handle& c_obj, const py::handle& offsets_obj,
                                  double lo, double hi, double tol) {
  auto h_arr = check_array<double>(h_obj, "h", "float64");
  auto c_arr = check_array<double>(c_obj, "counts", "float64");
  const int64_t k = h_arr.shape(0);
  check_length(c_arr.shape(0), k, "counts", "h");
  const std::vector<int64_t> off = check_offsets(offsets_obj, k);
  if (!(lo >= 0.0 && lo <= 1.0)) fail("lo: must lie in [0, 1], got ", lo);
  if (!(hi >= 1.0) || std::isinf(hi)) fail("hi: must be a finite number >= 1, got ", hi);
  if (!(tol > 0.0) || std::isinf(tol)) fail("tol: must be a finite number > 0, got ", tol);
  const double* h = h_arr.data();
  const double* c = c_arr.data();
  for (int64_t i = 0; i < k; ++i) {
    if (!std::isfinite(h[i]) || h[i] < 0.0) fail("h: must be finite and >= 0; got ", h[i], " at flat position ", i);
    if (!std::isfinite(c[i]) || !(c[i] > 0.0)) {
      fail("counts: must be finite and > 0; got ", c[i], " at flat position ", i);
    }
  }
  const int64_t t = static_cast<int64_t>(off.size()) - 1;
  py::array_t<double> x_out(static_cast<py::ssize_t>(k));
  double* x = x_out.mutable_data();
  std::string err;
  int64_t bad = -1;
  {
    py::gil_scoped_release release;
    for (int64_t j = 0; j < t && bad < 0; ++j) {
      const int64_t s = off[j], n = off[j + 1] - off[j];
      if (n == 0) continue;
      if (project_one(h + s, c + s, n, lo, hi, tol, x + s, err) != 0) bad = j;
    }
  }
  if (bad >= 0) fail("h: trajectory ", bad, ": ", err);
  return x_out;
}

}  // namespace

void register_lm_head(py::module_& m);    // csrc/lm_head_bf16.cpp
void register_attention(py::module_& m);  // csrc/attention_bf16.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "alignopsd C++ paths: batched segmentation and box projection (ALGORITHM.md 3.5, 3.8), the bf16 LM head and shared-prefix attention";
  m.def("segment_batch", &segment_batch, py::arg("d"), py::arg("boundary_valid"), py::arg("offsets"), py::arg("tau"),
        py::arg("min_len"), py::arg("max_len"), py::arg("tau_min"),
        "Segment every trajectory; returns (positions int64, kinds int8 [1 semantic, 2 guided, 3 forced], "
        "boundary offsets int64 [T+1]). Positions are local, ascending, excluding 0 and n.");
  m.def("project_batch", &project_batch, py::arg("h"), py::arg("counts"), py::arg("offsets"), py::arg("lo"),
        py::arg("hi"), py::arg("tol"), "Project each trajectory's h onto [lo, hi] keeping sum(counts*x) = sum(counts).");
  register_lm_head(m);
  register_attention(m);
}
