// A decode-only step of the whole model in one call (DecodeModel, built by model/fused.py), for steps whose
// every row is a decode row. A tiny model's decode step spent most of its time between kernels: Python, ~25 op
// calls per layer, a module call per layer and ~20 small ATen ops to build the step's tensors. Here the
// embedding lookup, every layer and the final norm run the same kernels in the same order on the same tensors as
// the op-table path (qwen3_5.py, layers.py), so the bits are that path's exactly (tests/test_fused_decode.py),
// and a decode row computed in a mixed step equals the same row computed here.
//
// A speculative verify step (run_verify: decode spans of several tokens, docs/speculative.md) runs here too: a row
// per token, every row with its own page-table row and length, so the linears, norms, MLP and attention are the
// one-token step's calls over more rows (each row's bits its own: the kernels are row-wise batch-invariant). Its
// GDN layers step each token as GDNMixer.forward's waves do, the same conv and recurrent arithmetic on the same slots
// in each slot's token order; they log the conv states after each token and the later tokens' recurrence inputs,
// and leave each recurrent state after its span's first token (the rollback replays). Its rows come in wave order,
// so that a wave is a block of rows of every buffer (views, nothing gathered); the result goes back to the step's
// order at the end.
//
// Projections are lists of parts (DecodeModel::Part): packed bf16 weights (pack_bf16_weight), multiplied by
// linear_bf16 or, where amx is set (the amx instruction set), linear_bf16_amx, as ops/linear.py does; packed fp8
// weights, multiplied by linear_fp8 of the fp8 extension (ops/fp8.py); several parts are concatenated as
// SplitWeight.linear does: each bf16 part writes its columns of the projection's buffer in place.
//
// No tensor is made during a step but the result (and an fp8 or amx part's product, copied into its columns):
// every intermediate lives in DecodeModel::Work's buffers (views: DecodeModel::Views), made once (and again for more rows than they hold),
// with their views for each row count made on first use. The
// residual stream x is updated in place, and each layer's closing residual add is fused with the next layer's
// input norm (the final norm after the last layer): add_rms_norm's sum is `x + h` rounded as torch rounds it and
// its norm is rms_norm's, so the bits are those of the add followed by the norm.

#include "aten_lite.h"
#include "kernels.h"

#include <ATen/ops/arange.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

namespace {

using Proj = DecodeModel::Proj;

int64_t width(const Proj& p) {
  int64_t n = 0;
  for (const auto& part : p) n += part.n;
  return n;
}

// src [B, n] -> dst [B, n] (row strides any, last dims contiguous), bf16: a projection part made elsewhere
void copy_rows(const at::Tensor& src, at::Tensor& dst) {
  TORCH_CHECK(src.sizes() == dst.sizes() && src.stride(1) == 1 && dst.stride(1) == 1, "copy_rows: shapes differ");
  const auto* sp = src.data_ptr<at::BFloat16>();
  auto* dp = dst.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < src.size(0); ++r)
    std::memcpy(dp + r * dst.stride(0), sp + r * src.stride(0), src.size(1) * sizeof(at::BFloat16));
}

// y's columns = x @ the projection's weight^T: ops/linear.py linear() on a PackedWeight, an Fp8Weight or a
// SplitWeight (its parts side by side, as torch.cat puts them); outs: one view per part (parts_of)
struct Mul {
  bool amx;
  Fp8Linear fp8;
  void operator()(const Proj& proj, const at::Tensor& x, std::vector<at::Tensor>& outs) const {
    for (size_t i = 0; i < proj.size(); ++i) {
      const DecodeModel::Part& p = proj[i];
      if (p.scales.defined())
        copy_rows(fp8(x, p.packed, p.scales, p.n, p.path), outs[i]);
      else if (amx)
        copy_rows(linear_bf16_amx(x, p.packed, p.n), outs[i]);
      else
        linear_bf16_into(x, p.packed, p.n, outs[i]);
    }
  }
};

// each part's columns of y [B, width(proj)]
std::vector<at::Tensor> parts_of(const at::Tensor& y, const Proj& proj) {
  if (proj.size() == 1) return {y};
  std::vector<at::Tensor> out;
  int64_t at = 0;
  for (const auto& p : proj) {
    out.push_back(y.narrow(1, at, p.n));
    at += p.n;
  }
  return out;
}

// the first n elements of a flat buffer as a contiguous tensor of `shape`
at::Tensor take(const at::Tensor& flat, at::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return flat.narrow(0, 0, n).view(shape);
}

// src [B, H, D] (last dim contiguous, any outer strides) -> dst, contiguous: the attention gate, which lies
// interleaved with q in the projection
void copy_heads(const at::Tensor& src, at::Tensor& dst) {
  const int64_t B = src.size(0), H = src.size(1), D = src.size(2);
  const auto* sp = src.data_ptr<at::BFloat16>();
  auto* dp = dst.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(dp + (b * H + h) * D, sp + b * src.stride(0) + h * src.stride(1), D * sizeof(at::BFloat16));
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

void check_index(const at::Tensor& t, int64_t dim, int64_t rows, const char* what) {
  TORCH_CHECK(t.dim() == dim && t.scalar_type() == at::kLong && t.is_contiguous() && t.size(0) == rows, what,
              " must be contiguous int64 with ", rows, " rows");
}

// one layer's tensors for a step of B rows: views of Work's buffers (and of the projection they come out of)
struct LayerViews {
  at::Tensor proj, mixed, gu, act, m;  // projections' outputs and the MLP's activation
  std::vector<at::Tensor> proj_parts, mixed_parts, gu_parts, m_parts;
  at::Tensor b, a, g, beta, conv_in, xc, q, k, v, o, z, core;  // a GDN layer's
  at::Tensor q_in, k_in, v_in, gate_in, qn, kn, gate, o2;       // an attention layer's (o, core shared)
};

}  // namespace

struct DecodeModel::Views {
  at::Tensor x, h, x3, h3, y, rows;  // the residual stream, its normed form (and both as [B, 1, H]), the MLP's input
  std::vector<LayerViews> layers;
};

// A verify step's rows lie in wave order, so wave j is the rows [at_j, at_j + waves[j]) of every buffer: its conv
// step reads and writes views of the step's buffers, with nothing gathered or scattered.
struct DecodeModel::Waves {
  struct Wave {
    int64_t at, n;
    at::Tensor rows, xc;  // the wave's rows of the step (indices) and of a GDN layer's conv output
  };
  std::vector<std::vector<Wave>> layers;  // [layer][wave]: empty for an attention layer
};

struct DecodeModel::Work {
  int64_t cap = 0;  // rows the buffers hold
  // flat buffers, each cap x (the widest row any layer needs)
  at::Tensor x, h, y, proj, g, beta, xc, o, gate, qn, kn, core, mixed, gu, act, m, rows;
  std::map<int64_t, Views> views;  // by row count
  std::map<std::vector<int64_t>, Waves> waves;  // by the waves' row counts
};

DecodeModel::Views& DecodeModel::views(int64_t B) const {
  if (work_ == nullptr || work_->cap < B) {  // new buffers for B rows; every view made again
    auto w = std::make_shared<Work>();
    w->cap = B;
    const int64_t H = H_;
    int64_t proj = 0, hv = 0, c = 0, o = 0, qd = 0, kn = 0, core = 0, gu = 0;  // the widest row of each buffer
    for (const Layer& l : layers_) {
      proj = std::max(proj, width(l.proj[0]));
      gu = std::max(gu, width(l.proj[2]));
      if (l.gdn) {
        hv = std::max(hv, l.dims[2]);
        c = std::max(c, l.dims[0]);
        o = std::max(o, l.dims[2] * l.dims[5]);
        core = std::max(core, l.dims[1]);
      } else {
        qd = std::max(qd, l.dims[0] * l.dims[2]);
        kn = std::max(kn, l.dims[1] * l.dims[2]);
      }
    }
    const auto bf = embed_.options(), f32 = bf.dtype(at::kFloat);
    auto buf = [&](int64_t row, const at::TensorOptions& opt) { return at::empty({B * std::max<int64_t>(row, 1)}, opt); };
    w->x = buf(H, bf), w->h = buf(H, bf), w->y = buf(H, bf), w->mixed = buf(H, bf), w->m = buf(H, bf);
    w->proj = buf(proj, bf), w->g = buf(hv, f32), w->beta = buf(hv, bf), w->xc = buf(c, bf);
    w->o = buf(std::max(o, qd), bf), w->gate = buf(qd, bf), w->qn = buf(qd, bf), w->kn = buf(kn, bf);
    w->core = buf(std::max(core, qd), bf);
    w->gu = buf(gu, bf), w->act = buf(gu / 2, bf);
    w->rows = at::arange(B, bf.dtype(at::kLong));
    work_ = std::move(w);
  }
  Work& w = *work_;
  auto found = w.views.find(B);
  if (found != w.views.end()) return found->second;
  const int64_t H = H_;
  Views v;
  v.x = take(w.x, {B, H}), v.h = take(w.h, {B, H}), v.y = take(w.y, {B, H});
  v.x3 = v.x.view({B, 1, H}), v.h3 = v.h.view({B, 1, H});
  v.rows = w.rows.narrow(0, 0, B);
  for (const Layer& l : layers_) {
    LayerViews lv;
    const int64_t pw = width(l.proj[0]);
    lv.proj = take(w.proj, {B, pw});
    lv.mixed = take(w.mixed, {B, H});
    lv.gu = take(w.gu, {B, width(l.proj[2])});
    lv.act = take(w.act, {B, width(l.proj[2]) / 2});
    lv.m = take(w.m, {B, H});
    lv.proj_parts = parts_of(lv.proj, l.proj[0]);
    lv.mixed_parts = parts_of(lv.mixed, l.proj[1]);
    lv.gu_parts = parts_of(lv.gu, l.proj[2]);
    lv.m_parts = parts_of(lv.m, l.proj[3]);
    if (l.gdn) {
      const int64_t c = l.dims[0], vd = l.dims[1], hv = l.dims[2], hk = l.dims[3], dk = l.dims[4], dv = l.dims[5];
      const int64_t kd = hk * dk;
      lv.b = lv.proj.narrow(1, c + vd, hv), lv.a = lv.proj.narrow(1, c + vd + hv, hv);
      lv.g = take(w.g, {B, hv}), lv.beta = take(w.beta, {B, hv});
      lv.conv_in = lv.proj.narrow(1, 0, c);
      lv.xc = take(w.xc, {B, c});
      lv.q = lv.xc.narrow(1, 0, kd).view({B, hk, dk});
      lv.k = lv.xc.narrow(1, kd, kd).view({B, hk, dk});
      lv.v = lv.xc.narrow(1, 2 * kd, hv * dv).view({B, hv, dv});
      lv.o = take(w.o, {B, hv, dv});
      lv.z = lv.proj.narrow(1, c, vd);
      lv.core = take(w.core, {B, vd});
    } else {
      const int64_t hq = l.dims[0], hkv = l.dims[1], d = l.dims[2];
      auto qg = lv.proj.narrow(1, 0, 2 * hq * d).view({B, hq, 2 * d});  // per head: its q, then its gate
      lv.q_in = qg.narrow(2, 0, d), lv.gate_in = qg.narrow(2, d, d);
      lv.k_in = lv.proj.narrow(1, 2 * hq * d, hkv * d).view({B, hkv, d});
      lv.v_in = lv.proj.narrow(1, (2 * hq + hkv) * d, hkv * d).view({B, hkv, d});
      lv.qn = take(w.qn, {B, hq, d}), lv.kn = take(w.kn, {B, hkv, d});
      lv.gate = take(w.gate, {B, hq * d});
      lv.o = take(w.o, {B, hq, d});
      lv.o2 = lv.o.view({B, hq * d});
      lv.core = take(w.core, {B, hq * d});
    }
    v.layers.push_back(std::move(lv));
  }
  return w.views.emplace(B, std::move(v)).first->second;
}

DecodeModel::Waves& DecodeModel::waves(int64_t B, const std::vector<int64_t>& sizes) const {
  Views& v = views(B);  // first: it may make the buffers (and the map of waves) again
  auto found = work_->waves.find(sizes);
  if (found != work_->waves.end()) return found->second;
  Waves ws;
  for (size_t li = 0; li < layers_.size(); ++li) {
    std::vector<Waves::Wave> layer;
    if (layers_[li].gdn) {
      const LayerViews& lv = v.layers[li];
      int64_t at = 0;
      for (int64_t n : sizes) {
        layer.push_back({at, n, v.rows.narrow(0, at, n), lv.xc.narrow(0, at, n)});
        at += n;
      }
    }
    ws.layers.push_back(std::move(layer));
  }
  return work_->waves.emplace(sizes, std::move(ws)).first->second;
}

DecodeModel::DecodeModel(at::Tensor embed, at::Tensor norm, double eps, bool amx, Fp8Linear fp8, int64_t vocab)
    : embed_(std::move(embed)), norm_(std::move(norm)), eps_(eps), amx_(amx), fp8_(fp8) {
  // [V, H], or a tied head packed by pack_bf16_weight [ceil(V / 16), H / 2, 16, 2] with its vocab V: that
  // packing holds every row of the embedding (a row's (2p, 2p + 1) pair at [r / 16, p, r % 16]), so the
  // model keeps no [V, H] copy beside it
  TORCH_CHECK(embed_.is_contiguous() && embed_.scalar_type() == at::kBFloat16 &&
                  (embed_.dim() == 2 || (embed_.dim() == 4 && embed_.size(2) == 16 && embed_.size(3) == 2)),
              "DecodeModel: the embedding must be contiguous bf16 [V, H] or packed [ceil(V/16), H/2, 16, 2]");
  packed_ = embed_.dim() == 4;
  V_ = packed_ ? vocab : embed_.size(0);
  H_ = packed_ ? 2 * embed_.size(1) : embed_.size(1);
  TORCH_CHECK(!packed_ || (vocab > 0 && (vocab + 15) / 16 == embed_.size(0)), "DecodeModel: a packed embedding of ",
              embed_.size(0), " row blocks does not hold a vocabulary of ", vocab);
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
  // the widths the step's buffers and views are cut to
  const int64_t H = H_, pw = width(layer.proj[0]);
  TORCH_CHECK(width(layer.proj[1]) == H && width(layer.proj[3]) == H && width(layer.proj[2]) % 2 == 0, "DecodeModel.",
              what, ": the output and down projections must give ", H, " columns, gate_up an even number");
  const auto& d = layer.dims;
  const int64_t want = layer.gdn ? d[0] + d[1] + 2 * d[2] : (2 * d[0] + 2 * d[1]) * d[2];
  TORCH_CHECK(pw == want, "DecodeModel.", what, ": the first projection gives ", pw, " columns, the dims ask ", want);
  TORCH_CHECK(!layer.gdn || d[0] == 2 * d[3] * d[4] + d[2] * d[5], "DecodeModel.", what, ": conv_dim ", d[0],
              " is not 2 Hk dk + Hv dv");
  (layer.gdn ? n_gdn_ : n_attn_) += 1;
  layers_.push_back(std::move(layer));
  work_.reset();  // the buffers' widths follow the layers
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
  return step(ids, conv, ssm, kv, slots, cos, sin, page_table, lengths, nullptr);
}

at::Tensor DecodeModel::run_verify(const at::Tensor& ids, const std::vector<at::Tensor>& conv,
                                   const std::vector<at::Tensor>& ssm, const std::vector<at::Tensor>& kv,
                                   const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& page_table, const at::Tensor& lengths,
                                   const std::vector<int64_t>& waves, const at::Tensor& order,
                                   const std::vector<at::Tensor>& log_conv,
                                   const std::vector<at::Tensor>& log_x, const std::vector<at::Tensor>& log_g,
                                   const std::vector<at::Tensor>& log_beta) const {
  const int64_t B = ids.numel();
  check_index(order, 1, B, "order");
  check_index(slots, 1, B, "slots");
  TORCH_CHECK(int64_t(conv.size()) == n_gdn_ && int64_t(ssm.size()) == n_gdn_, "DecodeModel.run_verify: ", n_gdn_,
              " conv and ssm caches");
  TORCH_CHECK(int64_t(log_conv.size()) == n_gdn_ && int64_t(log_x.size()) == n_gdn_ &&
                  int64_t(log_g.size()) == n_gdn_ && int64_t(log_beta.size()) == n_gdn_,
              "DecodeModel.run_verify: ", n_gdn_, " conv, x, g and beta logs");
  for (int64_t l = 0, li = 0; l < n_gdn_; ++li) {
    if (!layers_[li].gdn) continue;
    const at::Tensor &lc = log_conv[l], &lx = log_x[l], &lg = log_g[l], &lb = log_beta[l];
    const int64_t S = conv[l].size(0), P = lc.size(1), C = layers_[li].dims[0], hv = layers_[li].dims[2];
    TORCH_CHECK(lc.dim() == 4 && lc.is_contiguous() && lc.scalar_type() == conv[l].scalar_type() &&
                    lc.size(0) == S && lc.size(2) == conv[l].size(1) && lc.size(3) == conv[l].size(2) &&
                    conv[l].is_contiguous(),
                "log_conv[", l, "] must be a contiguous [S, positions, K-1, C] beside its conv cache");
    TORCH_CHECK(lx.dim() == 3 && lx.is_contiguous() && lx.scalar_type() == at::kBFloat16 && lx.size(0) == S &&
                    lx.size(1) == P && lx.size(2) == C,
                "log_x[", l, "] must be a contiguous bf16 [S, positions, conv_dim]");
    TORCH_CHECK(lg.dim() == 3 && lg.is_contiguous() && lg.scalar_type() == at::kFloat && lg.size(0) == S &&
                    lg.size(1) == P && lg.size(2) == hv,
                "log_g[", l, "] must be a contiguous fp32 [S, positions, Hv]");
    TORCH_CHECK(lb.dim() == 3 && lb.is_contiguous() && lb.scalar_type() == at::kBFloat16 && lb.size(0) == S &&
                    lb.size(1) == P && lb.size(2) == hv,
                "log_beta[", l, "] must be a contiguous bf16 [S, positions, Hv]");
    ++l;
  }
  // every row once, in waves of distinct slots (a wave is stepped as one decode step: a slot once)
  int64_t total = 0;
  const int64_t S = n_gdn_ ? conv[0].size(0) : 0;
  const int64_t* sl = slots.data_ptr<int64_t>();
  std::vector<int64_t> seen(std::max<int64_t>(S, 0), -1);
  for (size_t j = 0; j < waves.size(); ++j) {
    TORCH_CHECK(waves[j] >= 1, "DecodeModel.run_verify: an empty wave");
    for (int64_t i = total; i < total + waves[j] && S > 0; ++i) {
      TORCH_CHECK(sl[i] >= 0 && sl[i] < S, "slot ", sl[i], " is out of range");
      TORCH_CHECK(seen[sl[i]] != int64_t(j), "DecodeModel.run_verify: slot ", sl[i], " twice in wave ", j);
      seen[sl[i]] = int64_t(j);
    }
    total += waves[j];
  }
  TORCH_CHECK(total == B, "DecodeModel.run_verify: the waves hold ", total, " rows, the step ", B);
  std::vector<char> hit(B, 0);
  const int64_t* op = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    TORCH_CHECK(op[i] >= 0 && op[i] < B && !hit[op[i]], "DecodeModel.run_verify: order is not a permutation");
    hit[op[i]] = 1;
  }
  const Verify verify{waves, order, log_conv, log_x, log_g, log_beta};
  return step(ids, conv, ssm, kv, slots, cos, sin, page_table, lengths, &verify);
}

at::Tensor DecodeModel::step(const at::Tensor& ids, const std::vector<at::Tensor>& conv,
                             const std::vector<at::Tensor>& ssm, const std::vector<at::Tensor>& kv,
                             const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& page_table, const at::Tensor& lengths, const Verify* verify) const {
  const Mul mul{amx_, fp8_};
  const int64_t B = ids.numel();
  TORCH_CHECK(!layers_.empty(), "DecodeModel.run: a program without layers");
  TORCH_CHECK(int64_t(conv.size()) == n_gdn_ && int64_t(ssm.size()) == n_gdn_ && int64_t(kv.size()) == n_attn_,
              "DecodeModel.run: ", n_gdn_, " conv and ssm caches and ", n_attn_, " KV pools");
  check_index(ids, 1, B, "ids");
  check_index(slots, 1, B, "slots");
  check_index(lengths, 1, B, "lengths");
  check_index(page_table, 2, B, "page_table");
  for (const at::Tensor& t : conv) TORCH_CHECK(t.scalar_type() == at::kBFloat16, "conv caches must be bf16");
  for (const at::Tensor& t : ssm) TORCH_CHECK(t.scalar_type() == at::kFloat, "GDN state caches must be fp32");
  for (const at::Tensor& t : kv) TORCH_CHECK(t.scalar_type() == at::kBFloat16, "KV pools must be bf16");
  const int64_t V = V_, H = H_;
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < V, "token id ", ip[i], " is outside the vocabulary");
  auto out = at::empty({B, H}, embed_.options());  // the result: hidden [B, H] after the final norm
  if (B == 0) return out;
  Views& v = views(B);
  Waves* ws = verify != nullptr ? &waves(B, verify->waves) : nullptr;
  std::vector<at::Tensor> wave_slots;  // each wave's slots, made once for every GDN layer
  ds::GdnSpans spans;                   // each span's rows in token order (wave order: a slot's rows come in order)
  if (ws != nullptr) {
    const int64_t* sl = slots.data_ptr<int64_t>();
    std::map<int64_t, std::vector<int64_t>> by_slot;
    for (int64_t at = 0, j = 0; j < int64_t(verify->waves.size()); at += verify->waves[j++]) {
      wave_slots.push_back(slots.narrow(0, at, verify->waves[j]));
      for (int64_t i = at; i < at + verify->waves[j]; ++i) by_slot[sl[i]].push_back(i);
    }
    spans.at.push_back(0);
    for (const auto& [slot, rows] : by_slot) {
      spans.slot.push_back(slot);
      spans.rows.insert(spans.rows.end(), rows.begin(), rows.end());
      spans.at.push_back(int64_t(spans.rows.size()));
    }
  }
  const auto* ep = embed_.data_ptr<at::BFloat16>();  // F.embedding: a row copy
  auto* xp = v.x.data_ptr<at::BFloat16>();
  if (packed_) {  // row r's pairs, 16 rows apart in the packing (ops/packed.py embedding_packed)
    const auto* pp = reinterpret_cast<const uint32_t*>(ep);
    auto* xw = reinterpret_cast<uint32_t*>(xp);
    for (int64_t i = 0; i < B; ++i) {
      const uint32_t* src = pp + (ip[i] / 16) * (H / 2) * 16 + ip[i] % 16;
      for (int64_t p = 0; p < H / 2; ++p) xw[i * (H / 2) + p] = src[p * 16];
    }
  } else {
    for (int64_t i = 0; i < B; ++i) std::memcpy(xp + i * H, ep + ip[i] * H, H * sizeof(at::BFloat16));
  }
  rms_norm_into(v.x3, layers_[0].w[0], layers_[0].eps, v.h3);
  int64_t gi = 0, ai = 0;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = layers_[li];
    LayerViews& lv = v.layers[li];
    mul(l.proj[0], v.h, lv.proj_parts);
    if (l.gdn) {  // GDNMixer.forward's decode path
      at::Tensor state = ssm[gi], conv_state = conv[gi];  // updated in place
      gdn_gates_into(lv.b, lv.a, l.w[3], l.w[4], lv.g, lv.beta);
      if (ws == nullptr) {
        ds::conv_step_into(lv.conv_in, v.rows, l.w[2], conv_state, slots, lv.xc);
        ds::gdn_step_into(lv.q, lv.k, lv.v, lv.g, lv.beta, state, slots, lv.o);
      } else {
        // GDNMixer.forward's waves: each a decode step of its rows, then its states into the log. The conv steps
        // run wave by wave; the recurrent steps run span by span (gdn_span_into: a head's state block stays in
        // cache through its span's tokens instead of crossing memory once per wave). The conv and recurrent
        // states are apart, so the order between their steps changes no bits; each token's are the wave's.
        // The recurrent state is not logged: the slot keeps the state after the span's first token (first_only)
        // and the later tokens' inputs are logged (a few KB a token, where a state is a MB a layer on the 0.8B
        // shape), so a step whose drafts are all rejected writes no more state than a plain decode step.
        const at::Tensor &log_conv = verify->conv[gi], &log_x = verify->x[gi], &log_g = verify->g[gi],
                         &log_beta = verify->beta[gi];
        const int64_t positions = log_conv.size(1);
        const int64_t cb = conv_state.stride(0) * conv_state.element_size();  // a slot's bytes
        const auto* cp = static_cast<const char*>(conv_state.data_ptr());
        auto* lcp = static_cast<char*>(log_conv.data_ptr());
        const int64_t C = lv.xc.size(1), hv = lv.g.size(1);
        auto* lxp = log_x.data_ptr<at::BFloat16>();
        auto* lgp = log_g.data_ptr<float>();
        auto* lbp = log_beta.data_ptr<at::BFloat16>();
        const auto* xcp = lv.xc.data_ptr<at::BFloat16>();  // lv.xc, g, beta: contiguous [B, ...] in wave order
        const auto* gp = lv.g.data_ptr<float>();
        const auto* bp = lv.beta.data_ptr<at::BFloat16>();
        const int64_t* sl = slots.data_ptr<int64_t>();
        for (size_t j = 0; j < ws->layers[li].size(); ++j) {
          Waves::Wave& w = ws->layers[li][j];
          ds::conv_step_into(lv.conv_in, w.rows, l.w[2], conv_state, wave_slots[j], w.xc);
          for (int64_t i = w.at; i < w.at + w.n; ++i) {
            if (int64_t(j) < positions)  // the last token's conv state stays in the slot: it needs no entry
              std::memcpy(lcp + (sl[i] * positions + int64_t(j)) * cb, cp + sl[i] * cb, cb);  // log[slot, j]
            if (j >= 1 && int64_t(j) <= positions) {  // token j's recurrence inputs -> [slot, j - 1]
              const int64_t e = sl[i] * positions + int64_t(j) - 1;
              std::memcpy(lxp + e * C, xcp + i * C, C * sizeof(at::BFloat16));
              std::memcpy(lgp + e * hv, gp + i * hv, hv * sizeof(float));
              std::memcpy(lbp + e * hv, bp + i * hv, hv * sizeof(at::BFloat16));
            }
          }
        }
        spans.first_only = true;
        ds::gdn_span_into(lv.q, lv.k, lv.v, lv.g, lv.beta, state, spans, lv.o);
      }
      gated_rms_norm_into(lv.o, lv.z, l.w[5], l.eps, lv.core);
      ++gi;
    } else {  // AttentionMixer.forward's decode path
      const at::Tensor& pool = kv[ai];
      TORCH_CHECK(pool.dim() == 5 && pool.is_contiguous() && pool.size(3) == l.dims[1] && pool.size(4) == l.dims[2],
                  "kv_cache must be [P, 2, bs, Hkv, D] in x's dtype");
      qk_norm_rope_into(lv.q_in, l.w[2], l.eps, cos, sin, lv.qn);
      qk_norm_rope_into(lv.k_in, l.w[3], l.eps, cos, sin, lv.kn);
      kv_write(pool, lv.kn, lv.v_in, page_table, lengths);
      ds::paged_attention_into(lv.qn, pool, page_table, lengths, l.scale, lv.o);
      copy_heads(lv.gate_in, lv.gate);
      gate_output_into(lv.o2, lv.gate, lv.core);
      ++ai;
    }
    mul(l.proj[1], lv.core, lv.mixed_parts);
    // DecoderLayer.forward's tail: (x, h) = add_rms_norm(x, mixed, ln2); x + down(silu(gate(h)) * up(h)), whose
    // add runs with the next layer's input norm (the final norm after the last layer)
    add_rms_norm_into(v.x, lv.mixed, l.w[1], l.eps, v.x, v.y);
    mul(l.proj[2], v.y, lv.gu_parts);
    silu_mul_into(lv.gu, lv.act);
    mul(l.proj[3], lv.act, lv.m_parts);
    const bool last = li + 1 == layers_.size();
    add_rms_norm_into(v.x, lv.m, last ? norm_ : layers_[li + 1].w[0], last ? eps_ : layers_[li + 1].eps, v.x,
                      last && ws == nullptr ? out : v.h);
  }
  if (ws != nullptr) {  // the rows back in span order
    const auto* hp = v.h.data_ptr<at::BFloat16>();
    auto* rp = out.data_ptr<at::BFloat16>();
    const int64_t* op = verify->order.data_ptr<int64_t>();
    for (int64_t i = 0; i < B; ++i) std::memcpy(rp + op[i] * H, hp + i * H, H * sizeof(at::BFloat16));
  }
  return out;
}
