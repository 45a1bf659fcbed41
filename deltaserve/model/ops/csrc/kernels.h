// The kernels' entry points across translation units: the module definition (decode_kernels.cpp) binds them,
// decode_layers.cpp calls them directly.
#pragma once

#include "aten_lite.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

// The linears (linear_bf16.cpp, linear_bf16_amx.cpp, linear_fp8.cpp) split a call of kSerialBelow multiply-adds or
// more over the threads, a smaller one stays on the calling thread, where waking the others costs more than the
// work. At 2^16 a tiny model's batch-1 projections (256 x 256 and up) are parallel (at 2^19 they were not). On a
// host whose cores are taken by other processes every parallel region waits for its threads to be scheduled (a
// tiny decode step took 277 ms instead of ~3 ms, docs/cpu.md): serve with --num-threads 1 there.
constexpr int64_t kSerialBelow = int64_t(1) << 16;

namespace ds {
// body(b0, b1) over [0, n) in pieces of `chunk`, each taken by whichever thread is free next (a shared counter),
// so a thread that another process or tenant holds up takes fewer. With a static split of the column blocks in
// halves each of two threads waited 11-14% of a 0.8B-shape batch-1 decode step at the joins (perf, AMD EPYC Zen 4;
// 3-7% with pieces). The step gained ~2% on a quiet host (the other thread streams faster while one waits) and ~12%
// with a busy process on one of the two cores (docs/cpu.md). serial: all on the calling thread. Which thread
// computes a piece never changes its bits: each column's sum is its own.
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, bool serial, const F& body) {
  const int64_t pieces = (n + chunk - 1) / chunk;
  const int64_t threads = serial ? 1 : std::min<int64_t>(at::get_num_threads(), pieces);
  if (threads <= 1) {
    if (n > 0) body(int64_t(0), n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < pieces;
         c = next.fetch_add(1, std::memory_order_relaxed))
      body(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// a linear's piece of column blocks. One row tile (decode sizes, bound by memory): about eight pieces per thread,
// each a whole number of tiles (`tile` blocks wide) and at most `most` blocks. More rows (prefill, bound by the
// arithmetic): one even piece per thread, as a static split makes them, so that a thread's blocks stay together in
// panels that every row tile reuses from L2 (pieces of a few blocks made a 0.8B-shape prefill ~2% slower).
inline int64_t chunk_blocks(int64_t nblk, int64_t tile, int64_t most, bool one_row_tile) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (!one_row_tile) return std::max<int64_t>(1, (nblk + threads - 1) / threads);
  const int64_t per = nblk / (8 * threads);
  return std::max<int64_t>(tile, std::min<int64_t>(most, (per + tile - 1) / tile * tile));
}

// n zeroed floats starting on a 64-byte line, freed at scope end: a kernel's scratch read as whole vectors (a
// std::vector's storage is only 16-byte aligned, and a vector load across two lines costs two). An empty one
// (n = 0) allocates nothing until ensure.
class LineBuffer {
 public:
  explicit LineBuffer(size_t n = 0) {
    if (n > 0) ensure(n);
  }
  ~LineBuffer() { std::free(p_); }
  LineBuffer(const LineBuffer&) = delete;
  LineBuffer& operator=(const LineBuffer&) = delete;
  float* data() { return p_; }
  float& operator[](size_t i) { return p_[i]; }
  // room for at least n floats: the contents are kept when n fits, else the buffer is replaced by a zeroed one
  void ensure(size_t n) {
    if (n <= n_ && p_ != nullptr) return;
    std::free(p_);
    p_ = static_cast<float*>(std::aligned_alloc(64, (std::max<size_t>(n, 1) * sizeof(float) + 63) / 64 * 64));
    TORCH_CHECK(p_ != nullptr, "out of memory for a ", n, "-float kernel buffer");
    std::memset(p_, 0, n * sizeof(float));
    n_ = n;
  }

 private:
  float* p_ = nullptr;
  size_t n_ = 0;
};
}  // namespace ds

// linear_bf16.cpp
bool bf16_linear_available();
std::string kernel_isa();
at::Tensor pack_bf16_weight(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N);
void linear_bf16_into(const at::Tensor& x, const at::Tensor& packed, int64_t N, at::Tensor& y);  // y: any row stride
void check_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N);  // TORCH_CHECKs the shapes

// linear_bf16_amx.cpp
std::string amx_linear_status();
at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N);

// norm.cpp, pointwise.cpp: each kernel also as an _into form that writes the caller's tensors (the decode program's
// buffers) instead of allocating its result
at::Tensor rms_norm_fused(const at::Tensor& x, const at::Tensor& w, double eps);
void rms_norm_into(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y);  // [R, H, D]
std::vector<at::Tensor> add_rms_norm_fused(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                              double eps);
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w, double eps, at::Tensor& s,
                       at::Tensor& y);  // s may be x
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps);
void gated_rms_norm_into(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps, at::Tensor& y);
at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos,
                        const at::Tensor& sin);
void qk_norm_rope_into(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& y);

// pointwise.cpp
std::vector<at::Tensor> gdn_gates(const at::Tensor& b, const at::Tensor& a, const at::Tensor& dt_bias,
                                  const at::Tensor& neg_decay);
void gdn_gates_into(const at::Tensor& b, const at::Tensor& a, const at::Tensor& dt_bias, const at::Tensor& neg_decay,
                    at::Tensor& g, at::Tensor& beta);
at::Tensor silu_mul(const at::Tensor& gu);
void silu_mul_into(const at::Tensor& gu, at::Tensor& y);
at::Tensor gate_output(const at::Tensor& o, const at::Tensor& gate);
void gate_output_into(const at::Tensor& o, const at::Tensor& gate, at::Tensor& y);
void silu_into(const at::Tensor& acc, at::Tensor& out);

// prefill_attention.cpp: one sequence's prefill chunk (ops/attention.py prefill_attention's contract), the
// x86 builds (available() says whether this build has it; the generic one has not)
bool prefill_attention_available();
at::Tensor prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t pos,
                                  double scale);

// gdn_prefill.cpp: one sequence's chunked gated delta rule (ops/gdn.py chunk_gated_delta_rule's contract with
// use_qk_l2norm), the x86 builds; state [H, dv, dk] fp32 updated in place, out written, the states after
// the chunks ending at states_at returned
bool gdn_prefill_available();
std::vector<at::Tensor> gdn_chunk_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                          int64_t start_pos, at::Tensor& out, const std::vector<int64_t>& states_at);

// conv_prefill.cpp: one sequence's causal conv with its silu (ops/conv.py causal_conv1d_prefill, no bias), every
// build: x [L, C], wt [K, C] fp32 (tap-major), state [K-1, C] in x's dtype -> out [L, C]
at::Tensor conv1d_prefill(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& state);
namespace ds {
// rows [t0, t1) of that conv and silu over cat(state [K-1, C], x [*, C] with row stride xs) into out (row stride
// os); acc: C floats of scratch. The decode step (conv1d_step) runs one row of it per sequence.
void conv_rows(const float* x, int64_t xs, const float* state, const float* w, int64_t K, int64_t C, int64_t t0,
               int64_t t1, float* out, int64_t os, float* acc);
void conv_rows(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* state, const float* w, int64_t K, int64_t C,
               int64_t t0, int64_t t1, c10::BFloat16* out, int64_t os, float* acc);
}  // namespace ds

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);

// linear_fp8.cpp (its own extension): the decode program calls it through a pointer handed over in a capsule
// (linear_fp8_capsule), so an fp8 projection runs the very code ops/fp8.py's Fp8Weight.linear runs
using Fp8Linear = at::Tensor (*)(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                                 const std::string& path);
constexpr const char* kFp8LinearCapsule = "deltaserve.linear_fp8";

// decode_layers.cpp: a decode-only step of the whole model (model/fused.py builds one per model)
class DecodeModel {
 public:
  // One part of a projection's output rows: a bf16 weight packed by pack_bf16_weight (scales undefined), or an
  // fp8 one packed by pack_fp8_weight with its scales and linear_fp8 path. A projection of several parts (a
  // SplitWeight: Qwen's FP8 in_proj keeps its b and a rows in bf16) is their products concatenated.
  struct Part {
    at::Tensor packed, scales;
    int64_t n;
    std::string path;
  };
  using Proj = std::vector<Part>;
  // fp8: linear_fp8, or nullptr for a model without fp8 weights
  DecodeModel(at::Tensor embed, at::Tensor norm, double eps, bool amx, Fp8Linear fp8, int64_t vocab = 0);
  // w: ln1, ln2, conv_wt [K, C] fp32, dt_bias, neg_decay, norm_w; proj: in_proj, out_proj, gate_up, down;
  // dims: conv_dim, value_dim, Hv, Hk, dk, dv
  void add_gdn(std::vector<at::Tensor> w, std::vector<Proj> proj, std::vector<int64_t> dims, double eps);
  // w: ln1, ln2, q_norm, k_norm; proj: qkv_proj, o_proj, gate_up, down; dims: Hq, Hkv, D
  void add_attention(std::vector<at::Tensor> w, std::vector<Proj> proj, std::vector<int64_t> dims, double eps,
                     double scale);
  // ids [B] -> hidden [B, H] after the final norm; conv / ssm: the GDN layers' caches in layer order, kv the
  // attention layers'; slots [B] GDN slots; cos, sin [B, R]; page_table [B, maxp], lengths [B] (pos + 1)
  at::Tensor run(const at::Tensor& ids, const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm,
                 const std::vector<at::Tensor>& kv, const at::Tensor& slots, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& page_table, const at::Tensor& lengths) const;
  // A step of verify spans (a decode span of several tokens: docs/speculative.md): a row per token, in wave order
  // (wave j holds the j-th token of every span that long; waves[j] its row count, each wave's slots distinct),
  // every per-row argument in that order (slots, cos, sin, page_table and lengths: the token's span's slot and page
  // table, its position + 1). The GDN layers step each wave's conv as a decode step steps its rows and copy the
  // conv states into log_conv[l] [S, positions, K-1, C] at [slot, j] for j < positions; the recurrent state of a
  // slot is left after its span's first token (the later tokens step a copy), and the recurrence's inputs of token
  // j >= 1 go to log_x[l] [S, positions, C] (the conv output: q | k | v), log_g[l] and log_beta[l] [S, positions, Hv]
  // at [slot, j - 1], from which a rollback replays the accepted tokens (CacheStore.log_states: the same log).
  // order[i]: the row of the step (span order) wave row i is; the result [B, H] is in span order.
  at::Tensor run_verify(const at::Tensor& ids, const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm,
                        const std::vector<at::Tensor>& kv, const at::Tensor& slots, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& page_table, const at::Tensor& lengths,
                        const std::vector<int64_t>& waves, const at::Tensor& order,
                        const std::vector<at::Tensor>& log_conv, const std::vector<at::Tensor>& log_x,
                        const std::vector<at::Tensor>& log_g, const std::vector<at::Tensor>& log_beta) const;

 private:
  struct Layer {
    bool gdn;
    std::vector<at::Tensor> w;
    std::vector<Proj> proj;
    std::vector<int64_t> dims;
    double eps, scale;
  };
  struct Work;   // a step's buffers (decode_layers.cpp)
  struct Views;  // their views for one row count
  struct Waves;  // their views for one cut of the rows into waves
  struct Verify {  // run_verify's waves, row order and state log (conv states; the recurrence's inputs)
    const std::vector<int64_t>& waves;
    const at::Tensor& order;
    const std::vector<at::Tensor>&conv, &x, &g, &beta;
  };
  // run (verify == nullptr) and run_verify
  at::Tensor step(const at::Tensor& ids, const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm,
                  const std::vector<at::Tensor>& kv, const at::Tensor& slots, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& page_table, const at::Tensor& lengths,
                  const Verify* verify) const;
  Waves& waves(int64_t B, const std::vector<int64_t>& sizes) const;
  void add(Layer layer, size_t nw, size_t ndims, const char* what);
  Views& views(int64_t B) const;  // made on first use (the buffers too, when they hold fewer than B rows)
  at::Tensor embed_, norm_;
  bool packed_ = false;  // embed_ is a tied head's linear_bf16 packing
  int64_t V_ = 0, H_ = 0;
  double eps_;
  bool amx_;
  Fp8Linear fp8_;
  std::vector<Layer> layers_;
  int64_t n_gdn_ = 0, n_attn_ = 0;
  // Every intermediate of a step lives in buffers made once and kept (a tiny model's step spent ~40% of its time
  // making and freeing ~200 small tensors), sized for the most rows seen, with views per row count made on
  // first use. mutable: run() is const to its callers; one engine thread calls it at a time (the GIL is held).
  mutable std::shared_ptr<Work> work_;
};

// decode_kernels.cpp: the decode kernels by name, writing the caller's tensors
namespace ds {
void paged_attention_into(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
                          const at::Tensor& lengths, double scale, at::Tensor& out);
void gdn_step_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots, at::Tensor& out);
// The tokens of spans (rows of q, k, v, g, beta, out): span s is rows[at[s] .. at[s + 1]) in token order, on
// state slot slot[s]. first_only (a verify step): the slot keeps the state after the span's first token, and the
// later tokens step a copy of it (their outputs only); a rollback replays the kept ones from their logged inputs.
// Each token's bits are gdn_step_into's for that token alone.
struct GdnSpans {
  std::vector<int64_t> at, rows, slot;
  bool first_only = false;
};
void gdn_span_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, at::Tensor& state, const GdnSpans& spans, at::Tensor& out);
void conv_step_into(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& wt, at::Tensor& state,
                    const at::Tensor& slots, at::Tensor& out);
}  // namespace ds
