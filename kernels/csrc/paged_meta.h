// The paged KV layout's metadata as the CPU kernels read it (shared by paged_attention_cpu.cpp and
// flash_prefill_cpu.cpp). Values are range-checked once per call by check_metadata there.
#pragma once
#include <cstdint>

namespace pagedpack_cpu {

// Metadata read once on the host side of the call (CPU tensors: no copy).
struct Meta {
  int64_t num_seqs, max_blocks, block_size, num_blocks;
  const int32_t* cu;       // cu_seqlens_q [num_seqs + 1]
  const int32_t* kv_lens;  // seq_lens [num_seqs]
  const int32_t* table;    // block_table [num_seqs, table_stride]
  int64_t table_stride;
};

// Physical block of token j of sequence b.
inline int64_t block_of(const Meta& m, int64_t b, int64_t j) { return m.table[b * m.table_stride + j / m.block_size]; }

}  // namespace pagedpack_cpu
