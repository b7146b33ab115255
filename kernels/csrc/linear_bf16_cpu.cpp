// CPU kernels of pagedpack_cpu::bf16_linear_pack(weight) and bf16_linear(x, packed, bias, out_features):
// torch.nn.functional.linear(x, weight, bias) in bf16 (y = x W^T + b) for CPUs without bf16 dot-product
// instructions (no AVX512-BF16, no AMX), where oneDNN emulates bf16 and ATen's bf16 GEMM computes about
// 17 GFLOP/s on two AVX2 cores at any row count (a verified draft token then costs a whole decode row).
//
// Numerics: each product of two bf16 values is exact in fp32; the products are summed in fp32 over K
// in order, the bias added in fp32 and the sum rounded to bf16 once (round to nearest even) --
// oneDNN's bf16 inner product with fp32 accumulation, in its own summation order.
//
// Layout: bf16_linear_pack turns W [N, K] into panels [ceil(N / C), K, C] of C = 2 * Vec::size()
// columns of W^T (16 with AVX2, 32 with AVX-512), zero columns past N. The micro-kernel loads one
// Vectorized<bf16> of a panel row, widens it to two float vectors in registers and multiplies it into
// up to kRows rows of x (fp32, converted once a call) by broadcast: 2 * kRows accumulators, outer
// products, no horizontal sums. A thread takes a range of panels and sweeps them kRowChunk rows of x at
// a time (those rows stay in its cache while the panels stream through).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>

namespace {

using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<at::BFloat16>;
constexpr int64_t kCols = 2 * Vec::size();  // columns of a panel: one Vectorized<bf16>
constexpr int kRows = 6;                    // rows of x per micro-kernel pass (12 accumulators)
constexpr int64_t kRowChunk = 96;           // rows of x a thread keeps while it sweeps its panels
constexpr int64_t kMinWork = 1 << 16;       // multiply-adds a thread takes at least
constexpr int64_t kBlockK = 32;             // products summed in registers before the running sums

// out[r, 0:cols] = bf16(sum_k x[r, k] * panel[k, :] + bias) for R rows of x (fp32, `ldx` apart): the
// accumulators sum kBlockK products at a time, each block's sums added to the running ones (an fp32 sum
// of K products in sequence drifts by up to K rounding steps; in blocks, by kBlockK + K / kBlockK: a
// SmolLM2 step's logits then stay as close to ATen's as correctly rounded linears' do).
template <int R>
inline void micro_kernel(const float* x, int64_t ldx, const at::BFloat16* panel, int64_t K, const float* bias,
                         at::BFloat16* out, int64_t ldo, int64_t cols) {
  Vec sum0[R], sum1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) sum0[r] = sum1[r] = Vec(0.f);
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    Vec acc0[R], acc1[R];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = Vec(0.f);
    const int64_t k1 = std::min(K, k0 + kBlockK);
    for (int64_t k = k0; k < k1; ++k) {
      auto [w0, w1] = at::vec::convert_to_float<at::BFloat16>(BVec::loadu(panel + k * kCols));
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const Vec xv(x[r * ldx + k]);
        acc0[r] = at::vec::fmadd(xv, w0, acc0[r]);
        acc1[r] = at::vec::fmadd(xv, w1, acc1[r]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      sum0[r] = sum0[r] + acc0[r];
      sum1[r] = sum1[r] + acc1[r];
    }
  }
  const Vec b0 = bias ? Vec::loadu(bias) : Vec(0.f), b1 = bias ? Vec::loadu(bias + Vec::size()) : Vec(0.f);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    at::vec::convert_from_float<at::BFloat16>(sum0[r] + b0, sum1[r] + b1).store(out + r * ldo, static_cast<int>(cols));
  }
}

using MicroKernel = void (*)(const float*, int64_t, const at::BFloat16*, int64_t, const float*, at::BFloat16*,
                             int64_t, int64_t);
constexpr MicroKernel kKernels[kRows + 1] = {nullptr, micro_kernel<1>, micro_kernel<2>, micro_kernel<3>,
                                             micro_kernel<4>, micro_kernel<5>, micro_kernel<6>};

at::Tensor bf16_linear_pack(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "bf16_linear_pack: weight: ",
                    "expected a bfloat16 tensor [N, K], got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kCols - 1) / kCols;
  auto padded = at::zeros({panels * kCols, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kCols, k}).transpose(1, 2).contiguous();  // [panels, K, C]
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == kCols &&
                        packed.is_contiguous(),
                    "bf16_linear: packed: expected bf16_linear_pack's contiguous bfloat16 [P, K, ", kCols, "], got ",
                    packed.scalar_type(), " ", packed.sizes());
  const int64_t K = packed.size(1), panels = packed.size(0);
  TORCH_CHECK_VALUE(out_features >= 0 && out_features > (panels - 1) * kCols && out_features <= panels * kCols,
                    "bf16_linear: out_features: expected a count in (", std::max<int64_t>(-1, (panels - 1) * kCols),
                    ", ", panels * kCols, "] for ", panels, " panels, got ", out_features);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) == K, "bf16_linear: x: ",
                    "expected a bfloat16 tensor [..., ", K, "], got ", x.scalar_type(), " ", x.sizes());
  at::Tensor bias_f;  // fp32, padded to whole panels
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == out_features,
                      "bf16_linear: bias: expected a bfloat16 tensor [", out_features, "], got ",
                      bias->scalar_type(), " ", bias->sizes());
    bias_f = at::zeros({panels * kCols}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, out_features).copy_(*bias);
  }
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = out_features;
  auto out = at::empty(out_sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
  if (out.numel() == 0) return out;
  if (K == 0) return bias.has_value() ? out.copy_(bias->expand_as(out)) : out.zero_();
  const auto xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(M * K * kCols, 1));
  at::parallel_for(0, panels, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t cols = std::min(kCols, out_features - p * kCols);
        for (int64_t m = m0; m < m1; m += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - m));
          kKernels[rows](xp + m * K, K, wp + p * K * kCols, K, bp ? bp + p * kCols : nullptr,
                         op + m * out_features + p * kCols, out_features, cols);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedpack_cpu, m) {
  m.def("bf16_linear_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedpack_cpu, CPU, m) {
  m.impl("bf16_linear_pack", &bf16_linear_pack);
  m.impl("bf16_linear", &bf16_linear);
}
