// The one dot product of the project's invariant arithmetic (docs/true-on-policy.md, "the dot"), shared by the
// linear product (invariant_product.cpp) and the attention's scores (decode_attention.cpp).
//
// A dot of two float32 vectors of length n runs on W lanes (W = this build's float vector: 16 with AVX-512, 8 with
// AVX2 and in the portable build): lane l is a chain over the elements l, l + W, l + 2W, ... in that order, each
// term added by a fused multiply-add (the portable build: a product, then a sum, each rounded), every lane starting
// at +0; the last partial vector reads zeros past n. The W lanes are then added by one fixed tree, halves first
// (lane k + lane k + W/2, the same on the first half, down to one lane: ``lane_sums``). Nothing in that order depends
// on how many other dots are taken with it, where its operands sit or which thread takes it, so a row of a product
// has the same bits whatever the other rows, columns and threads of the call.
//
// bf16 operands are read as float32 (exactly: a bf16 is the top half of a float32) and take the same arithmetic.

#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace lanes {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
// the vector register type under Vec, where there is one: arrays of it stay in registers where arrays of Vec did not
#if defined(CPU_CAPABILITY_AVX512)
using Raw = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using Raw = __m256;
#else
using Raw = Vec;
#endif

// out[j] = the sum of acc[j]'s W lanes by one fixed tree, halves first (lane k + lane k + W / 2, then the same on
// the first half, down to one lane), for the W vectors at once: the same additions for every vector, whichever
// lane it lands in
__attribute__((always_inline)) inline void lane_sums(const Raw* acc, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(W == 16);
  __m512 v[16], w[8], z[4], u[2];
  for (int j = 0; j < 16; ++j) v[j] = acc[j];
  for (int m = 0; m < 8; ++m) {  // [k + k+8 of vector 2m | of vector 2m+1]
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
  }
  for (int m = 0; m < 4; ++m) {  // 128-bit lane l: k + k+4 of vector 4m + l
    z[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0xDD));
  }
  for (int m = 0; m < 2; ++m) {  // 128-bit lane l: k + k+2 of vectors 8m + l and 8m + 4 + l
    const __m512d a = _mm512_castps_pd(z[2 * m]), b = _mm512_castps_pd(z[2 * m + 1]);
    u[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lane 4l + j: vector 4j + l; put vector k in lane k
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, sums));
#elif defined(CPU_CAPABILITY_AVX2)
  static_assert(W == 8);
  __m256 w[4], u[2];
  for (int m = 0; m < 4; ++m) {  // [k + k+4 of vector 2m | of vector 2m+1]
    const __m256 a = acc[2 * m], b = acc[2 * m + 1];
    w[m] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int m = 0; m < 2; ++m) {  // 128-bit lane l: k + k+2 of vectors 4m + l and 4m + 2 + l
    const __m256d a = _mm256_castps_pd(w[2 * m]), b = _mm256_castps_pd(w[2 * m + 1]);
    u[m] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  // lane 4l + j: vector 2j + l; put vector k in lane k
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  float lanes[W];
  for (int64_t j = 0; j < W; ++j) {
    acc[j].store(lanes);
    for (int64_t half = W / 2; half >= 1; half /= 2) {
      for (int64_t k = 0; k < half; ++k) lanes[k] = lanes[k] + lanes[k + half];
    }
    out[j] = lanes[0];
  }
#endif
}

// W elements of T at p as floats (bf16 widened exactly)
template <typename T>
inline Vec load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
#else
    float out[W];
    for (int64_t i = 0; i < W; ++i) out[i] = static_cast<float>(p[i]);
    return Vec::loadu(out);
#endif
  }
}

// the first ``count`` (< W) elements of T at p as floats, zeros after
template <typename T>
inline Vec load_floats(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, count);
  } else {
    float out[W] = {};
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(p[i]);
    return Vec::loadu(out);
  }
}

}  // namespace lanes
