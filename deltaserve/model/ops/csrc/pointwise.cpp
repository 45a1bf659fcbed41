// The activations between the linears, for every row of a step (prefill and decode alike), each one pass in
// place of ATen's 5-15 small ops; loaded with decode_kernels.cpp (cpu_kernels.py). Their plain-torch
// references are in ops/pointwise.py, ops/gdn.py (gdn_gates_torch) and ops/mlp.py; tests/test_cpu_kernels.py
// compares them at a tolerance on awkward shapes and checks that a row's bits do not depend on its batch.
//
// Each rounds where its torch reference rounds (the dtype casts, bf16 x bf16 products rounded to bf16), with
// exp from vec_exp.h (a few ulp from ATen's) and a per-element log1p from libm: results are within a few ulp of
// the references, and an element's bits depend only on its own inputs.
//
//   gdn_gates(b [T, H], a [T, H], dt_bias [H] fp32, neg_decay [H] fp32) -> (g [T, H] fp32, beta [T, H])
//       beta = sigmoid(b); g = neg_decay * softplus(a + dt_bias)   (softplus linear above 20, as torch)
//   silu_mul(gu [T, 2I]) -> [T, I] = silu(gu[:, :I]) * gu[:, I:]   (silu rounded to the dtype first)
//   gate_output(o [T, N], gate [T, N]) -> o * sigmoid(gate)         (sigmoid rounded to the dtype first)
//   silu_into(acc [T, C] fp32, out [T, C]): out = acc / (1 + exp(-acc)) in out's dtype: the GDN conv's
//       activation on its fp32 sums (ops/conv.py), prefill and decode step alike
// Inputs may be row-strided views (unit stride along the last dim), as the projections' column slices are.

#include "aten_lite.h"
#include "vec_exp.h"

#include <cmath>
#include <vector>

namespace {

using ds::exp_map;
using ds::ld;
using ds::st;

constexpr int64_t kGrainRows = 16;

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, " must be 2-D with a contiguous last dim");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": fp32 or bf16, not ",
              x.scalar_type());
}

template <typename T>
void gates_impl(const at::Tensor& b, const at::Tensor& a, const float* dt, const float* nd, at::Tensor& g,
                at::Tensor& beta) {
  const int64_t R = b.size(0), H = b.size(1), sb = b.stride(0), sa = a.stride(0);
  const T* bp = b.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  float* gp = g.data_ptr<float>();
  T* betap = beta.data_ptr<T>();
  at::parallel_for(0, R, kGrainRows * 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> x(H);
    for (int64_t r = r0; r < r1; ++r) {
      const T* br = bp + r * sb;
      const T* ar = ap + r * sa;
      exp_map(H, [&](int64_t i) { return -ld(br[i]); },
              [&](int64_t i, float e) { betap[r * H + i] = st<T>(1.f / (1.f + e)); });
      for (int64_t i = 0; i < H; ++i) x[i] = ld(ar[i]) + dt[i];
      exp_map(H, [&](int64_t i) { return x[i]; }, [&](int64_t i, float e) {
        gp[r * H + i] = nd[i] * (x[i] > 20.f ? x[i] : std::log1p(e));
      });
    }
  });
}

template <typename T>
void silu_mul_impl(const at::Tensor& gu, at::Tensor& y) {
  const int64_t R = gu.size(0), I = y.size(1), s = gu.stride(0);
  const T* gp = gu.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, R, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = gp + r * s;
      const T* up = gate + I;
      T* out = yp + r * I;
#if defined(__AVX512F__)
      ds::blocks16(I, [&](int64_t i, __mmask16 m) {
        const __m512 g = ds::ld16(gate + i, m);
        const __m512 silu = ds::round16<T>(_mm512_div_ps(g, ds::one_plus_exp_neg(g)));
        ds::st16(out + i, _mm512_mul_ps(silu, ds::ld16(up + i, m)), m);
      });
#else
      exp_map(I, [&](int64_t i) { return -ld(gate[i]); }, [&](int64_t i, float e) {
        const float silu = ld(st<T>(ld(gate[i]) / (1.f + e)));
        out[i] = st<T>(silu * ld(up[i]));
      });
#endif
    }
  });
}

template <typename T>
void gate_output_impl(const at::Tensor& o, const at::Tensor& gate, at::Tensor& y) {
  const int64_t R = o.size(0), N = o.size(1), so = o.stride(0), sg = gate.stride(0);
  const T* op = o.data_ptr<T>();
  const T* gp = gate.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, R, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gp + r * sg;
      const T* x = op + r * so;
      T* out = yp + r * N;
#if defined(__AVX512F__)
      ds::blocks16(N, [&](int64_t i, __mmask16 m) {
        const __m512 sig = ds::round16<T>(_mm512_div_ps(_mm512_set1_ps(1.f), ds::one_plus_exp_neg(ds::ld16(g + i, m))));
        ds::st16(out + i, _mm512_mul_ps(ds::ld16(x + i, m), sig), m);
      });
#else
      exp_map(N, [&](int64_t i) { return -ld(g[i]); }, [&](int64_t i, float e) {
        out[i] = st<T>(ld(x[i]) * ld(st<T>(1.f / (1.f + e))));
      });
#endif
    }
  });
}

template <typename T>
void silu_into_impl(const at::Tensor& acc, at::Tensor& out) {
  const int64_t R = acc.size(0), C = acc.size(1), sa = acc.stride(0), so = out.stride(0);
  const float* ap = acc.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, R, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ds::silu_row<T>(ap + r * sa, op + r * so, C);
  });
}

}  // namespace

void silu_into(const at::Tensor& acc, at::Tensor& out) {
  check_rows(acc, "silu_into: acc");
  check_rows(out, "silu_into: out");
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.sizes() == out.sizes(),
              "silu_into: acc must be fp32, out its shape");
  if (out.scalar_type() == at::kFloat)
    silu_into_impl<float>(acc, out);
  else
    silu_into_impl<c10::BFloat16>(acc, out);
}

// The _into forms write into the caller's tensors (the decode program's buffers); the others allocate.

void gdn_gates_into(const at::Tensor& b, const at::Tensor& a, const at::Tensor& dt_bias, const at::Tensor& neg_decay,
                    at::Tensor& g, at::Tensor& beta) {
  // g [T, H] fp32 and beta [T, H] in b's dtype, both contiguous
  check_rows(b, "gdn_gates: b");
  check_rows(a, "gdn_gates: a");
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(), "gdn_gates: a and b must match");
  const int64_t H = b.size(1);
  for (const at::Tensor* t : {&dt_bias, &neg_decay})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == H && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gdn_gates: dt_bias and neg_decay must be fp32 [", H, "]");
  TORCH_CHECK(g.sizes() == b.sizes() && g.is_contiguous() && g.scalar_type() == at::kFloat && beta.sizes() == b.sizes() &&
                  beta.is_contiguous() && beta.scalar_type() == b.scalar_type(),
              "gdn_gates: g must be contiguous fp32 [T, H], beta contiguous [T, H] in b's dtype");
  if (b.scalar_type() == at::kFloat)
    gates_impl<float>(b, a, dt_bias.data_ptr<float>(), neg_decay.data_ptr<float>(), g, beta);
  else
    gates_impl<c10::BFloat16>(b, a, dt_bias.data_ptr<float>(), neg_decay.data_ptr<float>(), g, beta);
}

std::vector<at::Tensor> gdn_gates(const at::Tensor& b, const at::Tensor& a, const at::Tensor& dt_bias,
                                  const at::Tensor& neg_decay) {
  check_rows(b, "gdn_gates: b");
  auto g = at::empty(b.sizes(), b.options().dtype(at::kFloat));
  auto beta = at::empty(b.sizes(), b.options());
  gdn_gates_into(b, a, dt_bias, neg_decay, g, beta);
  return {g, beta};
}

void silu_mul_into(const at::Tensor& gu, at::Tensor& y) {
  // gu [T, 2I] (row stride any) -> y [T, I] contiguous
  check_rows(gu, "silu_mul: gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: gu must be [T, 2I]");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == gu.size(0) && 2 * y.size(1) == gu.size(1) && y.is_contiguous() &&
                  y.scalar_type() == gu.scalar_type(), "silu_mul: out must be contiguous [T, I] in gu's dtype");
  if (gu.scalar_type() == at::kFloat)
    silu_mul_impl<float>(gu, y);
  else
    silu_mul_impl<c10::BFloat16>(gu, y);
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_mul: gu");
  auto y = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  silu_mul_into(gu, y);
  return y;
}

void gate_output_into(const at::Tensor& o, const at::Tensor& gate, at::Tensor& y) {
  // o, gate [T, N] (row strides any) -> y [T, N] contiguous
  check_rows(o, "gate_output: o");
  check_rows(gate, "gate_output: gate");
  TORCH_CHECK(o.sizes() == gate.sizes() && o.scalar_type() == gate.scalar_type(), "gate_output: o and gate must match");
  TORCH_CHECK(y.sizes() == o.sizes() && y.is_contiguous() && y.scalar_type() == o.scalar_type(),
              "gate_output: out must be contiguous [T, N] in o's dtype");
  if (o.scalar_type() == at::kFloat)
    gate_output_impl<float>(o, gate, y);
  else
    gate_output_impl<c10::BFloat16>(o, gate, y);
}

at::Tensor gate_output(const at::Tensor& o, const at::Tensor& gate) {
  auto y = at::empty(o.sizes(), o.options());
  gate_output_into(o, gate, y);
  return y;
}
