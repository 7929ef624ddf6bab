// Attention of query tokens over their keys and values, on a CPU: the engine's decode step (modeling/decode_attention.py,
// one query a row) and, for any number of query positions a row, true-on-policy mode's attention in the engine's
// prefill and decode and in the trainer's forward (kernels/invariant.py).
//
// q [B, Hq, Lq, D], k and v [B, Hkv, L, D] (any strides, the last dimension contiguous), an optional mask
// broadcastable to [B, Hq, Lq, L] (boolean, true where a key is seen, or additive), out [B, Lq, Hq, D].
// Each (row, query position, key-value head) is one task: its Hq / Hkv queries read each key and value once, and a
// query position's output is the one its query alone would get over the keys its mask row sees. A task's
// arithmetic is fixed (the same vector order whatever the batch, the width or the thread count), and a
// masked key (false, or -inf) is skipped, its seen keys taken in key order wherever padding put them, so
// a row's output keeps its bits whatever rows or padding share the call. ``shared`` [B, 2], where given, says that
// row b's first shared[b][1] positions hold the same keys and values as row shared[b][0]'s (a prompt prefilled once
// for a group of samples): they are read there, so a group's rows read them from one place, the cache's lines
// fetched from memory once for the group (the same numbers: the same bits). Scores, softmax and the weighted
// sum are float32; bf16 inputs are read as float32 and the output rounded once. A query's scores are taken W keys
// at a time (W the vector width): each key's dot the dot of lanes.h (a chain of fused multiply-adds a lane over the
// head, then the lanes summed by one fixed tree: lane_sums, for W keys together; a key's dot is the same whichever
// block or lane it falls in, and W reductions cost some three times fewer shuffles and adds than W apart). The weighted sum of the values reads each
// value once for up to QUERIES queries of the group, their partial sums held in registers (at batch 16, 9/3 heads,
// head size 64, 82 keys, the cache hot, on a Zen 5 EPYC: 95 -> 60 us a call on one thread, 66 -> 39 on two, the
// scores taken block by block for all of a task's queries; inside a GRPO-shape decode step, where the keys and values
// come from memory, 2.74 -> 2.50 ms a step over 30 layers, and 2.76 -> 2.22 with a group's prompt read once). The
// partial sums of both loops live in registers (weighted_sequence): at that shape, 112 positions of which 83 seen,
// 57-59 -> 46-48 us a call on one thread and 33-37 -> 23-28 on two; inside the GRPO-shape step 1.73-1.87 -> 1.52-1.68
// ms a step (docs/benchmarks.md).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "lanes.h"

namespace {

using lanes::lane_sums;
using lanes::Raw;
using lanes::Vec;
using lanes::W;

// vector registers a weighted sum holds its partial sums in: most of AVX-512's 32, of AVX2's 16
constexpr int ACCUMULATORS = W >= 16 ? 24 : 12;
constexpr int QUERIES = 4;  // the most queries whose weighted sums one pass over the values adds into
// How far ahead the loops over the keys and the values ask for the lines they will read (in keys). A task's keys and
// values come from memory (a step's products have pushed them out of every cache) in runs of a few kilobytes, too
// short for the hardware's prefetchers to reach full speed on; asked for 16 keys ahead, a GRPO-shape decode step of
// SmolLM2 on a Zen 5 EPYC spent 2.1 instead of 2.9 ms in attention (docs/benchmarks.md). No arithmetic changes.
constexpr int64_t KEYS_AHEAD = 16, VALUES_AHEAD = 16;

// asks for the cache lines of ``floats`` floats from ``row`` (a hint: no fault, no effect on any value)
inline void prefetch_row(const float* row, int64_t floats) {
  for (int64_t c = 0; c < floats; c += 64 / sizeof(float)) __builtin_prefetch(row + c, 0, 3);
}

// one key's dot with a query's V whole vectors x and its ``last`` partial one: a single chain of fused multiply-adds
template <int V>
inline Raw key_dot(const Raw* x, const Vec& last, const float* key, int64_t tail) {
  Vec a = at::vec::fmadd(Vec(x[0]), Vec::loadu(key), Vec(0.f));
  for (int i = 1; i < V; ++i) a = at::vec::fmadd(Vec(x[i]), Vec::loadu(key + i * W), a);
  if (tail) a = at::vec::fmadd(last, Vec::loadu(key + V * W, tail), a);
  return a;
}

// block_dots with the query's V vectors in registers: the W keys a fold over J, every accumulator at a constant index
// (held in registers; see weighted_sequence)
template <int V, std::size_t... J>
inline void block_dots_sequence(const float* q, const float* const* keys, int64_t tail, float* out,
                                std::index_sequence<J...>) {
  Raw x[V];
  for (int i = 0; i < V; ++i) x[i] = Vec::loadu(q + i * W);
  const Vec last = tail ? Vec::loadu(q + V * W, tail) : Vec(0.f);
  Raw acc[sizeof...(J)];
  ((acc[J] = key_dot<V>(x, last, keys[J], tail)), ...);
  lane_sums(acc, out);
}

// block_dots one query vector at a time across the W keys (its ``vectors`` whole vectors, then ``tail`` elements):
// W accumulators (a fold over J: registers) and one query vector. Each key's chain is key_dot's, the same
// multiply-adds in the same order (the first on a zero accumulator): the same bits.
template <std::size_t... J>
inline void block_dots_by_vector(const float* q, const float* const* keys, int64_t vectors, int64_t tail, float* out,
                                 std::index_sequence<J...>) {
  Raw acc[sizeof...(J)];
  ((acc[J] = Vec(0.f)), ...);
  for (int64_t i = 0; i < vectors; ++i) {
    const Vec x = Vec::loadu(q + i * W);
    ((acc[J] = at::vec::fmadd(x, Vec::loadu(keys[J] + i * W), Vec(acc[J]))), ...);
  }
  if (tail) {
    const Vec last = Vec::loadu(q + vectors * W, tail);
    ((acc[J] = at::vec::fmadd(last, Vec::loadu(keys[J] + vectors * W, tail), Vec(acc[J]))), ...);
  }
  lane_sums(acc, out);
}

// one query against W keys: each key's dot a single chain of fused multiply-adds over the head dim (its whole vectors
// in order, then its last ``tail`` elements), then its lanes summed (lane_sums): a dot's arithmetic is the same
// whichever block of keys, and lane, it is computed in, and whichever of the two ways below. With V (the whole
// vectors, known at compile time) the query's vectors stay in registers beside the W accumulators where the ISA has
// room for both: AVX-512's 32 registers; at V = 8 AVX2's 16 did not hold them, and the compiler spilled the query and
// read it back for every key. Otherwise, and for V = 0 (any head size), one query vector at a time.
template <int V>
inline void block_dots(const float* q, const float* const* keys, int64_t d, int64_t tail, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  constexpr bool query_in_registers = false;
#else
  constexpr bool query_in_registers = V > 0;
#endif
  if constexpr (query_in_registers) {
    block_dots_sequence<V>(q, keys, tail, out, std::make_index_sequence<W>());
  } else {
    block_dots_by_vector(q, keys, V > 0 ? V : d / W, tail, out, std::make_index_sequence<W>());
  }
}

// the dots of ``queries`` queries (q, d floats each) with n keys, W keys at a time, every query on a block before
// the next block (its keys still in the nearest cache): out[g * pitch + j]; the last block filled up with ``zeros``
// (d floats), its extra dots dropped. Each key's value row is asked for with its key (the weighted sums read them
// next; a hint only)
template <int V>
inline void all_dots(const float* q, int64_t queries, const float* const* keys, const float* const* values, int64_t n,
                     int64_t d, int64_t tail, const float* zeros, float* out, int64_t pitch) {
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    for (int64_t r = j + KEYS_AHEAD; r < std::min(j + KEYS_AHEAD + W, n); ++r) {
      prefetch_row(keys[r], d);
      prefetch_row(values[r], d);
    }
    for (int64_t g = 0; g < queries; ++g) block_dots<V>(q + g * d, keys + j, d, tail, out + g * pitch + j);
  }
  if (j < n) {
    const float* last[W];
    float dots[W];
    for (int64_t r = 0; r < W; ++r) last[r] = j + r < n ? keys[j + r] : zeros;
    for (int64_t g = 0; g < queries; ++g) {
      block_dots<V>(q + g * d, last, d, tail, dots);
      std::copy(dots, dots + (n - j), out + g * pitch + j);
    }
  }
}

// all_dots for the head's whole vectors known at compile time where there are 1 to 8 of them
inline void dots(const float* q, int64_t queries, const float* const* keys, const float* const* values, int64_t n,
                 int64_t d, const float* zeros, float* out, int64_t pitch) {
  const int64_t tail = d % W;
  // the first keys and values, all asked for at once (the loop asks KEYS_AHEAD keys ahead from there on)
  for (int64_t r = 0; r < std::min(KEYS_AHEAD, n); ++r) {
    prefetch_row(keys[r], d);
    prefetch_row(values[r], d);
  }
  switch (d / W) {
    case 1: return all_dots<1>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
    case 2: return all_dots<2>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
    case 3: return all_dots<3>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
    case 4: return all_dots<4>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
    case 5: return all_dots<5>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
    case 6: return all_dots<6>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
    case 7: return all_dots<7>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
    case 8: return all_dots<8>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
    default: return all_dots<0>(q, queries, keys, values, n, d, tail, zeros, out, pitch);
  }
}

// out[g][i .. i + V vectors) for G queries at once = the sum over the keys, in key order, of p[g][j] *
// values[j][i ..]: a fused multiply-add per key, query and element, each key's V vectors read once for the G queries.
// Accumulator I is query I / V's vector I % V, every access a constant index (a fold over I) into an array of the
// register type (Raw), so that the compiler keeps the G x V partial sums in registers: written as loops over g and r
// into an array of Vec, GCC 12 kept them on the stack, a load and a store per multiply-add. The same multiply-adds in
// the same order: the same bits (block_dots_sequence likewise).
template <int G, int V, std::size_t... I>
inline void weighted_sequence(const float* const* p, const float* const* values, int64_t n, int64_t i,
                              float* const* out, std::index_sequence<I...>) {
  Raw acc[sizeof...(I)];
  ((acc[I] = Vec(0.f)), ...);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = values[j] + i;
    if (j + VALUES_AHEAD < n) prefetch_row(values[j + VALUES_AHEAD] + i, V * W);
    ((acc[I] = at::vec::fmadd(Vec(p[I / V][j]), Vec::loadu(v + (I % V) * W), Vec(acc[I]))), ...);
  }
  (Vec(acc[I]).store(out[I / V] + i + (I % V) * W), ...);
}

template <int G, int V>
inline void weighted(const float* const* p, const float* const* values, int64_t n, int64_t i, float* const* out) {
  weighted_sequence<G, V>(p, values, n, i, out, std::make_index_sequence<G * V>());
}

// weighted<G, 1> over the last ``tail`` (< W) elements: the same fused multiply-adds in one partial vector
template <int G>
inline void weighted_tail(const float* const* p, const float* const* values, int64_t n, int64_t i, float* const* out,
                          int64_t tail) {
  Vec acc[G];
  for (int g = 0; g < G; ++g) acc[g] = Vec(0.f);
  for (int64_t j = 0; j < n; ++j) {
    if (j + VALUES_AHEAD < n) prefetch_row(values[j + VALUES_AHEAD] + i, tail);
    const Vec x = Vec::loadu(values[j] + i, tail);
    for (int g = 0; g < G; ++g) acc[g] = at::vec::fmadd(Vec(p[g][j]), x, acc[g]);
  }
  for (int g = 0; g < G; ++g) acc[g].store(out[g] + i, tail);
}

// weighted<G, V> for a V known at run time (1 .. V)
template <int G, int V>
inline void weighted_vectors(int64_t vectors, const float* const* p, const float* const* values, int64_t n, int64_t i,
                             float* const* out) {
  if constexpr (V > 0) {
    if (vectors == V) return weighted<G, V>(p, values, n, i, out);
    weighted_vectors<G, V - 1>(vectors, p, values, n, i, out);
  }
}

// G queries' weighted sums over the whole head: as many vectors a pass as the registers hold
template <int G>
inline void weighted_queries(const float* const* p, const float* const* values, int64_t n, int64_t d,
                             float* const* out) {
  constexpr int most = ACCUMULATORS / G;
  int64_t i = 0;
  while (i + W <= d) {
    const int64_t vectors = std::min<int64_t>(most, (d - i) / W);
    weighted_vectors<G, most>(vectors, p, values, n, i, out);
    i += vectors * W;
  }
  if (i < d) weighted_tail<G>(p, values, n, i, out, d - i);
}

// every query's weighted sum, QUERIES of them at a time: out[g] = sum over the keys of p[g][j] * values[j]
inline void weighted_sums(const float* const* p, const float* const* values, int64_t queries, int64_t n, int64_t d,
                          float* const* out) {
  for (int64_t g = 0; g < queries; g += QUERIES) {
    switch (std::min<int64_t>(QUERIES, queries - g)) {
      case 4: weighted_queries<4>(p + g, values, n, d, out + g); break;
      case 3: weighted_queries<3>(p + g, values, n, d, out + g); break;
      case 2: weighted_queries<2>(p + g, values, n, d, out + g); break;
      default: weighted_queries<1>(p + g, values, n, d, out + g); break;
    }
  }
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
            const std::array<int64_t, 4>& mask_strides, const int64_t* shared, float scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), q_len = q.size(2), d = q.size(3), kv_heads = k.size(1);
  const int64_t width = k.size(2);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q0 = q.stride(0), q1 = q.stride(1), q2 = q.stride(2);
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), v2 = v.stride(2);
  const auto [m0, m1, m2, m3] = mask_strides;
  // a mask that differs between the queries of a task: each query's terms apart (else one term a key for all)
  const bool per_query = mask != nullptr && m1 != 0 && group > 1;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  constexpr bool convert = !std::is_same_v<T, float>;
  // a task: one query position of one row, one key-value head
  at::parallel_for(0, rows * q_len * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * d), terms(group * width), scores(group * width), acc(group * d);
    std::vector<float> packed(width), converted(convert ? 2 * width * d : 0), zeros(d, 0.f);
    std::vector<int64_t> seen(width), rank(width), kept(group);
    std::vector<const float*> key_rows(width), value_rows(width), probs(group);
    std::vector<float*> sums(group);
    for (int64_t g = 0; g < group; ++g) {
      probs[g] = scores.data() + g * width;
      sums[g] = acc.data() + g * d;
    }
    int64_t n = 0, listed = -1;  // the seen keys' count, and the (row, position) they were listed for
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (q_len * kv_heads), i = task / kv_heads % q_len, h = task % kv_heads;
      const int64_t at = b * q_len + i;  // the query position's place in the output
      const int64_t mask_base = b * m0 + i * m2;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + b * q0 + (h * group + g) * q1 + i * q2;
        for (int64_t i = 0; i < d; ++i) queries[g * d + i] = static_cast<float>(src[i]);
      }
      // the keys some query of the group sees, in key order: a key masked for every query is never read. One term
      // a key for the whole group: the row's list serves its every head where the mask is the same for them all.
      if (per_query) {
        n = 0;
        for (int64_t l = 0; l < width; ++l) {
          bool any = false;
          for (int64_t g = 0; g < group; ++g) {
            const float term = mask_term(mask, mask_base + (h * group + g) * m1 + l * m3);
            terms[g * width + n] = term;
            any = any || term != minus_inf;
          }
          if (any) seen[n++] = l;
        }
      } else if (at != listed || m1 != 0) {
        n = 0;
        for (int64_t l = 0; l < width; ++l) {
          const float term = mask ? mask_term(mask, mask_base + h * group * m1 + l * m3) : 0.f;
          if (term != minus_inf) {
            terms[n] = term;
            seen[n++] = l;
          }
        }
        listed = at;
      }
      // the row's first ``common`` positions from row ``source`` (the same keys and values: a shared prompt)
      const int64_t source = shared ? shared[2 * b] : b, common = shared ? shared[2 * b + 1] : 0;
      const T* keys = kp + b * k0 + h * k1;
      const T* values = vp + b * v0 + h * v1;
      const T* source_keys = kp + source * k0 + h * k1;
      const T* source_values = vp + source * v0 + h * v1;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t l = seen[j];
        key_rows[j] = as_float((l < common ? source_keys : keys) + l * k2, converted.data() + j * d, d);
        value_rows[j] = as_float((l < common ? source_values : values) + l * v2, converted.data() + (width + j) * d, d);
      }
      // scores: q . k * scale + mask, over the keys seen (their rank j among them)
      dots(queries.data(), group, key_rows.data(), value_rows.data(), n, d, zeros.data(), scores.data(), width);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * width;
        if (per_query) {
          const float* t = terms.data() + g * width;
          for (int64_t j = 0; j < n; ++j) s[j] = t[j] == minus_inf ? minus_inf : s[j] * scale + t[j];
        } else {  // no term is -inf: the same two roundings, a vector at a time
          at::vec::map2([scale](Vec x, Vec t) { return x * Vec(scale) + t; }, s, s, terms.data(), n);
        }
      }
      // softmax of each query's scores over its seen keys, packed in key order first where some are -inf: the vector
      // lanes each term lands in depend on its rank among the seen keys only, not on where padding put it
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * width;
        int64_t m = 0;
        const bool all_seen =
            n > 0 && at::vec::reduce_all<float>([](Vec a, Vec c) { return at::vec::minimum(a, c); }, s, n) != minus_inf;
        float* x = s;
        if (!all_seen) {
          for (int64_t j = 0; j < n; ++j) {
            if (s[j] != minus_inf) {
              packed[m] = s[j];
              rank[m++] = j;
            }
            s[j] = 0.f;
          }
          x = packed.data();
        } else {
          m = n;
        }
        kept[g] = m;
        if (m == 0) continue;
        const float top = at::vec::reduce_all<float>([](Vec a, Vec c) { return at::vec::maximum(a, c); }, x, m);
        at::vec::map([top](Vec a) { return (a - Vec(top)).exp(); }, x, x, m);
        const float total = at::vec::reduce_all<float>([](Vec a, Vec c) { return a + c; }, x, m);
        const float inverse = 1.f / total;
        if (all_seen) {
          at::vec::map([inverse](Vec a) { return a * Vec(inverse); }, s, s, n);
        } else {
          for (int64_t r = 0; r < m; ++r) s[rank[r]] = packed[r] * inverse;
        }
      }
      // the weighted sums of the values in key order, every query of the group in one pass over them
      weighted_sums(probs.data(), value_rows.data(), group, n, d, sums.data());
      for (int64_t g = 0; g < group; ++g) {
        float* o = acc.data() + g * d;
        if (kept[g] == 0) std::fill(o, o + d, 0.f);  // every key masked: sdpa's answer is NaN; ours is zeros
        T* dst = op + (at * heads + h * group + g) * d;
        if constexpr (std::is_same_v<T, float>) {
          std::copy(o, o + d, dst);
        } else {
          at::vec::convert(o, dst, d);
        }
      }
    }
  });
}

// the mask's strides over (row, head, query position, key), 0 where it broadcasts
std::array<int64_t, 4> broadcast_strides(const at::Tensor& mask) {
  auto stride = [&](int64_t dim) { return mask.size(dim) == 1 ? 0 : mask.stride(dim); };
  return {stride(0), stride(1), stride(2), stride(3)};
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale,
                            const c10::optional<at::Tensor>& shared) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: one query per row, got ", q.sizes());
  return attention(q, k, v, mask, scale, shared);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double scale, const c10::optional<at::Tensor>& shared) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: 4-d query, keys and values");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "decode_attention: keys ", k.sizes(), " and values ", v.sizes(), " do not fit queries ", q.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "decode_attention: ", q.size(1),
              " query heads over ", k.size(1), " key-value heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "decode_attention: one dtype for query, keys and values");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: contiguous head dims");
  auto out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const float s = static_cast<float>(scale);
  std::array<int64_t, 4> strides{0, 0, 0, 0};
  if (mask.has_value()) {
    const auto& m = mask.value();
    TORCH_CHECK(m.dim() == 4 && m.size(3) == k.size(2) && (m.size(0) == 1 || m.size(0) == q.size(0)) &&
                    (m.size(1) == 1 || m.size(1) == q.size(1)) && (m.size(2) == 1 || m.size(2) == q.size(2)),
                "decode_attention: mask ", m.sizes(), " does not broadcast to [", q.size(0), ", ", q.size(1), ", ",
                q.size(2), ", ", k.size(2), "]");
    strides = broadcast_strides(m);
  }
  at::Tensor sources;
  const int64_t* source = nullptr;
  if (shared.has_value()) {
    sources = shared->contiguous();
    TORCH_CHECK(sources.scalar_type() == at::kLong && sources.dim() == 2 && sources.size(0) == q.size(0) &&
                    sources.size(1) == 2,
                "decode_attention: shared must be int64 [", q.size(0), ", 2] (source row, positions), got ",
                sources.scalar_type(), " ", sources.sizes());
    source = sources.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b) {
      TORCH_CHECK(source[2 * b] >= 0 && source[2 * b] < q.size(0) && source[2 * b + 1] >= 0 &&
                      source[2 * b + 1] <= k.size(2),
                  "decode_attention: row ", b, " shares ", source[2 * b + 1], " positions of row ", source[2 * b],
                  " (rows 0 .. ", q.size(0) - 1, ", positions 0 .. ", k.size(2), ")");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    if (!mask.has_value()) {
      attend<scalar_t, float>(q, k, v, nullptr, strides, source, s, out);
      return;
    }
    const auto& m = mask.value();
    if (m.scalar_type() == at::kBool) {
      attend<scalar_t, bool>(q, k, v, m.data_ptr<bool>(), strides, source, s, out);
    } else if (m.scalar_type() == at::kFloat) {
      attend<scalar_t, float>(q, k, v, m.data_ptr<float>(), strides, source, s, out);
    } else if (m.scalar_type() == at::kBFloat16) {
      attend<scalar_t, at::BFloat16>(q, k, v, m.data_ptr<at::BFloat16>(), strides, source, s, out);
    } else {
      TORCH_CHECK(false, "decode_attention: a boolean, float32 or bf16 mask, got ", m.scalar_type());
    }
  });
  return out;
}
