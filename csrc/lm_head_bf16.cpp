// alignopsd._C: the LM head's log-softmax partials for bf16 hidden states and weights on x86 CPUs with AVX512-BF16.
//
// head_partials_bf16 computes, per row n of hidden[N, H] and over every vocabulary entry v of weight[V, H],
//     z[n, v] = (hidden[n] . weight[v]) * inv_t
// with bf16 products accumulated in fp32 (vdpbf16ps: each product of two bf16 values is exact in fp32), and
// returns the online log-softmax partials that kernels/lse_partials.py defines and combines:
//     m[n]  = max_v z[n, v]
//     s[n]  = sum_v exp(z[n, v] - m[n])
//     u[n]  = sum_v exp(z[n, v] - m[n]) (z[n, v] - m[n])      (the entropy's first moment; 0 unless need_u)
//     tz[n] = z[n, target[n]] when 0 <= target[n] < V, else 0
// The [N, V] logits are never stored: torch's CPU matmul has no bf16-input / fp32-output kernel, so the torch path
// upcasts the weight and multiplies in fp32, at about a third of this CPU's bf16 rate; rounding the logits to bf16
// instead would move the log-probs.
//
// Layout: the vocabulary is split into one contiguous range per thread (std::thread; the caller passes torch's
// thread count). A thread packs NB = 64 vocabulary rows at a time into pairs along H ([H/2][64] of bf16 pairs,
// the operand layout of vdpbf16ps), multiplies every hidden row against them MR = 6 rows at a time (24 fp32
// accumulators), and folds the [6, 64] logits tile into per-row running statistics: a scalar running maximum and
// 16-lane running sums relative to it (rescaled only when a tile raises the maximum). Threads' partials are merged
// in thread order at the end, so results are deterministic for a given thread count.
// Differences from the torch path are floating-point reassociation only (summation order of the dot products and
// of the sums; exp is a degree-6 polynomial with an error of about 2 ulp).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "bf16_tile.h"

namespace py = pybind11;

namespace {

using namespace alignopsd_bf16;

constexpr float kNegInit = -1.0e30f;  // the torch path's finite "minus infinity" for the running maximum

// Per-row running statistics of one thread: scalar maximum, 16-lane sums relative to it.
struct RowStats {
  std::vector<float> m, s16, u16, tz;
  explicit RowStats(int64_t n) : m(n, kNegInit), s16(n * 16, 0.0f), u16(n * 16, 0.0f), tz(n, 0.0f) {}
};

#ifdef ALIGNOPSD_AVX512_BF16

// pk[kp * kNB + c] = the bf16 pair (weight[v0 + c][2 kp], weight[v0 + c][2 kp + 1]); columns c >= nb are zero.
void pack_block(const uint32_t* w32, int64_t k2, int64_t v0, int nb, uint32_t* pk) {
  for (int c = 0; c < nb; ++c) {
    const uint32_t* src = w32 + (v0 + c) * k2;
    for (int64_t kp = 0; kp < k2; ++kp) pk[kp * kNB + c] = src[kp];
  }
  if (nb < kNB) {
    for (int64_t kp = 0; kp < k2; ++kp) std::memset(pk + kp * kNB + nb, 0, sizeof(uint32_t) * (kNB - nb));
  }
}

// Fold one row's logits tile z[0:nb] (vocabulary v0 + c) into its running statistics.
ALIGNOPSD_TARGET void fold_row(const float* z, int nb, int64_t v0, int64_t target, bool need_u, float& m, float* s16,
                               float* u16, float& tz) {
  __mmask16 k[4];
  for (int c = 0; c < 4; ++c) {
    const int left = std::clamp(nb - 16 * c, 0, 16);
    k[c] = static_cast<__mmask16>(left == 16 ? 0xFFFFu : ((1u << left) - 1u));
  }
  __m512 mx = _mm512_set1_ps(kNegInit);
  for (int c = 0; c < 4; ++c) mx = _mm512_mask_max_ps(mx, k[c], mx, _mm512_loadu_ps(z + 16 * c));
  const float bm = _mm512_reduce_max_ps(mx);
  __m512 vs = _mm512_loadu_ps(s16), vu = _mm512_loadu_ps(u16);
  if (bm > m) {  // a new maximum: rescale the sums to it (u relative to the new maximum, as merge_partials)
    const float a = std::exp(m - bm);
    const __m512 va = _mm512_set1_ps(a);
    vu = _mm512_mul_ps(va, _mm512_fmadd_ps(vs, _mm512_set1_ps(m - bm), vu));
    vs = _mm512_mul_ps(vs, va);
    m = bm;
  }
  const __m512 vm = _mm512_set1_ps(m);
  for (int c = 0; c < 4; ++c) {
    if (!k[c]) break;
    const __m512 d = _mm512_maskz_sub_ps(k[c], _mm512_loadu_ps(z + 16 * c), vm);
    const __m512 e = _mm512_maskz_mov_ps(k[c], exp_nonpositive(d));
    vs = _mm512_add_ps(vs, e);
    if (need_u) vu = _mm512_fmadd_ps(e, d, vu);
  }
  _mm512_storeu_ps(s16, vs);
  _mm512_storeu_ps(u16, vu);
  const int64_t c = target - v0;
  if (c >= 0 && c < nb) tz = z[c];
}

template <int R>
ALIGNOPSD_TARGET void rows_block(const uint32_t* h32, int64_t k2, const uint32_t* pk, float inv_t, int64_t n0, int nb,
                                 int64_t v0, const int64_t* targets, bool need_u, float* tile, RowStats& st) {
  micro_tile<R>(h32 + n0 * k2, k2, pk, inv_t, tile);
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r;
    fold_row(tile + r * kNB, nb, v0, targets[n], need_u, st.m[n], &st.s16[n * 16], &st.u16[n * 16], st.tz[n]);
  }
}

void thread_range(const uint32_t* h32, const uint32_t* w32, const int64_t* targets, int64_t n_rows, int64_t k2,
                  int64_t v_begin, int64_t v_end, float inv_t, bool need_u, RowStats& st) {
  std::vector<uint32_t> pk(static_cast<size_t>(k2) * kNB);
  alignas(64) float tile[kMR * kNB];
  for (int64_t v0 = v_begin; v0 < v_end; v0 += kNB) {
    const int nb = static_cast<int>(std::min<int64_t>(kNB, v_end - v0));
    pack_block(w32, k2, v0, nb, pk.data());
    int64_t n0 = 0;
    for (; n0 + kMR <= n_rows; n0 += kMR)
      rows_block<kMR>(h32, k2, pk.data(), inv_t, n0, nb, v0, targets, need_u, tile, st);
    switch (n_rows - n0) {
      case 5: rows_block<5>(h32, k2, pk.data(), inv_t, n0, nb, v0, targets, need_u, tile, st); break;
      case 4: rows_block<4>(h32, k2, pk.data(), inv_t, n0, nb, v0, targets, need_u, tile, st); break;
      case 3: rows_block<3>(h32, k2, pk.data(), inv_t, n0, nb, v0, targets, need_u, tile, st); break;
      case 2: rows_block<2>(h32, k2, pk.data(), inv_t, n0, nb, v0, targets, need_u, tile, st); break;
      case 1: rows_block<1>(h32, k2, pk.data(), inv_t, n0, nb, v0, targets, need_u, tile, st); break;
      default: break;
    }
  }
}

#endif

// hidden [N, H], weight [V, H] (bf16, C-contiguous), targets [N] int64 (local ids), outputs [N] fp32 each:
// addresses of torch tensors checked by the Python caller (kernels/lse_native.py), with the elements each holds
// (hidden, weight, targets, and each output); sizes are checked here against them, before the CPU is asked.
void head_partials_bf16(uintptr_t hidden, uintptr_t weight, uintptr_t targets, uintptr_t m_out, uintptr_t s_out,
                        uintptr_t u_out, uintptr_t tz_out, int64_t n_rows, int64_t vocab, int64_t hidden_size,
                        double inv_t, bool need_u, int64_t threads, std::vector<int64_t> elements) {
  if (n_rows < 0) fail("n_rows: must be >= 0, got ", n_rows);
  if (vocab <= 0) fail("vocab: must be > 0, got ", vocab);
  if (hidden_size <= 0 || hidden_size % 2) fail("hidden_size: must be even and > 0, got ", hidden_size);
  if (!(inv_t > 0.0) || !std::isfinite(inv_t)) fail("inv_t: must be finite and > 0, got ", inv_t);
  if (threads < 1) fail("threads: must be >= 1, got ", threads);
  for (uintptr_t p : {hidden, weight, targets, m_out, s_out, u_out, tz_out})
    if (!p && n_rows) fail("head_partials_bf16: a null tensor address");
  if (elements.size() != 4)
    fail("elements: expected 4 counts (hidden, weight, targets, each output), got ", elements.size());
  check_reach("weight", elements[1], {}, vocab * hidden_size);
  if (n_rows) {
    check_reach("hidden", elements[0], {}, n_rows * hidden_size);
    check_reach("targets", elements[2], {}, n_rows);
    check_reach("outputs", elements[3], {}, n_rows);
  }
  if (!cpu_has_avx512_bf16()) fail("head_partials_bf16: this CPU has no AVX512-BF16; use the torch path");
#ifdef ALIGNOPSD_AVX512_BF16
  const auto* h32 = reinterpret_cast<const uint32_t*>(hidden);
  const auto* w32 = reinterpret_cast<const uint32_t*>(weight);
  const auto* tg = reinterpret_cast<const int64_t*>(targets);
  auto* m = reinterpret_cast<float*>(m_out);
  auto* s = reinterpret_cast<float*>(s_out);
  auto* u = reinterpret_cast<float*>(u_out);
  auto* tz = reinterpret_cast<float*>(tz_out);
  const int64_t k2 = hidden_size / 2, n = n_rows;
  const int64_t blocks = (vocab + kNB - 1) / kNB;
  const int64_t t_count = std::max<int64_t>(1, std::min<int64_t>(threads, blocks));
  std::vector<RowStats> stats;
  stats.reserve(t_count);
  for (int64_t t = 0; t < t_count; ++t) stats.emplace_back(n);
  const auto range = [&](int64_t t) {
    const int64_t b0 = blocks * t / t_count, b1 = blocks * (t + 1) / t_count;
    return std::pair<int64_t, int64_t>(b0 * kNB, std::min(vocab, b1 * kNB));
  };
  {
    py::gil_scoped_release release;
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < t_count; ++t) {
      const auto [v0, v1] = range(t);
      pool.emplace_back(thread_range, h32, w32, tg, n, k2, v0, v1, static_cast<float>(inv_t), need_u,
                        std::ref(stats[t]));
    }
    const auto [v0, v1] = range(0);
    thread_range(h32, w32, tg, n, k2, v0, v1, static_cast<float>(inv_t), need_u, stats[0]);
    for (auto& th : pool) th.join();
    // merge the threads' partials in thread order (kernels/lse_partials.py merge_partials)
    for (int64_t i = 0; i < n; ++i) {
      float mm = kNegInit, ss = 0.0f, uu = 0.0f, zz = 0.0f;
      for (int64_t t = 0; t < t_count; ++t) {
        const RowStats& st = stats[t];
        float st_s = 0.0f, st_u = 0.0f;
        for (int l = 0; l < 16; ++l) {
          st_s += st.s16[i * 16 + l];
          st_u += st.u16[i * 16 + l];
        }
        const float mt = st.m[i], mn = std::max(mm, mt);
        const float a1 = std::exp(mm - mn), a2 = std::exp(mt - mn);
        uu = a1 * (uu + ss * (mm - mn)) + a2 * (st_u + st_s * (mt - mn));
        ss = ss * a1 + st_s * a2;
        mm = mn;
        zz += st.tz[i];
      }
      m[i] = mm;
      s[i] = ss;
      u[i] = need_u ? uu : 0.0f;
      tz[i] = zz;
    }
  }
#endif
}

}  // namespace

void register_lm_head(py::module_& m) {
  m.def("has_avx512_bf16", &cpu_has_avx512_bf16,
        "Whether this build and this CPU can run head_partials_bf16 (x86-64 with AVX512-BF16 and OS support).");
  m.def("head_partials_bf16", &head_partials_bf16, py::arg("hidden"), py::arg("weight"), py::arg("targets"),
        py::arg("m"), py::arg("s"), py::arg("u"), py::arg("tz"), py::arg("n_rows"), py::arg("vocab"),
        py::arg("hidden_size"), py::arg("inv_t"), py::arg("need_u"), py::arg("threads"), py::arg("elements"),
        "LM-head log-softmax partials (m, s, u, tz) of bf16 hidden [N, H] x bf16 weight [V, H] with fp32 "
        "accumulation, written to the fp32 outputs; tensor addresses from the Python caller, with the elements "
        "each holds (hidden, weight, targets, each output).");
}
