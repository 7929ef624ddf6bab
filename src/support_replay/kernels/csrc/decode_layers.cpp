// A float32 decode step's layers in one call (engine/fused_step.py, ``DecodeLayers``): the same operations, in the
// same order and through the same products, as the fused step's Python loop over its compiled kernels, without
// Python between them. Between a layer's four products that loop spent some 80 us of interpreter, view and argument
// work (0.17 s of a 3.9 s GRPO-shape run on SmolLM2, a Zen 3 EPYC).
//
// Its products: oneDNN's op (``mkldnn::_linear_pointwise``, through the dispatcher) on the packed copy of a weight
// where the step packs it, else the model's own product on the plain weight (``at::linear``: F.linear, or the same
// oneDNN op); the attention is the decode kernel (decode_attention.cpp) over every row's keys and values in place in
// the cache, the rows at one stride of blocks (engine/paged_cache.py); the rest are the layer kernels
// (decode_layer.cpp). The Python side takes this loop only where every one of those holds, and checks its bits
// against its own loop in the tests.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/stl.h>                 // the conversions of std::vector, std::map, optional tensors and strings
#include <torch/csrc/utils/pybind.h>  // at::Tensor's (torch/extension.h brings all of libtorch's C++ API besides)

#include "kernels.h"

namespace {

// oneDNN's linear op as Python calls it: (x, weight, bias, "none", [None], "")
at::Tensor onednn_product(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  c10::List<std::optional<at::Scalar>> scalars;
  scalars.push_back(std::nullopt);
  stack.emplace_back(scalars);
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

struct Product {
  at::Tensor weight;                 // the plain weight (the model's parameter, or a view of the fused one)
  c10::optional<at::Tensor> bias;
  c10::optional<at::Tensor> packed;  // oneDNN's packed copy, where the step packs this weight
  int64_t packed_from = 0;           // the fewest rows the packed copy keeps the plain product's bits from
  // a fused weight's parts' output widths where its product runs them apart (the fused step's ``fused_products``
  // off: this CPU's product changes a fused column's bits), their outputs side by side; empty: one product
  std::vector<int64_t> parts;
};

struct Layer {
  Product qkv, o, gate_up, down;
  at::Tensor post_norm, next_norm;
  double post_eps = 0, next_eps = 0;
  c10::optional<at::Tensor> q_norm, k_norm;
  double head_eps = 0;
  int64_t heads = 0, kv_heads = 0, dim = 0, intermediate = 0;
  double scaling = 1;
};

using Clock = std::chrono::steady_clock;

// the parts of a layer the loop times (``run``'s ``timing``)
enum Part { PRODUCTS, ATTENTION, INPUTS, NORMS, SILU, PARTS };
const char* const PART_NAMES[PARTS] = {"products", "attention", "inputs", "norms", "silu"};

}  // namespace

class DecodeLayers {
 public:
  // plain: "linear" (at::linear, F.linear's) or "onednn" (the oneDNN op on the plain weight)
  explicit DecodeLayers(const std::string& plain) : onednn_(plain == "onednn") {
    TORCH_CHECK(plain == "linear" || plain == "onednn", "DecodeLayers: plain product 'linear' or 'onednn', got ",
                plain);
  }

  // one layer: products in the order qkv, o, gate_up, down (weights, biases, packed copies and their row floors),
  // the post-attention norm, the next norm (the next layer's input norm; the final norm after the last layer)
  // ``apart``: the output widths of qkv's parts, then gate_up's, where each runs as its own product (else empty)
  void add_layer(const std::vector<at::Tensor>& weights, const std::vector<c10::optional<at::Tensor>>& biases,
                 const std::vector<c10::optional<at::Tensor>>& packs, const std::vector<int64_t>& packed_from,
                 const std::vector<int64_t>& apart,
                 const at::Tensor& post_norm, double post_eps, const at::Tensor& next_norm, double next_eps,
                 const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double head_eps,
                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t intermediate, double scaling) {
    TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && packs.size() == 4 && packed_from.size() == 4,
                "DecodeLayers: four products a layer (qkv, o, gate_up, down)");
    Layer layer;
    Product* products[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) *products[i] = Product{weights[i], biases[i], packs[i], packed_from[i], {}};
    if (!apart.empty()) {
      TORCH_CHECK(apart.size() == 5, "DecodeLayers: apart takes qkv's three widths and gate_up's two");
      layer.qkv.parts.assign(apart.begin(), apart.begin() + 3);
      layer.gate_up.parts.assign(apart.begin() + 3, apart.end());
    }
    layer.post_norm = post_norm;
    layer.post_eps = post_eps;
    layer.next_norm = next_norm;
    layer.next_eps = next_eps;
    layer.q_norm = q_norm;
    layer.k_norm = k_norm;
    layer.head_eps = head_eps;
    layer.heads = heads;
    layer.kv_heads = kv_heads;
    layer.dim = dim;
    layer.intermediate = intermediate;
    layer.scaling = scaling;
    layers_.push_back(std::move(layer));
  }

  // The layers of one step and the final norm: x the embeddings [B, 1, H], h the first layer's normed input;
  // cos, sin [B, 1, D]; each layer's keys and values (the cache's storage: [2, kv_heads, blocks, page, dim], held
  // for the call only, so the cache's memory goes back when it drops them); slots [B] (each row's write position);
  // mask [B, 1, 1, width] (additive); shared [B, 2] or none: the rows whose first positions are another row's
  // (decode_attention reads them there); the rows' keys and values at blocks first + r * stride on, ``width``
  // positions. Returns the normed last hidden states and, where ``timing``, the seconds spent in each part of the
  // layers: "products", "attention" (with its views of the cache), "inputs" (the queries' and keys' norms and
  // rotation, the cache writes), "norms" (the residual adds and RMSNorms), "silu" (SiLU x up); else no entries.
  std::tuple<at::Tensor, std::map<std::string, double>> run(at::Tensor x, at::Tensor h, const at::Tensor& cos,
                                                            const at::Tensor& sin,
                                                            const std::vector<at::Tensor>& storages,
                                                            const at::Tensor& slots, const at::Tensor& mask,
                                                            const c10::optional<at::Tensor>& shared,
                                                            int64_t first, int64_t stride, int64_t width,
                                                            bool packing, bool timing) {
    TORCH_CHECK(storages.size() == layers_.size(), "DecodeLayers: ", storages.size(), " layers' storage for ",
                layers_.size(), " layers");
    pybind11::gil_scoped_release no_gil;  // nothing here touches Python
    const int64_t batch = x.size(0);
    double seconds[PARTS] = {};
    // runs ``part`` of the layer, its wall time added to ``seconds[index]`` where ``timing``
    auto timed = [&](int index, auto&& part) {
      if (!timing) return part();
      const auto start = Clock::now();
      auto out = part();
      seconds[index] += std::chrono::duration<double>(Clock::now() - start).count();
      return out;
    };
    auto plain = [&](const at::Tensor& in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
      return onednn_ ? onednn_product(in, weight, bias) : at::linear(in, weight, bias);
    };
    auto product = [&](const at::Tensor& in, const Product& p) {
      return timed(PRODUCTS, [&] {
        if (!p.parts.empty()) {  // each part's own product over its rows of the fused weight (the modules' views)
          std::vector<at::Tensor> outs;
          int64_t start = 0;
          for (const int64_t rows : p.parts) {
            const auto bias = p.bias.has_value() ? c10::optional<at::Tensor>(p.bias->narrow(0, start, rows))
                                                 : c10::optional<at::Tensor>();
            outs.push_back(plain(in, p.weight.narrow(0, start, rows), bias));
            start += rows;
          }
          return at::cat(outs, -1);
        }
        if (packing && p.packed.has_value() && in.size(0) >= p.packed_from) {
          return onednn_product(in, *p.packed, p.bias);
        }
        return plain(in, p.weight, p.bias);
      });
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const auto& layer = layers_[i];
      const auto& storage = storages[i];
      TORCH_CHECK(storage.dim() == 5 && storage.size(0) == 2 && storage.size(1) == layer.kv_heads &&
                      storage.size(4) == layer.dim,
                  "DecodeLayers: layer ", i, "'s storage [2, ", layer.kv_heads, ", blocks, page, ", layer.dim,
                  "], got ", storage.sizes());
      // its keys' and values' halves as [kv_heads, slots, dim] rows (a block's page of slots after the block before)
      TORCH_CHECK(storage.device().is_cpu() && storage.scalar_type() == at::kFloat && storage.stride(4) == 1 &&
                      storage.stride(2) == storage.size(3) * storage.stride(3),
                  "DecodeLayers: layer ", i, "'s storage must be float32 on the CPU, its blocks' slots in one run, "
                  "got ", storage.scalar_type(), " of strides ", storage.strides());
      float* base = storage.data_ptr<float>();
      const int64_t slots_held = storage.size(2) * storage.size(3);
      const CacheRows keys{base, storage.stride(1), storage.stride(3), slots_held};
      const CacheRows values{base + storage.stride(0), storage.stride(1), storage.stride(3), slots_held};
      const auto qkv = product(h, layer.qkv);
      const auto q = timed(INPUTS, [&] {
        return attention_inputs(qkv, layer.heads, layer.kv_heads, layer.dim, cos, sin, layer.q_norm, layer.k_norm,
                                layer.head_eps, keys, values, slots);
      });
      const auto out = timed(ATTENTION, [&] {
        const auto [keys, values] = in_place(storage, first, stride, batch, width);
        return decode_attention(q, keys, values, mask, layer.scaling, shared);
      });
      const auto update = product(out.reshape({batch, 1, -1}), layer.o);
      std::tie(x, h) = timed(NORMS, [&] { return add_rms_norm(x, update, layer.post_norm, layer.post_eps); });
      const auto gate_up = product(h, layer.gate_up);
      const auto act = timed(SILU, [&] { return silu_mul(gate_up, layer.intermediate); });
      const auto down = product(act, layer.down);
      std::tie(x, h) = timed(NORMS, [&] { return add_rms_norm(x, down, layer.next_norm, layer.next_eps); });
    }
    std::map<std::string, double> parts;
    if (timing) {
      for (int i = 0; i < PARTS; ++i) parts[PART_NAMES[i]] = seconds[i];
    }
    return {h, parts};
  }

 private:
  // rows whose positions start at block first + r * stride and run on through consecutive blocks: keys and values
  // [rows, kv_heads, width, dim], views of the storage (block_pool.strided's)
  static std::tuple<at::Tensor, at::Tensor> in_place(const at::Tensor& s, int64_t first, int64_t stride,
                                                     int64_t rows, int64_t width) {
    const int64_t heads = s.size(1), blocks = s.size(2), page = s.size(3), dim = s.size(4);
    const int64_t head = blocks * page * dim, row = stride * page * dim;
    const int64_t base = s.storage_offset() + first * page * dim;
    TORCH_CHECK(first >= 0 && stride >= 0 && (first + (rows - 1) * stride) * page + width <= blocks * page,
                "DecodeLayers: rows at block ", first, " + r * ", stride, " of width ", width, " run past the storage's ",
                blocks, " blocks");
    return {s.as_strided({rows, heads, width, dim}, {row, head, dim, 1}, base),
            s.as_strided({rows, heads, width, dim}, {row, head, dim, 1}, base + heads * head)};
  }

  bool onednn_;
  std::vector<Layer> layers_;
};

void bind_decode_layers(pybind11::module_& m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<const std::string&>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("run", &DecodeLayers::run);
}
