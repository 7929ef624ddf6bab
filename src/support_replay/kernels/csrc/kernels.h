// The project's CPU kernels as the other sources and the Python module (bindings.cpp) call them: one declaration
// each, defined in decode_attention.cpp, decode_layer.cpp, decode_layers.cpp, invariant_product.cpp,
// invariant_layers.cpp, slot_watch.cpp and top_candidates.cpp.

#pragma once

#include <ATen/core/Tensor.h>

namespace pybind11 {
class module_;
}  // the bindings' module: declared, so that only bindings.cpp and the two that bind classes parse pybind11

#include <tuple>
#include <vector>

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale,
                            const c10::optional<at::Tensor>& shared = c10::nullopt);
// decode_attention for any number of query positions a row (q [B, Hq, Lq, D], a mask over [B, Hq, Lq, L]): each
// position's output is the one decode_attention gives that query alone over the keys its mask row sees
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double scale,
                     const c10::optional<at::Tensor>& shared = c10::nullopt);

// true-on-policy mode's arithmetic (invariant_product.cpp, invariant_layers.cpp; the dot of lanes.h)
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor invariant_dots(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ids,
                          const at::Tensor& counts);
std::tuple<at::Tensor, at::Tensor> invariant_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor invariant_silu_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor invariant_softmax(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> invariant_rotary(const at::Tensor& inv_freq, const at::Tensor& positions,
                                                    double scaling);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& update,
                                                const at::Tensor& weight, double eps);
at::Tensor attention_inputs(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t dim,
                            const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                            const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& slots);
// a cache of [kv_heads, slots, dim] floats (the last dimension contiguous) as attention_inputs writes into it: the
// layer loop (decode_layers.cpp) hands its storage's halves over this way, without making two tensors a layer
struct CacheRows {
  float* data;
  int64_t head_stride, slot_stride, slots;
};
at::Tensor attention_inputs(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t dim,
                            const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                            const c10::optional<at::Tensor>& k_norm, double eps, const CacheRows& key_cache,
                            const CacheRows& value_cache, const at::Tensor& slots);
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate);
bool use_aten_calls(bool on);
at::Tensor mean_of_squares(const at::Tensor& x);

void bind_decode_layers(pybind11::module_& m);
void bind_slot_watch(pybind11::module_& m);

std::tuple<at::Tensor, at::Tensor> top_candidates(const at::Tensor& probs, int64_t width);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sglang_rows(const at::Tensor& probs, int64_t width,
                                                                       const at::Tensor& top_k,
                                                                       const at::Tensor& top_p,
                                                                       const at::Tensor& min_p);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sglang_draw(
    const at::Tensor& probs, int64_t width, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
    const std::vector<at::Generator>& generators);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sglang_draw_logits(
    const at::Tensor& logits, int64_t width, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& min_p, const std::vector<at::Generator>& generators);
