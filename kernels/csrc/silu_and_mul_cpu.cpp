// CPU kernels of pagedpack_cpu::silu_and_mul(gate, up) = silu(gate) * up and
// pagedpack_cpu::gelu_tanh_and_mul(gate, up) = gelu(gate, approximate="tanh") * up (fp32, bf16, fp16).
//
// Semantics: a gated MLP's activation (transformers' LlamaMLP, `act_fn(gate_proj(x)) * up_proj(x)`
// with SiLU; vLLM's silu_and_mul, which takes the two as one `[..., 2I]` tensor: here `gate` and `up`
// may be the two halves of the merged gate/up GEMM's output, views with a row stride). One pass
// over the rows instead of ATen's two ops (silu, mul) and the `silu(gate)` temporary between them.
// Each value is computed and rounded as ATen's unfused ops do on this CPU (silu_kernel and mul in
// aten/src/ATen/native/cpu): silu(x) = x / (1 + exp(-x)) in fp32 (Vectorized<float>::exp, SLEEF's
// u10; the last `dim % 32` values of a row with std::exp, as ATen's loops treat a tail), rounded to
// the dtype, then multiplied by `up` in fp32 and rounded again: a bf16 / fp16 step's values are the
// graph's bit for bit. In fp32 a value may differ from ATen's in the last bit where ATen's scalar
// tails fall elsewhere (the end of each thread's share of a contiguous run, which can split a row):
// std::exp and SLEEF's exp differ by up to an ulp there. gelu_tanh_and_mul is the same loop with
// Gemma's activation (gelu_pytorch_tanh; vLLM's gelu_tanh_and_mul), computed by ATen's own helpers
// (ATen/native/cpu/Gelu.h: the vector form on whole vectors, the scalar one on a row's tail, as
// ATen's gelu kernel applies them). Chosen by lowering/reference/cpu_activation.py, which checks the
// lowered step against the graph.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Gelu.h>
#include <torch/library.h>

#include "float_pairs.h"

#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * Vec::size();     // values per iteration: one Vectorized<bf16 / fp16>
constexpr int64_t kGrainElements = 1 << 15;  // rows per thread: at least this many values

// An activation: `vec` on Vec::size() floats, `scalar` on one (a row's tail).
struct Silu {
  static Vec vec(const Vec& x) { return x / (Vec(1.f) + x.neg().exp()); }
  static float scalar(float x) { return x / (1.f + std::exp(-x)); }
};

struct GeluTanh {
  static Vec vec(const Vec& x) { return at::native::vectorized_gelu_approximated_with_tanh<float>(x); }
  static float scalar(float x) { return at::native::scalar_gelu_approximated_with_tanh<float>(x); }
};


// out[r, :] = T(float(T(act(gate[r, :]))) * float(up[r, :])) for `rows` rows of `dim` values;
// gate and up rows `gate_stride` / `up_stride` values apart, out's contiguous.
template <typename Act, typename T>
void act_and_mul_rows(const T* gate, const T* up, T* out, int64_t rows, int64_t dim, int64_t gate_stride,
                       int64_t up_stride) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(dim, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* g = gate + r * gate_stride;
      const T* u = up + r * up_stride;
      T* o = out + r * dim;
      int64_t d = 0;
      for (; d + kStep <= dim; d += kStep) {
        auto [g0, g1] = pagedpack_cpu::load_floats(g + d);
        auto [u0, u1] = pagedpack_cpu::load_floats(u + d);
        Vec s0 = Act::vec(g0), s1 = Act::vec(g1);
        if constexpr (!std::is_same_v<T, float>) {  // the activation rounded to T, as ATen's op stores it
          std::tie(s0, s1) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(s0, s1));
        }
        pagedpack_cpu::store_floats(s0 * u0, s1 * u1, o + d);
      }
      for (; d < dim; ++d) {
        const T s = static_cast<T>(Act::scalar(static_cast<float>(g[d])));
        o[d] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[d]));
      }
    }
  });
}

// `t` as [rows, dim] with its last dimension contiguous (a view where the strides allow, else a copy).
at::Tensor as_rows(const at::Tensor& t) {
  const int64_t dim = t.size(-1);
  at::Tensor rows = t.reshape({-1, dim});
  return rows.stride(1) == 1 || dim <= 1 ? rows : rows.contiguous();
}

template <typename Act>
at::Tensor act_and_mul_cpu(const char* name, const at::Tensor& gate, const at::Tensor& up) {
  const auto dtype = gate.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                        up.scalar_type() == dtype,
                    name, ": gate, up: expected one dtype of float32, bfloat16, float16, got ", dtype, ", ",
                    up.scalar_type());
  TORCH_CHECK_VALUE(gate.dim() >= 1 && gate.sizes() == up.sizes(), name, ": gate ", gate.sizes(), ", up ",
                    up.sizes(), ": expected one shape [..., I]");
  auto out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const auto g = as_rows(gate), u = as_rows(up);
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    act_and_mul_rows<Act, T>(g.data_ptr<T>(), u.data_ptr<T>(), out.data_ptr<T>(), g.size(0), g.size(1), g.stride(0),
                             u.stride(0));
  };
  if (dtype == at::kFloat) {
    run(float{});
  } else if (dtype == at::kBFloat16) {
    run(at::BFloat16{});
  } else {
    run(at::Half{});
  }
  return out;
}

at::Tensor silu_and_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  return act_and_mul_cpu<Silu>("silu_and_mul", gate, up);
}

at::Tensor gelu_tanh_and_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  return act_and_mul_cpu<GeluTanh>("gelu_tanh_and_mul", gate, up);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedpack_cpu, m) {
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedpack_cpu, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul_cpu);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul_cpu);
}
