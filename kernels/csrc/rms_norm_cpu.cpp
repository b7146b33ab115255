// CPU kernels of pagedpack_cpu::rms_norm and pagedpack_cpu::fused_add_rms_norm (fp32).
//
// Semantics: transformers' LlamaRMSNorm in fp32, `weight * (x * rsqrt(mean(x^2, -1) + eps))`, and,
// fused with the residual add before it (vLLM's fused_add_rms_norm, here functional), the sum
// `x + residual` and its norm. One pass over each row instead of the graph's six ops (pow, mean,
// add, rsqrt, mul, mul), each a dispatch and, but for the mean, a temporary the size of the input.
// The sum of squares is accumulated in fp32 vector lanes: it differs from ATen's mean by rounding
// alone. Chosen by lowering/reference/cpu_norm.py, which checks the lowered step against the graph.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElements = 1 << 15;  // rows per thread: at least this many elements

void check(const at::Tensor& input, const at::Tensor& weight, const char* op) {
  TORCH_CHECK_VALUE(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, op,
                    ": input, weight: expected float32, got ", input.scalar_type(), ", ", weight.scalar_type());
  TORCH_CHECK_VALUE(input.dim() >= 1 && weight.dim() == 1 && weight.size(0) == input.size(-1), op, ": input ",
                    input.sizes(), ", weight ", weight.sizes(), ": expected weight [D] for input [..., D]");
}

// out[r] = weight * row * rsqrt(mean(row^2) + eps) for each of `rows` rows of `dim` floats;
// `sum_out` (may be null): rows are first `a + b`, written there.
void norm_rows(const float* a, const float* b, const float* weight, float* out, float* sum_out, int64_t rows,
               int64_t dim, double eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(dim, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* x = a + r * dim;
      if (b != nullptr) {  // the residual add, written out: the next layer's residual
        float* s = sum_out + r * dim;
        int64_t d = 0;
        for (; d + Vec::size() <= dim; d += Vec::size())
          (Vec::loadu(x + d) + Vec::loadu(b + r * dim + d)).store(s + d);
        for (; d < dim; ++d) s[d] = x[d] + b[r * dim + d];
        x = s;
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
      const Vec vinv(inv);
      float* o = out + r * dim;
      d = 0;
      for (; d + Vec::size() <= dim; d += Vec::size())
        (Vec::loadu(weight + d) * (Vec::loadu(x + d) * vinv)).store(o + d);
      for (; d < dim; ++d) o[d] = weight[d] * (x[d] * inv);
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check(input, weight, "rms_norm");
  const auto x = input.contiguous(), w = weight.contiguous();
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1);
  norm_rows(x.data_ptr<float>(), nullptr, w.data_ptr<float>(), out.data_ptr<float>(), nullptr,
            dim ? x.numel() / dim : 0, dim, epsilon);
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& input, const at::Tensor& residual,
                                                          const at::Tensor& weight, double epsilon) {
  check(input, weight, "fused_add_rms_norm");
  TORCH_CHECK_VALUE(residual.sizes() == input.sizes() && residual.scalar_type() == at::kFloat,
                    "fused_add_rms_norm: residual ", residual.sizes(), " ", residual.scalar_type(),
                    ": expected input's shape ", input.sizes(), " and float32");
  const auto x = input.contiguous(), res = residual.contiguous(), w = weight.contiguous();
  auto out = at::empty_like(x), sum = at::empty_like(x);
  const int64_t dim = x.size(-1);
  norm_rows(x.data_ptr<float>(), res.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(),
            sum.data_ptr<float>(), dim ? x.numel() / dim : 0, dim, epsilon);
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
