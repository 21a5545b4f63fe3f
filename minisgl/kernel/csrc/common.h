// Chapter 07 (07_stage1_milestone.ipynb): checks and helpers shared by the kernels.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, features], got ", t.dim(), "-D");
  TORCH_CHECK(t.stride(1) == 1, name, " must be contiguous along its last dim");
}

const int64_t* index_ptr(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.dim() == 1 &&
              t.is_contiguous(), name, " must be a contiguous 1-D int64 CPU tensor");
  return t.data_ptr<int64_t>();
}

// sum(a[i] * b[i]) with 16 partial sums, so the compiler can keep them in vector registers
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = w * (x / sqrt(mean(x^2) + eps)), the order Hugging Face multiplies in
inline void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / (float)n + eps);
  for (int64_t k = 0; k < n; ++k) y[k] = w[k] * (x[k] * r);
}

void check_weight(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 1 &&
              w.is_contiguous() && w.size(0) == x.size(1),
              "weight must be a contiguous float32 CPU vector of ", x.size(1), " values");
}

// Spread [begin, end) over torch's intra-op threads when there are more than `grain` items
// (at::parallel_for: OpenMP, torch's libgomp); fewer items, a decode batch's rows, stay on the
// calling thread. OpenMP's threads spin for a few milliseconds after each call: the fastest
// hand-off on a machine with a core to spare, and a slow one when other programs take the cores
// (benchmarks/bench_omp_wait.py measures both; benchmarks/README.md, "Threads that wait").
template <typename F>
void split_rows(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

constexpr int64_t kRowGrain = 64;  // rows per thread before split_rows splits the work

}  // namespace
