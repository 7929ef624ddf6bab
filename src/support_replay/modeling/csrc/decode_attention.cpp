// Attention of one query token per row over its keys and values, on a CPU (modeling/decode_attention.py).
//
// q [B, Hq, 1, D], k and v [B, Hkv, L, D] (any strides, the last dimension contiguous), an optional mask
// broadcastable to [B, Hq, 1, L] (boolean, true where a key is seen, or additive), out [B, 1, Hq, D].
// Each (row, key-value head) is one task: its Hq / Hkv queries read each key and value once. A task's
// arithmetic is fixed (the same vector order whatever the batch, the width or the thread count), and a
// masked key (false, or -inf) is skipped, its seen keys taken in key order wherever padding put them, so
// a row's output keeps its bits whatever rows or padding share the call. Scores, softmax and the weighted
// sum are float32; bf16 inputs are read as float32 and the output rounded once.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

inline float dot(const float* a, const float* b, int64_t d) {
  Vec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * W <= d; i += 2 * W) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + i + W), Vec::loadu(b + i + W), acc1);
  }
  if (i + W <= d) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
    i += W;
  }
  if (i < d) acc1 = at::vec::fmadd(Vec::loadu(a + i, d - i), Vec::loadu(b + i, d - i), acc1);
  return at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, acc0 + acc1);
}

inline void add_scaled(float p, const float* x, float* y, int64_t d) {
  const Vec pv(p);
  int64_t i = 0;
  for (; i + W <= d; i += W) at::vec::fmadd(pv, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  if (i < d) at::vec::fmadd(pv, Vec::loadu(x + i, d - i), Vec::loadu(y + i, d - i)).store(y + i, d - i);
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
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * d), scores(group * width), acc(group * d), buffer(d);
    std::vector<float> packed(width);
    std::vector<int64_t> rank(width);
    std::vector<char> seen(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + b * q0 + (h * group + g) * q1;
        for (int64_t i = 0; i < d; ++i) queries[g * d + i] = static_cast<float>(src[i]);
      }
      const T* keys = kp + b * k0 + h * k1;
      const T* values = vp + b * v0 + h * v1;
      // scores: q . k * scale + mask; a key masked for every query of the group is never read
      for (int64_t l = 0; l < width; ++l) {
        bool any = false;
        const float* key = nullptr;
        for (int64_t g = 0; g < group; ++g) {
          const float term = mask ? mask_term(mask, b * m0 + (h * group + g) * m1 + l * m3) : 0.f;
          float& s = scores[g * width + l];
          if (term == minus_inf) {
            s = minus_inf;
            continue;
          }
          if (key == nullptr) key = as_float(keys + l * k2, buffer.data(), d);
          s = dot(queries.data() + g * d, key, d) * scale + term;
          any = true;
        }
        seen[l] = any;
      }
      // softmax of each query's scores over its seen keys, packed in key order first: the vector lanes each
      // term lands in depend on its rank among the seen keys only, not on where padding put it
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * width;
        int64_t n = 0;
        for (int64_t l = 0; l < width; ++l) {
          if (s[l] != minus_inf) {
            packed[n] = s[l];
            rank[n++] = l;
          }
          s[l] = 0.f;
        }
        if (n == 0) continue;  // every key masked: sdpa's answer is NaN; ours is zeros (no such row in a decode)
        const float top =
            at::vec::reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, packed.data(), n);
        at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, packed.data(), packed.data(), n);
        const float total = at::vec::reduce_all<float>([](Vec x, Vec y) { return x + y; }, packed.data(), n);
        const float inverse = 1.f / total;
        for (int64_t j = 0; j < n; ++j) s[rank[j]] = packed[j] * inverse;
      }
      // the weighted sum of the values seen, in key order
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < width; ++l) {
        if (!seen[l]) continue;
        const float* value = as_float(values + l * v2, buffer.data(), d);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * width + l];
          if (p != 0.f) add_scaled(p, value, acc.data() + g * d, d);
        }
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
