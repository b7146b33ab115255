// bf16 and fp32 causal prefill attention over paged K/V (flash_prefill_cpu.cpp).
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "paged_meta.h"

namespace pagedpack_cpu {

// Whether flash_prefill runs on this CPU for this dtype (bf16 or fp32) and these head dims: oneDNN's
// BRGEMM micro-kernel takes such operands here and gives the right product (checked once per
// dtype and shape on first use).
bool flash_prefill_supported(at::ScalarType dtype, int64_t head_dim, int64_t head_dim_v);

// out[t, h, :] ([T, H, Dv], the query's dtype) for the rows of sequences `seqs`: softmax(scale * q k^T) v over
// the sequence's keys, causal aligned bottom-right (row i of q_len sees keys <= kv_len - q_len + i).
// query: bf16 or fp32 [T, H, D] contiguous; caches: the query's dtype, [num_blocks, block_size,
// Hkv, D|Dv], last dim contiguous. Metadata already checked (check_metadata); every seq has
// kv_len >= q_len.
void flash_prefill(const Meta& m, const std::vector<int64_t>& seqs, const at::Tensor& query,
                   const at::Tensor& key_cache, const at::Tensor& value_cache, double scale, at::Tensor& out);

}  // namespace pagedpack_cpu
