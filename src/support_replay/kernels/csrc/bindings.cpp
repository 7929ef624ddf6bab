// The Python module of the project's CPU kernels (kernels/build.py builds it): one extension, one build.

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor's and at::Generator's conversions, without all of libtorch's C++ API

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "one query token per row over its keys and values (CPU); shared [B, 2]: row b's first positions are those of "
        "another row (source row, positions), read there",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), pybind11::arg("scale"),
        pybind11::arg("shared") = pybind11::none());
  m.def("attention", &attention,
        "decode_attention for any number of query positions a row: q [B, Hq, Lq, D], mask over [B, Hq, Lq, L]; "
        "out [B, Lq, Hq, D]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), pybind11::arg("scale"),
        pybind11::arg("shared") = pybind11::none());
  m.def("invariant_linear", &invariant_linear,
        "x W^T + bias with every element one fixed-order dot (lanes.h)", pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("bias") = pybind11::none());
  m.def("invariant_dots", &invariant_dots,
        "per row t the dots of x[t] with the weight rows ids[t, :counts[t]] (invariant_linear's elements)");
  m.def("invariant_rms_norm", &invariant_rms_norm, "RMSNorm with a fixed-order sum: (out, rsqrt per row)");
  m.def("invariant_silu_mul", &invariant_silu_mul, "SiLU(gate) * up, one function for every element");
  m.def("invariant_softmax", &invariant_softmax, "a float32 softmax of every row with a fixed-order sum");
  m.def("invariant_rotary", &invariant_rotary, "the rotary embedding's (cos, sin) [..., 2 x inv_freq] per position");
  m.def("rms_norm", &rms_norm, "Llama's and Qwen3's RMSNorm in float32, the model's bits");
  m.def("add_rms_norm", &add_rms_norm, "a residual add, then RMSNorm of the sum: (sum, normed)");
  // the overload over the cache's tensors (the other takes raw cache rows, for the layer loop)
  using TensorInputs = at::Tensor (*)(const at::Tensor&, int64_t, int64_t, int64_t, const at::Tensor&,
                                      const at::Tensor&, const c10::optional<at::Tensor>&,
                                      const c10::optional<at::Tensor>&, double, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&);
  m.def("attention_inputs", static_cast<TensorInputs>(&attention_inputs),
        "a decode step's queries from its qkv product: normed and rotated; keys and values written to the cache");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up over a fused gate-up product's output");
  m.def("use_aten_calls", &use_aten_calls,
        "whether the RMSNorms' mean and SiLU call ATen's kernels or the loops in ATen's order; returns the old setting");
  m.def("mean_of_squares", &mean_of_squares, "x.pow(2).mean(-1, keepdim=True) of [rows, d] as the kernels take it");
  bind_decode_layers(m);  // DecodeLayers: a float32 decode step's layers in one call
  bind_slot_watch(m);     // SlotWatch: whether the attributes a fused step reads changed since it last looked
  m.def("top_candidates", &top_candidates,
        "each row's first width entries of the full sort by (value descending, id ascending): (values, ids)");
  m.def("sglang_rows", &sglang_rows,
        "SGLang's rule over each row's first width ranks, the kept ids ascending: (ids, valid, cols, counts)");
  m.def("sglang_draw", &sglang_draw,
        "sglang_rows, then each row's token drawn with its own generator: (ids, valid, cols, counts, tokens)");
  m.def("sglang_draw_logits", &sglang_draw_logits,
        "sglang_draw from the logits, each row's softmax(z / T) and selection in one task: (ids, valid, cols, "
        "counts, tokens, probs)");
}
