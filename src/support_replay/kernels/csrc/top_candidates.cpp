// The first ``width`` entries of each row's full sort by (value descending, id ascending), float32 on a CPU
// (kernels/top_candidates.py): what the sampler's rank filters read, without a pass of torch.topk over the
// vocabulary.
//
// The order is a total one (a tie of values goes to the lower id; NaN sorts above every number, as in torch.sort
// descending), so the selection is unique and needs no tie handling. A row is read once for the largest value of
// each chunk of it; only the chunks that can hold a selected entry are read again (``select_row``). Rows are
// independent tasks.

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/cpu/vec/functional.h>  // vec_reduce_all: vec.h alone brings it under AVX2, not under AVX-512
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

struct Entry {
  float value;
  int64_t id;
};

// a before b in the full sort: the larger value (NaN above every number), then the lower id
inline bool before(const Entry& a, const Entry& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.id < b.id;
}

// std's heap functions keep the largest under ``less`` at the root; ``less = before`` puts the worst kept entry there
struct Worst {
  bool operator()(const Entry& a, const Entry& b) const { return before(a, b); }
};

// The heap: a row with a NaN (rare; NaN outranks every number, so a chunk's largest value says nothing there)
void select_by_heap(const float* row, int64_t vocab, int64_t width, float* values, int64_t* ids) {
  std::vector<Entry> heap(width);
  for (int64_t i = 0; i < width; ++i) heap[i] = {row[i], i};
  std::make_heap(heap.begin(), heap.end(), Worst());
  // ids grow along the row: an entry beats the root (the worst kept) only by a larger value or NaN over a number
  for (int64_t i = width; i < vocab && !std::isnan(heap.front().value); ++i) {
    if (before({row[i], i}, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), Worst());
      heap.back() = {row[i], i};
      std::push_heap(heap.begin(), heap.end(), Worst());
    }
  }
  std::sort(heap.begin(), heap.end(), before);
  for (int64_t j = 0; j < width; ++j) {
    values[j] = heap[j].value;
    ids[j] = heap[j].id;
  }
}

// The row's largest value in each chunk of up to 64 values; the width-th largest of those, t, is at most the row's
// width-th largest value (width chunks hold a value >= t each), so the selection lies among the values >= t, in the
// chunks whose largest value is >= t: a few times width entries on a smooth row, at most width chunks' worth plus
// width ties on any row. NaN: the heap instead.
void select_row(const float* row, int64_t vocab, int64_t width, float* values, int64_t* ids) {
  const int64_t chunk = std::max<int64_t>(W, std::min<int64_t>(64, vocab / (4 * width)) / W * W);
  const int64_t chunks = (vocab + chunk - 1) / chunk;
  std::vector<float> largest(chunks);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * chunk, end = std::min(begin + chunk, vocab);
    int64_t i = begin;
    float top = -std::numeric_limits<float>::infinity();
    if (i + W <= end) {
      Vec acc = Vec::loadu(row + i);
      for (i += W; i + W <= end; i += W) acc = at::vec::maximum(acc, Vec::loadu(row + i));  // NaN propagates
      top = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, acc);
    }
    for (; i < end; ++i) top = (row[i] > top || std::isnan(row[i])) ? row[i] : top;
    if (std::isnan(top)) return select_by_heap(row, vocab, width, values, ids);
    largest[c] = top;
  }
  float threshold = -std::numeric_limits<float>::infinity();
  if (chunks >= width) {
    std::vector<float> order(largest);
    std::nth_element(order.begin(), order.begin() + (width - 1), order.end(), std::greater<float>());
    threshold = order[width - 1];
  }
  // Entries above t lie in the fewer than width chunks whose largest value is above t. Entries equal to t are
  // ties, won by the lower id: the first width of them along the row are all the selection can take (a flat row,
  // or a grammar's mask of exact zeros, would otherwise keep the whole row)
  std::vector<Entry> kept;
  kept.reserve(4 * width);
  int64_t ties = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (!(largest[c] > threshold || (largest[c] == threshold && ties < width))) continue;
    const int64_t begin = c * chunk, end = std::min(begin + chunk, vocab);
    for (int64_t i = begin; i < end; ++i) {
      if (row[i] > threshold) {
        kept.push_back({row[i], i});
      } else if (row[i] == threshold && ties < width) {
        kept.push_back({row[i], i});
        ++ties;
      }
    }
  }
  // the width first of the kept in the full sort's order (nth_element then a sort of those: linear in the kept)
  std::nth_element(kept.begin(), kept.begin() + (width - 1), kept.end(), before);
  std::sort(kept.begin(), kept.begin() + width, before);
  for (int64_t j = 0; j < width; ++j) {
    values[j] = kept[j].value;
    ids[j] = kept[j].id;
  }
}

// softmax(x / t) of one row of n logits as ATen computes a float32 softmax over the last dimension (SoftMaxKernel.cpp's
// _vec_softmax_lastdim: the vectors' maximum, exp(x - max) written out, their vectors' sum, each times 1 / sum), with
// the division by the temperature before it as Python's ``logits / temp`` (IEEE division, exact per element; skipped
// at t = 1, where it is the identity). The same ATen vector functions, so the same bits where the build's ISA is
// ATen's own (checked at start-up against torch.softmax: kernels/top_candidates.py).
inline void softmax_row(const float* in, float* out, int64_t n, float t) {
  const float* x = in;
  if (t != 1.f) {
    at::vec::map([t](Vec a) { return a / Vec(t); }, out, in, n);
    x = out;
  }
  const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
  at::vec::map([top](Vec a) { return (a - Vec(top)).exp(); }, out, x, n);
  float sum = at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, out, n);
  sum = 1 / sum;
  at::vec::map([sum](Vec a) { return a * Vec(sum); }, out, out, n);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> top_candidates(const at::Tensor& probs, int64_t width) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat,
              "top_candidates: probs must be a float32 CPU tensor, got ", probs.scalar_type(), " on ", probs.device());
  TORCH_CHECK(probs.dim() == 2, "top_candidates: probs must be [rows, vocab], got ", probs.sizes());
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(width >= 1 && width <= vocab, "top_candidates: width must be in [1, ", vocab, "], got ", width);
  const auto input = probs.contiguous();
  auto values = at::empty({rows, width}, probs.options());
  auto ids = at::empty({rows, width}, probs.options().dtype(at::kLong));
  const float* in = input.data_ptr<float>();
  float* out_values = values.data_ptr<float>();
  int64_t* out_ids = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      select_row(in + r * vocab, vocab, width, out_values + r * width, out_ids + r * width);
    }
  });
  return {values, ids};
}

// SGLang's rule over each row's first ``width`` ranks (core/sampling.py's ``_keep_sglang`` on ``top_candidates``),
// then the kept ids in ascending order (``_rows_of_ranks``), in one call: what the sampler draws from and scores,
// without a dozen small tensor operations between. The rule's arithmetic is PyTorch's: the cumulative sum of the
// ranks' probabilities in double (ATen's accumulation type for float on a CPU), each prefix rounded to float; the
// exclusive mass a float subtraction; top_p compared as float32, min_p times the largest probability as a float32
// product. Python checks the result against those operations at start-up before it uses this
// (kernels/top_candidates.py). Returns (ids [rows, K], valid [rows, K], the kept ids row after row, counts [rows]),
// K the most any row keeps (at least 1), padding ids 0.
namespace {

void check_columns(const char* name, int64_t rows, const at::Tensor& top_k, const at::Tensor& top_p,
                   const at::Tensor& min_p) {
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.numel() == rows, name, ": top_k of ", rows,
              " int64 values, got ", top_k.sizes(), " ", top_k.scalar_type());
  TORCH_CHECK(top_p.scalar_type() == at::kDouble && top_p.numel() == rows, name, ": top_p of ", rows,
              " float64 values, got ", top_p.sizes(), " ", top_p.scalar_type());
  TORCH_CHECK(min_p.scalar_type() == at::kFloat && min_p.numel() == rows, name, ": min_p of ", rows,
              " float32 values, got ", min_p.sizes(), " ", min_p.scalar_type());
}

// the rule over a selection's ``values`` and ``order`` [rows, width]: sglang_rows' four tensors
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rule_rows(const at::Tensor& values, const at::Tensor& order,
                                                                     const at::Tensor& top_k, const at::Tensor& top_p,
                                                                     const at::Tensor& min_p) {
  const int64_t rows = values.size(0), width = values.size(1);
  const auto k_col = top_k.contiguous(), p_col = top_p.contiguous(), m_col = min_p.contiguous();
  const int64_t* k_of = k_col.data_ptr<int64_t>();
  const double* p_of = p_col.data_ptr<double>();
  const float* m_of = m_col.data_ptr<float>();
  const float* value = values.data_ptr<float>();
  const int64_t* id = order.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> kept(rows);
  int64_t most = 1, total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = value + r * width;
    const float top = v[0];
    const float p = static_cast<float>(p_of[r]);
    const bool any_mass = p_of[r] >= 1;
    const float floor = m_of[r] * top;
    double running = 0;
    for (int64_t j = 0; j < width; ++j) {
      running += static_cast<double>(v[j]);
      const float exclusive = static_cast<float>(running) - v[j];
      const bool keep = j < k_of[r] && (exclusive <= p || any_mass) && v[j] >= floor && v[j] > 0;
      if (keep) kept[r].push_back(id[r * width + j]);
    }
    std::sort(kept[r].begin(), kept[r].end());
    most = std::max<int64_t>(most, static_cast<int64_t>(kept[r].size()));
    total += static_cast<int64_t>(kept[r].size());
  }
  const auto long_options = values.options().dtype(at::kLong);
  auto ids = at::zeros({rows, most}, long_options);
  auto valid = at::zeros({rows, most}, values.options().dtype(at::kBool));
  auto cols = at::empty({total}, long_options);
  auto counts = at::empty({rows}, long_options);
  int64_t* ids_out = ids.data_ptr<int64_t>();
  bool* valid_out = valid.data_ptr<bool>();
  int64_t* cols_out = cols.data_ptr<int64_t>();
  int64_t* counts_out = counts.data_ptr<int64_t>();
  for (int64_t r = 0, c = 0; r < rows; ++r) {
    counts_out[r] = static_cast<int64_t>(kept[r].size());
    for (size_t j = 0; j < kept[r].size(); ++j, ++c) {
      ids_out[r * most + j] = kept[r][j];
      valid_out[r * most + j] = true;
      cols_out[c] = kept[r][j];
    }
  }
  return {ids, valid, cols, counts};
}

// the draw over the kept ids: each row's weights (its probabilities at the kept ids, 0 at padding) over Exp(1) noise,
// row r drawing exactly counts[r] values from its own generator (padding 1), clamped at 1e-30; the largest ratio's id
at::Tensor draw_tokens(const at::Tensor& probs, const at::Tensor& ids, const at::Tensor& valid,
                       const at::Tensor& counts, const std::vector<at::Generator>& generators) {
  const int64_t rows = probs.size(0);
  auto weights = probs.gather(1, ids).masked_fill_(valid.logical_not(), 0.0);
  auto noise = at::ones(ids.sizes(), probs.options());
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    noise.select(0, r).narrow(0, 0, count[r]).exponential_(1.0, generators[r]);
  }
  noise.clamp_min_(1e-30);
  return ids.gather(1, (weights / noise).argmax(-1, true)).squeeze(1);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sglang_rows(const at::Tensor& probs, int64_t width,
                                                                       const at::Tensor& top_k,
                                                                       const at::Tensor& top_p,
                                                                       const at::Tensor& min_p) {
  check_columns("sglang_rows", probs.size(0), top_k, top_p, min_p);
  const auto [values, order] = top_candidates(probs, width);
  return rule_rows(values, order, top_k, top_p, min_p);
}

// ``sglang_rows``, then the draw core/sampling.py makes from them, with its operations: each row's weights (its
// probabilities at the kept ids, 0 at padding) over Exp(1) noise, row r drawing exactly counts[r] values from its own
// generator (padding 1), clamped at 1e-30; the token the largest ratio's id. The same ATen operations in the same
// order as Python's, so the same bits, without the interpreter between them. Returns sglang_rows' four tensors and
// the tokens [rows].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sglang_draw(
    const at::Tensor& probs, int64_t width, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
    const std::vector<at::Generator>& generators) {
  const int64_t rows = probs.size(0);
  TORCH_CHECK(static_cast<int64_t>(generators.size()) == rows, "sglang_draw: ", generators.size(),
              " generators for ", rows, " rows");
  auto [ids, valid, cols, counts] = sglang_rows(probs, width, top_k, top_p, min_p);
  auto tokens = draw_tokens(probs, ids, valid, counts, generators);
  return {ids, valid, cols, counts, tokens};
}

// ``sglang_draw`` from the logits: each row's softmax(z / T) (softmax_row, ATen's bits) and its selection in one task,
// so the selection reads a row its softmax has just written (the row in the nearest caches, not 3 MB of 16 rows read
// again from memory after the head's product), and no [rows, vocab] pass between. Returns sglang_draw's five tensors
// and the probabilities [rows, vocab].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sglang_draw_logits(
    const at::Tensor& logits, int64_t width, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& min_p, const std::vector<at::Generator>& generators) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "sglang_draw_logits: logits must be a float32 [rows, vocab] CPU tensor, got ", logits.scalar_type(), " ",
              logits.sizes(), " on ", logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(width >= 1 && width <= vocab, "sglang_draw_logits: width must be in [1, ", vocab, "], got ", width);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == rows, "sglang_draw_logits: ",
              "temperature of ", rows, " float32 values, got ", temperature.sizes(), " ", temperature.scalar_type());
  TORCH_CHECK(static_cast<int64_t>(generators.size()) == rows, "sglang_draw_logits: ", generators.size(),
              " generators for ", rows, " rows");
  check_columns("sglang_draw_logits", rows, top_k, top_p, min_p);
  const auto input = logits.contiguous();
  const auto t_col = temperature.contiguous();
  auto probs = at::empty({rows, vocab}, logits.options());
  auto values = at::empty({rows, width}, logits.options());
  auto order = at::empty({rows, width}, logits.options().dtype(at::kLong));
  const float* in = input.data_ptr<float>();
  const float* t_of = t_col.data_ptr<float>();
  float* p = probs.data_ptr<float>();
  float* out_values = values.data_ptr<float>();
  int64_t* out_ids = order.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      softmax_row(in + r * vocab, p + r * vocab, vocab, t_of[r]);
      select_row(p + r * vocab, vocab, width, out_values + r * width, out_ids + r * width);
    }
  });
  auto [ids, valid, cols, counts] = rule_rows(values, order, top_k, top_p, min_p);
  auto tokens = draw_tokens(probs, ids, valid, counts, generators);
  return {ids, valid, cols, counts, tokens, probs};
}
