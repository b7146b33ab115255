// CPU kernels of pagedpack_cpu::lora_shrink and lora_expand (fp32, bf16): multi-LoRA's two products,
// semantics in kernels/lora.py (punica's / vLLM's sgmv_shrink / sgmv_expand, bgmv_* for decode).
//
// The tokens are grouped by adapter slot (a counting sort of lora_indices: each slot's rows in
// ascending order, so a prefill sequence's run and a decode step's interleaved tokens alike), and
// each group runs register-tiled loops over its rows, 4 tokens at a time, with fp32 accumulation:
// - shrink: out[t, j] = dot(A[slot, j, :], x[t, :]) (x converted to fp32 once when bf16; A read in
//   its dtype, converted in registers); items of (slot, 16 tokens).
// - expand: out[t, o] = T(float(y[t, o]) + sum_r buffer[t, s R + r] B[slot, o, r]), the chunk of 64
//   columns of B transposed to fp32 [R, 64] once per item (slot, 64 tokens, slice, 64 columns) so the
//   token loop broadcasts buffer values against column vectors (no horizontal sums).
// Tokens with slot -1 are not touched: shrink's rows stay zero, expand's rows are y's copy. The slots
// are checked against max_loras on every call (no sync on a CPU). Items spread over
// at::parallel_for's threads, several to a thread where they are small.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "float_pairs.h"

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * Vec::size();  // values per inner step: one Vectorized<bf16>
constexpr int64_t kTile = 4;                // tokens per micro-kernel pass
constexpr int64_t kShrinkTokens = 16;       // tokens per shrink item
constexpr int64_t kExpandTokens = 64;       // tokens per expand item
constexpr int64_t kExpandCols = 64;         // output columns per expand item
constexpr int64_t kMinWork = 1 << 15;       // multiply-adds a thread takes at least, on average

// One slot's tokens: rows order[begin:end] of the step.
struct Group {
  int64_t slot, begin, end;
};

// The rows of each slot in use, by a counting sort; refuses a slot outside [-1, max_loras).
std::vector<Group> group_tokens(const char* op, const at::Tensor& indices, int64_t tokens, int64_t max_loras,
                                std::vector<int64_t>& order) {
  TORCH_CHECK_VALUE(indices.scalar_type() == at::kInt && indices.dim() == 1 && indices.size(0) == tokens, op,
                    ": lora_indices: expected an int32 tensor [N] with N=", tokens, ", got ", indices.scalar_type(),
                    " ", indices.sizes());
  const auto idx = indices.contiguous();
  const int32_t* p = idx.data_ptr<int32_t>();
  std::vector<int64_t> start(max_loras + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(p[t] >= -1 && p[t] < max_loras, op, ": lora_indices: expected slots in [0, ", max_loras,
                      ") or -1, got lora_indices[", t, "]=", p[t]);
    if (p[t] >= 0) ++start[p[t] + 1];
  }
  for (int64_t s = 0; s < max_loras; ++s) start[s + 1] += start[s];
  std::vector<Group> groups;
  for (int64_t s = 0; s < max_loras; ++s) {
    if (start[s + 1] > start[s]) groups.push_back({s, start[s], start[s + 1]});
  }
  order.assign(start[max_loras], 0);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    if (p[t] >= 0) order[next[p[t]]++] = t;
  }
  return groups;
}

// Runs fn(item) for items [0, n) of `work` multiply-adds in all, at least kMinWork a thread.
template <typename F>
void parallel_items(int64_t n, int64_t work, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, n * kMinWork / std::max<int64_t>(work, 1));
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) fn(i);
  });
}

void check_dtypes(const char* op, const char* arg, const at::Tensor& t, const char* w_arg, const at::Tensor& w) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", arg,
                    ": expected dtype float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(w.scalar_type() == t.scalar_type(), op, ": ", w_arg, ": expected the dtype of ", arg, " (",
                    t.scalar_type(), "), got ", w.scalar_type());
}

// out rows order[i:i+n] of [N, J] = x rows (fp32 [N, K]) times a [J, K]^T.
template <typename T>
void shrink_rows(const float* x, const T* a, float* out, const int64_t* rows, int64_t n, int64_t J, int64_t K) {
  for (int64_t i = 0; i < n; i += kTile) {
    const int64_t m = std::min(kTile, n - i);
    const float* xr[kTile];
    for (int64_t q = 0; q < kTile; ++q) xr[q] = x + rows[i + std::min(q, m - 1)] * K;  // a short tile repeats a row
    for (int64_t j = 0; j < J; ++j) {
      const T* ar = a + j * K;
      Vec acc[kTile][2];
      for (auto& pair : acc) pair[0] = pair[1] = Vec(0.f);
      int64_t k = 0;
      for (; k + kStep <= K; k += kStep) {
        auto [a0, a1] = pagedpack_cpu::load_floats(ar + k);
        for (int64_t q = 0; q < kTile; ++q) {
          acc[q][0] = at::vec::fmadd(a0, Vec::loadu(xr[q] + k), acc[q][0]);
          acc[q][1] = at::vec::fmadd(a1, Vec::loadu(xr[q] + k + Vec::size()), acc[q][1]);
        }
      }
      for (int64_t q = 0; q < m; ++q) {
        float sum = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, acc[q][0] + acc[q][1]);
        for (int64_t kk = k; kk < K; ++kk) sum += static_cast<float>(ar[kk]) * xr[q][kk];
        out[rows[i + q] * J + j] = sum;
      }
    }
  }
}

at::Tensor lora_shrink_cpu(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_indices) {
  const char* op = "lora_shrink";
  check_dtypes(op, "x", x, "lora_a", lora_a);
  TORCH_CHECK_VALUE(x.dim() >= 1 && lora_a.dim() == 3 && lora_a.size(2) == x.size(-1), op,
                    ": lora_a: expected [max_loras, S*R, in_features] with in_features=", x.dim() ? x.size(-1) : 0,
                    " as in x, got ", lora_a.sizes(), " (x ", x.sizes(), ")");
  const int64_t K = lora_a.size(2), J = lora_a.size(1);
  const auto x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t N = x2.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = J;
  auto out = at::zeros(out_sizes, x.options().dtype(at::kFloat));
  std::vector<int64_t> order;
  const auto groups = group_tokens(op, lora_indices, N, lora_a.size(0), order);
  if (groups.empty() || J == 0) return out;
  struct Item { int64_t slot, begin, end; };
  std::vector<Item> items;
  for (const auto& g : groups) {
    for (int64_t b = g.begin; b < g.end; b += kShrinkTokens) items.push_back({g.slot, b, std::min(g.end, b + kShrinkTokens)});
  }
  const auto a = lora_a.contiguous();
  float* o = out.data_ptr<float>();
  const float* xp = x2.data_ptr<float>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* ap = a.data_ptr<T>();
    parallel_items(items.size(), static_cast<int64_t>(order.size()) * J * K, [&](int64_t i) {
      const auto& it = items[i];
      shrink_rows<T>(xp, ap + it.slot * J * K, o, order.data() + it.begin, it.end - it.begin, J, K);
    });
  };
  if (a.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(at::BFloat16{});
  }
  return out;
}

// out rows order[i:i+n], columns [0, C) (pointer at the chunk's first column) += buffer rows (columns
// [0, R) from buf) times bt (fp32 [R, C], the chunk of B transposed).
template <typename T>
void expand_rows(const float* buf, int64_t buf_stride, const float* bt, T* out, int64_t out_stride,
                 const int64_t* rows, int64_t n, int64_t C, int64_t R) {
  for (int64_t i = 0; i < n; i += kTile) {
    const int64_t m = std::min(kTile, n - i);
    const float* br[kTile];
    T* orow[kTile];
    for (int64_t q = 0; q < kTile; ++q) {
      const int64_t row = rows[i + std::min(q, m - 1)];
      br[q] = buf + row * buf_stride;
      orow[q] = out + row * out_stride;
    }
    int64_t c = 0;
    for (; c + kStep <= C; c += kStep) {
      Vec acc[kTile][2];
      for (auto& pair : acc) pair[0] = pair[1] = Vec(0.f);
      for (int64_t r = 0; r < R; ++r) {
        const Vec b0 = Vec::loadu(bt + r * C + c), b1 = Vec::loadu(bt + r * C + c + Vec::size());
        for (int64_t q = 0; q < kTile; ++q) {
          const Vec u(br[q][r]);
          acc[q][0] = at::vec::fmadd(u, b0, acc[q][0]);
          acc[q][1] = at::vec::fmadd(u, b1, acc[q][1]);
        }
      }
      for (int64_t q = 0; q < m; ++q) {
        auto [y0, y1] = pagedpack_cpu::load_floats(orow[q] + c);
        pagedpack_cpu::store_floats(y0 + acc[q][0], y1 + acc[q][1], orow[q] + c);
      }
    }
    for (; c < C; ++c) {
      for (int64_t q = 0; q < m; ++q) {
        float sum = 0.f;
        for (int64_t r = 0; r < R; ++r) sum += br[q][r] * bt[r * C + c];
        orow[q][c] = static_cast<T>(static_cast<float>(orow[q][c]) + sum);
      }
    }
  }
}

at::Tensor lora_expand_cpu(const at::Tensor& y, const at::Tensor& buffer, const at::Tensor& lora_b,
                           const at::Tensor& lora_indices, at::IntArrayRef slice_sizes) {
  const char* op = "lora_expand";
  check_dtypes(op, "y", y, "lora_b", lora_b);
  TORCH_CHECK_VALUE(buffer.scalar_type() == at::kFloat, op, ": buffer: expected dtype float32, got ",
                    buffer.scalar_type());
  const int64_t S = slice_sizes.size();
  TORCH_CHECK_VALUE(y.dim() >= 1 && lora_b.dim() == 3 && lora_b.size(1) == y.size(-1), op,
                    ": lora_b: expected [max_loras, out_features, R] with out_features=", y.dim() ? y.size(-1) : 0,
                    " as in y, got ", lora_b.sizes());
  const int64_t O = lora_b.size(1), R = lora_b.size(2);
  int64_t total = 0;
  for (auto n : slice_sizes) {
    TORCH_CHECK_VALUE(n > 0, op, ": slice_sizes: expected positive sizes, got ", slice_sizes);
    total += n;
  }
  TORCH_CHECK_VALUE(S > 0 && total == O, op, ": slice_sizes: expected sizes summing to out_features=", O, ", got ",
                    slice_sizes);
  const auto y2 = y.reshape({-1, O});
  const int64_t N = y2.size(0);
  TORCH_CHECK_VALUE(buffer.dim() >= 1 && buffer.size(-1) == S * R && buffer.numel() == N * S * R, op,
                    ": buffer: expected [..., S*R] = [..., ", S * R, "] with the N=", N, " rows of y, got ",
                    buffer.sizes());
  auto out = y.clone(at::MemoryFormat::Contiguous);
  std::vector<int64_t> order;
  const auto groups = group_tokens(op, lora_indices, N, lora_b.size(0), order);
  if (groups.empty() || R == 0) return out;
  std::vector<int64_t> offsets(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) offsets[s + 1] = offsets[s] + slice_sizes[s];
  struct Item { int64_t slot, begin, end, slice, col, cols; };
  std::vector<Item> items;
  for (const auto& g : groups) {
    for (int64_t b = g.begin; b < g.end; b += kExpandTokens) {
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t c = offsets[s]; c < offsets[s + 1]; c += kExpandCols) {
          items.push_back({g.slot, b, std::min(g.end, b + kExpandTokens), s, c, std::min(offsets[s + 1] - c, kExpandCols)});
        }
      }
    }
  }
  const auto buf = buffer.reshape({N, S * R}).contiguous();
  const auto b = lora_b.contiguous();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* bp = b.data_ptr<T>();
    T* op_ = out.data_ptr<T>();
    const float* bufp = buf.data_ptr<float>();
    parallel_items(items.size(), static_cast<int64_t>(order.size()) * O * R, [&](int64_t i) {
      const auto& it = items[i];
      std::vector<float> scratch(it.cols * R);  // the chunk of B transposed, fp32 [R, cols]
      const T* chunk = bp + (it.slot * O + it.col) * R;
      for (int64_t c = 0; c < it.cols; ++c) {
        for (int64_t r = 0; r < R; ++r) scratch[r * it.cols + c] = static_cast<float>(chunk[c * R + r]);
      }
      expand_rows<T>(bufp + it.slice * R, S * R, scratch.data(), op_ + it.col, O, order.data() + it.begin, it.end - it.begin,
                     it.cols, R);
    });
  };
  if (b.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(at::BFloat16{});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedpack_cpu, m) {
  m.def("lora_shrink(Tensor x, Tensor lora_a, Tensor lora_indices) -> Tensor");
  m.def("lora_expand(Tensor y, Tensor buffer, Tensor lora_b, Tensor lora_indices, int[] slice_sizes) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedpack_cpu, CPU, m) {
  m.impl("lora_shrink", &lora_shrink_cpu);
  m.impl("lora_expand", &lora_expand_cpu);
}
