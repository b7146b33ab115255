// CPU kernels of the recurrent ops (kernels/recurrent.py): pagedpack_cpu::causal_conv1d_varlen,
// gated_delta_rule_varlen (also lightning_attention_varlen's, without the delta term) and
// selective_scan_varlen over packed varlen tokens, each sequence continuing from and writing back its
// state slot. Semantics and argument checks are those of the Python ops (their docstrings; vLLM's
// causal_conv1d_fn, FLA's gated delta rule, MiniMax's lightning attention, mamba_ssm's selective
// scan); the Python op checks shapes, dtypes and the metadata's values before it calls these. Activations fp32 or bf16, states fp32 or bf16, everything accumulated in fp32; the
// per-sequence recurrence runs token by token (a decode step's one token, a prefill chunk's many),
// in parallel over (sequence, channel or head).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float f(T v) {
  return static_cast<float>(v);
}

// Calls fn(T{}, S{}) with T the activations' and S the state's C++ type (float or BFloat16).
template <typename Fn>
void dispatch(const char* op, at::ScalarType act, at::ScalarType state, Fn&& fn) {
  auto with_state = [&](auto t) {
    if (state == at::kFloat) {
      fn(t, float{});
    } else if (state == at::kBFloat16) {
      fn(t, at::BFloat16{});
    } else {
      TORCH_CHECK_VALUE(false, op, ": state: expected dtype float32 or bfloat16, got ", state);
    }
  };
  if (act == at::kFloat) {
    with_state(float{});
  } else if (act == at::kBFloat16) {
    with_state(at::BFloat16{});
  } else {
    TORCH_CHECK_VALUE(false, op, ": expected float32 or bfloat16 activations, got ", act);
  }
}

// Memory safety: ``t`` has exactly ``sizes`` (every call, O(1): the kernels index the state and the
// inputs by these sizes, so a state from a crafted file of another shape would be read out of bounds).
void expect_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef sizes) {
  TORCH_CHECK_VALUE(t.sizes() == sizes, op, ": ", name, ": expected shape ", sizes, ", got ", t.sizes());
}

struct Varlen {
  const int32_t* cu;
  const int32_t* slots;
  const bool* initial;
  int64_t num_seqs;
};

// The metadata's pointers, after the checks memory safety needs (always: O(B), no sync on the CPU):
// offsets rising from 0 to num_tokens, slots in [-1, num_slots).
Varlen varlen(const char* op, const at::Tensor& state_indices, const at::Tensor& cu_seqlens_q,
              const at::Tensor& has_initial_state, int64_t num_tokens, int64_t num_slots) {
  const Varlen v{cu_seqlens_q.data_ptr<int32_t>(), state_indices.data_ptr<int32_t>(),
                 has_initial_state.data_ptr<bool>(), state_indices.size(0)};
  TORCH_CHECK_VALUE(cu_seqlens_q.numel() == v.num_seqs + 1 && has_initial_state.numel() == v.num_seqs &&
                        v.cu[0] == 0 && v.cu[v.num_seqs] == num_tokens,
                    op, ": cu_seqlens_q: expected B+1 offsets from 0 to T=", num_tokens);
  for (int64_t b = 0; b < v.num_seqs; ++b) {
    TORCH_CHECK_VALUE(v.cu[b] <= v.cu[b + 1], op, ": cu_seqlens_q: expected non-decreasing offsets");
    TORCH_CHECK_VALUE(v.slots[b] >= -1 && v.slots[b] < num_slots, op, ": state_indices: expected slots in [0, ",
                      num_slots, ") or -1, got ", v.slots[b]);
  }
  return v;
}

// ---------------------------------------------------------------- causal depthwise conv1d

at::Tensor causal_conv1d_varlen_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                                    const std::optional<at::Tensor>& bias_in, at::Tensor conv_state,
                                    const at::Tensor& state_indices, const at::Tensor& cu_seqlens_q,
                                    const at::Tensor& has_initial_state, bool silu) {
  TORCH_CHECK_VALUE(conv_state.is_contiguous(), "causal_conv1d_varlen: conv_state: expected a contiguous tensor");
  const auto x = x_in.contiguous();
  const auto weight = weight_in.to(at::kFloat).contiguous();
  const auto bias = bias_in.has_value() ? bias_in->to(at::kFloat).contiguous() : at::Tensor();
  auto out = at::empty_like(x);
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2, "causal_conv1d_varlen: expected x [T, dim], weight [dim, width]");
  const int64_t dim = weight.size(0), width = weight.size(1);
  expect_shape("causal_conv1d_varlen", "x", x, {x.size(0), dim});
  expect_shape("causal_conv1d_varlen", "conv_state", conv_state, {conv_state.size(0), dim, width - 1});
  if (bias.defined()) expect_shape("causal_conv1d_varlen", "bias", bias, {dim});
  const Varlen v = varlen("causal_conv1d_varlen", state_indices, cu_seqlens_q, has_initial_state, x.size(0),
                         conv_state.size(0));
  dispatch("causal_conv1d_varlen", x.scalar_type(), conv_state.scalar_type(), [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    S* sp = conv_state.data_ptr<S>();
    const float* wp = weight.data_ptr<float>();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    at::parallel_for(0, v.num_seqs * dim, 64, [&](int64_t lo, int64_t hi) {
      std::vector<float> window(width + 1);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / dim, c = i % dim;
        const int64_t slot = v.slots[b];
        S* state = slot >= 0 ? sp + (slot * dim + c) * (width - 1) : nullptr;
        for (int64_t j = 0; j < width - 1; ++j) window[j] = v.initial[b] && state ? f(state[j]) : 0.f;
        const float* w = wp + c * width;
        for (int64_t tok = v.cu[b]; tok < v.cu[b + 1]; ++tok) {
          window[width - 1] = f(xp[tok * dim + c]);
          float acc = bp ? bp[c] : 0.f;
          for (int64_t j = 0; j < width; ++j) acc += w[j] * window[j];
          if (silu) acc = acc / (1.f + std::exp(-acc));
          op[tok * dim + c] = static_cast<T>(acc);
          for (int64_t j = 0; j < width - 1; ++j) window[j] = window[j + 1];
        }
        if (state) {
          for (int64_t j = 0; j < width - 1; ++j) state[j] = static_cast<S>(window[j]);
        }
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------- gated delta rule

// Per token and value head: S = S * exp(g); S += k (beta (v - k^T S))^T with delta_rule, else
// S += k (beta v)^T (lightning attention: g = -slope, beta = 1, scale 1); o = (scale q)^T S.
at::Tensor gated_delta_rule_varlen_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                       const at::Tensor& g_in, const at::Tensor& beta_in, at::Tensor ssm_state,
                                       const at::Tensor& state_indices, const at::Tensor& cu_seqlens_q,
                                       const at::Tensor& has_initial_state, double scale, bool l2norm,
                                       bool delta_rule) {
  TORCH_CHECK_VALUE(ssm_state.is_contiguous(), "gated_delta_rule_varlen: ssm_state: expected a contiguous tensor");
  const auto q = q_in.contiguous(), k = k_in.contiguous(), val = v_in.contiguous();
  const auto g = g_in.to(at::kFloat).contiguous(), beta = beta_in.to(at::kFloat).contiguous();
  auto out = at::empty_like(val);
  const char* op_name = "gated_delta_rule_varlen";
  TORCH_CHECK_VALUE(q.dim() == 3 && val.dim() == 3, op_name, ": expected q, k [T, H, Dk] and v [T, Hv, Dv]");
  const int64_t tokens = val.size(0), hk = q.size(1), dk = q.size(2), hv = val.size(1), dv = val.size(2);
  TORCH_CHECK_VALUE(hk > 0 && hv % hk == 0, op_name, ": expected value heads a multiple of key heads, got ", hv,
                    " and ", hk);
  const int64_t group = hv / hk;
  const bool per_channel = g.dim() == 3;  // [T, hv, dk]: a decay per key channel (KDA); else [T, hv]
  expect_shape(op_name, "q", q, {tokens, hk, dk});
  expect_shape(op_name, "k", k, {tokens, hk, dk});
  if (per_channel) {
    expect_shape(op_name, "g", g, {tokens, hv, dk});
  } else {
    expect_shape(op_name, "g", g, {tokens, hv});
  }
  expect_shape(op_name, "beta", beta, {tokens, hv});
  expect_shape(op_name, "ssm_state", ssm_state, {ssm_state.size(0), hv, dk, dv});
  const Varlen v = varlen("gated_delta_rule_varlen", state_indices, cu_seqlens_q, has_initial_state, val.size(0),
                         ssm_state.size(0));
  dispatch("gated_delta_rule_varlen", val.scalar_type(), ssm_state.scalar_type(), [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    TORCH_CHECK_VALUE(q.scalar_type() == val.scalar_type() && k.scalar_type() == val.scalar_type(),
                      "gated_delta_rule_varlen: q, k, v: expected one dtype");
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = val.data_ptr<T>();
    const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
    T* op = out.data_ptr<T>();
    S* sp = ssm_state.data_ptr<S>();
    at::parallel_for(0, v.num_seqs * hv, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> mem(dk * dv), qf(dk), kf(dk), delta(dv), o(dv);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / hv, h = i % hv, kh = h / group, slot = v.slots[b];
        S* state = slot >= 0 ? sp + (slot * hv + h) * dk * dv : nullptr;
        for (int64_t e = 0; e < dk * dv; ++e) mem[e] = v.initial[b] && state ? f(state[e]) : 0.f;
        for (int64_t tok = v.cu[b]; tok < v.cu[b + 1]; ++tok) {
          const T* qt = qp + (tok * hk + kh) * dk;
          const T* kt = kp + (tok * hk + kh) * dk;
          float qn = 0.f, kn = 0.f;
          for (int64_t d = 0; d < dk; ++d) {
            qf[d] = f(qt[d]);
            kf[d] = f(kt[d]);
            qn += qf[d] * qf[d];
            kn += kf[d] * kf[d];
          }
          const float qs = (l2norm ? 1.f / std::sqrt(qn + 1e-6f) : 1.f) * static_cast<float>(scale);
          const float ks = l2norm ? 1.f / std::sqrt(kn + 1e-6f) : 1.f;
          for (int64_t d = 0; d < dk; ++d) {
            qf[d] *= qs;
            kf[d] *= ks;
          }
          const float w = bp[tok * hv + h];
          const float* gt = per_channel ? gp + (tok * hv + h) * dk : gp + tok * hv + h;
          const float head_decay = per_channel ? 0.f : std::exp(*gt);
          const T* vt = vp + (tok * hv + h) * dv;
          for (int64_t e = 0; e < dv; ++e) delta[e] = 0.f;
          for (int64_t d = 0; d < dk; ++d) {
            float* row = mem.data() + d * dv;
            const float decay = per_channel ? std::exp(gt[d]) : head_decay;
            for (int64_t e = 0; e < dv; ++e) {
              row[e] *= decay;
              if (delta_rule) delta[e] += kf[d] * row[e];  // a loop invariant: -O3 unswitches it
            }
          }
          for (int64_t e = 0; e < dv; ++e) delta[e] = (f(vt[e]) - delta[e]) * w;
          T* ot = op + (tok * hv + h) * dv;
          for (int64_t e = 0; e < dv; ++e) o[e] = 0.f;
          for (int64_t d = 0; d < dk; ++d) {
            float* row = mem.data() + d * dv;
            for (int64_t e = 0; e < dv; ++e) {
              row[e] += kf[d] * delta[e];
              o[e] += qf[d] * row[e];
            }
          }
          for (int64_t e = 0; e < dv; ++e) ot[e] = static_cast<T>(o[e]);
        }
        if (state) {
          for (int64_t e = 0; e < dk * dv; ++e) state[e] = static_cast<S>(mem[e]);
        }
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------- selective scan

at::Tensor selective_scan_varlen_cpu(const at::Tensor& x_in, const at::Tensor& dt_in, const at::Tensor& A_in,
                                     const at::Tensor& B_in, const at::Tensor& C_in,
                                     const std::optional<at::Tensor>& D_in, const std::optional<at::Tensor>& dt_bias_in,
                                     at::Tensor ssm_state, const at::Tensor& state_indices,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& has_initial_state,
                                     bool dt_softplus, double dt_min, std::optional<double> dt_max) {
  TORCH_CHECK_VALUE(ssm_state.is_contiguous(), "selective_scan_varlen: ssm_state: expected a contiguous tensor");
  const auto x = x_in.contiguous();
  const auto dt = dt_in.to(at::kFloat).contiguous(), B = B_in.to(at::kFloat).contiguous(),
             C = C_in.to(at::kFloat).contiguous();
  const char* op_name = "selective_scan_varlen";
  TORCH_CHECK_VALUE(x.dim() == 3 && B.dim() == 3, op_name, ": expected x [T, H, P] and B, C [T, G, N]");
  const int64_t tokens = x.size(0), heads = x.size(1), P = x.size(2), groups = B.size(1), N = B.size(2);
  TORCH_CHECK_VALUE(groups > 0 && heads % groups == 0, op_name, ": expected heads a multiple of groups, got ", heads,
                    " and ", groups);
  TORCH_CHECK_VALUE(A_in.dim() == 2 || A_in.dim() == 1, op_name, ": A: expected [H, N] or [H]");
  const auto A = (A_in.dim() == 2 ? A_in : A_in.unsqueeze(1).expand({heads, N})).to(at::kFloat).contiguous();
  const auto D = D_in.has_value() ? D_in->to(at::kFloat).contiguous() : at::Tensor();
  const auto dt_bias = dt_bias_in.has_value() ? dt_bias_in->to(at::kFloat).contiguous() : at::Tensor();
  expect_shape(op_name, "dt", dt, {tokens, heads});
  expect_shape(op_name, "A", A, {heads, N});
  expect_shape(op_name, "B", B, {tokens, groups, N});
  expect_shape(op_name, "C", C, {tokens, groups, N});
  if (D.defined()) expect_shape(op_name, "D", D, {heads});
  if (dt_bias.defined()) expect_shape(op_name, "dt_bias", dt_bias, {heads});
  expect_shape(op_name, "ssm_state", ssm_state, {ssm_state.size(0), heads, P, N});
  auto out = at::empty_like(x);
  const Varlen v = varlen("selective_scan_varlen", state_indices, cu_seqlens_q, has_initial_state, x.size(0),
                         ssm_state.size(0));
  const float lo_dt = static_cast<float>(dt_min), hi_dt = dt_max.has_value() ? static_cast<float>(*dt_max) : INFINITY;
  dispatch("selective_scan_varlen", x.scalar_type(), ssm_state.scalar_type(), [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    const T* xp = x.data_ptr<T>();
    const float *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>(), *Bp = B.data_ptr<float>(),
                *Cp = C.data_ptr<float>();
    const float* Dp = D.defined() ? D.data_ptr<float>() : nullptr;
    const float* biasp = dt_bias.defined() ? dt_bias.data_ptr<float>() : nullptr;
    T* op = out.data_ptr<T>();
    S* sp = ssm_state.data_ptr<S>();
    at::parallel_for(0, v.num_seqs * heads, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> H(P * N), dA(N);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / heads, h = i % heads, grp = h / (heads / groups), slot = v.slots[b];
        S* state = slot >= 0 ? sp + (slot * heads + h) * P * N : nullptr;
        for (int64_t e = 0; e < P * N; ++e) H[e] = v.initial[b] && state ? f(state[e]) : 0.f;
        for (int64_t tok = v.cu[b]; tok < v.cu[b + 1]; ++tok) {
          float step = dtp[tok * heads + h] + (biasp ? biasp[h] : 0.f);
          if (dt_softplus) step = step > 20.f ? step : std::log1p(std::exp(step));  // torch's softplus threshold
          step = std::min(std::max(step, lo_dt), hi_dt);
          for (int64_t n = 0; n < N; ++n) dA[n] = std::exp(step * Ap[h * N + n]);
          const float* Bt = Bp + (tok * groups + grp) * N;
          const float* Ct = Cp + (tok * groups + grp) * N;
          for (int64_t p = 0; p < P; ++p) {
            const float xv = f(xp[(tok * heads + h) * P + p]);
            float* row = H.data() + p * N;
            float y = 0.f;
            for (int64_t n = 0; n < N; ++n) {
              row[n] = row[n] * dA[n] + step * xv * Bt[n];
              y += row[n] * Ct[n];
            }
            op[(tok * heads + h) * P + p] = static_cast<T>(y + (Dp ? Dp[h] * xv : 0.f));
          }
        }
        if (state) {
          for (int64_t e = 0; e < P * N; ++e) state[e] = static_cast<S>(H[e]);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedpack_cpu, m) {
  m.def("causal_conv1d_varlen(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor state_indices, "
        "Tensor cu_seqlens_q, Tensor has_initial_state, bool silu) -> Tensor");
  m.def("gated_delta_rule_varlen(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) ssm_state, "
        "Tensor state_indices, Tensor cu_seqlens_q, Tensor has_initial_state, float scale, bool l2norm, "
        "bool delta_rule) -> Tensor");
  m.def("selective_scan_varlen(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? dt_bias, "
        "Tensor(a!) ssm_state, Tensor state_indices, Tensor cu_seqlens_q, Tensor has_initial_state, bool dt_softplus, "
        "float dt_min, float? dt_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedpack_cpu, CPU, m) {
  m.impl("causal_conv1d_varlen", &causal_conv1d_varlen_cpu);
  m.impl("gated_delta_rule_varlen", &gated_delta_rule_varlen_cpu);
  m.impl("selective_scan_varlen", &selective_scan_varlen_cpu);
}
