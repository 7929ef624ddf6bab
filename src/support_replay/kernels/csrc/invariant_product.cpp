// The batch-invariant product of true-on-policy mode (modeling/invariant_ops.py): out = x W^T (+ bias), each
// output element one dot of lanes.h (W lanes of fused multiply-adds over K, folded by one fixed tree) in float32,
// then its bias added and the sum rounded once to the output's dtype. An element's arithmetic depends on K and W
// alone: not on the row count, the columns computed beside it (a column subset, a fused QKV or gate/up weight), the
// strides, the tile it falls in or the thread that takes it. So the engine's decode step (a few rows), its prefill
// and the trainer's forward (thousands of packed rows) give a row the same bits, on every CPU kind and kernel set,
// by construction: nothing here is a vendor library's choice.
//
// Tiles of R rows x C columns (R C = W accumulators, lane_sums reduces them together), rows and columns taken from
// panels sized to stay in the core's caches; a tile at an edge repeats its last row or column (the same arithmetic,
// the extra results dropped); fewer than R rows take tiles of one row x W columns. ``dots`` takes each row's own
// list of columns (the sparse LM head: a token's logits at its support ids) with the same dot.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels.h"
#include "lanes.h"

namespace {

using lanes::load_floats;
using lanes::Raw;
using lanes::Vec;
using lanes::W;

// rows x columns of a full tile: W accumulators
constexpr int R = W >= 16 ? 4 : 2;
constexpr int C = W / R;
// a panel's rows of x (or of W) take at most this many bytes, so a tile's operands come from the nearest caches
constexpr int64_t ROW_PANEL_BYTES = 96 << 10, COLUMN_PANEL_BYTES = 160 << 10;

// the W dots of rows xs[I / Cs] with columns ws[I % Cs] (Rs x Cs = W), into out[I]: each a chain over K per lane,
// then lane_sums. Every accumulator at a constant index (a fold over I), so they stay in registers.
template <typename T, int Rs, int Cs, std::size_t... I>
inline void tile_dots(const T* const* xs, const T* const* ws, int64_t k_size, float* out, std::index_sequence<I...>) {
  static_assert(Rs * Cs == W);
  Raw acc[W];
  ((acc[I] = Vec(0.f)), ...);
  int64_t k = 0;
  for (; k + W <= k_size; k += W) {
    Raw x[Rs], w[Cs];
    for (int r = 0; r < Rs; ++r) x[r] = load_floats(xs[r] + k);
    for (int c = 0; c < Cs; ++c) w[c] = load_floats(ws[c] + k);
    ((acc[I] = at::vec::fmadd(Vec(x[I / Cs]), Vec(w[I % Cs]), Vec(acc[I]))), ...);
  }
  if (k < k_size) {
    const int64_t tail = k_size - k;
    Raw x[Rs], w[Cs];
    for (int r = 0; r < Rs; ++r) x[r] = load_floats(xs[r] + k, tail);
    for (int c = 0; c < Cs; ++c) w[c] = load_floats(ws[c] + k, tail);
    ((acc[I] = at::vec::fmadd(Vec(x[I / Cs]), Vec(w[I % Cs]), Vec(acc[I]))), ...);
  }
  // a copy for lane_sums to read through a pointer: the loop's array is never address-taken, so GCC keeps it in
  // registers (taken by lane_sums itself, it stored all W accumulators to the stack at every step)
  Raw sums[W];
  ((sums[I] = acc[I]), ...);
  lanes::lane_sums(sums, out);
}

template <typename T, int Rs, int Cs>
inline void tile(const T* const* xs, const T* const* ws, int64_t k_size, float* out) {
  tile_dots<T, Rs, Cs>(xs, ws, k_size, out, std::make_index_sequence<W>());
}

template <typename T>
struct Product {
  const T* x;
  int64_t x_stride;  // between rows of x
  const T* weight;
  int64_t w_stride;               // between rows of the weight
  const float* bias;              // per weight row (float32), or null
  T* out;
  int64_t rows, cols, k_size;

  const T* column(int64_t c) const { return weight + c * w_stride; }

  void store(int64_t row, int64_t col, float sum) const {
    if (bias) sum = sum + bias[col];
    out[row * cols + col] = static_cast<T>(sum);  // rounded once (bf16: to nearest even)
  }

  // the dots of rows [r0, r1) with columns [c0, c1)
  void block(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    float sums[W];
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      const T* xs[R];
      for (int i = 0; i < R; ++i) xs[i] = x + (r + i) * x_stride;
      for (int64_t c = c0; c < c1; c += C) {
        const T* ws[C];
        for (int j = 0; j < C; ++j) ws[j] = column(std::min(c + j, c1 - 1));  // the edge repeats its last column
        tile<T, R, C>(xs, ws, k_size, sums);
        for (int i = 0; i < R; ++i) {
          for (int j = 0; j < C && c + j < c1; ++j) store(r + i, c + j, sums[i * C + j]);
        }
      }
    }
    for (; r < r1; ++r) {  // fewer than R rows left: one row against W columns a tile
      const T* xs[1] = {x + r * x_stride};
      for (int64_t c = c0; c < c1; c += W) {
        const T* ws[W];
        for (int j = 0; j < W; ++j) ws[j] = column(std::min<int64_t>(c + j, c1 - 1));
        tile<T, 1, W>(xs, ws, k_size, sums);
        for (int j = 0; j < W && c + j < c1; ++j) store(r, c + j, sums[j]);
      }
    }
  }

  void run() const {
    const int64_t row_bytes = std::max<int64_t>(1, k_size * static_cast<int64_t>(sizeof(T)));
    const int64_t panel_rows = std::max<int64_t>(R, ROW_PANEL_BYTES / row_bytes / R * R);
    const int64_t panel_cols = std::max<int64_t>(W, COLUMN_PANEL_BYTES / row_bytes / W * W);
    const int64_t row_panels = (rows + panel_rows - 1) / panel_rows;
    const int64_t col_panels = (cols + panel_cols - 1) / panel_cols;
    // each task one panel of columns against one panel of rows; which thread takes it changes no arithmetic
    at::parallel_for(0, row_panels * col_panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t cp = task / row_panels, rp = task % row_panels;
        const int64_t c0 = cp * panel_cols, c1 = std::min(cols, c0 + panel_cols);
        const int64_t r0 = rp * panel_rows, r1 = std::min(rows, r0 + panel_rows);
        block(r0, r1, c0, c1);
      }
    });
  }
};

// per row: the dots of x[t] with the weight rows ids[t, :count[t]] (a row's columns in tiles of W), each rounded once
// to T; the ids past count[t] stay as the caller made them
template <typename T>
void row_dots(const T* x, int64_t x_stride, const T* weight, int64_t w_stride, const int64_t* ids, int64_t id_stride,
              const int64_t* counts, int64_t rows, int64_t k_size, T* out, int64_t out_stride) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float sums[W];
    for (int64_t t = begin; t < end; ++t) {
      const T* xs[1] = {x + t * x_stride};
      const int64_t* row_ids = ids + t * id_stride;
      const int64_t n = counts[t];
      for (int64_t c = 0; c < n; c += W) {
        const T* ws[W];
        for (int j = 0; j < W; ++j) ws[j] = weight + row_ids[std::min<int64_t>(c + j, n - 1)] * w_stride;
        tile<T, 1, W>(xs, ws, k_size, sums);
        for (int j = 0; j < W && c + j < n; ++j) out[t * out_stride + c + j] = static_cast<T>(sums[j]);
      }
    }
  });
}

// calls f with a zero of x's element type: float or c10::BFloat16 (the two this arithmetic reads)
template <typename F>
void dispatch(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat) {
    f(float(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "invariant product: float32 or bfloat16, got ", x.scalar_type());
    f(c10::BFloat16(0.f));
  }
}

at::Tensor rows_of(const at::Tensor& x, const char* name, int64_t k_size) {
  TORCH_CHECK(x.device().is_cpu(), "invariant product: ", name, " on the CPU");
  TORCH_CHECK(x.size(-1) == k_size, "invariant product: ", name, " has ", x.size(-1), " features, the weight ",
              k_size);
  auto flat = x.reshape({-1, k_size});
  if (flat.stride(1) != 1 && k_size > 1) flat = flat.contiguous();
  return flat;
}

}  // namespace

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "invariant_linear: a 2-d CPU weight, got ",
              weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "invariant_linear: x is ", x.scalar_type(), ", the weight ",
              weight.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "invariant_linear: float32 or bfloat16, got ", x.scalar_type());
  const int64_t k_size = weight.size(1);
  const auto flat = rows_of(x, "x", k_size);
  auto w = weight.stride(1) == 1 || k_size == 1 ? weight : weight.contiguous();
  const int64_t cols = w.size(0);
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "invariant_linear: bias ", bias->sizes(),
                " for a weight of ", w.size(0), " rows");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = cols;
  auto out = at::empty({flat.size(0), cols}, x.options());
  if (flat.size(0) && cols) {
    dispatch(x, [&](auto zero) {
      using T = decltype(zero);
      Product<T>{flat.data_ptr<T>(), flat.stride(0), w.data_ptr<T>(), w.stride(0),
                 bias32.defined() ? bias32.data_ptr<float>() : nullptr, out.data_ptr<T>(), flat.size(0), cols, k_size}
          .run();
    });
  }
  return out.view(shape);
}

at::Tensor invariant_dots(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ids,
                          const at::Tensor& counts) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "invariant_dots: a 2-d CPU weight, got ",
              weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "invariant_dots: x is ", x.scalar_type(), ", the weight ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0) && counts.dim() == 1 &&
                  counts.size(0) == x.size(0),
              "invariant_dots: x [T, K], ids [T, J] and counts [T], got ", x.sizes(), ", ", ids.sizes(), ", ",
              counts.sizes());
  const int64_t k_size = weight.size(1);
  const auto flat = rows_of(x, "x", k_size);
  auto w = weight.stride(1) == 1 || k_size == 1 ? weight : weight.contiguous();
  const auto index = ids.to(at::kLong).contiguous();
  const auto count = counts.to(at::kLong).contiguous();
  const int64_t* cp = count.data_ptr<int64_t>();
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < count.size(0); ++t) {
    TORCH_CHECK(cp[t] >= 0 && cp[t] <= index.size(1), "invariant_dots: row ", t, " has ", cp[t], " of ",
                index.size(1), " ids");
    for (int64_t j = 0; j < cp[t]; ++j) {
      const int64_t id = ip[t * index.size(1) + j];
      TORCH_CHECK(id >= 0 && id < w.size(0), "invariant_dots: row ", t, " names id ", id, " of ", w.size(0));
    }
  }
  auto out = at::zeros({flat.size(0), index.size(1)}, x.options());
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    row_dots<T>(flat.data_ptr<T>(), flat.stride(0), w.data_ptr<T>(), w.stride(0), ip, index.size(1), cp,
                flat.size(0), k_size, out.data_ptr<T>(), out.size(1));
  });
  return out;
}
