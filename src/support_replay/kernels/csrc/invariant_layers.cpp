// The row-wise work of true-on-policy mode's forward besides its products and attention (modeling/invariant_ops.py):
// RMSNorm, SiLU(gate) x up, a row softmax (the mixture-of-experts router) and the rotary embedding's cos and sin.
//
// Each element's arithmetic is fixed here and depends on nothing but its own row (and, for a row's sum, the row's
// width): the same function for every element of a tensor, a short last vector included (ATen's own loops take a
// scalar function for the elements past the last whole vector, where its SiLU rounds differently from its vector
// SiLU, so a value's bits there depended on the tensor's length), and no reduction split between threads. So a row
// gets the same bits in the engine's decode step, its prefill and the trainer's forward.
//
// A row's sum (RMSNorm's sum of squares, the softmax's sum) is lanes.h's: W lanes, each a chain in element order,
// folded halves first; the sum of squares by fused multiply-adds (as a dot of the row with itself). Results are
// rounded where the models' own operations round them (RMSNorm: x * rsqrt(mean + eps) in float32, rounded to the
// input's dtype, then times the weight in that dtype), so a float32 model keeps its usual numbers to the last bits
// of these sums.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

#include "kernels.h"
#include "lanes.h"

namespace {

using lanes::load_floats;
using lanes::Vec;
using lanes::W;

// the lanes of ``acc`` added halves first (lane_sums' tree, for one vector)
inline float fold(const Vec& acc) {
  float lane[W];
  acc.store(lane);
  for (int64_t half = W / 2; half >= 1; half /= 2) {
    for (int64_t k = 0; k < half; ++k) lane[k] = lane[k] + lane[k + half];
  }
  return lane[0];
}

template <typename T>
inline void store(const Vec& v, T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, count);
  } else {
    float lane[W];
    v.store(lane);
    for (int64_t i = 0; i < count; ++i) p[i] = static_cast<T>(lane[i]);  // rounded once, to nearest even
  }
}

// v rounded to T and back to float (the model's cast between two of its operations)
template <typename T>
inline Vec rounded(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    float lane[W];
    v.store(lane);
    for (int64_t i = 0; i < W; ++i) lane[i] = static_cast<float>(static_cast<T>(lane[i]));
    return Vec::loadu(lane);
  }
}

// row(r) for every row of x (``width`` elements each), rows split between the threads
template <typename F>
void for_rows(const at::Tensor& x, int64_t width, F&& row) {
  const int64_t rows = x.numel() / std::max<int64_t>(width, 1);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(r);
  });
}

// calls f with a zero of x's element type: float or c10::BFloat16
template <typename F>
void dispatch(const at::Tensor& x, const char* name, F&& f) {
  if (x.scalar_type() == at::kFloat) {
    f(float(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16, got ", x.scalar_type());
    f(c10::BFloat16(0.f));
  }
}

at::Tensor rows_contiguous(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, name, ": a CPU tensor of at least one dimension");
  return x.contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> invariant_rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  const auto x = rows_contiguous(input, "invariant_rms_norm");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == x.scalar_type(),
              "invariant_rms_norm: a weight of ", n, " ", x.scalar_type(), " values, got ", weight.sizes(), " ",
              weight.scalar_type());
  const auto w = weight.contiguous();
  auto out = at::empty_like(x);
  auto inverse = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));  // rsqrt, per row
  const float epsilon = static_cast<float>(eps);
  dispatch(x, "invariant_rms_norm", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    float* ip = inverse.data_ptr<float>();
    for_rows(x, n, [&](int64_t r) {
      const T* row = xp + r * n;
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        const Vec v = load_floats(row + i);
        acc = at::vec::fmadd(v, v, acc);
      }
      if (i < n) {
        const Vec v = load_floats(row + i, n - i);
        acc = at::vec::fmadd(v, v, acc);
      }
      const float mean = fold(acc) / static_cast<float>(n);
      const float inv = 1.f / std::sqrt(mean + epsilon);  // each operation rounded, as ATen's rsqrt
      ip[r] = inv;
      T* dst = op + r * n;
      for (i = 0; i < n; i += W) {
        const int64_t count = std::min<int64_t>(W, n - i);
        const Vec h = rounded<T>(load_floats(row + i, count) * Vec(inv));
        store<T>(load_floats(wp + i, count) * h, dst + i, count);
      }
    });
  });
  return {out, inverse};
}

at::Tensor invariant_silu_mul(const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.sizes() == up_in.sizes() && gate_in.scalar_type() == up_in.scalar_type(),
              "invariant_silu_mul: gate ", gate_in.sizes(), " ", gate_in.scalar_type(), " and up ", up_in.sizes(),
              " ", up_in.scalar_type(), " differ");
  const auto gate = rows_contiguous(gate_in, "invariant_silu_mul");
  const auto up = up_in.contiguous();
  auto out = at::empty_like(gate);
  const int64_t n = gate.size(-1);
  dispatch(gate, "invariant_silu_mul", [&](auto zero) {
    using T = decltype(zero);
    const T* gp = gate.data_ptr<T>();
    const T* up_ptr = up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    for_rows(gate, n, [&](int64_t r) {
      for (int64_t i = 0; i < n; i += W) {
        const int64_t count = std::min<int64_t>(W, n - i);
        const Vec g = load_floats(gp + r * n + i, count);
        const Vec silu = rounded<T>(g / (Vec(1.f) + g.neg().exp()));  // SiLU rounded to T, then times up
        store<T>(silu * load_floats(up_ptr + r * n + i, count), op + r * n + i, count);
      }
    });
  });
  return out;
}

at::Tensor invariant_softmax(const at::Tensor& input) {
  const auto x = rows_contiguous(input, "invariant_softmax");
  const int64_t n = x.size(-1);
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const float minus_inf = -std::numeric_limits<float>::infinity();
  dispatch(x, "invariant_softmax", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    float* op = out.data_ptr<float>();
    for_rows(x, n, [&](int64_t r) {
      const T* row = xp + r * n;
      float* dst = op + r * n;
      float top = minus_inf;
      for (int64_t i = 0; i < n; ++i) top = std::max(top, static_cast<float>(row[i]));  // a max is exact in any order
      Vec acc(0.f);
      for (int64_t i = 0; i < n; i += W) {
        const int64_t count = std::min<int64_t>(W, n - i);
        const Vec e = (load_floats(row + i, count) - Vec(top)).exp();
        e.store(dst + i, count);
        if (count == W) {
          acc = acc + e;
        } else {  // the lanes past n add nothing
          float lane[W] = {};
          e.store(lane, count);
          acc = acc + Vec::loadu(lane);
        }
      }
      const Vec total(fold(acc));
      for (int64_t i = 0; i < n; i += W) {
        const int64_t count = std::min<int64_t>(W, n - i);
        (Vec::loadu(dst + i, count) / total).store(dst + i, count);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> invariant_rotary(const at::Tensor& inv_freq, const at::Tensor& positions,
                                                    double scaling) {
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat && inv_freq.device().is_cpu(),
              "invariant_rotary: inv_freq a 1-d float32 CPU tensor, got ", inv_freq.sizes(), " ",
              inv_freq.scalar_type());
  const auto freq = inv_freq.contiguous();
  const auto pos = positions.to(at::kFloat).contiguous();
  const int64_t half = freq.size(0), dim = 2 * half, count = pos.numel();
  std::vector<int64_t> shape(pos.sizes().begin(), pos.sizes().end());
  shape.push_back(dim);
  auto cos = at::empty(shape, pos.options());
  auto sin = at::empty(shape, pos.options());
  const float* fp = freq.data_ptr<float>();
  const float* pp = pos.data_ptr<float>();
  float* cp = cos.data_ptr<float>();
  float* sp = sin.data_ptr<float>();
  const Vec scale(static_cast<float>(scaling));
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < half; i += W) {
        const int64_t n = std::min<int64_t>(W, half - i);
        const Vec angle = Vec(pp[t]) * Vec::loadu(fp + i, n);  // position x frequency: one product, as the models'
        const Vec c = angle.cos() * scale, s = angle.sin() * scale;
        for (int64_t copy = 0; copy < 2; ++copy) {  // [freqs, freqs], as the models concatenate them
          c.store(cp + t * dim + copy * half + i, n);
          s.store(sp + t * dim + copy * half + i, n);
        }
      }
    }
  });
  return {cos, sin};
}
