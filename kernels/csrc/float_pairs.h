// Two Vectorized<float> of 2 * Vec::size() consecutive values of a float, bfloat16 or half array, loaded
// (bf16 / fp16 widened) and stored (narrowed, rounded once): the conversions the elementwise kernels
// (silu_and_mul_cpu.cpp) and the LoRA kernels (lora_cpu.cpp) share.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>
#include <utility>

namespace pagedpack_cpu {

using FloatVec = at::vec::Vectorized<float>;

// The pair of float vectors holding p[0, 2 * FloatVec::size()).
template <typename T>
inline std::pair<FloatVec, FloatVec> load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return {FloatVec::loadu(p), FloatVec::loadu(p + FloatVec::size())};
  } else {
    auto [a, b] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
    return {a, b};
  }
}

template <typename T>
inline void store_floats(const FloatVec& a, const FloatVec& b, T* p) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + FloatVec::size());
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

}  // namespace pagedpack_cpu
