// The GDN layer's causal conv with its silu over one sequence's prefill chunk (ops/conv.py causal_conv1d_prefill's
// contract, no bias), in one pass: each output row's fp32 sum over the K taps, then its silu, while the row is in
// L1. ops/conv.py is the torch form (the same arithmetic as K shifted multiplies and adds over slices).
//
// Bits: out[t, c] = silu(acc) with acc = x_0 w_0, then acc = acc + x_j w_j for j = 1 .. K-1 (each product rounded
// to fp32, then the add: the file is built with -ffp-contract=off), x_j the input K-1-j rows before t in
// cat(state, x), and silu from vec_exp.h silu_row: the arithmetic of the torch form with the compiled silu and of
// decode_kernels.cpp conv1d_step, which runs these very rows (ds::conv_rows) for its one token per sequence:
// a token's bits are the same through either, wherever a chunk starts.

#include "aten_lite.h"
#include "kernels.h"
#include "vec_exp.h"

#include <ATen/Parallel.h>

#include <cstdint>

namespace {

constexpr int64_t kGrainRows = 16;  // rows per work item: a few of them per thread for a prefill chunk

template <typename T>
void rows_of(const T* x, int64_t xs, const T* state, const float* w, int64_t K, int64_t C, int64_t t0, int64_t t1,
             T* out, int64_t os, float* acc) {
  // rows [t0, t1) of out; row i of cat(state, x) is state row K-1+i for i < 0, else x row i
  auto input = [&](int64_t i) { return i < 0 ? state + (K - 1 + i) * C : x + i * xs; };
  for (int64_t t = t0; t < t1; ++t) {
    const T* r = input(t - (K - 1));
    for (int64_t c = 0; c < C; ++c) acc[c] = ds::ld(r[c]) * w[c];
    for (int64_t j = 1; j < K; ++j) {
      r = input(t - (K - 1) + j);
      const float* wj = w + j * C;
      for (int64_t c = 0; c < C; ++c) acc[c] = acc[c] + ds::ld(r[c]) * wj[c];
    }
    ds::silu_row<T>(acc, out + t * os, C);
  }
}

template <typename T>
void conv_impl(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& state, at::Tensor& out) {
  const int64_t L = x.size(0), C = x.size(1), K = wt.size(0);
  const T* xp = x.data_ptr<T>();
  const T* sp = state.data_ptr<T>();
  const float* w = wt.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t grain = L * C * K < kSerialBelow ? L : kGrainRows;
  at::parallel_for(0, L, grain, [&](int64_t t0, int64_t t1) {
    ds::LineBuffer acc(C);
    rows_of<T>(xp, x.stride(0), sp, w, K, C, t0, t1, op, out.stride(0), acc.data());
  });
}

}  // namespace

namespace ds {
void conv_rows(const float* x, int64_t xs, const float* state, const float* w, int64_t K, int64_t C, int64_t t0,
               int64_t t1, float* out, int64_t os, float* acc) {
  rows_of<float>(x, xs, state, w, K, C, t0, t1, out, os, acc);
}
void conv_rows(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* state, const float* w, int64_t K, int64_t C,
               int64_t t0, int64_t t1, c10::BFloat16* out, int64_t os, float* acc) {
  rows_of<c10::BFloat16>(x, xs, state, w, K, C, t0, t1, out, os, acc);
}
}  // namespace ds

at::Tensor conv1d_prefill(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& state) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "conv1d_prefill: x must be [L, C] with a contiguous last dim");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "conv1d_prefill: fp32 or bf16 x");
  TORCH_CHECK(wt.dim() == 2 && wt.is_contiguous() && wt.scalar_type() == at::kFloat && wt.size(1) == x.size(1) &&
                  wt.size(0) >= 2, "conv1d_prefill: wt must be fp32 contiguous [K >= 2, C]");
  TORCH_CHECK(state.dim() == 2 && state.is_contiguous() && state.scalar_type() == x.scalar_type() &&
                  state.size(0) == wt.size(0) - 1 && state.size(1) == x.size(1),
              "conv1d_prefill: state must be a contiguous [K-1, C] in x's dtype");
  auto out = at::empty(x.sizes(), x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat)
    conv_impl<float>(x, wt, state, out);
  else
    conv_impl<c10::BFloat16>(x, wt, state, out);
  return out;
}
