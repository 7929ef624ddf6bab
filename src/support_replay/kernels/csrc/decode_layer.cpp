// The elementwise work around a decode step's products (modeling/decode_layer.py), float32: RMSNorm, the
// residual adds, the query and key norms and rotary embedding with the keys' and values' cache writes, SiLU x up.
//
// Each result is rounded where the model's own PyTorch operations round it, so the fused step keeps the module
// tree's bits: a product and a sum are two roundings (built with -ffp-contract=off: no fused multiply-add), the
// RMSNorm's mean is ATen's reduction over the squares and SiLU ATen's kernel (in this file's loops written in
// their order, or ATen's own calls: ``aten_calls``), and 1 / sqrt is ATen's rsqrt (an exactly rounded square root,
// then an exactly rounded division). Python checks the bits against the models' functions at start-up before the
// step uses any of this. The attention's inputs and SiLU x up split a
// step's rows between the threads (``for_rows``; a row's arithmetic does not depend on its share): SiLU x up at
// batch 16 took 22 instead of 30 us standalone, and the two 0.15 instead of 0.18 s of a GRPO-shape run on a Zen 3
// EPYC.

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/silu.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// Whether the RMSNorm's mean and SiLU call ATen's own kernels (true) or this file's loops, written to round in
// ATen's order (false). ATen's calls cost a few microseconds of dispatch each, and two to three times that at a
// decode step, where each product's kernels leave ATen's code and data cold; the loops cost a fraction of it.
// Python sets this once per process (modeling/decode_layer.py): the loops where the start-up check finds them the
// models' bits on this CPU and PyTorch, ATen's calls where it does not.
std::atomic<bool> aten_calls{true};

// ATen's float sum runs on vectors of 8 floats on AVX2 and AVX-512 CPUs alike (under AVX-512 its sum gives the AVX2
// kernel's bits: seen on a Zen 5 EPYC with torch 2.13), so the sum here does too, whatever this build's Vec is
constexpr int64_t SUM_LANES = 8;
struct SumVec {
  float lane[SUM_LANES];
  SumVec() = default;
  explicit SumVec(float value) { std::fill(lane, lane + SUM_LANES, value); }
  SumVec operator+(const SumVec& other) const {
    SumVec out(0.f);
    for (int64_t k = 0; k < SUM_LANES; ++k) out.lane[k] = lane[k] + other.lane[k];
    return out;
  }
};

template <typename T>
inline T item(const float* x, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return x[i];
  } else {
    T out(0.f);
    std::copy(x + i * SUM_LANES, x + (i + 1) * SUM_LANES, out.lane);
    return out;
  }
}

inline int64_t ceil_log2(int64_t n) {
  int64_t bits = 1;
  while (bits < 63 && (int64_t(1) << bits) < n) ++bits;
  return bits;
}

// The sum of ``count`` items (floats, or vectors of SUM_LANES floats) in the order of ATen's cascade sum
// (SumKernel.cpp): four running sums over the items 4g .. 4g + 3 of each group g, each held on four levels; every 16
// groups the lowest level is added into the next, and so on up while the group count is a multiple of 16, 256, 4096 (of
// 2^p, p = max(4, ceil(log2 groups) / 4)); then the leftover items go into the first sum and the four are added in
// order. Additions only: with -ffp-contract=off the bits are the order's.
template <typename T>
T cascade_sum(const float* x, int64_t count) {
  constexpr int levels = 4, lanes = 4;
  const int64_t groups = count / lanes;
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / levels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  T acc[levels][lanes];
  for (auto& level : acc) std::fill(level, level + lanes, T(0.f));
  int64_t g = 0;
  while (g + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++g) {
      for (int k = 0; k < lanes; ++k) acc[0][k] = acc[0][k] + item<T>(x, g * lanes + k);
    }
    for (int l = 1; l < levels; ++l) {
      for (int k = 0; k < lanes; ++k) {
        acc[l][k] = acc[l][k] + acc[l - 1][k];
        acc[l - 1][k] = T(0.f);
      }
      if ((g & (mask << (l * power))) != 0) break;
    }
  }
  for (; g < groups; ++g) {
    for (int k = 0; k < lanes; ++k) acc[0][k] = acc[0][k] + item<T>(x, g * lanes + k);
  }
  for (int l = 1; l < levels; ++l) {
    for (int k = 0; k < lanes; ++k) acc[0][k] = acc[0][k] + acc[l][k];
  }
  for (int64_t i = groups * lanes; i < count; ++i) acc[0][0] = acc[0][0] + item<T>(x, i);
  for (int k = 1; k < lanes; ++k) acc[0][0] = acc[0][0] + acc[0][k];
  return acc[0][0];
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// cascade_sum<SumVec> with its sixteen partial sums in registers of eight floats (__m256, which both ISAs have): the
// same additions in the same order, lane by lane. cascade_sum's arrays indexed in loops stayed on the stack, a load
// and a store around every addition (GCC 12: an RMSNorm of 16 rows of 576 took 17 us on a Zen 3 EPYC).
inline __m256 cascade_sum_of_vectors(const float* x, int64_t count) {
  const int64_t groups = count / 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / 4);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero;  // the lowest level: item 4g + k goes into ak
  __m256 b0 = zero, b1 = zero, b2 = zero, b3 = zero, c0 = zero, c1 = zero, c2 = zero, c3 = zero;
  __m256 d0 = zero, d1 = zero, d2 = zero, d3 = zero;
  const auto add_group = [&](int64_t g) {
    const float* v = x + g * 4 * SUM_LANES;
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(v));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(v + SUM_LANES));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(v + 2 * SUM_LANES));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(v + 3 * SUM_LANES));
  };
  int64_t g = 0;
  while (g + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++g) add_group(g);
    // each level into the next, up while the group count is a multiple of the next level's span
    b0 = _mm256_add_ps(b0, a0), b1 = _mm256_add_ps(b1, a1), b2 = _mm256_add_ps(b2, a2), b3 = _mm256_add_ps(b3, a3);
    a0 = a1 = a2 = a3 = zero;
    if ((g & (mask << power)) != 0) continue;
    c0 = _mm256_add_ps(c0, b0), c1 = _mm256_add_ps(c1, b1), c2 = _mm256_add_ps(c2, b2), c3 = _mm256_add_ps(c3, b3);
    b0 = b1 = b2 = b3 = zero;
    if ((g & (mask << (2 * power))) != 0) continue;
    d0 = _mm256_add_ps(d0, c0), d1 = _mm256_add_ps(d1, c1), d2 = _mm256_add_ps(d2, c2), d3 = _mm256_add_ps(d3, c3);
    c0 = c1 = c2 = c3 = zero;
  }
  for (; g < groups; ++g) add_group(g);
  a0 = _mm256_add_ps(a0, b0), a1 = _mm256_add_ps(a1, b1), a2 = _mm256_add_ps(a2, b2), a3 = _mm256_add_ps(a3, b3);
  a0 = _mm256_add_ps(a0, c0), a1 = _mm256_add_ps(a1, c1), a2 = _mm256_add_ps(a2, c2), a3 = _mm256_add_ps(a3, c3);
  a0 = _mm256_add_ps(a0, d0), a1 = _mm256_add_ps(a1, d1), a2 = _mm256_add_ps(a2, d2), a3 = _mm256_add_ps(a3, d3);
  for (int64_t i = groups * 4; i < count; ++i) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i * SUM_LANES));
  a0 = _mm256_add_ps(a0, a1);
  a0 = _mm256_add_ps(a0, a2);
  return _mm256_add_ps(a0, a3);
}
#endif

// ATen's float sum of a contiguous row of d: the vectors' cascade, then the scalar tail and the vector's lanes in
// order after it (rows shorter than a vector: the cascade over the floats)
inline float row_sum(const float* x, int64_t d) {
  if (d < SUM_LANES) return 0.f + cascade_sum<float>(x, d);
  const int64_t vectors = d / SUM_LANES;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  SumVec acc;
  _mm256_storeu_ps(acc.lane, cascade_sum_of_vectors(x, vectors));
#else
  const SumVec acc = cascade_sum<SumVec>(x, vectors);
#endif
  float total = 0.f;
  for (int64_t i = vectors * SUM_LANES; i < d; ++i) total += x[i];
  for (int64_t k = 0; k < SUM_LANES; ++k) total += acc.lane[k];
  return 0.f + total;
}

// x / (1 + exp(-x)) as ATen's SiLU rounds it along a row (vectors two at a time, the rest one float at a time),
// each rounded SiLU then times up[i], one more rounding: SiLU(gate) * up in one pass over the row
inline void silu_mul_row(const float* x, const float* up, float* y, int64_t n) {
  int64_t i = 0;
  const Vec one(1.f);
  for (; i + 2 * W <= n; i += 2 * W) {
    const Vec a = Vec::loadu(x + i), b = Vec::loadu(x + i + W);
    const Vec silu_a = a / (one + a.neg().exp()), silu_b = b / (one + b.neg().exp());
    (silu_a * Vec::loadu(up + i)).store(y + i);
    (silu_b * Vec::loadu(up + i + W)).store(y + i + W);
  }
  for (; i < n; ++i) {
    const float silu = x[i] / (1.f + std::exp(-x[i]));
    y[i] = silu * up[i];
  }
}

// pointers to the rows (the last dimension, contiguous) of a tensor of any leading shape and strides
std::vector<float*> rows_of(const at::Tensor& t) {
  const int64_t dims = t.dim(), count = t.numel() / std::max<int64_t>(t.size(-1), 1);
  std::vector<float*> rows(count);
  float* base = t.data_ptr<float>();
  std::vector<int64_t> index(std::max<int64_t>(dims - 1, 0), 0);
  for (int64_t r = 0; r < count; ++r) {
    int64_t offset = 0;
    for (int64_t d = 0; d + 1 < dims; ++d) offset += index[d] * t.stride(d);
    rows[r] = base + offset;
    for (int64_t d = dims - 2; d >= 0; --d) {  // the next multi-index, the last leading dimension fastest
      if (++index[d] < t.size(d)) break;
      index[d] = 0;
    }
  }
  return rows;
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "decode_layer: ", what,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, "decode_layer: ", what, "'s last dimension must be contiguous");
}

void check_weight(const at::Tensor& w, int64_t width, const char* what) {
  check_rows(w, what);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == width, "decode_layer: ", what, " of ", w.sizes(), " for rows of ", width);
}

// x.pow(2).mean(-1, keepdim=True) of rows [begin, end) of ``in`` into var[0 .. end - begin): each square rounded,
// then ATen's mean (the model's own sum order) or the same order without its dispatch (the sum, then a division,
// as ATen's mean on a CPU). A row of GRAIN_SIZE floats or more always takes ATen's: alone in a call, ATen splits its
// sum between the threads.
void means_of_squares(const std::vector<float*>& in, int64_t begin, int64_t end, int64_t d, float* var) {
  const int64_t n = end - begin;
  std::vector<float> squares(n * d);
  float* sq = squares.data();
  for (int64_t r = 0; r < n; ++r) {
    const float* x = in[begin + r];
    for (int64_t i = 0; i < d; ++i) sq[r * d + i] = x[i] * x[i];
  }
  if (aten_calls || d >= at::internal::GRAIN_SIZE) {
    const auto mean = at::mean(at::from_blob(sq, {n, d}, at::kFloat), {-1}, true);
    std::copy(mean.data_ptr<float>(), mean.data_ptr<float>() + n, var);
  } else {
    for (int64_t r = 0; r < n; ++r) var[r] = row_sum(sq + r * d, d) / static_cast<float>(d);
  }
}

// x.pow(2).mean(-1, keepdim=True), x * rsqrt(variance + eps), weight * that: Llama's and Qwen3's RMSNorm in float32,
// over rows [begin, end) of ``in`` into the same rows of ``out``
void normalize(const std::vector<float*>& in, int64_t begin, int64_t end, int64_t d, const float* weight, float eps,
               const std::vector<float*>& out) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  std::vector<float> var(n);
  means_of_squares(in, begin, end, d, var.data());
  for (int64_t r = 0; r < n; ++r) {
    const float inverse = 1.f / std::sqrt(var[r] + eps);
    const float* x = in[begin + r];
    float* y = out[begin + r];
    for (int64_t i = 0; i < d; ++i) y[i] = weight[i] * (x[i] * inverse);
  }
}

void normalize(const std::vector<float*>& in, int64_t d, const float* weight, float eps, const std::vector<float*>& out) {
  normalize(in, 0, static_cast<int64_t>(in.size()), d, weight, eps, out);
}

// the rows of a step split between the threads: each row's arithmetic is the same whichever share it falls in
// (the kernels' bits are checked against the models' at start-up, at 1 to 16 rows)
template <typename F>
void for_rows(int64_t rows, const F& body) {
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the other threads take the caller's
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::optional<c10::InferenceMode> guard;
    if (inference) guard.emplace();
    body(begin, end);
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_weight(weight, x.size(-1), "weight");
  auto out = at::empty(x.sizes(), x.options());
  auto rows = rows_of(out);
  normalize(rows_of(x), x.size(-1), weight.data_ptr<float>(), static_cast<float>(eps), rows);
  return out;
}

// residual + update (the layer's residual add), then RMSNorm of the sum: (sum, normalized)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& update,
                                                const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(update, "update");
  TORCH_CHECK(residual.sizes() == update.sizes(), "decode_layer: residual ", residual.sizes(), " and update ",
              update.sizes());
  const int64_t d = residual.size(-1);
  check_weight(weight, d, "weight");
  auto sum = at::empty(residual.sizes(), residual.options());
  auto out = at::empty(residual.sizes(), residual.options());
  // one thread: split between two, a step's 16 rows took as long (the norm's reduction is a few microseconds)
  auto a = rows_of(residual), b = rows_of(update), s = rows_of(sum), o = rows_of(out);
  for (size_t r = 0; r < s.size(); ++r) {
    for (int64_t i = 0; i < d; ++i) s[r][i] = a[r][i] + b[r][i];
  }
  normalize(s, d, weight.data_ptr<float>(), static_cast<float>(eps), o);
  return {sum, out};
}

// The attention's inputs from a decode step's fused query-key-value product qkv [B, 1, (Hq + 2 Hkv) D]: the
// queries and keys normed (Qwen3's q_norm and k_norm, when given) and rotated (q * cos + rotate_half(q) * sin,
// cos and sin [B, 1, D]); the keys and values written to the cache ([Hkv, slots, D] each) at each row's slot;
// returns the queries [B, Hq, 1, D].
at::Tensor attention_inputs(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t dim,
                            const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                            const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& slots) {
  check_rows(key_cache, "key_cache");
  check_rows(value_cache, "value_cache");
  for (const auto* t : {&key_cache, &value_cache}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == kv_heads && t->size(2) == dim, "decode_layer: a cache of [",
                kv_heads, ", slots, ", dim, "], got ", t->sizes());
  }
  const CacheRows keys{key_cache.data_ptr<float>(), key_cache.stride(0), key_cache.stride(1), key_cache.size(1)};
  const CacheRows values{value_cache.data_ptr<float>(), value_cache.stride(0), value_cache.stride(1),
                         value_cache.size(1)};
  return attention_inputs(qkv, heads, kv_heads, dim, cos, sin, q_norm, k_norm, eps, keys, values, slots);
}

at::Tensor attention_inputs(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t dim,
                            const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                            const c10::optional<at::Tensor>& k_norm, double eps, const CacheRows& key_cache,
                            const CacheRows& value_cache, const at::Tensor& slots) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t batch = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == 1 && qkv.size(2) == (heads + 2 * kv_heads) * dim,
              "decode_layer: qkv ", qkv.sizes(), " for ", heads, " + 2 x ", kv_heads, " heads of ", dim);
  TORCH_CHECK(dim % 2 == 0, "decode_layer: an even head size, got ", dim);
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == batch && t->size(1) == 1 && t->size(2) == dim,
                "decode_layer: cos and sin of [", batch, ", 1, ", dim, "], got ", t->sizes());
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == batch,
              "decode_layer: one int64 slot per row, got ", slots.sizes(), " ", slots.scalar_type());
  auto slot = slots.contiguous();
  const int64_t* slot_of = slot.data_ptr<int64_t>();
  const int64_t capacity = std::min(key_cache.slots, value_cache.slots);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slot_of[b] >= 0 && slot_of[b] < capacity, "decode_layer: row ", b, "'s slot ", slot_of[b],
                " is outside the cache's ", capacity);
  }
  const float e = static_cast<float>(eps);
  auto queries = at::empty({batch, heads, 1, dim}, qkv.options());
  auto keys = at::empty({batch, kv_heads, dim}, qkv.options());
  std::vector<float*> q_in, k_in, v_in, q_out, k_out;
  for (int64_t b = 0; b < batch; ++b) {
    float* row = qkv.data_ptr<float>() + b * qkv.stride(0);
    for (int64_t h = 0; h < heads; ++h) {
      q_in.push_back(row + h * dim);
      q_out.push_back(queries.data_ptr<float>() + (b * heads + h) * dim);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      k_in.push_back(row + (heads + h) * dim);
      v_in.push_back(row + (heads + kv_heads + h) * dim);
      k_out.push_back(keys.data_ptr<float>() + (b * kv_heads + h) * dim);
    }
  }
  for (const auto* norm : {&q_norm, &k_norm}) {
    if (norm->has_value()) check_weight(norm->value(), dim, "q_norm and k_norm weights");
  }
  const int64_t half = dim / 2;
  float* kc = key_cache.data;
  float* vc = value_cache.data;
  for_rows(batch, [&](int64_t first, int64_t last) {
    // normed (each head's row is a row of the norm), then rotated in place
    if (q_norm.has_value()) normalize(q_in, first * heads, last * heads, dim, q_norm->data_ptr<float>(), e, q_out);
    if (k_norm.has_value()) {
      normalize(k_in, first * kv_heads, last * kv_heads, dim, k_norm->data_ptr<float>(), e, k_out);
    }
    std::vector<float> x(dim);
    auto rotate = [&](const float* src, float* dst, const float* c, const float* s) {
      std::copy(src, src + dim, x.begin());  // src may be dst (normed in place)
      for (int64_t i = 0; i < half; ++i) dst[i] = x[i] * c[i] + (-x[i + half]) * s[i];
      for (int64_t i = half; i < dim; ++i) dst[i] = x[i] * c[i] + x[i - half] * s[i];
    };
    for (int64_t b = first; b < last; ++b) {
      const float* c = cos.data_ptr<float>() + b * cos.stride(0);
      const float* s = sin.data_ptr<float>() + b * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t r = b * heads + h;
        rotate(q_norm.has_value() ? q_out[r] : q_in[r], q_out[r], c, s);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t r = b * kv_heads + h;
        rotate(k_norm.has_value() ? k_out[r] : k_in[r], k_out[r], c, s);
        float* key_slot = kc + h * key_cache.head_stride + slot_of[b] * key_cache.slot_stride;
        float* value_slot = vc + h * value_cache.head_stride + slot_of[b] * value_cache.slot_stride;
        std::copy(k_out[r], k_out[r] + dim, key_slot);
        std::copy(v_in[r], v_in[r] + dim, value_slot);
      }
    }
  });
  return queries;
}

// SiLU(gate) * up over a fused gate-up product's output [..., 2 I]: ATen's SiLU, then one rounded product
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(-1) == 2 * intermediate, "decode_layer: gate_up of ", gate_up.sizes(), " for ",
              intermediate, " + ", intermediate, " columns");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = intermediate;
  auto out = at::empty(sizes, gate_up.options());
  const auto gate = gate_up.reshape({-1, 2 * intermediate}).narrow(1, 0, intermediate);
  const auto act2d = out.view({-1, intermediate});
  const auto up = rows_of(gate_up), act = rows_of(out);
  for_rows(act2d.size(0), [&](int64_t begin, int64_t end) {
    if (!aten_calls) {  // the gate: a row's first half, up its second
      for (int64_t r = begin; r < end; ++r) silu_mul_row(up[r], up[r] + intermediate, act[r], intermediate);
      return;
    }
    auto chunk = act2d.narrow(0, begin, end - begin);
    at::silu_out(chunk, gate.narrow(0, begin, end - begin));
    for (int64_t r = begin; r < end; ++r) {
      const float* u = up[r] + intermediate;
      for (int64_t i = 0; i < intermediate; ++i) act[r][i] = act[r][i] * u[i];
    }
  });
  return out;
}

// whether the RMSNorm's mean and SiLU call ATen (``aten_calls`` above); returns the setting before
bool use_aten_calls(bool on) { return aten_calls.exchange(on); }

// x.pow(2).mean(-1, keepdim=True) of a 2-d float32 tensor as the RMSNorms here compute it now (the start-up check
// compares it with ATen's over many widths before the loops are used)
at::Tensor mean_of_squares(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "decode_layer: mean_of_squares takes [rows, d], got ", x.sizes());
  auto out = at::empty({x.size(0), 1}, x.options());
  means_of_squares(rows_of(x), 0, x.size(0), x.size(1), out.data_ptr<float>());
  return out;
}
