// Page element types and their conversion to float32 vectors, shared by the native kernels (decode.cpp,
// prefill.cpp). Compiled with each ISA's flags (native/build.py): at::vec::Vectorized<float> and the
// intrinsics below are as wide as they allow.
#pragma once

#include <torch/extension.h>
#include <pybind11/numpy.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace chunkattn {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Page element types. Float8 codes are read through float16: an e5m2 code is the top byte of the float16 of
// the same value; an e4m3fn code c becomes the float16 bits sign << 15 | (c & 0x7f) << 7, which is the value
// / 256 (exponent bias 15 instead of 7, subnormals included), the 256 folded into the scales; its NaN codes
// (0x7f, 0xff) become a float16 NaN.
struct E4M3 { uint8_t bits; };
struct E5M2 { uint8_t bits; };

template <typename T> constexpr float kRawScale = 1.0f;  // value = converted * kRawScale (* the cache's scale)
template <> constexpr float kRawScale<E4M3> = 256.0f;

inline uint16_t e4m3_half_bits(uint8_t c) {
  if ((c & 0x7f) == 0x7f) return 0x7e00;
  return static_cast<uint16_t>(((c & 0x80) << 8) | ((c & 0x7f) << 7));
}

inline float scalar(float x) { return x; }
inline float scalar(c10::BFloat16 x) { return static_cast<float>(x); }
inline float scalar(c10::Half x) { return static_cast<float>(x); }
inline float scalar(E5M2 x) { return c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(x.bits << 8)); }
inline float scalar(E4M3 x) { return c10::detail::fp16_ieee_to_fp32_value(e4m3_half_bits(x.bits)); }

// kV elements from p as floats (times 1 / kRawScale).
template <typename T>
__attribute__((always_inline)) inline Vec load_vec(const T* p) {
  float tmp[kV];
  for (int64_t i = 0; i < kV; ++i) tmp[i] = scalar(p[i]);
  return Vec::loadu(tmp);
}

// The first n < kV elements, the rest zero (a head size that is not a multiple of kV: the rare path).
template <typename T>
__attribute__((noinline)) Vec load_part_vec(const T* p, int64_t n) {
  float tmp[kV] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = scalar(p[i]);
  return Vec::loadu(tmp);
}

template <>
__attribute__((always_inline)) inline Vec load_vec<float>(const float* p) { return Vec::loadu(p); }

#if defined(CPU_CAPABILITY_AVX512)
template <>
__attribute__((always_inline)) inline Vec load_vec<c10::BFloat16>(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
template <>
__attribute__((always_inline)) inline Vec load_vec<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
__attribute__((always_inline)) inline Vec load_vec<E5M2>(const E5M2* p) {
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(c, 8));
}
template <>
__attribute__((always_inline)) inline Vec load_vec<E4M3>(const E4M3* p) {
  // the code in the top byte, shifted right by one arithmetically (the sign lands in bits 15 and 14, the
  // magnitude in 13..7), bit 14 cleared; a NaN code's lanes (masked) become a float16 NaN
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(c, 8), 1),
                                     _mm256_set1_epi16(static_cast<short>(0xbfff)));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
  return _mm512_cvtph_ps(_mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(0x7e00)));
}
inline float hsum(const Vec& v) { return _mm512_reduce_add_ps(v); }
#elif defined(CPU_CAPABILITY_AVX2)
template <>
__attribute__((always_inline)) inline Vec load_vec<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
template <>
__attribute__((always_inline)) inline Vec load_vec<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
__attribute__((always_inline)) inline Vec load_vec<E5M2>(const E5M2* p) {
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(c, 8));
}
template <>
__attribute__((always_inline)) inline Vec load_vec<E4M3>(const E4M3* p) {
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(c, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
  h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
  return _mm256_cvtph_ps(h);
}
inline float hsum(const Vec& v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#else
inline float hsum(const Vec& v) {
  float tmp[kV];
  v.store(tmp);
  float x = 0.0f;
  for (int64_t i = 0; i < kV; ++i) x += tmp[i];
  return x;
}
#endif

inline float hmax(const Vec& v) {
  float tmp[kV];
  v.store(tmp);
  float x = tmp[0];
  for (int64_t i = 1; i < kV; ++i) x = std::max(x, tmp[i]);
  return x;
}

// Element [i * kV, i * kV + kV) of a row of d elements (zero past d).
template <typename T>
__attribute__((always_inline)) inline Vec load_at(const T* row, int64_t i, int64_t d) {
  const int64_t at = i * kV;
  return at + kV <= d ? load_vec<T>(row + at) : load_part_vec<T>(row + at, d - at);
}

}  // namespace chunkattn
