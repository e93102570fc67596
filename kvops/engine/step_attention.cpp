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

DecodePlan plan_decode(const at::Tensor& tables, const at::Tensor& lens, int64_t bs) {
  const int64_t rows = tables.size(0), width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  DecodePlan plan;
  plan.order.resize(rows);
  for (int64_t r = 0; r < rows; ++r) plan.order[r] = r;
  auto first_block = [&](int64_t r) { return len[r] > 0 ? table[r * width] : -1 - r; };
  std::stable_sort(plan.order.begin(), plan.order.end(),
                   [&](int64_t a, int64_t b) { return first_block(a) < first_block(b); });
  for (int64_t i = 0; i < rows;) {
    const int64_t* lead = table + plan.order[i] * width;
    int64_t j = i + 1, shortest = len[plan.order[i]];
    while (j < rows && j - i < kSpanRows && first_block(plan.order[j]) == first_block(plan.order[i]))
      shortest = std::min(shortest, len[plan.order[j++]]);
    int64_t blocks = 0;  // leading blocks equal in every row of the span
    if (j - i > 1)
      for (const int64_t limit = (shortest + bs - 1) / bs; blocks < limit; ++blocks) {
        bool same = true;
        for (int64_t m = i + 1; m < j && same; ++m) same = table[plan.order[m] * width + blocks] == lead[blocks];
        if (!same) break;
      }
    plan.spans.push_back({i, j - i, std::min(blocks * bs, shortest)});
    i = j;
  }
  return plan;
}

// What the decode attention reads: the shapes, K and V in the cache, the block tables and lengths, the output,
// and how many (span, KV head) items a thread takes at a time.
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
    grain = std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, 4 * group * longest * d * kSpanRows));
  }

  // fn(t, row) for tokens [from, to) with their K (or V, from `half`) row of KV head `kvh` through a block table,
  // a block at a time, not a division per token to find its block (with it, the kernel took ~15% longer).
  template <typename Fn>
  void each_row(const T* half, const int64_t* blocks, int64_t from, int64_t to, int64_t kvh, Fn&& fn) const {
    const int64_t token_stride = kv_heads * d;
    for (int64_t t = from; t < to;) {
      const int64_t b = t / bs, end = std::min((b + 1) * bs, to);
      const T* row = half + (blocks[b] * bs + t - b * bs) * token_stride + kvh * d;
      for (; t < end; ++t, row += token_stride) fn(t, row);
    }
  }
};

// q . k over d; with `kVec` (float, d a multiple of 8) in AVX2 registers.
template <bool kVec, typename T>
inline float score(const float* q, const T* k, int64_t d) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVec) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(k + j + 8), a1);
    }
    if (j < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j), a0);
    return sum8(_mm256_add_ps(a0, a1));
  }
#endif
  return dot(q, k, d);
}

// Scores of queries [m0, m1) (rows of qf, d apart) against one K row into s[m * stride + t]. In AVX2, four queries
// a load of K, each summed as `score` sums it (the same bits): one K row's loads for four dot products.
template <bool kVec, typename T>
inline void scores_of(const float* qf, int64_t m0, int64_t m1, const T* k, int64_t d, float* s, int64_t stride,
                      int64_t t) {
  int64_t m = m0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVec) {
    for (; m + 4 <= m1; m += 4) {
      const float *q0 = qf + m * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
      __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
             a31 = a00;
      int64_t j = 0;
      for (; j + 16 <= d; j += 16) {
        const __m256 k0 = _mm256_loadu_ps(k + j), k1 = _mm256_loadu_ps(k + j + 8);
        a00 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + j), k0, a00);
        a01 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + j + 8), k1, a01);
        a10 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + j), k0, a10);
        a11 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + j + 8), k1, a11);
        a20 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + j), k0, a20);
        a21 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + j + 8), k1, a21);
        a30 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + j), k0, a30);
        a31 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + j + 8), k1, a31);
      }
      if (j < d) {
        const __m256 k0 = _mm256_loadu_ps(k + j);
        a00 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + j), k0, a00);
        a10 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + j), k0, a10);
        a20 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + j), k0, a20);
        a30 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + j), k0, a30);
      }
      s[m * stride + t] = sum8(_mm256_add_ps(a00, a01));
      s[(m + 1) * stride + t] = sum8(_mm256_add_ps(a10, a11));
      s[(m + 2) * stride + t] = sum8(_mm256_add_ps(a20, a21));
      s[(m + 3) * stride + t] = sum8(_mm256_add_ps(a30, a31));
    }
  }
#endif
  for (; m < m1; ++m) s[m * stride + t] = score<kVec>(qf + m * d, k, d);
}

// a += p * v over d.
template <bool kVec, typename T>
inline void add_scaled(float p, const T* v, float* a, int64_t d) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVec) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t j = 0; j < d; j += 8)
      _mm256_storeu_ps(a + j, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + j), _mm256_loadu_ps(a + j)));
    return;
  }
#endif
  for (int64_t j = 0; j < d; ++j) a[j] += p * f32(v[j]);
}

// The scores s[0, n) become e^(s - max) in place; returns 1 / their sum.
template <bool kVec>
inline float softmax_weights(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVec) {
    const __m256 topv = _mm256_set1_ps(top);
    __m256 sumv = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), topv));
      _mm256_storeu_ps(s + t, e);
      sumv = _mm256_add_ps(sumv, e);
    }
    sum = sum8(sumv);
  }
#endif
  for (; t < n; ++t) sum += (s[t] = std::exp(s[t] - top));
  return 1.f / sum;
}

// Each (span, KV head) item: the span's queries of that head's group scaled into `qf`, their scores over the shared
// tokens (one K row for all of them) and then over each row's own, the softmax, and V the same way. Every query's
// sums run in token order as a row at a time would, so the output is the same to the bit.
template <typename T, bool kVec>
void paged_decode_spans(const DecodeView<T>& view, const DecodePlan& plan, double scale) {
  const auto& [rows, heads, d, bs, kv_heads, group, width, longest, grain, qp, kc, vc, table, len, op] = view;
  const int64_t stride = longest + 8;  // a query's scores, padded to whole vectors
  at::parallel_for(0, static_cast<int64_t>(plan.spans.size()) * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kSpanRows * group * d), acc(kSpanRows * group * d), scores(kSpanRows * group * stride),
        inv(kSpanRows * group);
    for (int64_t item = begin; item < end; ++item) {
      const Span& span = plan.spans[item / kv_heads];
      const int64_t kvh = item % kv_heads, queries = span.count * group;
      const int64_t* members = plan.order.data() + span.first;
      for (int64_t i = 0; i < span.count; ++i)
        for (int64_t g = 0; g < group; ++g)
          for (int64_t j = 0; j < d; ++j)
            qf[(i * group + g) * d + j] = f32(qp[(members[i] * heads + kvh * group + g) * d + j]) * scale;
      const int64_t* lead = table + members[0] * width;
      view.each_row(kc, lead, 0, span.shared, kvh, [&](int64_t t, const T* k) {
        scores_of<kVec>(qf.data(), 0, queries, k, d, scores.data(), stride, t);
      });
      for (int64_t i = 0; i < span.count; ++i)
        view.each_row(kc, table + members[i] * width, span.shared, len[members[i]], kvh, [&](int64_t t, const T* k) {
          scores_of<kVec>(qf.data(), i * group, (i + 1) * group, k, d, scores.data(), stride, t);
        });
      for (int64_t m = 0; m < queries; ++m)
        inv[m] = softmax_weights<kVec>(scores.data() + m * stride, len[members[m / group]]);
      std::fill(acc.begin(), acc.begin() + queries * d, 0.f);
      view.each_row(vc, lead, 0, span.shared, kvh, [&](int64_t t, const T* v) {
        for (int64_t m = 0; m < queries; ++m) add_scaled<kVec>(scores[m * stride + t], v, acc.data() + m * d, d);
      });
      for (int64_t i = 0; i < span.count; ++i)
        view.each_row(vc, table + members[i] * width, span.shared, len[members[i]], kvh, [&](int64_t t, const T* v) {
          for (int64_t m = i * group; m < (i + 1) * group; ++m)
            add_scaled<kVec>(scores[m * stride + t], v, acc.data() + m * d, d);
        });
      for (int64_t m = 0; m < queries; ++m) {
        T* o = op + (members[m / group] * heads + kvh * group + m % group) * d;
        for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(acc[m * d + j] * inv[m]);
      }
    }
  });
}

// Every cache line of the K and V rows that `paged_decode` will read from this layer's cache, on their way to the
// caches while the layer before is busy with its matmuls; a span's shared tokens once. Without it a decode step's
// attention waited on memory: one stream's ~100 tokens, 30 us a layer, 14 us with the same rows in cache.
void prefetch_kv(const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens, const DecodePlan& plan) {
  const int64_t bs = cache.size(2), row_bytes = cache.size(3) * cache.size(4) * cache.element_size();
  const int64_t width = tables.size(1);
  const char* k = static_cast<const char*>(cache.data_ptr());
  const int64_t half = cache.stride(0) * cache.element_size();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  auto fetch = [&](int64_t r, int64_t from, int64_t to) {  // tokens [from, to) of row r
    for (int64_t t = from; t < to;) {
      const int64_t b = t / bs, tokens = std::min((b + 1) * bs, to) - t;
      const char* row = k + (table[r * width + b] * bs + t % bs) * row_bytes;
      for (int64_t line = 0; line < tokens * row_bytes; line += 64) {
        __builtin_prefetch(row + line, 0, 1);
        __builtin_prefetch(row + half + line, 0, 1);
      }
      t += tokens;
    }
  };
  for (const Span& span : plan.spans) {
    fetch(plan.order[span.first], 0, span.shared);
    for (int64_t i = 0; i < span.count; ++i) {
      const int64_t r = plan.order[span.first + i];
      fetch(r, span.shared, len[r]);
    }
  }
}

at::Tensor paged_decode_planned(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                                const at::Tensor& lens, double scale, const DecodePlan& plan) {
  TORCH_CHECK(q.is_contiguous() && halves_contiguous(cache) && tables.is_contiguous() && lens.is_contiguous(),
              "paged_decode: layouts");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "paged_decode: the cache must hold the model dtype");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    const DecodeView<float> view(q, cache, tables, lens, out);
#if defined(__AVX2__) && defined(__FMA__)
    if (view.d % 8 == 0) {
      paged_decode_spans<float, true>(view, plan, scale);
      return out;
    }
#endif
    paged_decode_spans<float, false>(view, plan, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    paged_decode_spans<c10::BFloat16, false>(DecodeView<c10::BFloat16>(q, cache, tables, lens, out), plan, scale);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> decode_spans(const at::Tensor& tables, const at::Tensor& lens, int64_t block_size) {
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "decode_spans: layouts");
  const DecodePlan plan = plan_decode(tables, lens, block_size);
  auto spans = at::empty({static_cast<int64_t>(plan.spans.size()), 3}, lens.options());
  auto out = spans.accessor<int64_t, 2>();
  for (size_t i = 0; i < plan.spans.size(); ++i) {
    out[i][0] = plan.spans[i].first;
    out[i][1] = plan.spans[i].count;
    out[i][2] = plan.spans[i].shared;
  }
  return {at::tensor(plan.order, lens.options()), spans};
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                        const at::Tensor& lens, double scale) {
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "paged_decode: layouts");
  return paged_decode_planned(q, cache, tables, lens, scale, plan_decode(tables, lens, cache.size(2)));
}

}  // namespace kvops_step
