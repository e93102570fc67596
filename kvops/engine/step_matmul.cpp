// The compiled step's float32 matmul, x [rows, k] @ w [n, k]^T, at the few rows of a decode step (kvops/engine/compiled.py
// builds it with the other kvops/engine/step_*.cpp; kvops/engine/linear.py measures it against MKL and oneDNN).

#include "step_kernels.h"

namespace kvops_step {

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
// From kPanelRows rows on, the weights go through in panels of 16 rows, each transposed on the fly into a
// buffer as [k][16] (two 8x8 transposes per 8 columns of k) while the next panel is prefetched into L2. Then one
// step of k is two vector loads of the panel and one broadcast a row of x: 6 rows x 16 columns is 12 accumulators,
// 12 multiply-adds for 2 loads and 6 broadcasts, where the 4x3 register tile of dot products these replaced took 7
// loads, 4 of them rows of x that at 16 rows no longer fit L1 (16 x 576 floats). 16 rows on one Zen 3 thread,
// weights streamed from memory: 47-54 against 33-38 GFLOP/s (docs/benchmarks.md, "Panels").
template <int64_t Stride>
inline void transpose8(const float* src, int64_t ld, float* dst) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * Stride, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * Stride, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

// `count` (<= Width) weight rows of w [count, k] into dst [k][Width], the missing rows as zeros.
template <int64_t Width>
inline void pack_panel(const float* w, int64_t count, int64_t k, float* dst) {
  int64_t j = 0;
  if (count == Width)
    for (; j + 8 <= k; j += 8)
      for (int64_t c = 0; c < Width; c += 8) transpose8<Width>(w + c * k + j, k, dst + j * Width + c);
  for (; j < k; ++j)
    for (int64_t c = 0; c < Width; ++c) dst[j * Width + c] = c < count ? w[c * k + j] : 0.f;
}

#if defined(__AVX512F__)
// With AVX-512 a panel is 32 weight rows, two 16-float registers a step of k, against up to 8 rows of x: 16
// accumulators, 16 multiply-adds for 2 loads and 8 broadcasts, twice the AVX2 kernel's work per instruction. On the
// 2-vCPU Xeon (AVX-512), one pass over SmolLM2's weights against oneDNN's in the same run: 8 rows 0.89-0.91 of its
// time (AVX2 panels 1.05-1.07), 16 rows 1.09-1.15 (1.20-1.26), where the pass is bound by reading the weights.
constexpr int64_t kPanel = 32;
constexpr int64_t kPanelX = 8;
#else
constexpr int64_t kPanel = 16;
constexpr int64_t kPanelX = 6;
#endif

#define KVOPS_PANEL_ROW(i)                                                  \
  if constexpr (R > i) {                                                    \
    const __m256 xv = _mm256_broadcast_ss(x + i * k + j);                   \
    c##i##0 = _mm256_fmadd_ps(xv, b0, c##i##0);                             \
    c##i##1 = _mm256_fmadd_ps(xv, b1, c##i##1);                             \
  }
#define KVOPS_PANEL_STORE(i)                                                \
  if constexpr (R > i) {                                                    \
    _mm256_storeu_ps(out + i * n, c##i##0);                                 \
    _mm256_storeu_ps(out + i * n + 8, c##i##1);                             \
  }

// R (<= 6) rows of x [R, k] against a packed panel: out [R, 16] at row stride n. Named registers, not arrays: with
// arrays GCC kept the accumulators in memory (26 against 56 GFLOP/s). `lines` cache lines from `next` go to L2, one
// a step of k: the next panel's rows (k lines when whole), fetched while this one computes (all at once before the
// loop instead: 10% slower, streamed from memory).
template <int R>
inline void panel_rows(const float* x, int64_t k, const float* b, float* out, int64_t n, const char* next,
                       int64_t lines) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t j = 0; j < k; ++j) {
    const __m256 b0 = _mm256_loadu_ps(b + kPanel * j), b1 = _mm256_loadu_ps(b + kPanel * j + 8);
    if (j < lines) _mm_prefetch(next + 64 * j, _MM_HINT_T1);
    KVOPS_PANEL_ROW(0) KVOPS_PANEL_ROW(1) KVOPS_PANEL_ROW(2) KVOPS_PANEL_ROW(3) KVOPS_PANEL_ROW(4)
    KVOPS_PANEL_ROW(5)
  }
  KVOPS_PANEL_STORE(0) KVOPS_PANEL_STORE(1) KVOPS_PANEL_STORE(2) KVOPS_PANEL_STORE(3) KVOPS_PANEL_STORE(4)
  KVOPS_PANEL_STORE(5)
}
#undef KVOPS_PANEL_ROW
#undef KVOPS_PANEL_STORE

#if defined(__AVX512F__)
#define KVOPS_PANEL_ROW(i)                                                  \
  if constexpr (R > i) {                                                    \
    const __m512 xv = _mm512_set1_ps(x[i * k + j]);                         \
    c##i##0 = _mm512_fmadd_ps(xv, b0, c##i##0);                             \
    c##i##1 = _mm512_fmadd_ps(xv, b1, c##i##1);                             \
  }
#define KVOPS_PANEL_STORE(i)                                                \
  if constexpr (R > i) {                                                    \
    _mm512_storeu_ps(out + i * n, c##i##0);                                 \
    _mm512_storeu_ps(out + i * n + 16, c##i##1);                            \
  }

// R (<= 8) rows of x [R, k] against a packed 32-wide panel: out [R, 32] at row stride n; the next panel's `lines`
// go to L2 two a step of k (a whole panel is 2k lines).
template <int R>
inline void panel_rows_512(const float* x, int64_t k, const float* b, float* out, int64_t n, const char* next,
                           int64_t lines) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
  for (int64_t j = 0; j < k; ++j) {
    const __m512 b0 = _mm512_loadu_ps(b + kPanel * j), b1 = _mm512_loadu_ps(b + kPanel * j + 16);
    if (2 * j < lines) {
      _mm_prefetch(next + 128 * j, _MM_HINT_T1);
      _mm_prefetch(next + 128 * j + 64, _MM_HINT_T1);
    }
    KVOPS_PANEL_ROW(0) KVOPS_PANEL_ROW(1) KVOPS_PANEL_ROW(2) KVOPS_PANEL_ROW(3) KVOPS_PANEL_ROW(4)
    KVOPS_PANEL_ROW(5) KVOPS_PANEL_ROW(6) KVOPS_PANEL_ROW(7)
  }
  KVOPS_PANEL_STORE(0) KVOPS_PANEL_STORE(1) KVOPS_PANEL_STORE(2) KVOPS_PANEL_STORE(3) KVOPS_PANEL_STORE(4)
  KVOPS_PANEL_STORE(5) KVOPS_PANEL_STORE(6) KVOPS_PANEL_STORE(7)
}
#undef KVOPS_PANEL_ROW
#undef KVOPS_PANEL_STORE
#endif

// Every row of x against one packed panel, kPanelX rows at a time; out [rows, cols] at row stride n (cols < kPanel
// for the last panel of a weight whose rows are not a multiple of it: through a scratch tile). The first rows of x
// prefetch the next panel.
inline void panel(const float* x, int64_t rows, int64_t k, const float* b, float* out, int64_t n, int64_t cols,
                  const char* next, int64_t lines) {
  float scratch[kPanelX * kPanel];
  for (int64_t r = 0; r < rows; r += kPanelX) {
    const int64_t here = std::min<int64_t>(kPanelX, rows - r);
    float* o = cols == kPanel ? out + r * n : scratch;
    const int64_t stride = cols == kPanel ? n : kPanel;
    const float* xr = x + r * k;
    const int64_t fetch = r == 0 ? lines : 0;
#if defined(__AVX512F__)
    switch (here) {
      case 8: panel_rows_512<8>(xr, k, b, o, stride, next, fetch); break;
      case 7: panel_rows_512<7>(xr, k, b, o, stride, next, fetch); break;
      case 6: panel_rows_512<6>(xr, k, b, o, stride, next, fetch); break;
      case 5: panel_rows_512<5>(xr, k, b, o, stride, next, fetch); break;
      case 4: panel_rows_512<4>(xr, k, b, o, stride, next, fetch); break;
      case 3: panel_rows_512<3>(xr, k, b, o, stride, next, fetch); break;
      case 2: panel_rows_512<2>(xr, k, b, o, stride, next, fetch); break;
      default: panel_rows_512<1>(xr, k, b, o, stride, next, fetch); break;
    }
#else
    switch (here) {
      case 6: panel_rows<6>(xr, k, b, o, stride, next, fetch); break;
      case 5: panel_rows<5>(xr, k, b, o, stride, next, fetch); break;
      case 4: panel_rows<4>(xr, k, b, o, stride, next, fetch); break;
      case 3: panel_rows<3>(xr, k, b, o, stride, next, fetch); break;
      case 2: panel_rows<2>(xr, k, b, o, stride, next, fetch); break;
      default: panel_rows<1>(xr, k, b, o, stride, next, fetch); break;
    }
#endif
    if (cols != kPanel)
      for (int64_t i = 0; i < here; ++i) std::copy(scratch + i * kPanel, scratch + i * kPanel + cols, out + (r + i) * n);
  }
}

// x [rows, k] @ w [n, k]^T panel by panel, the panels of [begin, end) on this thread.
inline void panels(const float* x, int64_t rows, const float* w, int64_t n, int64_t k, float* out, int64_t begin,
                   int64_t end) {
  thread_local std::vector<float> buffer;
  buffer.resize(kPanel * k);
  for (int64_t p = begin; p < end; ++p) {
    const int64_t o = p * kPanel, cols = std::min(kPanel, n - o);
    pack_panel<kPanel>(w + o * k, cols, k, buffer.data());
    // the next panel's rows are contiguous: k lines of 64 bytes when whole (cols * k floats)
    const char* next = reinterpret_cast<const char*>(w + (o + kPanel) * k);
    const int64_t lines = p + 1 < end ? (std::min(kPanel, n - o - kPanel) * k * 4 + 63) / 64 : 0;
    panel(x, rows, k, buffer.data(), out + o, n, cols, next, std::min(lines, kPanel / 16 * k));
  }
}
#endif
#pragma GCC pop_options

// From this many rows on, packed panels (above): one to three rows are bound by reading the weights, and a weight
// row at a time (dot_rows) reads them fastest (one pass over SmolLM2's projections at one row: 20 against 28 ms in
// panels); from four rows on the panels win (4 rows 25 against 27.5 ms, 16 rows 45 against 54 with the 4x3
// register tile they replace).
constexpr int64_t kPanelRows = 4;

// x [rows, k] @ w [n, k]^T in float32, each weight row read from memory once for all rows of x. A decode step's
// matmuls are memory-bound at a few rows, where MKL's and oneDNN's reached about half the machine's read rate;
// from four rows on, packed panels keep the loop bound by multiply-adds (docs/benchmarks.md, "The compiled step").
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
#if defined(__AVX2__) && defined(__FMA__)
  if (rows >= kPanelRows) {
    const int64_t count = (n + kPanel - 1) / kPanel;
    at::parallel_for(0, count, std::max<int64_t>(1, kGrainFlops / (2 * k * rows * kPanel)),
                     [&](int64_t begin, int64_t end) { panels(xp, rows, wp, n, k, op, begin, end); });
    return out;
  }
#endif
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainFlops / (2 * k * rows)), [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
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

}  // namespace kvops_step
