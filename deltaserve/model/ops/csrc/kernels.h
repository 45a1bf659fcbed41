// The kernels' entry points across translation units: the module definition (decode_kernels.cpp) binds them,
// decode_layers.cpp calls them directly.
#pragma once

#include "aten_lite.h"

#include <string>
#include <vector>

// linear_bf16.cpp
bool bf16_linear_available();
std::string kernel_isa();
at::Tensor pack_bf16_weight(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N);
void check_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N);  // TORCH_CHECKs the shapes

// linear_bf16_amx.cpp
std::string amx_linear_status();
at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N);

// norm.cpp
at::Tensor rms_norm_fused(const at::Tensor& x, const at::Tensor& w, double eps);
std::vector<at::Tensor> add_rms_norm_fused(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                              double eps);
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps);
at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos,
                        const at::Tensor& sin);

// pointwise.cpp
std::vector<at::Tensor> gdn_gates(const at::Tensor& b, const at::Tensor& a, const at::Tensor& dt_bias,
                                  const at::Tensor& neg_decay);
at::Tensor silu_mul(const at::Tensor& gu);
at::Tensor gate_output(const at::Tensor& o, const at::Tensor& gate);

// decode_layers.cpp
at::Tensor gdn_layer_decode(const at::Tensor& x, const std::vector<at::Tensor>& w, const std::vector<int64_t>& dims,
                            double eps, const at::Tensor& conv_cache, const at::Tensor& ssm_cache,
                            const at::Tensor& rows, const at::Tensor& slots, bool amx);
at::Tensor attention_layer_decode(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                  const std::vector<int64_t>& dims, double eps, double scale,
                                  const at::Tensor& kv_cache, const std::vector<at::Tensor>& step, bool amx);

// decode_kernels.cpp: the decode kernels, by name
namespace ds {
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
                           const at::Tensor& lengths, double scale);
at::Tensor gdn_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                    const at::Tensor& beta, const at::Tensor& state, const at::Tensor& slots);
at::Tensor conv_step_acc(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& wt, const at::Tensor& state,
                         const at::Tensor& slots);
}  // namespace ds
