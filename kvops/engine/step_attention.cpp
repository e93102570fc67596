// Decode attention over the paged cache, in place: each row's K and V read through its block table, nothing
// gathered into a copy first (kvops/engine/compiled.py builds it with the other kvops/engine/step_*.cpp).

#include "step_kernels.h"

namespace kvops_step {

// Sixteen partial sums, so the compiler vectorizes the loop without reassociating it.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[j + l] * f32(b[j + l]);
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; j < n; ++j) s += a[j] * f32(b[j]);
  return s;
}

// What both decode attentions read: the shapes, K and V in the cache, the block tables and lengths, the output,
// and how many (row, KV head) items a thread takes at a time.
template <typename T>
struct DecodeView {
  int64_t rows, heads, d, bs, kv_heads, group, width, longest, grain;
  const T *q, *k, *v;
  const int64_t *table, *len;
  T* out;

  DecodeView(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens,
             at::Tensor& output)
      : rows(query.size(0)), heads(query.size(1)), d(query.size(2)), bs(cache.size(2)), kv_heads(cache.size(3)),
        group(heads / kv_heads), width(tables.size(1)), longest(0), grain(1), q(query.data_ptr<T>()),
        k(cache.data_ptr<T>()), v(k + cache.stride(0)), table(tables.data_ptr<int64_t>()),
        len(lens.data_ptr<int64_t>()), out(output.data_ptr<T>()) {
    for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, len[r]);
    grain = std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, 4 * group * longest * d));
  }
};

template <typename T>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                       const at::Tensor& lens, double scale, at::Tensor& out) {
  const auto [rows, heads, d, bs, kv_heads, group, width, longest, grain, qp, kc, vc, table, len, op] =
      DecodeView<T>(q, cache, tables, lens, out);
  at::parallel_for(0, rows * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores(group * longest);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, kvh = item % kv_heads, n = len[r];
      const int64_t* blocks = table + r * width;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < d; ++j) qf[g * d + j] = f32(qp[(r * heads + kvh * group + g) * d + j]) * scale;
      // K in place: each token's row is found through the block table, nothing is gathered
      for (int64_t t = 0; t < n; ++t) {
        const T* k = kc + ((blocks[t / bs] * bs + t % bs) * kv_heads + kvh) * d;
        for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(qf.data() + g * d, k, d);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> sums(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - top));
        sums[g] = sum;
      }
      for (int64_t t = 0; t < n; ++t) {
        const T* v = vc + ((blocks[t / bs] * bs + t % bs) * kv_heads + kvh) * d;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + t];
          float* a = acc.data() + g * d;
          for (int64_t j = 0; j < d; ++j) a[j] += p * f32(v[j]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = op + (r * heads + kvh * group + g) * d;
        const float inv = 1.f / sums[g];
        for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(acc[g * d + j] * inv);
      }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// paged_decode_impl for float with a head size of whole vectors: the same steps, each in AVX2 registers.
void paged_decode_f32(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens,
                      double scale, at::Tensor& out) {
  const auto [rows, heads, d, bs, kv_heads, group, width, longest, grain, qp, kc, vc, table, len, op] =
      DecodeView<float>(q, cache, tables, lens, out);
  at::parallel_for(0, rows * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores(group * (longest + 8));
    const int64_t stride = longest + 8;  // a group's scores, padded to whole vectors
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, kvh = item % kv_heads, n = len[r];
      const int64_t* blocks = table + r * width;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < d; ++j) qf[g * d + j] = qp[(r * heads + kvh * group + g) * d + j] * scale;
      for (int64_t t = 0; t < n; ++t) {
        const float* k = kc + ((blocks[t / bs] * bs + t % bs) * kv_heads + kvh) * d;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * d;
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
          int64_t j = 0;
          for (; j + 16 <= d; j += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j), _mm256_loadu_ps(k + j), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j + 8), _mm256_loadu_ps(k + j + 8), a1);
          }
          if (j < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j), _mm256_loadu_ps(k + j), a0);
          scores[g * stride + t] = sum8(_mm256_add_ps(a0, a1));
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float inv[64];  // 1 / the softmax's sum, a query head of the group each (GQA groups are small)
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * stride;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
        const __m256 topv = _mm256_set1_ps(top);
        __m256 sumv = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), topv));
          _mm256_storeu_ps(s + t, e);
          sumv = _mm256_add_ps(sumv, e);
        }
        float sum = sum8(sumv);
        for (; t < n; ++t) sum += (s[t] = std::exp(s[t] - top));
        inv[g] = 1.f / sum;
      }
      for (int64_t t = 0; t < n; ++t) {
        const float* v = vc + ((blocks[t / bs] * bs + t % bs) * kv_heads + kvh) * d;
        for (int64_t g = 0; g < group; ++g) {
          const __m256 p = _mm256_set1_ps(scores[g * stride + t]);
          float* a = acc.data() + g * d;
          for (int64_t j = 0; j < d; j += 8)
            _mm256_storeu_ps(a + j, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + j), _mm256_loadu_ps(a + j)));
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (r * heads + kvh * group + g) * d;
        for (int64_t j = 0; j < d; ++j) o[j] = acc[g * d + j] * inv[g];
      }
    }
  });
}
#endif


// Every cache line of the K and V rows that `paged_decode` will read from this layer's cache, on their way to the
// caches while the layer before is busy with its matmuls. Without it a decode step's attention waited on memory:
// one stream's ~100 tokens, 30 us a layer, 14 us with the same rows in cache.
void prefetch_kv(const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens) {
  const int64_t bs = cache.size(2), row_bytes = cache.size(3) * cache.size(4) * cache.element_size();
  const int64_t width = tables.size(1), rows = tables.size(0);
  const char* k = static_cast<const char*>(cache.data_ptr());
  const int64_t half = cache.stride(0) * cache.element_size();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b * bs < len[r]; ++b) {
      const int64_t tokens = std::min(bs, len[r] - b * bs);
      const char* block = k + table[r * width + b] * bs * row_bytes;
      for (int64_t line = 0; line < tokens * row_bytes; line += 64) {
        __builtin_prefetch(block + line, 0, 1);
        __builtin_prefetch(block + half + line, 0, 1);
      }
    }
}

// Decode attention: q [rows, heads, d], each row over its `lens` tokens whose blocks are `tables` [rows, width]
// in the cache [2, blocks, block_size, kv_heads, d]. Query heads share a KV head in groups (GQA).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                        const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && halves_contiguous(cache) && tables.is_contiguous() && lens.is_contiguous(),
              "paged_decode: layouts");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "paged_decode: the cache must hold the model dtype");
  auto out = at::empty_like(q);
#if defined(__AVX2__) && defined(__FMA__)
  if (q.scalar_type() == at::kFloat && q.size(2) % 8 == 0 && q.size(1) / cache.size(3) <= 64) {
    paged_decode_f32(q, cache, tables, lens, scale, out);
    return out;
  }
#endif
  if (q.scalar_type() == at::kFloat)
    paged_decode_impl<float>(q, cache, tables, lens, scale, out);
  else if (q.scalar_type() == at::kBFloat16)
    paged_decode_impl<c10::BFloat16>(q, cache, tables, lens, scale, out);
  else
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only, got ", q.scalar_type());
  return out;
}

}  // namespace kvops_step
