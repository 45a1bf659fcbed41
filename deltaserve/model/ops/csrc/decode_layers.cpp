// A decoder layer's decode step in one call, for steps whose every row is a decode row (layers.py takes this
// path through model/fused.py when the model qualifies). A tiny model's decode step spent most of its time
// between kernels (Python, ~25 op calls per layer); here the same kernels run in the same order on the same
// tensors, so the bits are those of layers.py's path exactly (tests/test_fused_decode.py checks it), and a
// decode row computed in a mixed step (layers.py) equals the same row computed here.
//
// gdn_layer_decode    w: ln1, ln2, in_proj, conv_wt [K, C] fp32, dt_bias, neg_decay, norm_w, out_proj, gate_up, down
//                     dims: in_N, conv_dim, value_dim, Hv, Hk, dk, dv, out_N, gate_up_N, down_N
// attention_layer_decode  w: ln1, ln2, qkv_proj, q_norm, k_norm, o_proj, gate_up, down
//                     dims: qkv_N, Hq, Hkv, D, o_N, gate_up_N, down_N
//                     step: cos, sin [B, R], kv_pages, kv_rows [B], page_table [B, maxp], lengths [B]
// Projections are packed bf16 weights (pack_bf16_weight), multiplied by linear_bf16 or, where amx is set (the amx
// instruction set), linear_bf16_amx, as ops/linear.py does; x [B, H] is the residual stream, returned updated.

#include "aten_lite.h"
#include "kernels.h"

#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/neg.h>

#include <cstring>
#include <vector>

namespace {

using Linear = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t);

inline Linear linear_for(bool amx) { return amx ? &linear_bf16_amx : &linear_bf16; }

// DecoderLayer.forward's tail: (x, h) = add_rms_norm(x, mixed, ln2); x + down(silu(gate(h)) * up(h))
at::Tensor residual_mlp(Linear linear, const at::Tensor& x, const at::Tensor& mixed, const at::Tensor& ln2, double eps,
                        const at::Tensor& gate_up, int64_t gu_n, const at::Tensor& down, int64_t down_n) {
  auto sy = add_rms_norm_fused(x, mixed, ln2, eps);
  auto m = linear(silu_mul(linear(sy[1], gate_up, gu_n)), down, down_n);
  return at::add(sy[0], m);
}

// ops/pointwise.py silu on the conv's fp32 pre-activation, then the cast: the same ATen ops in the same order
at::Tensor silu_to(const at::Tensor& acc, at::ScalarType dtype) {
  return at::div(acc, at::add(at::exp(at::neg(acc)), 1.0)).to(dtype);
}

}  // namespace

at::Tensor gdn_layer_decode(const at::Tensor& x, const std::vector<at::Tensor>& w, const std::vector<int64_t>& dims,
                            double eps, const at::Tensor& conv_cache, const at::Tensor& ssm_cache,
                            const at::Tensor& rows, const at::Tensor& slots, bool amx) {
  const Linear linear = linear_for(amx);
  TORCH_CHECK(w.size() == 10 && dims.size() == 10, "gdn_layer_decode: 10 weights and 10 dims");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be [B, H] bf16");
  const int64_t in_n = dims[0], c = dims[1], vd = dims[2], hv = dims[3], hk = dims[4], dk = dims[5], dv = dims[6];
  const int64_t B = x.size(0), kd = hk * dk;
  auto h = rms_norm_fused(x, w[0], eps);
  auto proj = linear(h, w[2], in_n);  // [B, conv_dim + value_dim + 2 Hv]
  auto gb = gdn_gates(proj.narrow(1, c + vd, hv), proj.narrow(1, c + vd + hv, hv), w[4], w[5]);
  auto xc = silu_to(ds::conv_step_acc(proj.narrow(1, 0, c), rows, w[3], conv_cache, slots), x.scalar_type());
  auto q = xc.narrow(1, 0, kd).view({B, hk, dk});
  auto k = xc.narrow(1, kd, kd).view({B, hk, dk});
  auto v = xc.narrow(1, 2 * kd, c - 2 * kd).view({B, hv, dv});
  auto o = ds::gdn_step(q, k, v, gb[0], gb[1], ssm_cache, slots);  // [B, Hv, dv]
  auto core = gated_rms_norm(o.view({B, hv, dv}), proj.narrow(1, c, vd), w[6], eps);
  return residual_mlp(linear, x, linear(core, w[7], dims[7]), w[1], eps, w[8], dims[8], w[9], dims[9]);
}

at::Tensor attention_layer_decode(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                  const std::vector<int64_t>& dims, double eps, double scale,
                                  const at::Tensor& kv_cache, const std::vector<at::Tensor>& step, bool amx) {
  const Linear linear = linear_for(amx);
  TORCH_CHECK(w.size() == 8 && dims.size() == 7 && step.size() == 6, "attention_layer_decode: 8 weights, 7 dims, "
              "6 step tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be [B, H] bf16");
  const int64_t hq = dims[1], hkv = dims[2], d = dims[3], B = x.size(0);
  const at::Tensor &cos = step[0], &sin = step[1], &pages = step[2], &prow = step[3];
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.scalar_type() == x.scalar_type() &&
                  kv_cache.size(3) == hkv && kv_cache.size(4) == d, "kv_cache must be [P, 2, bs, Hkv, D] in x's dtype");
  TORCH_CHECK(pages.scalar_type() == at::kLong && prow.scalar_type() == at::kLong && pages.is_contiguous() &&
                  prow.is_contiguous() && pages.numel() == B && prow.numel() == B, "kv_pages, kv_rows: int64 [B]");
  auto h = rms_norm_fused(x, w[0], eps);
  auto proj = linear(h, w[2], dims[0]);  // [B, (2 Hq + 2 Hkv) D]
  auto qg = proj.narrow(1, 0, 2 * hq * d).view({B, hq, 2 * d});
  auto gate = qg.narrow(2, d, d).reshape({B, hq * d});
  auto q = qk_norm_rope(qg.narrow(2, 0, d), w[3], eps, cos, sin);
  auto k = qk_norm_rope(proj.narrow(1, 2 * hq * d, hkv * d).view({B, hkv, d}), w[4], eps, cos, sin);
  auto v = proj.narrow(1, (2 * hq + hkv) * d, hkv * d).view({B, hkv, d});
  {  // kv_write: kv[page, 0 | 1, row] = k[i] | v[i], a copy (ops/attention.py kv_write's bits)
    const int64_t P = kv_cache.size(0), bs = kv_cache.size(2), row = hkv * d;
    const int64_t* pp = pages.data_ptr<int64_t>();
    const int64_t* rp = prow.data_ptr<int64_t>();
    auto* kvp = kv_cache.data_ptr<at::BFloat16>();
    const auto* kp = k.data_ptr<at::BFloat16>();  // contiguous [B, Hkv, D]
    const auto* vp = v.data_ptr<at::BFloat16>();  // a view of the projection: [B, Hkv, D] with a row stride
    const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
    for (int64_t i = 0; i < B; ++i) {
      TORCH_CHECK(pp[i] >= 0 && pp[i] < P && rp[i] >= 0 && rp[i] < bs, "kv page or row out of range");
      at::BFloat16* dst = kvp + (pp[i] * 2 * bs + rp[i]) * row;
      std::memcpy(dst, kp + i * row, row * sizeof(at::BFloat16));
      for (int64_t j = 0; j < hkv; ++j)
        std::memcpy(dst + bs * row + j * d, vp + i * vs0 + j * vs1, d * sizeof(at::BFloat16));
    }
  }
  auto o = ds::paged_attention(q, kv_cache, step[4], step[5], scale);  // [B, Hq, D]
  auto out = gate_output(o.view({B, hq * d}), gate);
  return residual_mlp(linear, x, linear(out, w[5], dims[4]), w[1], eps, w[6], dims[5], w[7], dims[6]);
}
