// A decode-only step of the whole model in one call (DecodeModel, built by model/fused.py), for steps whose
// every row is a decode row. A tiny model's decode step spent most of its time between kernels: Python, ~25 op
// calls per layer, a module call per layer and ~20 small ATen ops to build the step's tensors. Here the
// embedding lookup, every layer and the final norm run the same kernels in the same order on the same tensors as
// the op-table path (qwen3_5.py, layers.py), so the bits are that path's exactly (tests/test_fused_decode.py),
// and a decode row computed in a mixed step equals the same row computed here.
//
// Projections are lists of parts (DecodeModel::Part): packed bf16 weights (pack_bf16_weight), multiplied by
// linear_bf16 or, where amx is set (the amx instruction set), linear_bf16_amx, as ops/linear.py does; packed fp8
// weights, multiplied by linear_fp8 of the fp8 extension (ops/fp8.py); several parts are concatenated as
// SplitWeight.linear does. x [B, H] is the residual stream.

#include "aten_lite.h"
#include "kernels.h"

#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>

#include <cstring>
#include <vector>

namespace {

using Linear = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t);
using Proj = DecodeModel::Proj;

// y [B, N] = x @ the projection's weight^T: ops/linear.py linear() on a PackedWeight, an Fp8Weight or a SplitWeight
struct Mul {
  Linear bf16;
  Fp8Linear fp8;
  at::Tensor part(const DecodeModel::Part& p, const at::Tensor& x) const {
    return p.scales.defined() ? fp8(x, p.packed, p.scales, p.n, p.path) : bf16(x, p.packed, p.n);
  }
  at::Tensor operator()(const Proj& proj, const at::Tensor& x) const {
    if (proj.size() == 1) return part(proj[0], x);
    std::vector<at::Tensor> ys;
    for (const auto& p : proj) ys.push_back(part(p, x));
    return at::cat(ys, 1);
  }
};

// DecoderLayer.forward's tail: (x, h) = add_rms_norm(x, mixed, ln2); x + down(silu(gate(h)) * up(h))
at::Tensor residual_mlp(const Mul& mul, const at::Tensor& x, const at::Tensor& mixed, const at::Tensor& ln2,
                        double eps, const Proj& gate_up, const Proj& down) {
  auto sy = add_rms_norm_fused(x, mixed, ln2, eps);
  auto m = mul(down, silu_mul(mul(gate_up, sy[1])));
  return at::add(sy[0], m);
}

// GDNMixer.forward's decode path and the layer around it. rows: 0 .. B-1 (the conv step's rows of proj)
at::Tensor gdn_layer(const Mul& mul, const at::Tensor& x, const std::vector<at::Tensor>& w, const std::vector<Proj>& pr,
                     const std::vector<int64_t>& dims, double eps, const at::Tensor& conv_cache,
                     const at::Tensor& ssm_cache, const at::Tensor& rows, const at::Tensor& slots) {
  const int64_t c = dims[0], vd = dims[1], hv = dims[2], hk = dims[3], dk = dims[4], dv = dims[5];
  const int64_t B = x.size(0), kd = hk * dk;
  auto h = rms_norm_fused(x, w[0], eps);
  auto proj = mul(pr[0], h);  // [B, conv_dim + value_dim + 2 Hv]
  auto gb = gdn_gates(proj.narrow(1, c + vd, hv), proj.narrow(1, c + vd + hv, hv), w[3], w[4]);
  auto xc = ds::conv_step(proj.narrow(1, 0, c), rows, w[2], conv_cache, slots);  // [B, conv_dim]
  auto q = xc.narrow(1, 0, kd).view({B, hk, dk});
  auto k = xc.narrow(1, kd, kd).view({B, hk, dk});
  auto v = xc.narrow(1, 2 * kd, c - 2 * kd).view({B, hv, dv});
  auto o = ds::gdn_step(q, k, v, gb[0], gb[1], ssm_cache, slots);  // [B, Hv, dv]
  auto core = gated_rms_norm(o.view({B, hv, dv}), proj.narrow(1, c, vd), w[5], eps);
  return residual_mlp(mul, x, mul(pr[1], core), w[1], eps, pr[2], pr[3]);
}

// kv[page, 0 | 1, row] = k[i] | v[i] for decode row i at position p = lengths[i] - 1: page = table[i, p / bs],
// row = p % bs (ops/attention.py kv_write's bits: a copy)
void kv_write(const at::Tensor& kv, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
              const at::Tensor& lengths) {
  const int64_t B = k.size(0), P = kv.size(0), bs = kv.size(2), hkv = k.size(1), d = k.size(2), row = hkv * d;
  const int64_t maxp = table.size(1);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  auto* kvp = kv.data_ptr<at::BFloat16>();
  const auto* kp = k.data_ptr<at::BFloat16>();  // contiguous [B, Hkv, D]
  const auto* vp = v.data_ptr<at::BFloat16>();  // a view of the projection: [B, Hkv, D] with a row stride
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t p = lp[i] - 1;
    TORCH_CHECK(p >= 0 && p / bs < maxp, "decode row ", i, ": position ", p, " is outside its page table");
    const int64_t page = tp[i * maxp + p / bs];
    TORCH_CHECK(page >= 0 && page < P, "decode row ", i, ": page ", page, " is outside the KV pool");
    at::BFloat16* dst = kvp + (page * 2 * bs + p % bs) * row;
    std::memcpy(dst, kp + i * row, row * sizeof(at::BFloat16));
    for (int64_t j = 0; j < hkv; ++j)
      std::memcpy(dst + bs * row + j * d, vp + i * vs0 + j * vs1, d * sizeof(at::BFloat16));
  }
}

// AttentionMixer.forward's decode path and the layer around it
at::Tensor attention_layer(const Mul& mul, const at::Tensor& x, const std::vector<at::Tensor>& w,
                           const std::vector<Proj>& pr, const std::vector<int64_t>& dims, double eps, double scale,
                           const at::Tensor& kv_cache, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& table, const at::Tensor& lengths) {
  const int64_t hq = dims[0], hkv = dims[1], d = dims[2], B = x.size(0);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.scalar_type() == x.scalar_type() &&
                  kv_cache.size(3) == hkv && kv_cache.size(4) == d, "kv_cache must be [P, 2, bs, Hkv, D] in x's dtype");
  auto h = rms_norm_fused(x, w[0], eps);
  auto proj = mul(pr[0], h);  // [B, (2 Hq + 2 Hkv) D]
  auto qg = proj.narrow(1, 0, 2 * hq * d).view({B, hq, 2 * d});
  auto gate = qg.narrow(2, d, d).reshape({B, hq * d});
  auto q = qk_norm_rope(qg.narrow(2, 0, d), w[2], eps, cos, sin);
  auto k = qk_norm_rope(proj.narrow(1, 2 * hq * d, hkv * d).view({B, hkv, d}), w[3], eps, cos, sin);
  kv_write(kv_cache, k, proj.narrow(1, (2 * hq + hkv) * d, hkv * d).view({B, hkv, d}), table, lengths);
  auto o = ds::paged_attention(q, kv_cache, table, lengths, scale);  // [B, Hq, D]
  auto out = gate_output(o.view({B, hq * d}), gate);
  return residual_mlp(mul, x, mul(pr[1], out), w[1], eps, pr[2], pr[3]);
}

void check_index(const at::Tensor& t, int64_t dim, int64_t rows, const char* what) {
  TORCH_CHECK(t.dim() == dim && t.scalar_type() == at::kLong && t.is_contiguous() && t.size(0) == rows, what,
              " must be contiguous int64 with ", rows, " rows");
}

}  // namespace

DecodeModel::DecodeModel(at::Tensor embed, at::Tensor norm, double eps, bool amx, Fp8Linear fp8)
    : embed_(std::move(embed)), norm_(std::move(norm)), eps_(eps), amx_(amx), fp8_(fp8) {
  TORCH_CHECK(embed_.dim() == 2 && embed_.is_contiguous() && embed_.scalar_type() == at::kBFloat16,
              "DecodeModel: the embedding must be contiguous bf16 [V, H]");
}

void DecodeModel::add(Layer layer, size_t nw, size_t ndims, const char* what) {
  TORCH_CHECK(layer.w.size() == nw && layer.proj.size() == 4 && layer.dims.size() == ndims, "DecodeModel.", what, ": ",
              nw, " weights, 4 projections and ", ndims, " dims");
  for (const Proj& p : layer.proj) {
    TORCH_CHECK(!p.empty(), "DecodeModel.", what, ": a projection without parts");
    for (const Part& part : p)
      TORCH_CHECK(!part.scales.defined() || fp8_ != nullptr, "DecodeModel.", what,
                  ": an fp8 part in a program built without linear_fp8");
  }
  (layer.gdn ? n_gdn_ : n_attn_) += 1;
  layers_.push_back(std::move(layer));
}

void DecodeModel::add_gdn(std::vector<at::Tensor> w, std::vector<Proj> proj, std::vector<int64_t> dims, double eps) {
  add({true, std::move(w), std::move(proj), std::move(dims), eps, 0.0}, 6, 6, "add_gdn");
}

void DecodeModel::add_attention(std::vector<at::Tensor> w, std::vector<Proj> proj, std::vector<int64_t> dims,
                                double eps, double scale) {
  add({false, std::move(w), std::move(proj), std::move(dims), eps, scale}, 4, 3, "add_attention");
}

at::Tensor DecodeModel::run(const at::Tensor& ids, const std::vector<at::Tensor>& conv,
                            const std::vector<at::Tensor>& ssm, const std::vector<at::Tensor>& kv,
                            const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& page_table, const at::Tensor& lengths) const {
  const Mul mul{amx_ ? &linear_bf16_amx : &linear_bf16, fp8_};
  const int64_t B = ids.numel();
  TORCH_CHECK(int64_t(conv.size()) == n_gdn_ && int64_t(ssm.size()) == n_gdn_ && int64_t(kv.size()) == n_attn_,
              "DecodeModel.run: ", n_gdn_, " conv and ssm caches and ", n_attn_, " KV pools");
  check_index(ids, 1, B, "ids");
  check_index(slots, 1, B, "slots");
  check_index(lengths, 1, B, "lengths");
  check_index(page_table, 2, B, "page_table");
  for (const at::Tensor& t : conv) TORCH_CHECK(t.scalar_type() == at::kBFloat16, "conv caches must be bf16");
  for (const at::Tensor& t : ssm) TORCH_CHECK(t.scalar_type() == at::kFloat, "GDN state caches must be fp32");
  for (const at::Tensor& t : kv) TORCH_CHECK(t.scalar_type() == at::kBFloat16, "KV pools must be bf16");
  const int64_t V = embed_.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < V, "token id ", ip[i], " is outside the vocabulary");
  const int64_t H = embed_.size(1);
  auto x = at::empty({B, H}, embed_.options());  // F.embedding: a row copy, [B, H]
  const auto* ep = embed_.data_ptr<at::BFloat16>();
  auto* xp = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < B; ++i) std::memcpy(xp + i * H, ep + ip[i] * H, H * sizeof(at::BFloat16));
  const auto rows = at::arange(B, ids.options());
  int64_t gi = 0, ai = 0;
  for (const Layer& l : layers_) {
    if (l.gdn) {
      x = gdn_layer(mul, x, l.w, l.proj, l.dims, l.eps, conv[gi], ssm[gi], rows, slots);
      ++gi;
    } else {
      x = attention_layer(mul, x, l.w, l.proj, l.dims, l.eps, l.scale, kv[ai], cos, sin, page_table, lengths);
      ++ai;
    }
  }
  return rms_norm_fused(x, norm_, eps_);
}
