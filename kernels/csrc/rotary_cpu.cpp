// CPU kernel of pagedpack_cpu::rotate_half_rope (fp32, bf16, fp16).
//
// Semantics: transformers' rotate-half rotary embedding (modeling_llama.apply_rotary_pos_emb), as
// its graph computes it: `x * cos + cat(-x2, x1) * sin` with x1, x2 the halves of x's last
// dimension D, each of the two products and their sum rounded to x's dtype (the graph's mul, mul,
// add in bf16 / fp16 each round; in fp32 the products may be fused into the add, a rounding
// difference). One pass instead of the graph's seven ops (two slices, neg, cat, two muls, add) and
// their four temporaries. `cos` and `sin` broadcast to x's shape. The output has x's layout order
// (a [1, H, T, D] view of a [T, H * D] projection gives a tensor whose [T, H, D] view is
// contiguous, as the attention ops want it). Chosen by lowering/reference/cpu_rotary.py, which
// checks the lowered step against the graph.
//
// pagedpack_cpu::rope_qkv_and_cache takes an attention layer's merged QKV projection output
// `[T, N]` (or `[1, T, N]`; columns [q_offset, + H*D) are q, [k_offset, + Hkv*D) k, [v_offset,
// + Hkv*D) v, head after head), rotates q and k as rotate_half_rope does (same roundings), writes k
// and v into the paged caches, and returns q rotated, `[T, H, D]` contiguous (the layout paged_attention
// reads). One call instead of the graph's ~20 per layer (the QKV slices, views and transposes, two
// rotary calls, the cache write): chosen by lowering/reference/cpu_qkv.py, which checks that the
// graph's views select exactly these columns. Caches of qkv's dtype take the rotated k and the v
// rows straight from the token's pass (one pass, no temporaries); any other cache dtype (scaled
// int8 / fp8, another float) goes through pagedpack_cpu::reshape_and_cache, which converts or
// quantizes as it does for the graph's own cache write.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainRows = 64;

// A dense tensor of x's sizes whose dims are laid out in the order of x's strides (largest first).
at::Tensor empty_in_layout_of(const at::Tensor& x) {
  std::vector<int64_t> order(x.dim());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  std::vector<int64_t> strides(x.dim());
  int64_t step = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    strides[*it] = step;
    step *= std::max<int64_t>(x.size(*it), 1);
  }
  return at::empty_strided(x.sizes(), strides, x.options());
}

template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Vec::size() values of T as floats, rounded to T and back, stored as T.
template <typename T>
inline Vec load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec v;
    at::vec::load_to_float<T>(p, v);
    return v;
  }
}

template <typename T>
inline Vec rounded(Vec v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
}

template <typename T>
inline void store_floats(Vec v, T* p) {
  if constexpr (std::is_same_v<T, float>) v.store(p);
  else at::vec::convert_from_float<T>(v, v).store(p, Vec::size());
}

// One row of D = 2 * half values: contiguous (vector lanes, scalar tail) or at the given strides.
template <typename T>
inline void rotate_row(const T* x, const T* c, const T* s, T* o, int64_t half, int64_t xs, int64_t cs, int64_t ss,
                       int64_t os) {
  int64_t i = 0;
  if (xs == 1 && cs == 1 && ss == 1 && os == 1) {
    for (; i + Vec::size() <= half; i += Vec::size()) {
      const Vec x1 = load_floats(x + i), x2 = load_floats(x + i + half);
      store_floats(rounded<T>(x1 * load_floats(c + i)) - rounded<T>(x2 * load_floats(s + i)), o + i);
      store_floats(rounded<T>(x2 * load_floats(c + i + half)) + rounded<T>(x1 * load_floats(s + i + half)), o + i + half);
    }
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i * xs]), x2 = static_cast<float>(x[(i + half) * xs]);
    o[i * os] = static_cast<T>(rounded<T>(x1 * static_cast<float>(c[i * cs])) -
                               rounded<T>(x2 * static_cast<float>(s[i * ss])));
    o[(i + half) * os] = static_cast<T>(rounded<T>(x2 * static_cast<float>(c[(i + half) * cs])) +
                                        rounded<T>(x1 * static_cast<float>(s[(i + half) * ss])));
  }
}

template <typename T>
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t rank = x.dim(), dim = x.size(-1), half = dim / 2, rows = dim ? x.numel() / dim : 0;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(-1), cs = cos.stride(-1), ss = sin.stride(-1), os = out.stride(-1);
  // the leading dims, innermost first: size and each tensor's stride
  std::vector<std::array<int64_t, 5>> lead;
  for (int64_t d = rank - 2; d >= 0; --d)
    if (x.size(d) > 1) lead.push_back({x.size(d), x.stride(d), cos.stride(d), sin.stride(d), out.stride(d)});
  at::parallel_for(0, rows, kGrainRows, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      int64_t xo = 0, co = 0, so = 0, oo = 0, rest = r;
      for (const auto& [size, x_stride, c_stride, s_stride, o_stride] : lead) {  // row r's index
        const int64_t i = rest % size;
        rest /= size;
        xo += i * x_stride;
        co += i * c_stride;
        so += i * s_stride;
        oo += i * o_stride;
      }
      const T* xr = xp + xo;
      const T* c = cp + co;
      const T* s = sp + so;
      T* o = op + oo;
      rotate_row<T>(xr, c, s, o, half, xs, cs, ss, os);
    }
  });
}

// out = x rotated (x, cos, sin, out of one shape; cos and sin may be expanded views).
void rope_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const auto dtype = x.scalar_type();
  if (dtype == at::kFloat) rope_rows<float>(x, cos, sin, out);
  else if (dtype == at::kBFloat16) rope_rows<at::BFloat16>(x, cos, sin, out);
  else rope_rows<at::Half>(x, cos, sin, out);
}

at::Tensor rotate_half_rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                        cos.scalar_type() == dtype && sin.scalar_type() == dtype,
                    "rotate_half_rope: x, cos, sin: expected one dtype of float32, bfloat16, float16, got ", dtype,
                    ", ", cos.scalar_type(), ", ", sin.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 2 == 0, "rotate_half_rope: x ", x.sizes(),
                    ": expected a last dimension of even size");
  TORCH_CHECK_VALUE(cos.dim() <= x.dim() && sin.dim() <= x.dim() && at::is_expandable_to(cos.sizes(), x.sizes()) &&
                        at::is_expandable_to(sin.sizes(), x.sizes()),
                    "rotate_half_rope: cos ", cos.sizes(), ", sin ", sin.sizes(), ": expected shapes that broadcast to x's ",
                    x.sizes());
  auto out = empty_in_layout_of(x);
  rope_into(x, cos.expand(x.sizes()), sin.expand(x.sizes()), out);
  return out;
}

// Whether rope_qkv_and_cache can write the rotated k and the v rows straight into the caches:
// caches of qkv's dtype (unscaled), [num_blocks, block_size, num_kv_heads, head_dim] with a
// contiguous head, contiguous cos / sin and int64 slots. Checked otherwise by reshape_and_cache.
bool writes_rows_directly(const at::Tensor& rows, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const at::Tensor& slot_mapping) {
  for (const auto& cache : {key_cache, value_cache})
    if (cache.scalar_type() != rows.scalar_type() || cache.dim() != 4 || cache.size(2) != num_kv_heads ||
        cache.size(3) != head_dim || cache.stride(3) != 1 || cache.size(1) < 1)
      return false;
  return key_cache.sizes().slice(0, 2) == value_cache.sizes().slice(0, 2) && cos.is_contiguous() &&
         sin.is_contiguous() && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
         rows.stride(1) == 1;
}

// The direct path: token by token, q's heads rotated into `query` [T, H, D], k's rotated into the
// key cache row of the token's slot and v's copied into the value cache row (a slot of -1: q only).
// `offsets` are q's, k's and v's first columns in `rows` [T, N]. Slots are checked first, as
// reshape_and_cache checks them.
template <typename T>
void rope_qkv_rows(const at::Tensor& rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   std::array<int64_t, 3> offsets, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                   at::Tensor& value_cache, const at::Tensor& slot_mapping, at::Tensor& query) {
  const int64_t tokens = rows.size(0), block_size = key_cache.size(1), num_slots = key_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_VALUE(slots[t] >= -1 && slots[t] < num_slots, "rope_qkv_and_cache: slot_mapping: expected -1 or a "
                      "slot in [0, ", num_slots, ") (num_blocks=", key_cache.size(0), " x block_size=", block_size,
                      "), got slot_mapping[", t, "]=", slots[t]);
  const T* x = rows.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* q = query.data_ptr<T>();
  T* kc = key_cache.data_ptr<T>();
  T* vc = value_cache.data_ptr<T>();
  const int64_t row_stride = rows.stride(0), half = head_dim / 2;
  const auto ks = key_cache.strides(), vs = value_cache.strides();
  const int64_t grain = std::max<int64_t>(1, (kGrainRows * 64) / std::max<int64_t>(rows.size(1), 1));
  at::parallel_for(0, tokens, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const T* row = x + t * row_stride;
      const T* c = cp + t * head_dim;
      const T* s = sp + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        rotate_row<T>(row + offsets[0] + h * head_dim, c, s, q + (t * num_heads + h) * head_dim, half, 1, 1, 1, 1);
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      T* k_row = kc + block * ks[0] + offset * ks[1];
      T* v_row = vc + block * vs[0] + offset * vs[1];
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        rotate_row<T>(row + offsets[1] + h * head_dim, c, s, k_row + h * ks[2], half, 1, 1, 1, 1);
        const T* v = row + offsets[2] + h * head_dim;
        std::copy(v, v + head_dim, v_row + h * vs[2]);
      }
    }
  });
}

at::Tensor rope_qkv_and_cache_cpu(const at::Tensor& qkv, int64_t q_offset, int64_t k_offset, int64_t v_offset,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& cos,
                                  const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
                                  const at::Tensor& slot_mapping) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                        cos.scalar_type() == dtype && sin.scalar_type() == dtype,
                    "rope_qkv_and_cache: qkv, cos, sin: expected one dtype of float32, bfloat16, float16, got ", dtype,
                    ", ", cos.scalar_type(), ", ", sin.scalar_type());
  TORCH_CHECK_VALUE(num_heads >= 1 && num_kv_heads >= 1 && head_dim >= 2 && head_dim % 2 == 0,
                    "rope_qkv_and_cache: num_heads, num_kv_heads, head_dim: expected positive counts and an even "
                    "head_dim, got ", num_heads, ", ", num_kv_heads, ", ", head_dim);
  TORCH_CHECK_VALUE(qkv.dim() >= 1 && qkv.stride(-1) == 1, "rope_qkv_and_cache: qkv ", qkv.sizes(),
                    ": expected a tensor with a contiguous last dimension");
  const int64_t width = qkv.size(-1), tokens = slot_mapping.size(0);
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && qkv.numel() == tokens * width, "rope_qkv_and_cache: qkv ",
                    qkv.sizes(), ": expected ", tokens, " rows (one per slot_mapping entry)");
  const std::pair<int64_t, int64_t> columns[] = {{q_offset, num_heads}, {k_offset, num_kv_heads}, {v_offset, num_kv_heads}};
  for (const auto& [offset, heads] : columns)
    TORCH_CHECK_VALUE(offset >= 0 && offset + heads * head_dim <= width, "rope_qkv_and_cache: offset ", offset,
                      ": expected ", heads, " heads of ", head_dim, " columns inside qkv's ", width);
  TORCH_CHECK_VALUE(cos.numel() == tokens * head_dim && sin.numel() == tokens * head_dim, "rope_qkv_and_cache: cos ",
                    cos.sizes(), ", sin ", sin.sizes(), ": expected ", tokens, " x ", head_dim, " values each");
  const auto rows = qkv.reshape({tokens, width});
  if (writes_rows_directly(rows, num_kv_heads, head_dim, cos, sin, key_cache, value_cache, slot_mapping)) {
    auto query = at::empty({tokens, num_heads, head_dim}, qkv.options());
    if (dtype == at::kFloat) rope_qkv_rows<float>(rows, num_heads, num_kv_heads, head_dim, {q_offset, k_offset, v_offset}, cos, sin, key_cache, value_cache, slot_mapping, query);
    else if (dtype == at::kBFloat16) rope_qkv_rows<at::BFloat16>(rows, num_heads, num_kv_heads, head_dim, {q_offset, k_offset, v_offset}, cos, sin, key_cache, value_cache, slot_mapping, query);
    else rope_qkv_rows<at::Half>(rows, num_heads, num_kv_heads, head_dim, {q_offset, k_offset, v_offset}, cos, sin, key_cache, value_cache, slot_mapping, query);
    return query;
  }
  // Any other cache (a scaled or other dtype, an unusual layout, a bad shape): rotate into
  // temporaries, and reshape_and_cache converts, quantizes or refuses.
  const auto heads_of = [&](int64_t offset, int64_t heads) {
    return rows.narrow(1, offset, heads * head_dim).view({tokens, heads, head_dim});
  };
  const auto c = cos.reshape({tokens, 1, head_dim}), s = sin.reshape({tokens, 1, head_dim});
  auto query = at::empty({tokens, num_heads, head_dim}, qkv.options());
  auto key = at::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  rope_into(heads_of(q_offset, num_heads), c.expand(query.sizes()), s.expand(query.sizes()), query);
  rope_into(heads_of(k_offset, num_kv_heads), c.expand(key.sizes()), s.expand(key.sizes()), key);
  static const auto reshape_and_cache =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedpack_cpu::reshape_and_cache", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>();
  reshape_and_cache.call(key, heads_of(v_offset, num_kv_heads), key_cache, value_cache, slot_mapping);
  return query;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedpack_cpu, m) {
  m.def("rotate_half_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "rope_qkv_and_cache(Tensor qkv, int q_offset, int k_offset, int v_offset, int num_heads, int num_kv_heads, "
      "int head_dim, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(pagedpack_cpu, CPU, m) {
  m.impl("rotate_half_rope", &rotate_half_rope_cpu);
  m.impl("rope_qkv_and_cache", &rope_qkv_and_cache_cpu);
}
