// argmax_rows: greedy sampling's argmax over each logits row, torch.argmax(x, dim=-1)'s answer exactly (the first
// maximal element; a NaN counts as larger than any number, so a row with a NaN gives its first NaN). ATen's CPU
// argmax is a scalar loop; here two passes over a row that stays in L1: its maximum, then where it first occurs.
// Comparisons only, so every build gives the same answer; sampler.py falls back to torch.argmax where the kernels
// are not loaded.

#include "aten_lite.h"
#include "kernels.h"

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

int64_t argmax_row(const float* x, int64_t V) {
  int64_t i = 0;
  float mx = -INFINITY;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 un = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(v, m);  // a NaN in v leaves m as it was
  }
  mx = _mm512_reduce_max_ps(m);
  nan = un != 0;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 m = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(v, m);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float l : lanes) mx = l > mx ? l : mx;
  nan = _mm256_movemask_ps(un) != 0;
#endif
  for (; i < V; ++i) {
    nan = nan || std::isnan(x[i]);
    mx = x[i] > mx ? x[i] : mx;
  }
  for (int64_t j = 0; j < V; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == mx) return j;
  return 0;  // not reached: some element is the maximum (or the NaN)
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "argmax_rows: x must be fp32 [N, V > 0] with a contiguous last dim");
  const int64_t N = x.size(0), V = x.size(1), s = x.stride(0);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) op[r] = argmax_row(xp + r * s, V);
  return out;
}
