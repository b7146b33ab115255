// CPU kernels of pagedpack_cpu::rms_norm and pagedpack_cpu::fused_add_rms_norm (fp32, bf16, fp16).
//
// Semantics: transformers' LlamaRMSNorm, `weight * (x * rsqrt(mean(x^2, -1) + eps))` with the norm
// computed in fp32 and, for a bf16 / fp16 input, rounded to the input's dtype before the weight
// multiplies it in that dtype (LlamaRMSNorm casts x to fp32 and the normed value back); fused with
// the residual add before it (vLLM's fused_add_rms_norm, here functional), the sum `x + residual`
// rounded to the dtype and its norm. One pass over each row instead of the graph's six to nine ops
// (casts, pow, mean, add, rsqrt, mul, mul), each a dispatch and, but for the mean, a temporary the
// size of the input. Each value is rounded where the graph rounds it; the sum of squares is
// accumulated in fp32 vector lanes: it differs from ATen's mean by rounding alone. Chosen by
// lowering/reference/cpu_norm.py, which checks the lowered step against the graph.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElements = 1 << 15;  // rows per thread: at least this many elements

void check(const at::Tensor& input, const at::Tensor& weight, const char* op) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                        weight.scalar_type() == dtype,
                    op, ": input, weight: expected one dtype of float32, bfloat16, float16, got ", dtype, ", ",
                    weight.scalar_type());
  TORCH_CHECK_VALUE(input.dim() >= 1 && weight.dim() == 1 && weight.size(0) == input.size(-1), op, ": input ",
                    input.sizes(), ", weight ", weight.sizes(), ": expected weight [D] for input [..., D]");
}

// x rounded to T and back (the identity for float).
template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// out[r] = weight * T(row * rsqrt(mean(row^2) + eps)) for each of `rows` rows of `dim` values,
// the norm in fp32; `sum_out` (may be null): rows are first T(a + b), written there.
template <typename T>
void norm_rows(const T* a, const T* b, const T* weight, T* out, T* sum_out, int64_t rows, int64_t dim, double eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(dim, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : dim);  // a low-precision row in fp32
    for (int64_t r = lo; r < hi; ++r) {
      const T* in = a + r * dim;
      if (b != nullptr) {  // the residual add, written out: the next layer's residual
        T* s = sum_out + r * dim;
        if constexpr (std::is_same_v<T, float>) {
          int64_t d = 0;
          for (; d + Vec::size() <= dim; d += Vec::size())
            (Vec::loadu(in + d) + Vec::loadu(b + r * dim + d)).store(s + d);
          for (; d < dim; ++d) s[d] = in[d] + b[r * dim + d];
        } else {
          for (int64_t d = 0; d < dim; ++d) s[d] = static_cast<T>(static_cast<float>(in[d]) + static_cast<float>(b[r * dim + d]));
        }
        in = s;
      }
      const float* x;
      if constexpr (std::is_same_v<T, float>) {
        x = in;
      } else {
        for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(in[d]);
        x = row.data();
      }
      Vec acc(0.f);
      int64_t d = 0;
      for (; d + Vec::size() <= dim; d += Vec::size()) {
        const Vec v = Vec::loadu(x + d);
        acc = at::vec::fmadd(v, v, acc);
      }
      float squares = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc);
      for (; d < dim; ++d) squares += x[d] * x[d];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = out + r * dim;
      d = 0;
      if constexpr (std::is_same_v<T, float>) {
        const Vec vinv(inv);
        for (; d + Vec::size() <= dim; d += Vec::size())
          (Vec::loadu(weight + d) * (Vec::loadu(x + d) * vinv)).store(o + d);
      }
      for (; d < dim; ++d) o[d] = static_cast<T>(static_cast<float>(weight[d]) * rounded<T>(x[d] * inv));
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check(input, weight, "rms_norm");
  const auto x = input.contiguous(), w = weight.contiguous();
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), nullptr,
                        dim ? x.numel() / dim : 0, dim, epsilon);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& input, const at::Tensor& residual,
                                                          const at::Tensor& weight, double epsilon) {
  check(input, weight, "fused_add_rms_norm");
  TORCH_CHECK_VALUE(residual.sizes() == input.sizes() && residual.scalar_type() == input.scalar_type(),
                    "fused_add_rms_norm: residual ", residual.sizes(), " ", residual.scalar_type(),
                    ": expected input's shape ", input.sizes(), " and dtype ", input.scalar_type());
  const auto x = input.contiguous(), res = residual.contiguous(), w = weight.contiguous();
  auto out = at::empty_like(x), sum = at::empty_like(x);
  const int64_t dim = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm_cpu", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), res.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(), dim ? x.numel() / dim : 0, dim, epsilon);
  });
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedpack_cpu, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float epsilon) -> Tensor");
  m.def("fused_add_rms_norm(Tensor input, Tensor residual, Tensor weight, float epsilon) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedpack_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cpu);
}
