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
#include "vec_exp.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

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

template <typename T>
void gated_impl(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, float eps, at::Tensor& y) {
  // x [R, H, D]; z [R, H * D] (row stride any); y [R, H * D]
  const int64_t R = x.size(0), H = x.size(1), D = x.size(2), sr = x.stride(0), sh = x.stride(1), sz = z.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* zp = z.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, R * H, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t r = i / H, h = i % H;
      const T* xr = xp + r * sr + h * sh;
      const T* zr = zp + r * sz + h * D;
      T* yr = yp + r * H * D + h * D;
      const float inv = inv_rms(xr, D, eps);
      ds::exp_map(D, [&](int64_t j) { return -load(zr[j]); }, [&](int64_t j, float e) {
        const float silu = load(zr[j]) / (1.f + e);
        const float normed = load(store<T>(load(xr[j]) * inv));
        yr[j] = store<T>(load(store<T>(load(wp[j]) * normed)) * silu);
      });
    }
  });
}

template <typename T>
void qk_norm_rope_impl(const at::Tensor& x, const at::Tensor& w, float eps, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& y) {
  // x [R, H, D] (last dim contiguous); cos, sin [R, P] contiguous, P <= D even; y [R, H, D]
  const int64_t R = x.size(0), H = x.size(1), D = x.size(2), sr = x.stride(0), sh = x.stride(1), P = cos.size(1);
  const int64_t half = P / 2;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  auto mul = [](T a, T b) { return load(store<T>(load(a) * load(b))); };  // a bf16 x bf16 product, as torch rounds it
  at::parallel_for(0, R * H, 64, [&](int64_t a, int64_t b) {
    std::vector<T> n(D);
    for (int64_t i = a; i < b; ++i) {
      const int64_t r = i / H;
      norm_row(xp + r * sr + (i % H) * sh, wp, D, eps, n.data());
      const T* c = cp + r * P;
      const T* s = sp + r * P;
      T* yr = yp + i * D;
      // rot * cos + rotate_half(rot) * sin, rotate_half(rot) = cat(-rot[half:], rot[:half]); each op rounded
      for (int64_t j = 0; j < half; ++j) yr[j] = store<T>(mul(n[j], c[j]) - mul(n[j + half], s[j]));
      for (int64_t j = half; j < P; ++j) yr[j] = store<T>(mul(n[j], c[j]) + mul(n[j - half], s[j]));
      for (int64_t j = P; j < D; ++j) yr[j] = n[j];
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

// The _into forms write into the caller's tensors (the decode program's buffers, kept across steps); the others
// allocate their result and call them.

void rms_norm_into(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y) {
  // x [R, H, D] (last dim contiguous, any outer strides, read in place) -> y [R, H, D] contiguous
  check(x, w);
  TORCH_CHECK(x.dim() == 3 && y.sizes() == x.sizes() && y.is_contiguous() && y.scalar_type() == x.scalar_type(),
              "rms_norm: x must be [R, H, D] and out a contiguous tensor of its shape and dtype");
  if (x.scalar_type() == at::kFloat)
    rms_norm_impl<float>(x, w, static_cast<float>(eps), y);
  else
    rms_norm_impl<at::BFloat16>(x, w, static_cast<float>(eps), y);
}

at::Tensor rms_norm_fused(const at::Tensor& x, const at::Tensor& w, double eps) {
  // x [..., D] (last dim contiguous; 2-D and 3-D views with any outer strides read in place) -> contiguous
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rms_norm: x must be [R, D] or [R, H, D]");
  auto x3 = x.dim() == 3 ? x : x.unsqueeze(1);
  auto y = at::empty(x3.sizes(), x.options());
  rms_norm_into(x3, w, eps, y);
  return x.dim() == 3 ? y : y.squeeze(1);
}

void add_rms_norm_into(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w, double eps, at::Tensor& s,
                       at::Tensor& y) {
  // s = x + h (rounded to x's dtype), y = rms_norm(s): x, h, s, y [R, D] contiguous; s may be x itself (each
  // element is read before its sum is written), y is none of the others
  check(x, w);
  TORCH_CHECK(x.dim() == 2 && h.sizes() == x.sizes() && h.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and h must be [R, D] of one dtype");
  const at::Tensor* all[] = {&x, &h, &s, &y};
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->is_contiguous() && t->sizes() == x.sizes() && t->scalar_type() == x.scalar_type(),
                "add_rms_norm: x, h and the outputs must be contiguous [R, D] of one dtype");
  TORCH_CHECK(y.data_ptr() != s.data_ptr() && y.data_ptr() != x.data_ptr() && y.data_ptr() != h.data_ptr(),
              "add_rms_norm: the normed output must not alias an input or the sum");
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_impl<float>(x, h, w, static_cast<float>(eps), s, y);
  else
    add_rms_norm_impl<at::BFloat16>(x, h, w, static_cast<float>(eps), s, y);
}

std::vector<at::Tensor> add_rms_norm_fused(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                              double eps) {
  auto xc = x.contiguous(), hc = h.contiguous();
  auto s = at::empty_like(xc), y = at::empty_like(xc);
  add_rms_norm_into(xc, hc, w, eps, s, y);
  return {s, y};
}

void gated_rms_norm_into(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps, at::Tensor& y) {
  // the GDN output norm (ops/norm.py rms_norm_gated): x [R, H, D] (last dim contiguous), z [R, H * D] (row
  // stride any), w [D] plain weight -> y [R, H * D] contiguous = norm(x) * w * silu(z), rounded where
  // transformers rounds
  check(x, w);
  TORCH_CHECK(x.dim() == 3 && z.dim() == 2 && z.size(0) == x.size(0) && z.size(1) == x.size(1) * x.size(2) &&
                  z.stride(1) == 1 && z.scalar_type() == x.scalar_type(),
              "gated_rms_norm: x [R, H, D] and z [R, H * D] of one dtype");
  TORCH_CHECK(y.sizes() == z.sizes() && y.is_contiguous() && y.scalar_type() == x.scalar_type(),
              "gated_rms_norm: out must be contiguous [R, H * D] in x's dtype");
  if (x.scalar_type() == at::kFloat)
    gated_impl<float>(x, z, w, static_cast<float>(eps), y);
  else
    gated_impl<at::BFloat16>(x, z, w, static_cast<float>(eps), y);
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 3, "gated_rms_norm: x [R, H, D] and z [R, H * D] of one dtype");
  auto y = at::empty({x.size(0), x.size(1) * x.size(2)}, x.options());
  gated_rms_norm_into(x, z, w, eps, y);
  return y;
}

void qk_norm_rope_into(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& y) {
  // apply_rotary(rms_norm(x, w, eps), cos, sin) for q or k: x [R, H, D] (last dim contiguous), cos and sin
  // [R, P] in x's dtype, P <= D even -> y [R, H, D] contiguous; the norm is rms_norm_fused's bits, the rotary
  // torch's (ops/attention.py apply_rotary) exactly
  check(x, w);
  TORCH_CHECK(x.dim() == 3, "qk_norm_rope: x must be [R, H, D]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) <= x.size(2) &&
                  cos.size(1) % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "qk_norm_rope: cos and sin must be contiguous [R, P <= D, even] in x's dtype");
  TORCH_CHECK(y.sizes() == x.sizes() && y.is_contiguous() && y.scalar_type() == x.scalar_type(),
              "qk_norm_rope: out must be contiguous [R, H, D] in x's dtype");
  if (x.scalar_type() == at::kFloat)
    qk_norm_rope_impl<float>(x, w, static_cast<float>(eps), cos, sin, y);
  else
    qk_norm_rope_impl<at::BFloat16>(x, w, static_cast<float>(eps), cos, sin, y);
}

at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos,
                        const at::Tensor& sin) {
  auto y = at::empty(x.sizes(), x.options());
  qk_norm_rope_into(x, w, eps, cos, sin, y);
  return y;
}
