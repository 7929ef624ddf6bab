// Attention of one query token per row over its keys and values, on a CPU (modeling/decode_attention.py).
//
// q [B, Hq, 1, D], k and v [B, Hkv, L, D] (any strides, the last dimension contiguous), an optional mask
// broadcastable to [B, Hq, 1, L] (boolean, true where a key is seen, or additive), out [B, 1, Hq, D].
// Each (row, key-value head) is one task: its Hq / Hkv queries read each key and value once. A task's
// arithmetic is fixed (the same vector order whatever the batch, the width or the thread count), and a
// masked key (false, or -inf) is skipped, its seen keys taken in key order wherever padding put them, so
// a row's output keeps its bits whatever rows or padding share the call. Scores, softmax and the weighted
// sum are float32; bf16 inputs are read as float32 and the output rounded once. A query's scores are taken KEYS
// keys at a time (independent chains of fused multiply-adds, each key's dot the same whichever block it falls in),
// and its weighted sum of the values is held in registers, VECTORS vectors of the head at a time.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

constexpr int KEYS = 8;    // keys scored together: independent chains of fused multiply-adds
constexpr int VECTORS = 8;  // vectors of a head's output summed in registers at a time

// one query against N keys, each key's dot a single chain of fused multiply-adds over the head dim and then one
// lane reduction: a dot's arithmetic is the same whichever block of keys it is computed in
template <int N>
inline void dots(const float* q, const float* const* keys, int64_t d, float* out) {
  Vec acc[N];
  for (int j = 0; j < N; ++j) acc[j] = Vec(0.f);
  int64_t i = 0;
  for (; i + W <= d; i += W) {
    const Vec x = Vec::loadu(q + i);
    for (int j = 0; j < N; ++j) acc[j] = at::vec::fmadd(x, Vec::loadu(keys[j] + i), acc[j]);
  }
  if (i < d) {
    const Vec x = Vec::loadu(q + i, d - i);
    for (int j = 0; j < N; ++j) acc[j] = at::vec::fmadd(x, Vec::loadu(keys[j] + i, d - i), acc[j]);
  }
  for (int j = 0; j < N; ++j) out[j] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, acc[j]);
}

inline void all_dots(const float* q, const float* const* keys, int64_t n, int64_t d, float* out) {
  int64_t j = 0;
  for (; j + KEYS <= n; j += KEYS) dots<KEYS>(q, keys + j, d, out + j);
  for (; j < n; ++j) dots<1>(q, keys + j, d, out + j);
}

// out[i .. i + N vectors) = the sum over the keys, in key order, of p[j] * values[j][i ..]: a fused multiply-add
// per key and element, the partial sums held in registers; ``tail`` (< W) elements in one partial vector instead
template <int N>
inline void weighted(const float* p, const float* const* values, int64_t n, int64_t i, float* out, int64_t tail = 0) {
  Vec acc[N];
  for (int r = 0; r < N; ++r) acc[r] = Vec(0.f);
  for (int64_t j = 0; j < n; ++j) {
    const Vec pj(p[j]);
    const float* v = values[j] + i;
    if (tail) {
      acc[0] = at::vec::fmadd(pj, Vec::loadu(v, tail), acc[0]);
    } else {
      for (int r = 0; r < N; ++r) acc[r] = at::vec::fmadd(pj, Vec::loadu(v + r * W), acc[r]);
    }
  }
  if (tail) {
    acc[0].store(out + i, tail);
  } else {
    for (int r = 0; r < N; ++r) acc[r].store(out + i + r * W);
  }
}

template <int N>
inline void weighted_vectors(int64_t vectors, const float* p, const float* const* values, int64_t n, int64_t i,
                             float* out) {
  if constexpr (N > 0) {
    if (vectors == N) return weighted<N>(p, values, n, i, out);
    weighted_vectors<N - 1>(vectors, p, values, n, i, out);
  }
}

inline void weighted_sum(const float* p, const float* const* values, int64_t n, int64_t d, float* out) {
  int64_t i = 0;
  for (; i + VECTORS * W <= d; i += VECTORS * W) weighted<VECTORS>(p, values, n, i, out);
  const int64_t vectors = (d - i) / W;
  weighted_vectors<VECTORS - 1>(vectors, p, values, n, i, out);
  i += vectors * W;
  if (i < d) weighted<1>(p, values, n, i, out, d - i);
}

template <typename T>
inline const float* as_float(const T* src, float* buffer, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    at::vec::convert(src, buffer, d);
    return buffer;
  }
}

template <typename M>
inline float mask_term(const M* mask, int64_t offset) {
  if constexpr (std::is_same_v<M, bool>) {
    return mask[offset] ? 0.f : -std::numeric_limits<float>::infinity();
  } else {
    return static_cast<float>(mask[offset]);
  }
}

template <typename T, typename M>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const M* mask,
            const std::array<int64_t, 3>& mask_strides, float scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(3), kv_heads = k.size(1), width = k.size(2);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q0 = q.stride(0), q1 = q.stride(1);
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), v2 = v.stride(2);
  const auto [m0, m1, m3] = mask_strides;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  constexpr bool convert = !std::is_same_v<T, float>;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * d), terms(group * width), scores(group * width), acc(group * d);
    std::vector<float> packed(width), converted(convert ? 2 * width * d : 0);
    std::vector<int64_t> seen(width), rank(width);
    std::vector<const float*> key_rows(width), value_rows(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + b * q0 + (h * group + g) * q1;
        for (int64_t i = 0; i < d; ++i) queries[g * d + i] = static_cast<float>(src[i]);
      }
      // the keys some query of the group sees, in key order: a key masked for every query is never read
      int64_t n = 0;
      for (int64_t l = 0; l < width; ++l) {
        bool any = false;
        for (int64_t g = 0; g < group; ++g) {
          const float term = mask ? mask_term(mask, b * m0 + (h * group + g) * m1 + l * m3) : 0.f;
          terms[g * width + n] = term;
          any = any || term != minus_inf;
        }
        if (any) seen[n++] = l;
      }
      const T* keys = kp + b * k0 + h * k1;
      const T* values = vp + b * v0 + h * v1;
      for (int64_t j = 0; j < n; ++j) {
        key_rows[j] = as_float(keys + seen[j] * k2, converted.data() + j * d, d);
        value_rows[j] = as_float(values + seen[j] * v2, converted.data() + (width + j) * d, d);
      }
      // scores: q . k * scale + mask, over the keys seen (their rank j among them)
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * width;
        const float* t = terms.data() + g * width;
        all_dots(queries.data() + g * d, key_rows.data(), n, d, s);
        for (int64_t j = 0; j < n; ++j) s[j] = t[j] == minus_inf ? minus_inf : s[j] * scale + t[j];
      }
      // softmax of each query's scores over its seen keys, packed in key order first: the vector lanes each
      // term lands in depend on its rank among the seen keys only, not on where padding put it; then the
      // weighted sum of the values in key order
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * width;
        int64_t m = 0;
        for (int64_t j = 0; j < n; ++j) {
          if (s[j] != minus_inf) {
            packed[m] = s[j];
            rank[m++] = j;
          }
          s[j] = 0.f;
        }
        float* o = acc.data() + g * d;
        if (m == 0) {  // every key masked: sdpa's answer is NaN; ours is zeros (no such row in a decode)
          std::fill(o, o + d, 0.f);
          continue;
        }
        const float top =
            at::vec::reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, packed.data(), m);
        at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, packed.data(), packed.data(), m);
        const float total = at::vec::reduce_all<float>([](Vec x, Vec y) { return x + y; }, packed.data(), m);
        const float inverse = 1.f / total;
        for (int64_t r = 0; r < m; ++r) s[rank[r]] = packed[r] * inverse;
        weighted_sum(s, value_rows.data(), n, d, o);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (b * heads + h * group + g) * d;
        if constexpr (std::is_same_v<T, float>) {
          std::copy(acc.begin() + g * d, acc.begin() + (g + 1) * d, dst);
        } else {
          at::vec::convert(acc.data() + g * d, dst, d);
        }
      }
    }
  });
}

// the mask's strides over (row, head, key), 0 where it broadcasts
std::array<int64_t, 3> broadcast_strides(const at::Tensor& mask) {
  auto stride = [&](int64_t dim) { return mask.size(dim) == 1 ? 0 : mask.stride(dim); };
  return {stride(0), stride(1), stride(3)};
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: 4-d query, keys and values");
  TORCH_CHECK(q.size(2) == 1, "decode_attention: one query per row, got ", q.size(2));
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "decode_attention: keys ", k.sizes(), " and values ", v.sizes(), " do not fit queries ", q.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "decode_attention: ", q.size(1),
              " query heads over ", k.size(1), " key-value heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "decode_attention: one dtype for query, keys and values");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: contiguous head dims");
  auto out = at::empty({q.size(0), 1, q.size(1), q.size(3)}, q.options());
  const float s = static_cast<float>(scale);
  std::array<int64_t, 3> strides{0, 0, 0};
  if (mask.has_value()) {
    const auto& m = mask.value();
    TORCH_CHECK(m.dim() == 4 && m.size(2) == 1 && m.size(3) == k.size(2) &&
                    (m.size(0) == 1 || m.size(0) == q.size(0)) && (m.size(1) == 1 || m.size(1) == q.size(1)),
                "decode_attention: mask ", m.sizes(), " does not broadcast to [", q.size(0), ", ", q.size(1), ", 1, ",
                k.size(2), "]");
    strides = broadcast_strides(m);
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    if (!mask.has_value()) {
      attend<scalar_t, float>(q, k, v, nullptr, strides, s, out);
      return;
    }
    const auto& m = mask.value();
    if (m.scalar_type() == at::kBool) {
      attend<scalar_t, bool>(q, k, v, m.data_ptr<bool>(), strides, s, out);
    } else if (m.scalar_type() == at::kFloat) {
      attend<scalar_t, float>(q, k, v, m.data_ptr<float>(), strides, s, out);
    } else if (m.scalar_type() == at::kBFloat16) {
      attend<scalar_t, at::BFloat16>(q, k, v, m.data_ptr<at::BFloat16>(), strides, s, out);
    } else {
      TORCH_CHECK(false, "decode_attention: a boolean, float32 or bf16 mask, got ", m.scalar_type());
    }
  });
  return out;
}
