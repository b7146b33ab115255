// bf16 and fp32 causal prefill attention over paged K/V: flash attention (online softmax over KV
// blocks) whose two GEMM tiles, S = Q K^T and O += P V, run in oneDNN's BRGEMM micro-kernels
// (at::native::cpublas::brgemm, the kernels ATen's own CPU flash attention calls; in bf16
// AVX512-BF16 or AMX dot products accumulating in fp32). Decision and measurements:
// docs/cpu-kernels.md.
//
// Numerics in fp32: every operand and sum fp32, P too. In bf16: Q and K are bf16, their products exact in fp32 and summed in fp32; the softmax is
// fp32; P is split into two bf16 terms (hi + lo, 16 significant bits) so that P V is the fp32
// product up to ~2^-17 relative: the output is the fp32 computation on the bf16 inputs rounded
// once, as on every other path (decode, short chunks, the reference and Ascend targets), so a
// prompt's result does not depend on how the scheduler chunks it. Rounding P to bf16, as SDPA and
// FlashAttention do, saved 10-30 % of the time but changed greedy tokens against those paths.
#include "flash_prefill.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pagedpack_cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
using bf16 = at::BFloat16;
constexpr int64_t kBlockQ = 64;    // query rows per work item
constexpr int64_t kDiagRows = 32;  // rows per GEMM tile in the causal diagonal's block (8 % fewer FLOPs on W1)
constexpr int64_t kBlockKv = 128;  // keys per online-softmax update (even: the VNNI pairs)
constexpr int64_t kColStep = 32;   // a block's computed keys: a multiple of this, past the last one visible
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
constexpr bool kVnni = std::is_same_v<T, bf16>;  // brgemm's bf16 B operand is VNNI-packed, fp32's plain

// Keys, for S = Q K^T (B = K^T, [d, kBlockKv]); columns >= n zero. fp32: (e, j) = key_j[e]. bf16,
// the VNNI layout (a [K, N] matrix stored as [K / 2][N][2]): word (e / 2, j) = key_j[e, e + 1].
template <typename T>
void pack_keys(const T* const* rows, int64_t n, int64_t d, T* dst) {
  if constexpr (kVnni<T>) {
    auto* out = reinterpret_cast<uint32_t*>(dst);
    std::fill(out, out + (d / 2) * kBlockKv, 0u);
    for (int64_t j = 0; j < n; ++j) {
      uint32_t word;
      for (int64_t e = 0; e < d / 2; ++e) {
        std::memcpy(&word, rows[j] + 2 * e, sizeof(word));
        out[e * kBlockKv + j] = word;
      }
    }
  } else {
    std::fill(dst, dst + d * kBlockKv, T(0));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t e = 0; e < d; ++e) dst[e * kBlockKv + j] = rows[j][e];
  }
}

// Values, for O += P V (B = V, [kBlockKv, dv]); rows >= n zero. fp32: (j, e) = value_j[e]. bf16:
// (j / 2, e, j % 2) = value_j[e].
template <typename T>
void pack_values(const T* const* rows, int64_t n, int64_t dv, T* dst) {
  std::fill(dst, dst + kBlockKv * dv, T(0.f));
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (kVnni<T>) {
      for (int64_t e = 0; e < dv; ++e) dst[((j / 2) * dv + e) * 2 + j % 2] = rows[j][e];
    } else {
      std::copy(rows[j], rows[j] + dv, dst + j * dv);
    }
  }
}

// C = A B for A [m, k] row-major (row stride lda), B packed [k, n] (row stride ldb, k even), C fp32
// [m, n] (row stride ldc).
template <typename T>
void gemm(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool accumulate, const T* a,
          const T* b, float* c) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, /*is_vnni=*/kVnni<T>);
}

// Run brgemm on small integer matrices (exact in bf16 and fp32) of the kernel's two shapes and
// compare with a plain loop: false where the micro-kernel is absent, raises, or computes
// something else (a CPU without the instructions).
template <typename T>
bool brgemm_matches(int64_t d, int64_t dv) {
  try {
    const int64_t m = 3;
    std::vector<T> a(m * std::max(d, kBlockKv)), keys(kBlockKv * d), vals(kBlockKv * dv);
    std::vector<T> kp(d * kBlockKv), vp(kBlockKv * dv);
    for (size_t i = 0; i < a.size(); ++i) a[i] = T(static_cast<float>(static_cast<int64_t>(i % 7) - 3));
    for (size_t i = 0; i < keys.size(); ++i) keys[i] = T(static_cast<float>(static_cast<int64_t>(i % 5) - 2));
    for (size_t i = 0; i < vals.size(); ++i) vals[i] = T(static_cast<float>(static_cast<int64_t>(i % 3) - 1));
    std::vector<const T*> krows(kBlockKv), vrows(kBlockKv);
    for (int64_t j = 0; j < kBlockKv; ++j) krows[j] = keys.data() + j * d, vrows[j] = vals.data() + j * dv;
    pack_keys(krows.data(), kBlockKv, d, kp.data());
    pack_values(vrows.data(), kBlockKv, dv, vp.data());
    std::vector<float> s(m * kBlockKv), o(m * dv);
    gemm(m, kBlockKv, d, d, kBlockKv, kBlockKv, false, a.data(), kp.data(), s.data());
    gemm(m, dv, kBlockKv, kBlockKv, dv, dv, false, a.data(), vp.data(), o.data());
    at::native::cpublas::brgemm_release(kVnni<T>);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < kBlockKv; ++j) {
        float x = 0.f;
        for (int64_t e = 0; e < d; ++e) x += float(a[i * d + e]) * float(keys[j * d + e]);
        if (x != s[i * kBlockKv + j]) return false;
      }
      for (int64_t e = 0; e < dv; ++e) {
        float x = 0.f;
        for (int64_t j = 0; j < kBlockKv; ++j) x += float(a[i * kBlockKv + j]) * float(vals[j * dv + e]);
        if (x != o[i * dv + e]) return false;
      }
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// One query row's raw scores s[0, cols) against a KV block, the first `seen` of them visible
// (seen <= cols, cols a multiple of kColStep): the online-softmax update of the row's running max
// and sum (scaled units), P = exp(scale * s - max) (zero past `seen`): in fp32 into hi, in bf16 as
// two terms, hi + lo. Returns the factor the row's accumulated output takes.
template <typename T>
float softmax_row(const float* s, int64_t seen, int64_t cols, float scale, float& row_max, float& row_sum, T* hi,
                  T* lo) {
  constexpr int64_t w = Vec::size();
  static_assert(kBlockKv % kColStep == 0 && kColStep % (2 * w) == 0);
  if (seen == 0) {
    std::fill(hi, hi + cols, T(0.f));
    if constexpr (kVnni<T>) std::fill(lo, lo + cols, T(0.f));
    return 1.f;
  }
  const float raw_max = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, seen);
  const float m_new = std::max(row_max, raw_max * scale), corr = std::exp(row_max - m_new);
  const Vec vs(scale), vm(m_new), zero(0.f);
  Vec sum(0.f);
  for (int64_t j = 0; j < cols; j += 2 * w) {
    Vec a = at::vec::fmsub(Vec::loadu(s + j), vs, vm).exp_u20();
    Vec b = at::vec::fmsub(Vec::loadu(s + j + w), vs, vm).exp_u20();
    if (j + 2 * w > seen) {
      a = Vec::set(zero, a, std::clamp<int64_t>(seen - j, 0, w));
      b = Vec::set(zero, b, std::clamp<int64_t>(seen - j - w, 0, w));
    }
    sum = sum + a + b;
    if constexpr (kVnni<T>) {
      const auto h = at::vec::convert_from_float<bf16>(a, b);
      const auto [ha, hb] = at::vec::convert_to_float<bf16>(h);
      h.store(hi + j);
      at::vec::convert_from_float<bf16>(a - ha, b - hb).store(lo + j);
    } else {
      a.store(hi + j);
      b.store(hi + j + w);
    }
  }
  row_sum = row_sum * corr + at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
  row_max = m_new;
  return corr;
}

struct Work {  // query rows [r0, r0 + kBlockQ) of head h of sequence seqs[s]
  int64_t s, h, r0, cost;
};

}  // namespace

bool flash_prefill_supported(at::ScalarType dtype, int64_t head_dim, int64_t head_dim_v) {
  if (head_dim % 2 || head_dim <= 0 || head_dim_v <= 0) return false;
  if (dtype != at::kBFloat16 && dtype != at::kFloat) return false;
  static std::mutex mutex;
  static std::map<std::tuple<at::ScalarType, int64_t, int64_t>, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(dtype, head_dim, head_dim_v);
  auto it = known.find(key);
  if (it == known.end()) {
    const bool ok = dtype == at::kFloat ? brgemm_matches<float>(head_dim, head_dim_v)
                                        : brgemm_matches<bf16>(head_dim, head_dim_v);
    it = known.emplace(key, ok).first;
  }
  return it->second;
}

namespace {

template <typename T>
void flash_prefill(const Meta& m, const std::vector<int64_t>& seqs, const at::Tensor& query,
                   const at::Tensor& key_cache, const at::Tensor& value_cache, double scale, at::Tensor& out) {
  const int64_t num_heads = query.size(1), d = query.size(2), dv = value_cache.size(3);
  const int64_t num_kv_heads = key_cache.size(2), group = num_heads / num_kv_heads;
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const auto ks = key_cache.strides(), vs = value_cache.strides();

  // 1. Each sequence's K/V, per KV head and block of kBlockKv keys, packed once (shared by the
  //    query blocks and the GQA group's heads): pack[first[s] + g * blocks(s) + blk].
  std::vector<int64_t> first(seqs.size() + 1, 0);
  auto blocks = [&](size_t s) { return (m.kv_lens[seqs[s]] + kBlockKv - 1) / kBlockKv; };
  for (size_t s = 0; s < seqs.size(); ++s) first[s + 1] = first[s] + num_kv_heads * blocks(s);
  std::vector<T> kpack(first.back() * d * kBlockKv), vpack(first.back() * kBlockKv * dv);
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> krows(kBlockKv), vrows(kBlockKv);
    for (int64_t i = begin; i < end; ++i) {
      const size_t s = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
      const int64_t b = seqs[s], g = (i - first[s]) / blocks(s), blk = (i - first[s]) % blocks(s);
      const int64_t c0 = blk * kBlockKv, n = std::min<int64_t>(kBlockKv, m.kv_lens[b] - c0);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t phys = block_of(m, b, c0 + j), off = (c0 + j) % m.block_size;
        krows[j] = kc + phys * ks[0] + off * ks[1] + g * ks[2];
        vrows[j] = vc + phys * vs[0] + off * vs[1] + g * vs[2];
      }
      pack_keys(krows.data(), n, d, kpack.data() + i * d * kBlockKv);
      pack_values(vrows.data(), n, dv, vpack.data() + i * kBlockKv * dv);
    }
  });

  // 2. Work items, most keys first, taken from a shared counter (causal rows differ in cost).
  std::vector<Work> work;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int64_t b = seqs[s], q_len = m.cu[b + 1] - m.cu[b], past = m.kv_lens[b] - q_len;
    for (int64_t r0 = 0; r0 < q_len; r0 += kBlockQ)
      for (int64_t h = 0; h < num_heads; ++h)
        work.push_back({static_cast<int64_t>(s), h, r0, past + std::min(q_len, r0 + kBlockQ)});
  }
  std::stable_sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.cost > b.cost; });
  std::atomic<size_t> next{0};
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(kBlockQ * kBlockKv), acc(kBlockQ * dv), row_max(kBlockQ), row_sum(kBlockQ);
    std::vector<T> p_hi(kBlockQ * kBlockKv), p_lo(kVnni<T> ? kBlockQ * kBlockKv : 0);
    for (size_t w = next++; w < work.size(); w = next++) {
      const Work& it = work[w];
      const int64_t b = seqs[it.s], kv_len = m.kv_lens[b], q_len = m.cu[b + 1] - m.cu[b];
      const int64_t rows = std::min(kBlockQ, q_len - it.r0), pos0 = kv_len - q_len + it.r0;
      const int64_t g = it.h / group, nblk = blocks(it.s);
      const T* qa = q + ((m.cu[b] + it.r0) * num_heads + it.h) * d;
      std::fill(acc.begin(), acc.begin() + rows * dv, 0.f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      for (int64_t c0 = 0; c0 < pos0 + rows; c0 += kBlockKv) {
        const int64_t pk = first[it.s] + g * nblk + c0 / kBlockKv;
        const T* vb = vpack.data() + pk * kBlockKv * dv;
        // The causal diagonal's block (the item's last) in tiles of kDiagRows rows, the others whole.
        const int64_t tile = pos0 + rows - c0 <= kBlockKv ? kDiagRows : kBlockQ;
        for (int64_t r0 = 0; r0 < rows; r0 += tile) {
          const int64_t n = std::min(tile, rows - r0);
          // Only the block's keys up to the tile's last visible one (rounded up) are computed: the
          // causal diagonal's blocks and a short sequence's only block cost what they show.
          const int64_t visible = std::min({kBlockKv, kv_len - c0, pos0 + r0 + n - c0});
          if (visible <= 0) continue;  // the tile's rows see none of the block's keys
          const int64_t cols = (visible + kColStep - 1) / kColStep * kColStep;
          float* s_tile = scores.data() + r0 * kBlockKv;
          T* hi = p_hi.data() + r0 * kBlockKv;
          T* lo = kVnni<T> ? p_lo.data() + r0 * kBlockKv : nullptr;
          float* acc_tile = acc.data() + r0 * dv;
          gemm(n, cols, d, num_heads * d, kBlockKv, kBlockKv, false, qa + r0 * num_heads * d,
               kpack.data() + pk * d * kBlockKv, s_tile);
          for (int64_t i = 0; i < n; ++i) {
            // Keys this row sees in the block: j < kv_len and j <= its position.
            const int64_t seen = std::clamp<int64_t>(std::min(kv_len, pos0 + r0 + i + 1) - c0, 0, visible);
            const float corr = softmax_row(s_tile + i * kBlockKv, seen, cols, sc, row_max[r0 + i], row_sum[r0 + i],
                                           hi + i * kBlockKv, lo ? lo + i * kBlockKv : nullptr);
            float* a = acc_tile + i * dv;
            if (corr != 1.f) at::vec::map([corr](Vec x) { return x * Vec(corr); }, a, a, dv);
          }
          gemm(n, dv, cols, kBlockKv, dv, dv, true, hi, vb, acc_tile);
          if constexpr (kVnni<T>) gemm(n, dv, cols, kBlockKv, dv, dv, true, lo, vb, acc_tile);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const float inv = 1.f / row_sum[i];  // > 0: every row sees key 0
        float* row = acc.data() + i * dv;
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, row, row, dv);
        at::vec::convert(row, o + ((m.cu[b] + it.r0 + i) * num_heads + it.h) * dv, dv);
      }
    }
    at::native::cpublas::brgemm_release(kVnni<T>);
  });
}

}  // namespace

void flash_prefill(const Meta& m, const std::vector<int64_t>& seqs, const at::Tensor& query,
                   const at::Tensor& key_cache, const at::Tensor& value_cache, double scale, at::Tensor& out) {
  if (query.scalar_type() == at::kFloat) {
    flash_prefill<float>(m, seqs, query, key_cache, value_cache, scale, out);
  } else {
    flash_prefill<bf16>(m, seqs, query, key_cache, value_cache, scale, out);
  }
}

}  // namespace pagedpack_cpu
