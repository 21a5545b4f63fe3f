// Chapter 07 (07_stage1_milestone.ipynb): the fused CPU kernels, in C++.
//
// Each function does in one pass over the data what the torch ops of one layer do in several:
// an RMSNorm is about nine tensor operations (add, pow, mean, rsqrt, mul, ...), each paying the
// dispatcher, an output allocation and a trip through memory; here it is one loop. Every
// function checks its inputs (float32, CPU, rows contiguous in the last dim, consistent shapes,
// slots inside the pool) and raises a clear error instead of touching memory it does not own.
// Rows are spread over threads with at::parallel_for only when there are enough of them
// (prefill); a decode batch runs on the calling thread. `linear` is the exception: a decode
// batch's matmul splits the weight's output features over the threads, since reading the weight
// is the whole cost. The PYBIND11_MODULE block at the end names what Python can call.
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

constexpr int64_t kRowGrain = 64;  // rows per thread before parallel_for splits the work

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
  at::parallel_for(0, tiles, 16, [&](int64_t lo, int64_t hi) {
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

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_weight(x, weight);
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0);
  auto y = torch::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) norm_row(xp + t * xs, wp, yp + t * H, H, (float)eps);
  });
  return y;
}

torch::Tensor fused_add_rmsnorm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_weight(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual ", residual.sizes(),
              " and x ", x.sizes(), " must have the same shape");
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  auto y = torch::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      float* r = rp + t * rs;
      const float* a = xp + t * xs;
      for (int64_t k = 0; k < H; ++k) r[k] += a[k];
      norm_row(r, wp, yp + t * H, H, (float)eps);
    }
  });
  return y;
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim (", x.size(1), ") must be even: [gate | up]");
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto y = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + I;
      float* o = yp + t * I;
      for (int64_t k = 0; k < I; ++k) o[k] = g[k] / (1.0f + std::exp(-g[k])) * u[k];
    }
  });
  return y;
}

void rope_inplace(torch::Tensor positions, torch::Tensor x, torch::Tensor cos_sin,
                  int64_t head_size) {
  check_rows(x, "x");
  check_rows(cos_sin, "cos_sin_cache");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.size(1) == head_size,
              "cos_sin_cache must be contiguous [max_position, head_size=", head_size, "]");
  TORCH_CHECK(head_size % 2 == 0 && x.size(1) % head_size == 0, "x's last dim (", x.size(1),
              ") must be a multiple of the (even) head_size ", head_size);
  // the batch's positions are int32: read them as they are (no copy per layer)
  auto pos = positions.contiguous();
  TORCH_CHECK(pos.device().is_cpu() && pos.dim() == 1 &&
              (pos.scalar_type() == torch::kInt32 || pos.scalar_type() == torch::kInt64),
              "positions must be a 1-D int32 or int64 CPU tensor");
  const bool wide = pos.scalar_type() == torch::kInt64;
  const int32_t* p32 = wide ? nullptr : pos.data_ptr<int32_t>();
  const int64_t* p64 = wide ? pos.data_ptr<int64_t>() : nullptr;
  auto position = [&](int64_t t) -> int64_t { return wide ? p64[t] : p32[t]; };
  const int64_t T = x.size(0), H = x.size(1) / head_size, half = head_size / 2;
  TORCH_CHECK(pos.size(0) == T, "positions has ", pos.size(0), " entries, x has ", T, " rows");
  const int64_t P = cos_sin.size(0), xs = x.stride(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(position(t) >= 0 && position(t) < P, "position ", position(t),
                " is outside the rope table (", P, " positions): raise max_position");
  float* xp = x.data_ptr<float>();
  const float* cp = cos_sin.data_ptr<float>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* c = cp + position(t) * head_size;
      const float* s = c + half;
      for (int64_t h = 0; h < H; ++h) {
        float* v = xp + t * xs + h * head_size;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * c[i] - x2 * s[i];
          v[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

// Decode attention over the paged pool, one query per request. The caller has already written
// this step's k, v into the pool (store_kv: the pool has one writer), so request b attends to
// slots kv_slots[b*L .. b*L + seq_lens[b]), its new token included.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor kv_slots, torch::Tensor seq_lens, int64_t max_kv_len,
                               int64_t head_dim) {
  check_rows(q, "q");
  check_rows(k_cache, "k_cache");
  check_rows(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must be contiguous "
              "[slots, Hkv * head_dim] views of the same shape");
  const int64_t B = q.size(0), D = head_dim, row = k_cache.size(1), S = k_cache.size(0);
  TORCH_CHECK(D > 0 && row % D == 0 && q.size(1) % row == 0, "q [B, Hq*D] and the caches "
              "[slots, Hkv*D] must agree with head_dim ", D, " and Hq a multiple of Hkv");
  const int64_t Hkv = row / D, Hq = q.size(1) / D, G = Hq / Hkv, L = max_kv_len;
  const int64_t* slots = index_ptr(kv_slots, "kv_slots");
  const int64_t* lens = index_ptr(seq_lens, "seq_lens");
  TORCH_CHECK(seq_lens.size(0) == B && kv_slots.size(0) == B * L, "decode metadata must have "
              "one seq_len per request and B * L kv_slots (B=", B, ", L=", L, ")");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= L, "seq_len ", lens[b], " must be in 1..", L);
    for (int64_t j = 0; j < lens[b]; ++j)
      TORCH_CHECK(slots[b * L + j] >= 0 && slots[b * L + j] < S, "kv slot ", slots[b * L + j],
                  " is outside the pool (", S, " slots)");
  }
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  auto o = torch::empty({B, Hq * D}, q.options());
  const float scale = 1.0f / std::sqrt((float)D);
  const float* qp = q.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const int64_t qs = q.stride(0);
  // one task per (request, KV head): its G query heads read each key and value row once
  at::parallel_for(0, B * Hkv, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> p(G * L);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv, n = lens[b];
      const int64_t* sl = slots + b * L;
      const float* qh = qp + b * qs + hk * G * D;  // the G query heads of KV head hk
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = kc + sl[j] * row + hk * D;
        for (int64_t g = 0; g < G; ++g) p[g * L + j] = dot(qh + g * D, kj, D) * scale;
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the request's keys
        float* pg = p.data() + g * L;
        float m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < n; ++j) m = std::max(m, pg[j]);
        for (int64_t j = 0; j < n; ++j) sum += (pg[j] = std::exp(pg[j] - m));
        for (int64_t j = 0; j < n; ++j) pg[j] /= sum;
      }
      float* oh = op + b * Hq * D + hk * G * D;
      std::fill(oh, oh + G * D, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = vc + sl[j] * row + hk * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * L + j];
          float* og = oh + g * D;
          for (int64_t d = 0; d < D; ++d) og[d] += w * vj[d];
        }
      }
    }
  });
  return o;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rmsnorm", &rmsnorm, "RMSNorm of each row");
  m.def("fused_add_rmsnorm", &fused_add_rmsnorm, "residual += x, then RMSNorm of residual");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]");
  m.def("rope_inplace", &rope_inplace, "rotate every head of each row by its position");
  m.def("decode_attention", &decode_attention, "one query per request over the paged pool");
  m.def("linear", &linear, "x @ w.T (+ bias) for a few rows of x");
  m.def("has_openmp", &has_openmp, "built with OpenMP");
  m.def("vector_lanes", &vector_lanes, "floats per vector in linear's tiles");
}
