// alignopsd._C: attention over shared prefixes and own keys for a bf16 model on x86 CPUs with AVX512-BF16.
//
// attention_prefix_bf16 is the prefill attention of the CPU decoding cache's shared-prefix layout
// (engine/generation/decode_cache.py, SharedPrefixKV._prefill): row b's queries attend its prefix's keys (the
// prefix row_prefix[b] of the kept [G, K, P, D] keys, none when -1) followed by its own [n] keys, with the additive
// mask bias[b, s, P + n] (0 or -inf) that SharedPrefixKV.push built. In math, per query head h (kv head h / R):
//     out[b, s, h] = softmax_t(scale * q[b, h, s] . key_t + bias[b, s, t]) @ value_t
// The torch path gathers each row's prefix keys next to its own (a copy per row and layer) and calls fp32
// scaled-dot-product attention. Here nothing is gathered: the prefix is read in place, the scores q . k are
// products of bf16 pairs with fp32 accumulation (the model's queries and keys are bf16 values, kept in fp32: the
// products are exact, as in fp32), and softmax and probabilities x values stay fp32.
//
// Layout: one work item per (row b, kv head j); its R query heads x S positions are cut into tiles of 6 queries.
// The item's keys (from the first any of its queries may attend) are packed once into blocks of 64 (bf16 pairs along D: the vdpbf16ps operand), then every tile
// runs an online softmax over the blocks (flash attention's running maximum and sum, rescaling its fp32 output
// accumulator when a block raises the maximum). Items are spread over the threads the caller passes; each item's
// arithmetic is the same whichever thread runs it, so results do not depend on the thread count.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "bf16_tile.h"

namespace py = pybind11;

namespace {

using namespace alignopsd_bf16;

struct AttnArgs {
  const uint16_t* q;  // bf16 [B, H, S, D], strides q_s[0..2] (elements), D contiguous
  int64_t q_s[3];
  const float* k;  // own keys / values fp32 [B, K, n, D] (strides own_s), D contiguous
  const float* v;
  int64_t own_s[3];
  const float* pk;  // prefix keys / values fp32 [G, K, P, D] (strides pre_s), D contiguous; null when P == 0
  const float* pv;
  int64_t pre_s[3];
  const int64_t* row_prefix;  // [B], -1: no prefix
  const float* bias;          // [B, S, P + n] fp32 contiguous
  float* out;                 // [B, S, H, D] fp32 contiguous
  int64_t B, H, S, D, K, n, P, G;
  float scale;
};

#ifdef ALIGNOPSD_AVX512_BF16

// Key t of item (b, j) as a pointer to its D fp32 values (prefix first, then own) and its bias column.
struct Keys {
  const float* pk_base = nullptr;
  const float* pv_base = nullptr;
  const float* k_base;
  const float* v_base;
  int64_t pre_t, own_t, prefix_len, bias_off;
  const float* key(int64_t t) const { return t < prefix_len ? pk_base + t * pre_t : k_base + (t - prefix_len) * own_t; }
  const float* value(int64_t t) const {
    return t < prefix_len ? pv_base + t * pre_t : v_base + (t - prefix_len) * own_t;
  }
};

// pk[blk][p][c] = pair p of key first + blk * 64 + c (zero past the last key): 32 values of a key converted at a
// time (round to nearest even: exact for bf16 values) and scattered to their 16 pair rows.
ALIGNOPSD_TARGET void pack_keys(const Keys& ks, int64_t first, int64_t total, int64_t d2, uint32_t* pk) {
  const int64_t count = total - first, blocks = (count + kNB - 1) / kNB;
  const int64_t tail = count % kNB;
  if (tail) {
    uint32_t* last = pk + (blocks - 1) * d2 * kNB;
    for (int64_t p = 0; p < d2; ++p) std::memset(last + p * kNB + tail, 0, sizeof(uint32_t) * (kNB - tail));
  }
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(kNB));
  for (int64_t i = 0; i < count; ++i) {
    const float* src = ks.key(first + i);
    uint32_t* dst = pk + (i / kNB) * d2 * kNB + (i % kNB);
    for (int64_t p0 = 0; p0 < d2; p0 += 16) {
      const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 2 * p0 + 16), _mm512_loadu_ps(src + 2 * p0));
      _mm512_i32scatter_epi32(dst + p0 * kNB, rows, (__m512i)pairs, 4);
    }
  }
}

// The first key any query of row b may attend (the prefix's left padding is masked for every query): blocks
// before it hold no term of any softmax and are skipped.
int64_t first_live_key(const AttnArgs& a, const Keys& ks, int64_t b, int64_t total) {
  const int64_t width = a.P + a.n;
  int64_t first = total;
  for (int64_t s = 0; s < a.S && first > 0; ++s) {
    const float* row = a.bias + (b * a.S + s) * width + ks.bias_off;
    int64_t t = 0;
    while (t < first && row[t] == -std::numeric_limits<float>::infinity()) ++t;
    first = t;
  }
  return first;
}

// One tile of up to 6 queries (rows q_rows of pairs, positions s_of) over every key block of the item.
ALIGNOPSD_TARGET void query_tile(const AttnArgs& a, const Keys& ks, int64_t first, int64_t total, const uint32_t* pk,
                                 const uint32_t* q_rows, const int64_t* s_of, const int64_t* h_of, int count, int64_t b,
                                 float* o, float* tile) {
  const int64_t D = a.D, d2 = D / 2, width = a.P + a.n;
  float m[kMR], l[kMR];
  for (int r = 0; r < kMR; ++r) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.0f;
  std::memset(o, 0, sizeof(float) * kMR * D);
  const int64_t blocks = (total - first + kNB - 1) / kNB;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t t0 = first + blk * kNB;
    const int nb = static_cast<int>(std::min<int64_t>(kNB, total - t0));
    micro_tile<kMR>(q_rows, d2, pk + blk * d2 * kNB, a.scale, tile);
    for (int r = 0; r < count; ++r) {
      float* z = tile + r * kNB;
      const float* bias = a.bias + (b * a.S + s_of[r]) * width + ks.bias_off + t0;
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __mmask16 k[4];
      for (int c = 0; c < 4; ++c) {
        const int left = std::clamp(nb - 16 * c, 0, 16);
        k[c] = static_cast<__mmask16>(left == 16 ? 0xFFFFu : ((1u << left) - 1u));
        __m512 zc = _mm512_add_ps(_mm512_loadu_ps(z + 16 * c), _mm512_maskz_loadu_ps(k[c], bias + 16 * c));
        zc = _mm512_mask_blend_ps(k[c], _mm512_set1_ps(-std::numeric_limits<float>::infinity()), zc);
        _mm512_storeu_ps(z + 16 * c, zc);
        mx = _mm512_max_ps(mx, zc);
      }
      const float bm = _mm512_reduce_max_ps(mx);
      if (bm == -std::numeric_limits<float>::infinity()) {  // no key of this block for this query
        std::memset(z, 0, sizeof(float) * kNB);
        continue;
      }
      if (bm > m[r]) {
        const float alpha = std::exp(m[r] - bm);  // 0 on the first block
        l[r] *= alpha;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), va));
        m[r] = bm;
      }
      const __m512 vm = _mm512_set1_ps(m[r]);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        const __m512 zc = _mm512_loadu_ps(z + 16 * c);
        const __mmask16 live = _mm512_cmp_ps_mask(zc, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                  _CMP_NEQ_OQ);
        const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(zc, vm)));
        _mm512_storeu_ps(z + 16 * c, p);
        sum = _mm512_add_ps(sum, p);
      }
      l[r] += _mm512_reduce_add_ps(sum);
    }
    for (int r = count; r < kMR; ++r) std::memset(tile + r * kNB, 0, sizeof(float) * kNB);
    // o[r] += sum_c p[r][c] * value(t0 + c), 64 dimensions at a time (24 accumulators)
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int lanes = static_cast<int>(std::min<int64_t>(64, D - d0)) / 16;
      __m512 acc[kMR][4];
#pragma GCC unroll 8
      for (int r = 0; r < kMR; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = c < lanes ? _mm512_loadu_ps(o + r * D + d0 + 16 * c) : _mm512_setzero_ps();
      for (int c = 0; c < nb; ++c) {
        const float* vrow = ks.value(t0 + c) + d0;
        __m512 vv[4];
        for (int x = 0; x < 4; ++x) vv[x] = x < lanes ? _mm512_loadu_ps(vrow + 16 * x) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < kMR; ++r) {
          const __m512 p = _mm512_set1_ps(tile[r * kNB + c]);
          for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_fmadd_ps(p, vv[x], acc[r][x]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kMR; ++r)
        for (int c = 0; c < lanes; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
    }
  }
  for (int r = 0; r < count; ++r) {
    float* dst = a.out + ((b * a.S + s_of[r]) * a.H + h_of[r]) * D;
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
  }
}

void item(const AttnArgs& a, int64_t b, int64_t j, std::vector<uint32_t>& pk, std::vector<float>& o,
          std::vector<float>& tile) {
  const int64_t g = a.P ? a.row_prefix[b] : -1;
  Keys ks;
  ks.prefix_len = g >= 0 ? a.P : 0;
  ks.bias_off = g >= 0 ? 0 : a.P;
  if (g >= 0) {
    ks.pk_base = a.pk + g * a.pre_s[0] + j * a.pre_s[1];
    ks.pv_base = a.pv + g * a.pre_s[0] + j * a.pre_s[1];
  }
  ks.pre_t = a.pre_s[2];
  ks.k_base = a.k + b * a.own_s[0] + j * a.own_s[1];
  ks.v_base = a.v + b * a.own_s[0] + j * a.own_s[1];
  ks.own_t = a.own_s[2];
  const int64_t total = ks.prefix_len + a.n, d2 = a.D / 2;
  const int64_t first = std::min(first_live_key(a, ks, b, total) / kNB * kNB, total - 1);
  pk.resize(static_cast<size_t>((total - first + kNB - 1) / kNB * d2 * kNB));
  pack_keys(ks, first, total, d2, pk.data());
  const int64_t R = a.H / a.K, queries = R * a.S;
  uint32_t q_rows[kMR * 128];  // D <= 256: at most 128 pairs per query
  int64_t s_of[kMR], h_of[kMR];
  for (int64_t q0 = 0; q0 < queries; q0 += kMR) {
    const int count = static_cast<int>(std::min<int64_t>(kMR, queries - q0));
    for (int r = 0; r < kMR; ++r) {
      if (r < count) {
        const int64_t qi = q0 + r;
        h_of[r] = j * R + qi / a.S;
        s_of[r] = qi % a.S;
        const uint16_t* src = a.q + b * a.q_s[0] + h_of[r] * a.q_s[1] + s_of[r] * a.q_s[2];
        std::memcpy(q_rows + r * d2, src, sizeof(uint32_t) * d2);
      } else {
        std::memset(q_rows + r * d2, 0, sizeof(uint32_t) * d2);
      }
    }
    query_tile(a, ks, first, total, pk.data(), q_rows, s_of, h_of, count, b, o.data(), tile.data());
  }
}

#endif

int64_t stride_at(const std::vector<int64_t>& s, size_t i, const char* name) {
  if (s.size() != 3) fail(name, ": expected 3 strides, got ", s.size());
  return s[i];
}

// Every buffer the sizes and strides reach, against the elements the caller says it holds (from its address on).
void check_buffers(const AttnArgs& a, const std::vector<int64_t>& elements) {
  if (elements.size() != 8)
    fail("elements: expected 8 counts (q, k, v, pk, pv, row_prefix, bias, out), got ", elements.size());
  if (a.B == 0) return;
  check_reach("q", elements[0], {{a.B, a.q_s[0]}, {a.H, a.q_s[1]}, {a.S, a.q_s[2]}}, a.D);
  check_reach("k", elements[1], {{a.B, a.own_s[0]}, {a.K, a.own_s[1]}, {a.n, a.own_s[2]}}, a.D);
  check_reach("v", elements[2], {{a.B, a.own_s[0]}, {a.K, a.own_s[1]}, {a.n, a.own_s[2]}}, a.D);
  if (a.P > 0) {
    check_reach("pk", elements[3], {{a.G, a.pre_s[0]}, {a.K, a.pre_s[1]}, {a.P, a.pre_s[2]}}, a.D);
    check_reach("pv", elements[4], {{a.G, a.pre_s[0]}, {a.K, a.pre_s[1]}, {a.P, a.pre_s[2]}}, a.D);
    check_reach("row_prefix", elements[5], {}, a.B);
  }
  check_reach("bias", elements[6], {}, a.B * a.S * (a.P + a.n));
  check_reach("out", elements[7], {}, a.B * a.S * a.H * a.D);
}

void attention_prefix_bf16(uintptr_t q, std::vector<int64_t> q_strides, uintptr_t k, uintptr_t v,
                           std::vector<int64_t> own_strides, uintptr_t pk, uintptr_t pv,
                           std::vector<int64_t> prefix_strides, uintptr_t row_prefix, uintptr_t bias, uintptr_t out,
                           int64_t B, int64_t H, int64_t S, int64_t D, int64_t K, int64_t n, int64_t P, int64_t G,
                           double scale, int64_t threads, std::vector<int64_t> elements) {
  // every argument is checked before the CPU is asked (so the checks run, and are tested, on any CPU)
  if (B < 0 || S < 1 || n < 1 || P < 0 || G < 0) fail("attention_prefix_bf16: bad sizes B, S, n, P, G");
  if (D < 32 || D > 256 || D % 32) fail("head_dim: must be a multiple of 32 in [32, 256], got ", D);
  if (K < 1 || H < K || H % K) fail("heads: query heads ", H, " must be a multiple of kv heads ", K);
  if (P > 0 && (!pk || !pv || !row_prefix || G < 1)) fail("prefix: ", P, " positions but no prefix keys or rows");
  if (!(scale > 0.0) || !std::isfinite(scale)) fail("scale: must be finite and > 0, got ", scale);
  if (threads < 1) fail("threads: must be >= 1, got ", threads);
  for (uintptr_t p : {q, k, v, bias, out})
    if (!p && B) fail("attention_prefix_bf16: a null tensor address");
  AttnArgs a{};
  a.q = reinterpret_cast<const uint16_t*>(q);
  a.k = reinterpret_cast<const float*>(k);
  a.v = reinterpret_cast<const float*>(v);
  a.pk = reinterpret_cast<const float*>(pk);
  a.pv = reinterpret_cast<const float*>(pv);
  a.row_prefix = reinterpret_cast<const int64_t*>(row_prefix);
  a.bias = reinterpret_cast<const float*>(bias);
  a.out = reinterpret_cast<float*>(out);
  for (size_t i = 0; i < 3; ++i) {
    a.q_s[i] = stride_at(q_strides, i, "q_strides");
    a.own_s[i] = stride_at(own_strides, i, "own_strides");
    a.pre_s[i] = stride_at(prefix_strides, i, "prefix_strides");
  }
  a.B = B, a.H = H, a.S = S, a.D = D, a.K = K, a.n = n, a.P = P, a.G = G;
  a.scale = static_cast<float>(scale);
  check_buffers(a, elements);
  for (int64_t b = 0; b < B && P > 0; ++b)
    if (a.row_prefix[b] < -1 || a.row_prefix[b] >= G)
      fail("row_prefix: row ", b, " reads prefix ", a.row_prefix[b], " of ", G);
  if (!cpu_has_avx512_bf16()) fail("attention_prefix_bf16: this CPU has no AVX512-BF16; use the torch path");
#ifdef ALIGNOPSD_AVX512_BF16
  const int64_t items = B * K;
  const int64_t t_count = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const auto work = [&](int64_t t) {
    std::vector<uint32_t> pkbuf;
    std::vector<float> o(static_cast<size_t>(kMR * D)), tile(static_cast<size_t>(kMR * kNB));
    for (int64_t i = t; i < items; i += t_count) item(a, i / K, i % K, pkbuf, o, tile);
  };
  py::gil_scoped_release release;
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < t_count; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
#endif
}

}  // namespace

void register_attention(py::module_& m) {
  m.def("attention_prefix_bf16", &attention_prefix_bf16, py::arg("q"), py::arg("q_strides"), py::arg("k"),
        py::arg("v"), py::arg("own_strides"), py::arg("pk"), py::arg("pv"), py::arg("prefix_strides"),
        py::arg("row_prefix"), py::arg("bias"), py::arg("out"), py::arg("B"), py::arg("H"), py::arg("S"),
        py::arg("D"), py::arg("K"), py::arg("n"), py::arg("P"), py::arg("G"), py::arg("scale"), py::arg("threads"),
        py::arg("elements"),
        "Shared-prefix prefill attention of a bf16 model (csrc/attention_bf16.cpp); tensor addresses and element "
        "strides from the Python caller, with the elements each buffer holds from its address on (q, k, v, pk, pv, "
        "row_prefix, bias, out), fp32 output [B, S, H, D].");
}
