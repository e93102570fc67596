// The compiled parts of the engine's CPU step: the glue ops, the one call for all layers and the ops' registration
// (kvops/engine/compiled.py builds this with step_attention.cpp and step_matmul.cpp at engine start and caches it).
//
// A decode step of a small model is mostly small ops: per layer, the unfused step ran ~35 of them from Python,
// ~10 ms of a ~36 ms one-stream step. Here the glue between the matmuls is four ops per layer, and decode
// attention reads K/V where they lie in the paged cache instead of gathering them into a copy first.
// Everything accumulates in float; half-precision values are rounded where the unfused step rounds them.

#include "step_kernels.h"

#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>

#include <chrono>

namespace kvops_step {
namespace {

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
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * d;
      if (dp) {  // the residual, rounded as the unfused add
        const T* dr = dp + r * ds0;
        for (int64_t j = 0; j < d; ++j) xr[j] = static_cast<T>(f32(xr[j]) + f32(dr[j * ds1]));
      }
      float acc[16] = {0.f};
      int64_t j = 0;
      for (; j + 16 <= d; j += 16)
        for (int l = 0; l < 16; ++l) acc[l] += f32(xr[j + l]) * f32(xr[j + l]);
      for (; j < d; ++j) acc[j & 15] += f32(xr[j]) * f32(xr[j]);
      float ss = 0.f;
      for (int l = 0; l < 16; ++l) ss += acc[l];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
      T* o = op + r * d;
      // float: (x * inv) * w, F.rms_norm's order; half precision: w * round(x * inv), transformers' order
      for (j = 0; j < d; ++j) o[j] = static_cast<T>(f32(wp[j]) * f32(static_cast<T>(f32(xr[j]) * inv)));
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
        const T rolled = x[(j < half ? j + half : j - half) * s1];
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
  TORCH_CHECK(halves_contiguous(cache) && cos.is_contiguous() && sin.is_contiguous(), "rope_write: layouts");
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

// silu(gate) * up of the fused projection [tokens, 2 * inter]. In float32 one loop with exp8 (within 2 ulp of
// ATen's: 2 against 9 us a layer for one stream, where ATen's three ops were mostly their own dispatch); otherwise
// ATen's own ops, one call from Python instead of three, and the same bits as the unfused step.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t inter = gate_up.size(1) / 2;
#if defined(__AVX2__) && defined(__FMA__)
  if (gate_up.scalar_type() == at::kFloat && inter % 8 == 0) {
    auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
    const float* src = gate_up.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    // oneDNN's product is a transposed view (kvops/engine/linear.py): its columns are gathered eight at a time
    const int64_t rows = gate_up.size(0), s0 = gate_up.stride(0), s1 = gate_up.stride(1);
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFlops / (8 * inter)), [&](int64_t begin, int64_t end) {
      alignas(32) float g8[8], u8[8];
      for (int64_t r = begin; r < end; ++r)
        for (int64_t j = 0; j < inter; j += 8) {
          const float* g = src + r * s0 + j * s1;
          __m256 gv, uv;
          if (s1 == 1) {
            gv = _mm256_loadu_ps(g);
            uv = _mm256_loadu_ps(g + inter);
          } else {
            for (int l = 0; l < 8; ++l) g8[l] = g[l * s1], u8[l] = g[(inter + l) * s1];
            gv = _mm256_load_ps(g8);
            uv = _mm256_load_ps(u8);
          }
          // silu(g) = g / (1 + e^-g), ATen's form; e^-g capped below float's overflow
          const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.f)));
          _mm256_storeu_ps(dst + r * inter + j,
                           _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)), uv));
        }
    });
    return out;
  }
#endif
  return at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
}

// (W @ x^T)^T through oneDNN, as kvops/engine/linear.py's _onednn_linear computes it: a transposed view.
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
// gate_up, down); `onednn` picks the matmul backend kvops/engine/linear.py chose for this row count, `gemv` this file's
// own (measured faster at this row count when the step was loaded: kvops/engine/compiled.py). Returns the
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
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous() && !caches.empty(), "decode_layers: layouts");
  const DecodePlan plan = plan_decode(tables, lens, caches[0].size(2));  // one block table for every layer
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
      attn = paged_decode_planned(q, caches[i], tables, lens, scale, plan).view({rows, -1});
    }
    h = add_rms_norm(x, linear(attn, *weight(3), std::nullopt), *weight(4), eps);
    at::Tensor gate_up = linear(h, *weight(5), std::nullopt);
    if (i + 1 < caches.size()) prefetch_kv(caches[i + 1], tables, lens, plan);  // the next layer's, during the down matmul
    delta = linear(silu_mul(gate_up), *weight(6), std::nullopt);
  }
  if (delta.has_value()) x.add_(*delta);
  return {x, linear_s};
}

}  // namespace
}  // namespace kvops_step

using namespace kvops_step;

TORCH_LIBRARY(kvops_step, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor", add_rms_norm);
  m.def("rope_write(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor slots, "
        "int heads, int kv_heads) -> Tensor",
        rope_write);
  m.def("paged_decode(Tensor q, Tensor cache, Tensor tables, Tensor lens, float scale) -> Tensor", paged_decode);
  m.def("decode_spans(Tensor tables, Tensor lens, int block_size) -> (Tensor, Tensor)", decode_spans);
  m.def("silu_mul(Tensor gate_up) -> Tensor", silu_mul);
  m.def("gemv(Tensor x, Tensor w) -> Tensor", gemv);
  m.def("decode_layers(Tensor(a!) x, Tensor?[] layers, Tensor(b!)[] caches, Tensor positions, Tensor cos, "
        "Tensor sin, Tensor slots, Tensor tables, Tensor lens, int heads, int kv_heads, float scale, float eps, "
        "bool onednn, bool gemv) -> (Tensor, float)",
        decode_layers);
}
