// Pieces shared by the AVX512-BF16 paths of alignopsd._C (csrc/lm_head_bf16.cpp, csrc/attention_bf16.cpp):
// the CPU check, e^x for x <= 0, and the 6 x 64 product tile of bf16 pairs with fp32 accumulation.
//
// A "pair" is two consecutive bf16 values along the reduced dimension, read as one uint32: the operand of
// vdpbf16ps, which multiplies pairs and adds both exact fp32 products to an fp32 lane.

#pragma once

#include <cstdint>

#include "errors.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define ALIGNOPSD_AVX512_BF16 1
#define ALIGNOPSD_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,fma")))
#endif

namespace alignopsd_bf16 {

constexpr int kNB = 64;  // columns of a packed block (4 zmm of 16 fp32 lanes)
constexpr int kMR = 6;   // rows of a product tile: 6 x 4 = 24 accumulators

using alignopsd_c::check_reach;
using alignopsd_c::fail;

#ifdef ALIGNOPSD_AVX512_BF16

// x86-64 with AVX512 F/DQ/BW/VL and BF16, and an OS that saves the ZMM and opmask state.
inline bool cpu_has_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned xlo = 0, xhi = 0;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  if ((xlo & 0xE6u) != 0xE6u) return false;  // XMM, YMM, opmask and ZMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  if (!(f && dq && bw && vl)) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return a & (1u << 5);  // AVX512_BF16
}

// e^x for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes' expf coefficients, about
// 2 ulp), scaled by 2^n (scalef underflows to 0 below the denormal range).
ALIGNOPSD_TARGET inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// out[r][0:64] = scale * sum_kp a[r * k2 + kp] . pk[kp * 64 + 0:64] for R rows of pairs a ([R, k2]) against a
// packed block pk ([k2, 64] pairs).
template <int R>
ALIGNOPSD_TARGET inline void micro_tile(const uint32_t* a, int64_t k2, const uint32_t* pk, float scale, float* out) {
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k2; ++kp) {
    const uint32_t* b = pk + kp * kNB;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 16);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 32);
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512(b + 48);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * k2 + kp]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], av, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], av, b3);
    }
  }
  const __m512 t = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + r * kNB + 16 * c, _mm512_mul_ps(acc[r][c], t));
}

#else

inline bool cpu_has_avx512_bf16() { return false; }

#endif

}  // namespace alignopsd_bf16
