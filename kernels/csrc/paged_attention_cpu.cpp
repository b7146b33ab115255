// CPU kernels of pagedpack::paged_attention and pagedpack::reshape_and_cache.
//
// Semantics: kernels/ops.py (the Python reference, the ground truth in tests). Decision and
// measurements: docs/cpu-kernels.md. In short:
//   * Short query runs (decode, short chunks) and every call with attention parameters read K/V
//     in place through block_table: one work item per (sequence, KV heads, query tile, KV split),
//     the query heads of a GQA group sharing each K/V row, online softmax in fp32 per KV chunk,
//     split-KV partials merged at the end. at::parallel_for spreads the items over threads.
//   * Long query runs without parameters (prefill): in bf16 and fp32, flash attention over the
//     paged K/V with BRGEMM tiles (flash_prefill_cpu.cpp); otherwise the sequence's K/V copied once into a
//     contiguous buffer and ATen's flash SDPA (GEMM tiles), the copy ~1/q_len of the work.
// Metadata values are bounds-checked here on every call (cheap on the CPU, no sync), so bad
// metadata raises instead of reading outside the cache.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash_prefill.h"

namespace {

using pagedpack_cpu::block_of;
using pagedpack_cpu::Meta;

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kPrefillMinRows = 32;  // query rows from which a parameter-free sequence takes the prefill path
constexpr int64_t kQueryTile = 16;     // query rows per work item
constexpr int64_t kKvChunk = 32;       // KV tokens per online-softmax update
constexpr int64_t kMinSplitTokens = 256;
constexpr int64_t kItemChunkBytes = 128 << 10;  // fp32 K + V of one KV chunk of an item, at most
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Params {
  double scale;
  int64_t window;      // 0: none
  int64_t chunk;       // attention_chunk_size, 0: none
  double soft_cap;     // 0: none
  const float* alibi;  // [H] or nullptr
  const float* sinks;  // [H] or nullptr
};

// One work item: query rows [r0, r1) of sequence b (rows relative to its first row), KV heads
// [g0, g1), keys [lo, hi) of the sequence.
struct Item {
  int64_t b, g0, g1, r0, r1, lo, hi;
};

// The first key position a query at position pos sees: pos - window + 1 with a sliding window, the
// start of pos's chunk with attention_chunk_size (the later of the two), else 0.
inline int64_t first_key(const Params& p, int64_t pos) {
  int64_t first = 0;
  if (p.window) first = pos - p.window + 1;
  if (p.chunk) first = std::max(first, pos >= 0 ? pos / p.chunk * p.chunk : 0);
  return first;
}

inline float reduce_add(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {  // y += alpha * x
  const Vec va(alpha);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) at::vec::fmadd(va, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < n; ++d) y[d] += alpha * x[d];
}

inline void scale_row(float alpha, float* y, int64_t n) {
  at::vec::map([alpha](Vec x) { return x * Vec(alpha); }, y, y, n);
}

// Scaled caches (int8, fp8): each (token, KV head) row holds its head's quantized values, then the
// fp32 scale they are multiplied by, in kScaleBytes one-byte elements (kernels/kv_quant.py).
template <typename T>
constexpr bool kScaled =
    std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;
constexpr int64_t kScaleBytes = 4;

bool is_scaled(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// Activations (query, key, value) are float32/64, bfloat16 or float16; caches also one of the scaled dtypes.
bool is_activation_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

void check_cache_dtypes(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  for (const auto& [name, cache] : {std::pair{"key_cache", key_cache}, std::pair{"value_cache", value_cache}})
    TORCH_CHECK_VALUE(is_activation_dtype(cache.scalar_type()) || is_scaled(cache.scalar_type()), op, ": ", name,
                      ": expected a cache dtype (float32, float64, bfloat16, float16, int8, float8_e4m3fn, "
                      "float8_e5m2), got ", cache.scalar_type());
  TORCH_CHECK_VALUE(key_cache.scalar_type() == value_cache.scalar_type(), op,
                    ": value_cache: expected the dtype of key_cache (", key_cache.scalar_type(), "), got ",
                    value_cache.scalar_type());
}

// The head size of a cache [num_blocks, block_size, num_kv_heads, row].
int64_t head_size(const at::Tensor& cache) {
  return cache.size(3) - (is_scaled(cache.scalar_type()) ? kScaleBytes : 0);
}

// The scale of a scaled row of `head` values (1 for an unscaled dtype).
template <typename T>
inline float row_scale(const T* row, int64_t head) {
  if constexpr (kScaled<T>) {
    float scale;
    std::memcpy(&scale, row + head, sizeof(float));
    return scale;
  } else {
    return 1.f;
  }
}

// Vec::size() elements of the cache's dtype as a vector of floats, converted in registers (bf16,
// fp16, int8 and fp8 caches are read as they are stored, never copied; a scaled row's scale is
// applied by the caller).
template <typename T>
inline Vec load_float(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(x);
  } else if constexpr (c10::is_reduced_floating_point_v<T>) {
    Vec out;
    at::vec::load_to_float<T>(x, out);
    return out;
  }
#if defined(CPU_CAPABILITY_AVX512)
  else if constexpr (std::is_same_v<T, int8_t>) {
    return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)))));
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    // e4m3 bits s.eeee.mmm placed as fp16's s.0eeee.mmm0000000 are the value times 2^-8, subnormals
    // included (fp16 holds them as normals or its own subnormals exactly); NaN (never written) is not
    // kept. 3.7x faster than ATen's conversion, whose subnormal branch a scaled row takes often.
    const __m256i bits = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bits, _mm256_set1_epi16(0x80)), 8);
    const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(bits, _mm256_set1_epi16(0x7F)), 7);
    return Vec(_mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, magnitude)), _mm512_set1_ps(256.f)));
  } else if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    __m512 out;
    at::vec::cvtfp8e5m2_fp32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)), out);
    return Vec(out);
  }
#endif
  else {  // float64, and the 1-byte types without AVX-512
    __at_align__ float tmp[Vec::size()];
    for (int64_t i = 0; i < Vec::size(); ++i) tmp[i] = static_cast<float>(x[i]);
    return Vec::loadu(tmp);
  }
}

// Scores and weighted values of a GQA group's query vectors against n key rows of dtype T, in
// fp32. Head dims known at compile time (D == Dv, a multiple of the vector width): G query vectors
// at a time share each key / value row, loaded (and converted from its cache dtype) once for the G,
// with the queries or accumulators in registers; kTile keeps the G queries or accumulators, the row
// and the sums within the 32 vector registers. D == 0: any head dims, one vector at a time, through
// memory.
template <int64_t D>
struct Row {
  static_assert(D % Vec::size() == 0, "head dims of the register kernels are multiples of the vector width");
  static constexpr int64_t kVecs = D / Vec::size();
  static constexpr int64_t kTile = D == 0 ? 1 : (kVecs <= 4 ? 4 : (kVecs <= 8 ? 2 : 1));
  // One K / V row of dtype T into registers as fp32; returns the row's scale (1 unless int8 / fp8).
  template <typename T, size_t N>
  static float load_row(const T* row, Vec (&out)[N]) {
    for (size_t i = 0; i < N; ++i) out[i] = load_float(row + i * Vec::size());
    return row_scale(row, D);
  }
  // s[g * s_stride + t] = q[g * d ..] . k[t] for g < G, t < n.
  template <int64_t G, typename T>
  static void scores_tile(const float* q, const T* const* k, int64_t n, float* s, int64_t s_stride) {
    Vec qv[G][kVecs];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < kVecs; ++i) qv[g][i] = Vec::loadu(q + g * D + i * Vec::size());
    for (int64_t t = 0; t < n; ++t) {
      Vec kv[kVecs];
      const float scale = load_row(k[t], kv);
      for (int64_t g = 0; g < G; ++g) {
        Vec acc = qv[g][0] * kv[0];
        for (int64_t i = 1; i < kVecs; ++i) acc = at::vec::fmadd(qv[g][i], kv[i], acc);
        s[g * s_stride + t] = reduce_add(acc) * scale;
      }
    }
  }
  // out[g * out_stride ..] += sum_t w[g * w_stride + t] * v[t] for g < G.
  template <int64_t G, typename T>
  static void accumulate_tile(const float* w, int64_t w_stride, const T* const* v, int64_t n, float* out,
                              int64_t out_stride) {
    Vec acc[G][kVecs];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < kVecs; ++i) acc[g][i] = Vec::loadu(out + g * out_stride + i * Vec::size());
    for (int64_t t = 0; t < n; ++t) {
      Vec vv[kVecs];
      const float scale = load_row(v[t], vv);
      for (int64_t g = 0; g < G; ++g) {
        const Vec wt(w[g * w_stride + t] * scale);
        for (int64_t i = 0; i < kVecs; ++i) acc[g][i] = at::vec::fmadd(wt, vv[i], acc[g][i]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < kVecs; ++i) acc[g][i].store(out + g * out_stride + i * Vec::size());
  }
  // s / out of gn <= kTile query vectors: the tiles above, or (D == 0, any head dims) one vector at a
  // time through memory.
  template <typename T>
  static void scores_group(int64_t gn, const float* q, const T* const* k, int64_t n, int64_t d, float* s,
                           int64_t s_stride) {
    if constexpr (D == 0) {
      for (int64_t g = 0; g < gn; ++g, q += d, s += s_stride) {
        for (int64_t t = 0; t < n; ++t) {
          Vec acc(0.f);
          int64_t e = 0;
          for (; e + Vec::size() <= d; e += Vec::size()) acc = at::vec::fmadd(Vec::loadu(q + e), load_float(k[t] + e), acc);
          float x = reduce_add(acc);
          for (; e < d; ++e) x += q[e] * static_cast<float>(k[t][e]);
          s[t] = x * row_scale(k[t], d);
        }
      }
    } else {
      dispatch_tile(gn, [&](auto g) { scores_tile<decltype(g)::value>(q, k, n, s, s_stride); });
    }
  }
  template <typename T>
  static void accumulate_group(int64_t gn, const float* w, int64_t w_stride, const T* const* v, int64_t n,
                               int64_t dv, float* out, int64_t out_stride) {
    if constexpr (D == 0) {
      for (int64_t g = 0; g < gn; ++g, w += w_stride, out += out_stride) {
        for (int64_t t = 0; t < n; ++t) {
          const float wt_s = w[t] * row_scale(v[t], dv);
          const Vec wt(wt_s);
          int64_t e = 0;
          for (; e + Vec::size() <= dv; e += Vec::size())
            at::vec::fmadd(wt, load_float(v[t] + e), Vec::loadu(out + e)).store(out + e);
          for (; e < dv; ++e) out[e] += wt_s * static_cast<float>(v[t][e]);
        }
      }
    } else {
      dispatch_tile(gn, [&](auto g) { accumulate_tile<decltype(g)::value>(w, w_stride, v, n, out, out_stride); });
    }
  }

 private:
  template <typename F>
  static void dispatch_tile(int64_t gn, F&& f) {
    using C1 = std::integral_constant<int64_t, 1>;
    using C2 = std::integral_constant<int64_t, 2>;
    using C3 = std::integral_constant<int64_t, 3>;
    using C4 = std::integral_constant<int64_t, 4>;
    if constexpr (kTile >= 4) {
      if (gn == 4) return f(C4{});
      if (gn == 3) return f(C3{});
    }
    if constexpr (kTile >= 2) {
      if (gn == 2) return f(C2{});
    }
    TORCH_CHECK(gn == 1, "paged_attention: internal: a tile of ", gn, " query vectors");
    f(C1{});
  }
};

// Into L2, not L1 (locality 1: prefetcht2): a chunk's K/V rows (24 KB for 32 tokens of 3 bf16
// heads of 64) asked for while the previous chunk computes would evict that chunk's rows from a
// 32 KB L1 (docs/cpu-kernels.md).
template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 1);
}

// Query vector (token t, head h) of a contiguous query [T, H, D] of an activation dtype, times
// scale, into dst as fp32 (the kernels' compute dtype; no whole-query copy).
void load_query(const at::Tensor& query, int64_t t, int64_t h, float scale, float* dst) {
  const int64_t d = query.size(2), offset = (t * query.size(1) + h) * d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "load_query", [&] {
    const scalar_t* src = query.const_data_ptr<scalar_t>() + offset;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(src[e]) * scale;
  });
}

// n fp32 values into out's elements [offset, offset + n), rounded once to out's dtype.
void store_row(const float* src, at::Tensor& out, int64_t offset, int64_t n) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "store_row",
                                  [&] { at::vec::convert(src, out.data_ptr<scalar_t>() + offset, n); });
}

void check_metadata(const Meta& m, int64_t num_tokens) {
  TORCH_CHECK_VALUE(m.cu[0] == 0, "paged_attention: cu_seqlens_q: expected cu_seqlens_q[0] == 0, got ", m.cu[0]);
  for (int64_t b = 0; b < m.num_seqs; ++b) {
    const int64_t q_len = m.cu[b + 1] - m.cu[b];
    TORCH_CHECK_VALUE(q_len >= 0, "paged_attention: cu_seqlens_q: expected a non-decreasing sequence, got cu_seqlens_q[",
                      b, "]=", m.cu[b], " > cu_seqlens_q[", b + 1, "]=", m.cu[b + 1]);
    const int64_t kv_len = std::max<int64_t>(m.kv_lens[b], 0);
    const int64_t needed = (kv_len + m.block_size - 1) / m.block_size;
    TORCH_CHECK_VALUE(needed <= m.max_blocks, "paged_attention: block_table: expected at least ", needed,
                      " columns for seq_lens[", b, "]=", kv_len, " with block_size=", m.block_size, ", got ",
                      m.max_blocks);
    for (int64_t i = 0; i < needed; ++i) {
      const int64_t id = m.table[b * m.table_stride + i];
      TORCH_CHECK_VALUE(id >= 0 && id < m.num_blocks, "paged_attention: block_table: expected block ids in [0, ",
                        m.num_blocks, "), got block_table[", b, ", ", i, "]=", id);
    }
  }
  TORCH_CHECK_VALUE(m.cu[m.num_seqs] == num_tokens, "paged_attention: cu_seqlens_q: expected the last entry to equal ",
                    "num_tokens=", num_tokens, ", got ", m.cu[m.num_seqs]);
}

// Online-softmax state of one work item: per query vector (row x query head of KV heads
// [g0, g1)) its running max, denominator and unnormalised output. Stored as [rows, heads, 2 + Dv]
// floats: m, l, acc[Dv]. A token's rows of KV heads g0..g1 are adjacent in a block, so an item
// with several KV heads reads them as one contiguous run.
template <typename T, int64_t D>
void attend_item(const Item& it, const Meta& meta, const Params& p, const at::Tensor& query, const T* k_base,
                 const T* v_base, at::IntArrayRef k_strides, at::IntArrayRef v_strides, int64_t group, int64_t dv,
                 float* state) {
  const int64_t d = query.size(2);
  const int64_t heads = (it.g1 - it.g0) * group, rows = it.r1 - it.r0, nvec = rows * heads;
  const int64_t nkv = it.g1 - it.g0;
  const int64_t q_len = meta.cu[it.b + 1] - meta.cu[it.b];
  const int64_t kv_len = std::max<int64_t>(meta.kv_lens[it.b], 0);
  const int64_t first_pos = kv_len - q_len;  // absolute position of the sequence's query row 0
  const int64_t width = 2 + dv;

  std::vector<float> q(nvec * d), s(Row<D>::kTile * kKvChunk);  // s: [tile's query vector][chunk token]
  std::vector<const T*> kp(nkv * kKvChunk), vp(nkv * kKvChunk);  // [KV head of the item][chunk token]
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < heads; ++i) {
      const int64_t h = it.g0 * group + i, v = r * heads + i;
      load_query(query, meta.cu[it.b] + it.r0 + r, h, static_cast<float>(p.scale), q.data() + v * d);
      float* st = state + v * width;
      st[0] = kNegInf;
      st[1] = 0.f;
      std::fill(st + 2, st + width, 0.f);
    }
  }
  for (int64_t c0 = it.lo; c0 < it.hi; c0 += kKvChunk) {
    const int64_t n = std::min(kKvChunk, it.hi - c0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t tok = c0 + j, blk = block_of(meta, it.b, tok), off = tok % meta.block_size;
      for (int64_t gl = 0; gl < nkv; ++gl) {
        const T* k = k_base + blk * k_strides[0] + off * k_strides[1] + (it.g0 + gl) * k_strides[2];
        const T* v = v_base + blk * v_strides[0] + off * v_strides[1] + (it.g0 + gl) * v_strides[2];
        kp[gl * kKvChunk + j] = k;
        vp[gl * kKvChunk + j] = v;
      }
    }
    // The next chunk's rows sit in other blocks the hardware prefetcher cannot guess: ask for them
    // now, so that they arrive while this chunk computes.
    for (int64_t tok = c0 + n; tok < std::min(it.hi, c0 + n + kKvChunk); ++tok) {
      const int64_t blk = block_of(meta, it.b, tok), off = tok % meta.block_size;
      for (int64_t gl = 0; gl < nkv; ++gl) {
        prefetch_row(k_base + blk * k_strides[0] + off * k_strides[1] + (it.g0 + gl) * k_strides[2], d);
        prefetch_row(v_base + blk * v_strides[0] + off * v_strides[1] + (it.g0 + gl) * v_strides[2], dv);
      }
    }
    // The query vectors of row r and KV head gl (a GQA group) share the keys they see, so each
    // key / value row is read once for up to Row<D>::kTile of them.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row_pos = first_pos + it.r0 + r;
      // Keys this row sees: j <= pos (causal), j > pos - window, j in pos's chunk, j < kv_len (item range).
      const int64_t hi = std::min(c0 + n, row_pos + 1);
      const int64_t lo = std::max(c0, first_key(p, row_pos));
      if (hi <= lo) continue;
      const int64_t n_row = hi - lo;
      for (int64_t gl = 0; gl < nkv; ++gl) {
        const T* const* kv_k = kp.data() + gl * kKvChunk + (lo - c0);
        const T* const* kv_v = vp.data() + gl * kKvChunk + (lo - c0);
        for (int64_t g0 = 0; g0 < group; g0 += Row<D>::kTile) {
          const int64_t gn = std::min(Row<D>::kTile, group - g0), v0 = r * heads + gl * group + g0;
          Row<D>::scores_group(gn, q.data() + v0 * d, kv_k, n_row, d, s.data(), kKvChunk);
          for (int64_t g = 0; g < gn; ++g) {
            const int64_t h = (it.g0 + gl) * group + g0 + g;
            float* sc = s.data() + g * kKvChunk;
            for (int64_t t = 0; t < n_row; ++t) {
              if (p.soft_cap > 0) sc[t] = static_cast<float>(p.soft_cap * std::tanh(sc[t] / p.soft_cap));
              if (p.alibi) sc[t] += p.alibi[h] * static_cast<float>(lo + t - row_pos);
            }
            const float chunk_max =
                at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, sc, n_row);
            float* st = state + (v0 + g) * width;
            const float m_new = std::max(st[0], chunk_max);
            if (st[0] != m_new && st[1] > 0.f) {
              const float corr = std::exp(st[0] - m_new);
              st[1] *= corr;
              scale_row(corr, st + 2, dv);
            }
            st[0] = m_new;
            at::vec::map([m_new](Vec x) { return (x - Vec(m_new)).exp_u20(); }, sc, sc, n_row);
            st[1] += at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sc, n_row);
          }
          Row<D>::accumulate_group(gn, s.data(), kKvChunk, kv_v, n_row, dv, state + v0 * width + 2, width);
        }
      }
    }
  }
}

// Keys item rows [r0, r1) of sequence b can see: [lo, hi).
std::pair<int64_t, int64_t> key_range(const Meta& m, const Params& p, int64_t b, int64_t r0, int64_t r1) {
  const int64_t q_len = m.cu[b + 1] - m.cu[b], kv_len = std::max<int64_t>(m.kv_lens[b], 0);
  const int64_t first = kv_len - q_len + r0, last = kv_len - q_len + r1 - 1;
  const int64_t hi = std::clamp<int64_t>(last + 1, 0, kv_len);
  return {std::clamp<int64_t>(first_key(p, first), 0, hi), hi};
}

// Rows [..., row] of a cache as fp32 [..., head]: a scaled row's values times its scale.
at::Tensor read_rows(const at::Tensor& rows) {
  if (!is_scaled(rows.scalar_type())) return rows.to(at::kFloat);
  const int64_t head = rows.size(-1) - kScaleBytes;
  return rows.narrow(-1, 0, head).to(at::kFloat) * rows.narrow(-1, head, kScaleBytes).contiguous().view(at::kFloat);
}

// SDPA over the sequence's K/V copied out of the cache (parameter-free long query runs).
void sdpa_sequence(const Meta& m, int64_t b, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, double scale, at::Tensor& out) {
  const int64_t start = m.cu[b], q_len = m.cu[b + 1] - start, kv_len = m.kv_lens[b];
  const int64_t nblk = (kv_len + m.block_size - 1) / m.block_size;
  auto ids = at::from_blob(const_cast<int32_t*>(m.table + b * m.table_stride), {nblk}, at::kInt).to(at::kLong);
  auto k = key_cache.index_select(0, ids).flatten(0, 1).narrow(0, 0, kv_len).transpose(0, 1).unsqueeze(0);
  auto v = value_cache.index_select(0, ids).flatten(0, 1).narrow(0, 0, kv_len).transpose(0, 1).unsqueeze(0);
  auto q = query.narrow(0, start, q_len).to(at::kFloat).transpose(0, 1).unsqueeze(0);
  std::optional<at::Tensor> mask;
  if (kv_len > q_len) {  // bottom-right causal: row i sees keys <= kv_len - q_len + i
    auto rows = at::arange(q_len, at::kLong).unsqueeze(1) + (kv_len - q_len);
    mask = at::arange(kv_len, at::kLong).unsqueeze(0) <= rows;
  }
  auto o = at::scaled_dot_product_attention(q, read_rows(k), read_rows(v), mask, 0.0,
                                            /*is_causal=*/!mask.has_value(), scale, /*enable_gqa=*/true);
  out.narrow(0, start, q_len).copy_(o.squeeze(0).transpose(0, 1));
}

at::Tensor paged_attention_cpu(const at::Tensor& query_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& seq_lens, double scale, std::optional<int64_t> sliding_window,
                               std::optional<double> logits_soft_cap, const std::optional<at::Tensor>& alibi_slopes,
                               const std::optional<at::Tensor>& sinks, std::optional<int64_t> attention_chunk_size) {
  // The shape checks the runner's step skips in Python (kernels/ops.py), kept here because a
  // wrong shape would read outside the tensors.
  TORCH_CHECK_VALUE(query_in.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4 && block_table.dim() == 2 &&
                        seq_lens.dim() == 1 && cu_seqlens_q.dim() == 1,
                    "paged_attention: expected query [T, H, D], caches [num_blocks, block_size, Hkv, D], "
                    "block_table [B, max_blocks], seq_lens [B], cu_seqlens_q [B + 1]");
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                        cu_seqlens_q.scalar_type() == at::kInt,
                    "paged_attention: block_table, seq_lens, cu_seqlens_q: expected int32");
  TORCH_CHECK_VALUE(key_cache.size(2) > 0 && query_in.size(1) % key_cache.size(2) == 0 &&
                        query_in.size(2) == head_size(key_cache) && head_size(value_cache) >= 1 &&
                        key_cache.sizes().slice(0, 3) == value_cache.sizes().slice(0, 3),
                    "paged_attention: query ", query_in.sizes(), ", key_cache ", key_cache.sizes(), ", value_cache ",
                    value_cache.sizes(), ": head counts or head dims do not match");
  TORCH_CHECK_VALUE(block_table.size(0) == seq_lens.size(0) && cu_seqlens_q.size(0) == seq_lens.size(0) + 1,
                    "paged_attention: block_table ", block_table.sizes(), ", seq_lens ", seq_lens.sizes(), ", cu_seqlens_q ",
                    cu_seqlens_q.sizes(), ": expected B rows, B lengths and B + 1 offsets");
  TORCH_CHECK_VALUE(key_cache.size(1) >= 1, "paged_attention: key_cache: expected block_size >= 1, got ",
                    key_cache.sizes());
  check_cache_dtypes("paged_attention", key_cache, value_cache);
  TORCH_CHECK_VALUE(is_activation_dtype(query_in.scalar_type()),
                    "paged_attention: query: expected float32, float64, bfloat16 or float16, got ",
                    query_in.scalar_type());
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "paged_attention: key_cache/value_cache: expected a contiguous last dimension");
  const auto query = query_in.contiguous();
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
  const int64_t num_kv_heads = key_cache.size(2), dv = head_size(value_cache);
  const int64_t group = num_heads / num_kv_heads;
  const auto bt = block_table.contiguous();
  const auto cu = cu_seqlens_q.contiguous();
  const auto lens = seq_lens.contiguous();
  const Meta meta{lens.size(0),        bt.size(1),          key_cache.size(1), key_cache.size(0),
                  cu.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), bt.data_ptr<int32_t>(), bt.size(1)};
  check_metadata(meta, num_tokens);

  TORCH_CHECK_VALUE(!sliding_window || *sliding_window >= 1,
                    "paged_attention: sliding_window: expected None or an int >= 1, got ", sliding_window.value_or(0));
  TORCH_CHECK_VALUE(!attention_chunk_size || *attention_chunk_size >= 1,
                    "paged_attention: attention_chunk_size: expected None or an int >= 1, got ",
                    attention_chunk_size.value_or(0));
  TORCH_CHECK_VALUE(!logits_soft_cap || (std::isfinite(*logits_soft_cap) && *logits_soft_cap > 0),
                    "paged_attention: logits_soft_cap: expected None or a finite float > 0, got ",
                    logits_soft_cap.value_or(0.0));
  for (const auto& [name, t] : {std::pair{"alibi_slopes", alibi_slopes}, std::pair{"sinks", sinks}}) {
    TORCH_CHECK_VALUE(!t || (t->dim() == 1 && t->size(0) == query_in.size(1) && t->is_floating_point()),
                      "paged_attention: ", name, ": expected a floating tensor of shape [num_heads] = (",
                      query_in.size(1), ",), got ", t ? t->sizes() : at::IntArrayRef{});
  }
  at::Tensor alibi, sink;
  if (alibi_slopes) alibi = alibi_slopes->to(at::kFloat).contiguous();
  if (sinks) sink = sinks->to(at::kFloat).contiguous();
  const Params p{scale, sliding_window.value_or(0), attention_chunk_size.value_or(0), logits_soft_cap.value_or(0.0),
                 alibi.defined() ? alibi.data_ptr<float>() : nullptr, sink.defined() ? sink.data_ptr<float>() : nullptr};
  const bool plain = !p.window && !p.chunk && !p.soft_cap && !p.alibi && !p.sinks;

  // Every row is written below, by the merge of its items or by the prefill path.
  auto out = at::empty({num_tokens, num_heads, dv}, query.options());
  std::vector<int64_t> prefill_seqs;
  std::vector<std::array<int64_t, 3>> tiles;  // (b, r0, r1)
  for (int64_t b = 0; b < meta.num_seqs; ++b) {
    const int64_t q_len = meta.cu[b + 1] - meta.cu[b];
    if (plain && q_len >= kPrefillMinRows && meta.kv_lens[b] >= q_len) {
      prefill_seqs.push_back(b);
      continue;
    }
    for (int64_t r0 = 0; r0 < q_len; r0 += kQueryTile) tiles.push_back({b, r0, std::min(q_len, r0 + kQueryTile)});
  }
  // KV heads per item: one when the tiles are too few to keep every thread busy, else as many as
  // divide num_kv_heads with their fp32 chunk within kItemChunkBytes, so that a thread streams the
  // blocks' rows whole (a KV head's slice of a row is every num_kv_heads-th run of memory; SmolLM2's
  // 32 x 512 bf16 decode, K/V cold as in a step: 1.6 ms against 2.3 ms per head, docs/cpu-kernels.md).
  const int64_t threads = at::get_num_threads();
  int64_t kv_per_item = 1;
  if (static_cast<int64_t>(tiles.size()) >= 2 * threads) {
    for (int64_t n = num_kv_heads; n > 1; --n) {
      if (num_kv_heads % n == 0 && n * kKvChunk * (query.size(2) + dv) * static_cast<int64_t>(sizeof(float)) <= kItemChunkBytes) {
        kv_per_item = n;
        break;
      }
    }
  }
  std::vector<Item> items;
  for (const auto& [b, r0, r1] : tiles) {
    const auto [lo, hi] = key_range(meta, p, b, r0, r1);
    for (int64_t g = 0; g < num_kv_heads; g += kv_per_item) items.push_back({b, g, g + kv_per_item, r0, r1, lo, hi});
  }
  // Split long KV ranges when there are too few items to keep every thread busy.
  const int64_t want = 4 * threads;
  if (!items.empty() && static_cast<int64_t>(items.size()) < want) {
    const int64_t splits = (want + items.size() - 1) / items.size();
    std::vector<Item> split;
    for (const Item& it : items) {
      const int64_t n = std::clamp<int64_t>((it.hi - it.lo) / kMinSplitTokens, 1, splits);
      const int64_t step = (it.hi - it.lo + n - 1) / n;
      if (n == 1) {
        split.push_back(it);
        continue;
      }
      for (int64_t lo = it.lo; lo < it.hi; lo += step) split.push_back({it.b, it.g0, it.g1, it.r0, it.r1, lo, std::min(it.hi, lo + step)});
    }
    items.swap(split);
  }

  if (!items.empty()) {
    // Partial states, [item][query vector][2 + dv]; merged per (b, g, r0) after the parallel pass.
    std::vector<int64_t> offset(items.size() + 1, 0);
    for (size_t i = 0; i < items.size(); ++i)
      offset[i + 1] = offset[i] + (items[i].r1 - items[i].r0) * (items[i].g1 - items[i].g0) * group * (2 + dv);
    std::vector<float> state(offset.back());
    AT_DISPATCH_V2(key_cache.scalar_type(), "paged_attention_cpu", AT_WRAP([&] {
      const scalar_t* kb = key_cache.data_ptr<scalar_t>();
      const scalar_t* vb = value_cache.data_ptr<scalar_t>();
      const int64_t d = query.size(2);
      auto run = [&](auto head_dim) {
        constexpr int64_t D = decltype(head_dim)::value;
        at::parallel_for(0, items.size(), 1, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i)
            attend_item<scalar_t, D>(items[i], meta, p, query, kb, vb, key_cache.strides(), value_cache.strides(),
                                     group, dv, state.data() + offset[i]);
        });
      };
      // Head dims of common models get the register kernels; any other runs the generic one.
      if (d != dv) run(std::integral_constant<int64_t, 0>{});
      else if (d == 16) run(std::integral_constant<int64_t, 16>{});
      else if (d == 32) run(std::integral_constant<int64_t, 32>{});
      else if (d == 64) run(std::integral_constant<int64_t, 64>{});
      else if (d == 80) run(std::integral_constant<int64_t, 80>{});
      else if (d == 96) run(std::integral_constant<int64_t, 96>{});
      else if (d == 128) run(std::integral_constant<int64_t, 128>{});
      else if (d == 256) run(std::integral_constant<int64_t, 256>{});
      else run(std::integral_constant<int64_t, 0>{});
    }), AT_EXPAND(AT_FLOATING_TYPES), at::kBFloat16, at::kHalf, at::kChar, at::kFloat8_e4m3fn, at::kFloat8_e5m2);
    // Merge the splits of each (b, g0, r0) run (consecutive items) and normalise.
    const int64_t width = 2 + dv;
    std::vector<float> row_out(dv);
    for (size_t i = 0; i < items.size();) {
      size_t j = i + 1;
      while (j < items.size() && items[j].b == items[i].b && items[j].g0 == items[i].g0 && items[j].r0 == items[i].r0) ++j;
      const Item& it = items[i];
      const int64_t heads = (it.g1 - it.g0) * group, nvec = (it.r1 - it.r0) * heads;
      for (int64_t v = 0; v < nvec; ++v) {
        const int64_t h = it.g0 * group + v % heads, row = meta.cu[it.b] + it.r0 + v / heads;
        float m = p.sinks ? p.sinks[h] : kNegInf;
        for (size_t k = i; k < j; ++k) m = std::max(m, state[offset[k] + v * width]);
        float l = p.sinks ? std::exp(p.sinks[h] - m) : 0.f;
        float* dst = row_out.data();
        std::fill(dst, dst + dv, 0.f);  // a row that sees no key (l == 0): zeros
        for (size_t k = i; k < j; ++k) {
          const float* st = state.data() + offset[k] + v * width;
          if (st[1] == 0.f) continue;
          const float w = std::exp(st[0] - m);
          l += st[1] * w;
          axpy(w, st + 2, dst, dv);
        }
        if (l > 0.f) scale_row(1.f / l, dst, dv);
        store_row(dst, out, (row * num_heads + h) * dv, dv);
      }
      i = j;
    }
  }
  const auto dtype = query.scalar_type();
  if (!prefill_seqs.empty() && key_cache.scalar_type() == dtype && scale > 0 &&
      pagedpack_cpu::flash_prefill_supported(dtype, query.size(2), dv)) {
    pagedpack_cpu::flash_prefill(meta, prefill_seqs, query, key_cache, value_cache, scale, out);
  } else {
    for (int64_t b : prefill_seqs) sdpa_sequence(meta, b, query, key_cache, value_cache, scale, out);
  }
  return out;
}

// Quantize `n` values of `src` into `dst` with their scale after them (kernels/kv_quant.py:
// scale = max|x| / qmax, 1 for an all-zero row, NaN for a row holding inf / NaN; x / scale clamped
// to [-qmax, qmax], which a subnormal max|x| can exceed, and rounded to T, int8 to nearest-even).
template <typename T>
void quantize_row(const float* src, int64_t n, T* dst) {
  const float qmax = std::is_same_v<T, int8_t> ? 127.f : static_cast<float>(std::numeric_limits<T>::max());
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::abs(src[i]);
    if (std::isnan(a) || a > amax) amax = a;  // NaN sticks: no later a > NaN
  }
  float scale = amax / qmax;
  if (scale == 0.f) scale = 1.f;
  if (!std::isfinite(scale)) {  // an infinity or NaN in the row: zeros and a NaN scale, read back as NaN
    std::fill(dst, dst + n, static_cast<T>(0.f));
    scale = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(dst + n, &scale, sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::clamp(src[i] / scale, -qmax, qmax);
    if constexpr (std::is_same_v<T, int8_t>) {
      dst[i] = static_cast<int8_t>(std::nearbyint(q));
    } else {
      dst[i] = static_cast<T>(q);
    }
  }
  std::memcpy(dst + n, &scale, sizeof(float));
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4 &&
                        key.size(1) == key_cache.size(2) && key.size(2) == head_size(key_cache) &&
                        value.size(1) == value_cache.size(2) && value.size(2) == head_size(value_cache) &&
                        slot_mapping.dim() == 1 && key.size(0) == slot_mapping.size(0) &&
                        value.size(0) == slot_mapping.size(0),
                    "reshape_and_cache: key ", key.sizes(), ", value ", value.sizes(), ", key_cache ", key_cache.sizes(),
                    ", value_cache ", value_cache.sizes(), ", slot_mapping ", slot_mapping.sizes(),
                    ": expected key/value [T, Hkv, D] matching the caches' [num_blocks, block_size, Hkv, D] (D + 4 for "
                    "a scaled dtype) and T slots");
  TORCH_CHECK_VALUE(key_cache.sizes().slice(0, 2) == value_cache.sizes().slice(0, 2),
                    "reshape_and_cache: value_cache ", value_cache.sizes(), ": expected the num_blocks and block_size "
                    "of key_cache ", key_cache.sizes());
  check_cache_dtypes("reshape_and_cache", key_cache, value_cache);
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "reshape_and_cache: key_cache/value_cache: expected a contiguous last dimension");
  TORCH_CHECK_VALUE(key_cache.size(1) >= 1, "reshape_and_cache: key_cache: expected block_size >= 1, got ",
                    key_cache.sizes());
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
                    "reshape_and_cache: slot_mapping: expected dtype int32 or int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(is_activation_dtype(key.scalar_type()) && is_activation_dtype(value.scalar_type()),
                    "reshape_and_cache: key, value: expected float32, float64, bfloat16 or float16, got ",
                    key.scalar_type(), ", ", value.scalar_type());
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1), block_size = key_cache.size(1);
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK_VALUE(s[t] >= -1 && s[t] < num_slots, "reshape_and_cache: slot_mapping: expected -1 or a slot in [0, ",
                      num_slots, ") (num_blocks=", key_cache.size(0), " x block_size=", block_size, "), got slot_mapping[",
                      t, "]=", s[t]);
  for (auto [src_in, cache] : {std::pair{key, key_cache}, std::pair{value, value_cache}}) {
    const bool scaled = is_scaled(cache.scalar_type());
    const auto src = src_in.to(scaled ? at::kFloat : cache.scalar_type()).contiguous();
    const int64_t heads = cache.size(2), dim = head_size(cache);
    AT_DISPATCH_V2(cache.scalar_type(), "reshape_and_cache_cpu", AT_WRAP([&] {
      scalar_t* dst = cache.data_ptr<scalar_t>();
      for (int64_t t = 0; t < slots.size(0); ++t) {
        if (s[t] < 0) continue;
        scalar_t* row = dst + (s[t] / block_size) * cache.stride(0) + (s[t] % block_size) * cache.stride(1);
        for (int64_t h = 0; h < heads; ++h) {
          if constexpr (kScaled<scalar_t>) {
            quantize_row(src.data_ptr<float>() + (t * heads + h) * dim, dim, row + h * cache.stride(2));
          } else {
            const scalar_t* in = src.data_ptr<scalar_t>() + (t * heads + h) * dim;
            std::copy(in, in + dim, row + h * cache.stride(2));
          }
        }
      }
    }), AT_EXPAND(AT_FLOATING_TYPES), at::kBFloat16, at::kHalf, at::kChar, at::kFloat8_e4m3fn, at::kFloat8_e5m2);
  }
}

}  // namespace

TORCH_LIBRARY(pagedpack_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor cu_seqlens_q, "
      "Tensor seq_lens, float scale, int? sliding_window=None, float? logits_soft_cap=None, "
      "Tensor? alibi_slopes=None, Tensor? sinks=None, int? attention_chunk_size=None) -> Tensor");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  // Whether prefill runs of this dtype and these head dims take the BRGEMM flash kernel on this CPU.
  m.def("prefill_uses_brgemm(ScalarType dtype, int head_dim, int head_dim_v) -> bool", &pagedpack_cpu::flash_prefill_supported);
}

TORCH_LIBRARY_IMPL(pagedpack_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
}
