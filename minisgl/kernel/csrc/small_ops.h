// Chapter 07 (07_stage1_milestone.ipynb): RMSNorm, add + RMSNorm, silu * up, RoPE, one pass each.
#pragma once
#include "common.h"

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_weight(x, weight);
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0);
  auto y = torch::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  split_rows(T, kRowGrain, [&](int64_t lo, int64_t hi) {
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
  split_rows(T, kRowGrain, [&](int64_t lo, int64_t hi) {
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
  split_rows(T, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + I;
      float* o = yp + t * I;
      int64_t k = 0;
      for (; k + kLanes <= I; k += kLanes) {  // silu(g) * u = g / (1 + e^-g) * u, by vectors
        const vecf gv = loadv(g + k), e = expv(-gv), ov = gv / (1.0f + e) * loadv(u + k);
        std::memcpy(o + k, &ov, sizeof(ov));
      }
      for (; k < I; ++k) o[k] = g[k] / (1.0f + std::exp(-g[k])) * u[k];
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
  split_rows(T, kRowGrain, [&](int64_t lo, int64_t hi) {
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
