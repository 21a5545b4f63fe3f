// Chapter 07 (07_stage1_milestone.ipynb): checks and helpers shared by the kernels.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
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

// Split [begin, end) into one chunk per thread (each more than `grain` items), as
// at::parallel_for does, but run the other chunks on torch's inter-op threads (at::launch),
// which sleep while they wait. at::parallel_for's OpenMP threads instead spin for about 3 ms
// after each call; on a busy machine a spinning thread that loses its core makes the next call
// wait for its next time slice, and a decode step makes 121 such calls
// (benchmarks/bench_omp_wait.py: 4-5x slower than one thread, against about 1x here).
template <typename F>
void split_rows(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  const int64_t threads = n > grain ? std::min<int64_t>(at::get_num_threads(),
                                                       (n + grain - 1) / std::max<int64_t>(grain, 1))
                                     : 1;
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) f(begin, end);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  std::mutex m;
  std::condition_variable done;
  int64_t left = threads - 1;
  std::exception_ptr error;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t lo = begin + t * chunk, hi = std::min(end, lo + chunk);
    at::launch([&, lo, hi] {
      std::exception_ptr e;
      if (lo < hi) {
        try { f(lo, hi); } catch (...) { e = std::current_exception(); }
      }
      std::lock_guard<std::mutex> g(m);  // notify while holding the lock: the caller may
      if (e) error = e;                   // return (and free m, done) as soon as it is released
      --left;
      done.notify_one();
    });
  }
  std::exception_ptr mine;
  try { f(begin, std::min(end, begin + chunk)); } catch (...) { mine = std::current_exception(); }
  std::unique_lock<std::mutex> g(m);
  done.wait(g, [&] { return left == 0; });
  if (mine) std::rethrow_exception(mine);
  if (error) std::rethrow_exception(error);
}

constexpr int64_t kRowGrain = 64;  // rows per thread before split_rows splits the work

}  // namespace
