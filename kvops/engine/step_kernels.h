// What the compiled step's sources (kvops/engine/step_*.cpp, built together by kvops/engine/compiled.py) share.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvops_step {

// Below this many float operations an op runs on the calling thread: waking the pool costs more.
constexpr int64_t kGrainFlops = 1 << 15;

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

// Whether K and V (cache[0], cache[1]) are each one contiguous piece, read from the strides: cache[0] would be an op
// (aten::select) in every call, 60 a step.
inline bool halves_contiguous(const at::Tensor& cache) {
  int64_t expected = 1;
  for (int64_t dim = cache.dim() - 1; dim >= 1; --dim) {
    if (cache.size(dim) != 1 && cache.stride(dim) != expected) return false;
    expected *= cache.size(dim);
  }
  return true;
}

#if defined(__AVX2__) && defined(__FMA__)
// e^x eight at a time, for x up to 88 (callers cap it; below -87.3 it is taken as -87.3, e^x then under float's
// smallest normal): Cephes's expf, within 2 ulp of std::exp, for the softmax's scores less their maximum and SiLU.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#endif

// kvops/engine/step_attention.cpp
// Decode rows whose block tables begin with the same physical blocks (a prefix they share under prefix caching):
// `count` rows listed from `first` in the plan's order, their first `shared` tokens in the same blocks. The kernel
// reads each of those K and V rows once for every query of the span, where a row at a time read the prefix once a
// row (16 rows on a 1000-token prefix read 16 MB a layer for 1 MB of K/V).
struct Span {
  int64_t first, count, shared;
};

// Spans of at most kSpanRows rows: enough to read a shared prefix once for many queries, and a step of 16 rows
// behind one prefix still makes 2 spans x 3 KV heads of work for the threads.
constexpr int64_t kSpanRows = 8;

struct DecodePlan {
  std::vector<int64_t> order;  // the step's rows, those with the same first block together
  std::vector<Span> spans;
};

// The spans of a step's decode rows, from its block tables [rows, width] and lengths: the same for every layer.
DecodePlan plan_decode(const at::Tensor& tables, const at::Tensor& lens, int64_t bs);
// The plan as tensors, for tests and profiles: the rows' order [rows] and each span's (first, count, shared) [spans, 3].
std::tuple<at::Tensor, at::Tensor> decode_spans(const at::Tensor& tables, const at::Tensor& lens, int64_t block_size);
// Decode attention: q [rows, heads, d], each row over its `lens` tokens whose blocks are `tables` [rows, width]
// in the cache [2, blocks, block_size, kv_heads, d]. Query heads share a KV head in groups (GQA).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                        const at::Tensor& lens, double scale);
at::Tensor paged_decode_planned(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                                const at::Tensor& lens, double scale, const DecodePlan& plan);
void prefetch_kv(const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens, const DecodePlan& plan);

// kvops/engine/step_matmul.cpp
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w);

}  // namespace kvops_step
