// The compiled parts of the engine's CPU step (engine/compiled.py builds this at engine start and caches it).
//
// A decode step of a small model is mostly small ops: per layer, the unfused step ran ~35 of them from Python,
// ~10 ms of a ~36 ms one-stream step. Here the glue between the matmuls is four ops per layer, and decode
// attention reads K/V where they lie in the paged cache instead of gathering them into a copy first.
// Everything accumulates in float; half-precision values are rounded where the unfused step rounds them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Below this many float operations an op runs on the calling thread: waking the pool costs more.
constexpr int64_t kGrainFlops = 1 << 15;

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

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

template <typename T>
void add_rms_norm_impl(at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, at::Tensor& out,
                       double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const int64_t ds0 = delta ? delta->stride(0) : 0, ds1 = delta ? delta->stride(1) : 0;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFlops / (4 * d)), [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * d;
      float acc[16] = {0.f};
      for (int64_t j = 0; j < d; ++j) {
        float v = f32(xr[j]);
        if (dp) {
          xr[j] = static_cast<T>(v + f32(dp[r * ds0 + j * ds1]));  // the residual, rounded as the unfused add
          v = f32(xr[j]);
        }
        h[j] = v;
        acc[j & 15] += v * v;
      }
      float ss = 0.f;
      for (int l = 0; l < 16; ++l) ss += acc[l];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
      T* o = op + r * d;
      // float: (x * inv) * w, F.rms_norm's order; half precision: w * round(x * inv), transformers' order
      for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(f32(wp[j]) * f32(static_cast<T>(h[j] * inv)));
    }
  });
}

// x += delta (when given), then RMSNorm(x) * weight. x [rows, d] contiguous, updated in place.
at::Tensor add_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "add_rms_norm: x must be a contiguous [rows, d] tensor");
  auto out = at::empty_like(x);
  const at::Tensor* dp = delta.has_value() ? &delta.value() : nullptr;
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_impl<float>(x, dp, weight, out, eps);
  else if (x.scalar_type() == at::kBFloat16)
    add_rms_norm_impl<c10::BFloat16>(x, dp, weight, out, eps);
  else
    TORCH_CHECK(false, "add_rms_norm: float32 or bfloat16 only, got ", x.scalar_type());
  return out;
}

template <typename T>
void rope_write_impl(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, at::Tensor& cache, const at::Tensor& slots, int64_t heads,
                     int64_t kv_heads, at::Tensor& q) {
  const int64_t tokens = qkv.size(0), d = cos.size(1), half = d / 2;
  const int64_t s0 = qkv.stride(0), s1 = qkv.stride(1);
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kc = cache.data_ptr<T>();
  T* vc = kc + cache.stride(0);  // K and V may be two slices of a larger pool
  T* qp = q.data_ptr<T>();
  const int64_t items = tokens * (heads + kv_heads);
  at::parallel_for(0, items, std::max<int64_t>(1, kGrainFlops / (4 * d)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / (heads + kv_heads), h = i % (heads + kv_heads);
      const T* x = src + t * s0 + h * d * s1;
      const T* c = cp + pos[t] * d;
      const T* s = sp + pos[t] * d;
      T* dst;
      if (h < heads) {
        dst = qp + (t * heads + h) * d;
      } else {
        if (slot[t] < 0) continue;  // a padding token: not written, and no query reads it
        dst = kc + (slot[t] * kv_heads + (h - heads)) * d;
      }
      // x * cos + roll(x, d/2) * sin_signed, each product rounded as the unfused step rounds it
      for (int64_t j = 0; j < d; ++j) {
        const T rolled = x[((j + half) % d) * s1];
        dst[j] = static_cast<T>(f32(static_cast<T>(f32(x[j * s1]) * f32(c[j]))) +
                                f32(static_cast<T>(f32(rolled) * f32(s[j]))));
      }
      if (h >= heads) {  // V goes to the cache as it is
        const T* v = src + t * s0 + (heads + kv_heads + (h - heads)) * d * s1;
        T* vd = vc + (slot[t] * kv_heads + (h - heads)) * d;
        for (int64_t j = 0; j < d; ++j) vd[j] = v[j * s1];
      }
    }
  });
}

// RoPE on the q and k heads of the fused projection [tokens, (heads + 2 kv_heads) * d], k and v written to the
// cache [2, blocks, block_size, kv_heads, d] at `slots` (negative: skipped); returns q [tokens, heads, d].
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor cache, const at::Tensor& slots, int64_t heads,
                      int64_t kv_heads) {
  TORCH_CHECK(cache[0].is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "rope_write: layouts");
  TORCH_CHECK(cache.scalar_type() == qkv.scalar_type(), "rope_write: the cache must hold the model dtype");
  auto q = at::empty({qkv.size(0), heads, cos.size(1)}, qkv.options());
  if (qkv.scalar_type() == at::kFloat)
    rope_write_impl<float>(qkv, positions, cos, sin, cache, slots, heads, kv_heads, q);
  else if (qkv.scalar_type() == at::kBFloat16)
    rope_write_impl<c10::BFloat16>(qkv, positions, cos, sin, cache, slots, heads, kv_heads, q);
  else
    TORCH_CHECK(false, "rope_write: float32 or bfloat16 only, got ", qkv.scalar_type());
  return q;
}

template <typename T>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                       const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t bs = cache.size(2), kv_heads = cache.size(3), group = heads / kv_heads;
  const int64_t width = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kc = cache.data_ptr<T>();
  const T* vc = kc + cache.stride(0);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, len[r]);
  const int64_t grain = std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, 4 * group * longest * d));
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

// Decode attention: q [rows, heads, d], each row over its `lens` tokens whose blocks are `tables` [rows, width]
// in the cache [2, blocks, block_size, kv_heads, d]. Query heads share a KV head in groups (GQA).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                        const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && cache[0].is_contiguous() && tables.is_contiguous() && lens.is_contiguous(),
              "paged_decode: layouts");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "paged_decode: the cache must hold the model dtype");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat)
    paged_decode_impl<float>(q, cache, tables, lens, scale, out);
  else if (q.scalar_type() == at::kBFloat16)
    paged_decode_impl<c10::BFloat16>(q, cache, tables, lens, scale, out);
  else
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only, got ", q.scalar_type());
  return out;
}

// silu(gate) * up of the fused projection [tokens, 2 * inter]: ATen's own ops, one call from Python instead of
// three, and the same bits as the unfused step.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t inter = gate_up.size(1) / 2;
  return at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
}

// Fused multiply-adds here only: the matmul's sums are not the unfused step's anyway (another order), and RoPE,
// above, must round each product as the unfused step does (-ffp-contract=off for the rest of the file).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
template <int R>
inline void dot_rows(const float* x, const float* wr, int64_t k, float* out, int64_t n) {
  float acc[R][16] = {};
  int64_t j = 0;
  for (; j + 16 <= k; j += 16)
    for (int l = 0; l < 16; ++l) {
      const float wv = wr[j + l];
      for (int r = 0; r < R; ++r) acc[r][l] += x[r * k + j + l] * wv;
    }
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += acc[r][l];
    for (int64_t t = j; t < k; ++t) sum += x[r * k + t] * wr[t];
    out[r * n] = sum;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kTiled = true;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R rows of x against C weight rows: R*C dot products of eight lanes each, all in registers for the whole of k.
// Each x load feeds C multiply-adds and each weight load R, so the loop is bound by multiply-adds, not loads.
template <int R, int C>
inline void tile(const float* x, const float* w, int64_t k, float* out, int64_t n) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * k + j);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + j);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float sum = hsum(acc[r][c]);
      for (int64_t t = j; t < k; ++t) sum += x[r * k + t] * w[c * k + t];
      out[r * n + c] = sum;
    }
}

// Every row of x against C weight rows, four rows at a time while those weight rows sit in L1.
template <int C>
inline void tile_rows(const float* x, const float* w, int64_t rows, int64_t k, float* out, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile<4, C>(x + r * k, w, k, out + r * n, n);
  switch (rows - r) {
    case 1: tile<1, C>(x + r * k, w, k, out + r * n, n); break;
    case 2: tile<2, C>(x + r * k, w, k, out + r * n, n); break;
    case 3: tile<3, C>(x + r * k, w, k, out + r * n, n); break;
    default: break;
  }
}
#else
constexpr bool kTiled = false;
#endif
#pragma GCC pop_options

// Weight rows a tile of the tiled matmul: 4x3 measured best of 4x2, 3x4, 2x6, 6x2 and 8x1 at 4-32 rows (4x3 and
// 3x4 alike; 6x2 runs out of registers).
constexpr int64_t kTileCols = 3;
// Below this many rows a weight row at a time (dot_rows): at one to three rows the tile gained nothing.
constexpr int64_t kTileRows = 4;

// x [rows, k] @ w [n, k]^T in float32, each weight row read from memory once for all rows of x. A decode step's
// matmuls are memory-bound at a few rows, where MKL's and oneDNN's reached about half the machine's read rate;
// from four rows on, register tiles keep the loop bound by multiply-adds (docs/benchmarks.md, "The compiled step").
at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && x_in.scalar_type() == at::kFloat,
              "gemv: float32 only");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = w.size(0), k = w.size(1);
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;  // a chunked-prefill step that samples nothing
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool tiled = kTiled && rows >= kTileRows;
  const int64_t cols = tiled ? kTileCols : 1;
  const int64_t tiles = (n + cols - 1) / cols;
  const int64_t grain = std::max<int64_t>(1, kGrainFlops / (2 * k * rows * cols));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o = t * cols;
#if defined(__AVX2__) && defined(__FMA__)
      if (tiled) {
        if (o + kTileCols <= n) {
          tile_rows<kTileCols>(xp, wp + o * k, rows, k, op + o, n);
        } else {
          for (int64_t c = o; c < n; ++c) tile_rows<1>(xp, wp + c * k, rows, k, op + c, n);
        }
        continue;
      }
#endif
      const float* wr = wp + o * k;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) dot_rows<4>(xp + r * k, wr, k, op + r * n + o, n);
      switch (rows - r) {
        case 1: dot_rows<1>(xp + r * k, wr, k, op + r * n + o, n); break;
        case 2: dot_rows<2>(xp + r * k, wr, k, op + r * n + o, n); break;
        case 3: dot_rows<3>(xp + r * k, wr, k, op + r * n + o, n); break;
        default: break;
      }
    }
  });
  return out;
}

// (W @ x^T)^T through oneDNN, as engine/linear.py's _onednn_linear computes it: a transposed view.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{w, x, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack.back().toTensor().t();
}

// The decoder layers of a step whose every token decodes, with every layer's cache in the model dtype: one call
// instead of one per op. `layers` holds seven tensors a layer (input norm, qkv, qkv bias or None, o, post norm,
// gate_up, down); `onednn` picks the matmul backend engine/linear.py chose for this row count, `gemv` this file's
// own (measured faster at this row count when the step was loaded: engine/compiled.py). Returns the
// residual stream after the last layer and the seconds spent in matmuls (the dispatch's drift watch reads them).
std::tuple<at::Tensor, double> decode_layers(at::Tensor x, const c10::List<std::optional<at::Tensor>>& layers,
                                             const std::vector<at::Tensor>& caches, const at::Tensor& positions,
                                             const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                                             const at::Tensor& tables, const at::Tensor& lens, int64_t heads,
                                             int64_t kv_heads, double scale, double eps, bool onednn,
                                             bool use_gemv) {
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == 7 * static_cast<int64_t>(caches.size()),
              "decode_layers: seven tensors a layer");
  double linear_s = 0.0;
  auto linear = [&](const at::Tensor& in, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
    const auto started = std::chrono::steady_clock::now();
    at::Tensor out;
    if (use_gemv) {
      RECORD_FUNCTION("kvops_step::gemv", std::vector<c10::IValue>());  // seen by torch.profiler as a matmul
      out = gemv(in, w);
    } else {
      out = onednn ? onednn_linear(in, w) : at::linear(in, w);
    }
    if (bias.has_value()) out = out + *bias;
    linear_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return out;
  };
  const int64_t rows = x.size(0);
  std::optional<at::Tensor> delta;
  for (size_t i = 0; i < caches.size(); ++i) {
    auto weight = [&](size_t k) { return layers.get(7 * i + k); };
    at::Tensor h = add_rms_norm(x, delta, *weight(0), eps);
    at::Tensor qkv = linear(h, *weight(1), weight(2));
    at::Tensor q;
    {
      RECORD_FUNCTION("kvops_step::rope_write", std::vector<c10::IValue>());
      q = rope_write(qkv, positions, cos, sin, caches[i], slots, heads, kv_heads);
    }
    at::Tensor attn;
    {
      RECORD_FUNCTION("kvops_step::paged_decode", std::vector<c10::IValue>());
      attn = paged_decode(q, caches[i], tables, lens, scale).view({rows, -1});
    }
    h = add_rms_norm(x, linear(attn, *weight(3), std::nullopt), *weight(4), eps);
    delta = linear(silu_mul(linear(h, *weight(5), std::nullopt)), *weight(6), std::nullopt);
  }
  if (delta.has_value()) x.add_(*delta);
  return {x, linear_s};
}

}  // namespace

TORCH_LIBRARY(kvops_step, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor", add_rms_norm);
  m.def("rope_write(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor slots, "
        "int heads, int kv_heads) -> Tensor",
        rope_write);
  m.def("paged_decode(Tensor q, Tensor cache, Tensor tables, Tensor lens, float scale) -> Tensor", paged_decode);
  m.def("silu_mul(Tensor gate_up) -> Tensor", silu_mul);
  m.def("gemv(Tensor x, Tensor w) -> Tensor", gemv);
  m.def("decode_layers(Tensor(a!) x, Tensor?[] layers, Tensor(b!)[] caches, Tensor positions, Tensor cos, "
        "Tensor sin, Tensor slots, Tensor tables, Tensor lens, int heads, int kv_heads, float scale, float eps, "
        "bool onednn, bool gemv) -> (Tensor, float)",
        decode_layers);
}
