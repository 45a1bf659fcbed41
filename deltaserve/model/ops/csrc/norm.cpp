// Zero-centred RMSNorm (Qwen3_5RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back) in one
// pass per row, and the residual add fused in front of it; loaded with decode_kernels.cpp (cpu_kernels.py).
//
// A decode step of a small model runs ~10 torch ops per norm (cast, pow, mean, add, rsqrt, mul, ...), each a
// few microseconds of dispatch; these replace them for every row of every step, prefill and decode alike.
// Bits: a row's sum of squares is accumulated in 16 fixed lanes (element j in lane j % 16) and the lanes are
// added in a fixed order, so a row's result depends on nothing but the row (batch-invariant). It is not
// torch's reduction order: results differ from ops/norm.py rms_norm in the last place (tests compare at a
// tolerance). The residual sum is rounded to the model dtype exactly as torch's `x + h` rounds it.

#include "aten_lite.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

inline float load(float v) { return v; }
inline float load(at::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T store(float v) { return static_cast<T>(v); }  // c10::BFloat16(float) rounds to nearest even

template <typename T>
float inv_rms(const T* __restrict x, int64_t D, float eps) {
  float lane[16] = {0};
  int64_t j = 0;
  for (; j + 16 <= D; j += 16)
    for (int l = 0; l < 16; ++l) {
      const float v = load(x[j + l]);
      lane[l] += v * v;
    }
  for (int l = 0; j < D; ++j, ++l) {
    const float v = load(x[j]);
    lane[l] += v * v;
  }
  float ss = 0.f;
  for (int l = 0; l < 16; ++l) ss += lane[l];
  return 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
}

template <typename T>
void norm_row(const T* __restrict x, const T* __restrict w, int64_t D, float eps, T* __restrict y) {
  const float inv = inv_rms(x, D, eps);
  for (int64_t j = 0; j < D; ++j) y[j] = store<T>(load(x[j]) * inv * (1.0f + load(w[j])));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, float eps, at::Tensor& y) {
  // x [R, H, D] with a contiguous last dim (any row / head strides); y [R, H, D] contiguous
  const int64_t R = x.size(0), H = x.size(1), D = x.size(2), sr = x.stride(0), sh = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, R * H, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) norm_row(xp + (i / H) * sr + (i % H) * sh, wp, D, eps, yp + i * D);
  });
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w, float eps,
                       at::Tensor& s, at::Tensor& y) {
  const int64_t R = x.size(0), D = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* hp = h.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* sp = s.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, R, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      T* srow = sp + r * D;
      for (int64_t j = 0; j < D; ++j) srow[j] = store<T>(load(xp[r * D + j]) + load(hp[r * D + j]));
      norm_row(srow, wp, D, eps, yp + r * D);
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rms_norm: fp32 or bf16, not ",
              x.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == x.scalar_type() && w.size(0) == x.size(-1),
              "rms_norm: weight must be [D] contiguous in x's dtype");
  TORCH_CHECK(x.stride(-1) == 1, "rms_norm: the last dim must be contiguous");
}

}  // namespace

at::Tensor rms_norm_fused(const at::Tensor& x, const at::Tensor& w, double eps) {
  // x [..., D] (last dim contiguous; 2-D and 3-D views with any outer strides read in place) -> contiguous
  check(x, w);
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rms_norm: x must be [R, D] or [R, H, D]");
  auto x3 = x.dim() == 3 ? x : x.unsqueeze(1);
  auto y = at::empty(x3.sizes(), x.options());
  if (x.scalar_type() == at::kFloat)
    rms_norm_impl<float>(x3, w, static_cast<float>(eps), y);
  else
    rms_norm_impl<at::BFloat16>(x3, w, static_cast<float>(eps), y);
  return x.dim() == 3 ? y : y.squeeze(1);
}

std::vector<at::Tensor> add_rms_norm_fused(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                              double eps) {
  // s = x + h (rounded to x's dtype), y = rms_norm(s): x, h [R, D]
  check(x, w);
  TORCH_CHECK(x.dim() == 2 && h.sizes() == x.sizes() && h.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and h must be [R, D] of one dtype");
  auto xc = x.contiguous(), hc = h.contiguous();
  auto s = at::empty_like(xc), y = at::empty_like(xc);
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_impl<float>(xc, hc, w, static_cast<float>(eps), s, y);
  else
    add_rms_norm_impl<at::BFloat16>(xc, hc, w, static_cast<float>(eps), s, y);
  return {s, y};
}
