// Chapter 07 (07_stage1_milestone.ipynb): `linear`: x @ w.T for a decode batch's few rows.
#pragma once
#include "common.h"

namespace {

// One vector register of floats: 16 with AVX-512, 8 with AVX2, 4 otherwise (SSE, NEON), so
// that a tile's 16 running sums fit the register file. memcpy is how C++ reads a vector from
// any float address (the compiler turns it into one load).
#if defined(__AVX512F__)
#define MINISGL_LANES 16
#elif defined(__AVX__)
#define MINISGL_LANES 8
#else
#define MINISGL_LANES 4
#endif
constexpr int kLanes = MINISGL_LANES;
typedef float vecf __attribute__((vector_size(MINISGL_LANES * sizeof(float))));
inline vecf loadv(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

constexpr int kTileRows = 4;      // output features (weight rows) per tile
constexpr int kPrefetchTiles = 1;  // ask for the next tile's weight rows while computing this one

// y[m, n0 + i] = x[m] . w[n0 + i] (+ bias) for i < nn (1..4) and MM (1..4) rows of x. The 4
// weight rows are read once, one vector at a time; each chunk meets the MM rows of x (in L1
// cache) in MM x 4 vector accumulators; each accumulator is summed at the end.
template <int MM>
void linear_tile(const float* x, int64_t ldx, const float* const* wr, int64_t K,
                 int64_t prefetch, float* y, int64_t ldy, int64_t nn, const float* bias) {
  vecf acc[MM][kTileRows] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vecf a[kTileRows];
    for (int i = 0; i < kTileRows; ++i) {
      __builtin_prefetch(wr[i] + k + prefetch);
      a[i] = loadv(wr[i] + k);
    }
    for (int m = 0; m < MM; ++m) {
      const vecf xv = loadv(x + m * ldx + k);
      for (int i = 0; i < kTileRows; ++i) acc[m][i] += xv * a[i];
    }
  }
  for (int m = 0; m < MM; ++m) {
    float s[kTileRows];
    for (int i = 0; i < kTileRows; ++i) {
      s[i] = 0;
      for (int l = 0; l < kLanes; ++l) s[i] += acc[m][i][l];
      for (int64_t kk = k; kk < K; ++kk) s[i] += x[m * ldx + kk] * wr[i][kk];  // K % kLanes tail
    }
    for (int64_t i = 0; i < nn; ++i) y[m * ldy + i] = bias ? s[i] + bias[i] : s[i];
  }
}

}  // namespace

int64_t vector_lanes() { return kLanes; }  // floats per vector in linear's tiles

bool has_openmp() {  // without OpenMP, at::parallel_for runs on one thread
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

// y = x @ w.T (+ bias) for a few rows of x (a decode batch), w [N, K] in the checkpoint's
// layout: each output feature's K weights contiguous. MKL's GEMM, tuned for large products,
// reads the weight much more slowly with 2-16 rows than with one; here every weight byte is
// read once, whatever the row count, and the threads split the output features.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias) {
  check_rows(x, "x");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 2 &&
              w.stride(1) == 1, "weight must be a 2-D float32 CPU tensor [out_features, "
              "in_features] with each row contiguous (the checkpoint's layout; an input-major "
              "weight, stride(0) == 1, goes through F.linear instead)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "weight is ", w.sizes(), " but x has ", K, " features: the "
              "weight must be [out_features, ", K, "]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat32 &&
                bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N,
                "bias must be a contiguous float32 CPU vector of ", N, " values");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), tiles = (N + kTileRows - 1) / kTileRows;
  split_rows(0, tiles, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * kTileRows, nn = std::min<int64_t>(kTileRows, N - n0);
      const float* wr[kTileRows];  // a short last tile repeats its last row (never stored)
      for (int i = 0; i < kTileRows; ++i) wr[i] = wp + (n0 + std::min<int64_t>(i, nn - 1)) * ldw;
      // prefetch the next tile's rows; the last tiles prefetch their own (nothing past the end)
      const int64_t prefetch =
          n0 + (kPrefetchTiles + 1) * kTileRows <= N ? kPrefetchTiles * kTileRows * ldw : 0;
      const float* bt = bp ? bp + n0 : nullptr;
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = xp + m * ldx;
        float* ym = yp + m * N + n0;
        switch (std::min<int64_t>(4, M - m)) {
          case 4: linear_tile<4>(xm, ldx, wr, K, prefetch, ym, N, nn, bt); break;
          case 3: linear_tile<3>(xm, ldx, wr, K, prefetch, ym, N, nn, bt); break;
          case 2: linear_tile<2>(xm, ldx, wr, K, prefetch, ym, N, nn, bt); break;
          default: linear_tile<1>(xm, ldx, wr, K, prefetch, ym, N, nn, bt); break;
        }
      }
    }
  });
  return y;
}
