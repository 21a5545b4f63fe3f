// Chapter 07 (07_stage1_milestone.ipynb): RMSNorm, add + RMSNorm, silu * up, RoPE, one pass each;
// then the greedy sampler's argmax.
#pragma once
#include "common.h"

// The norms take chunks of about 4096 floats: at batch 16 (rows of 576), 7 rows a chunk on both
// threads. A decode step's 61 norms took 0.85-0.91 ms so, 1.09-1.21 ms in 64-row chunks.
constexpr int64_t kNormFloats = 4096;

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_weight(x, weight);
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0);
  auto y = torch::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  split_rows(T, rows_per_chunk(H, kNormFloats), [&](int64_t lo, int64_t hi) {
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
  split_rows(T, rows_per_chunk(H, kNormFloats), [&](int64_t lo, int64_t hi) {
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
  // chunks of about 8192 outputs: a decode batch's exponentials are worth both threads (16 rows
  // x 1536, on the Zen 2 EPYC: 26 us on one thread, 19 us on two)
  split_rows(T, rows_per_chunk(I, 8192), [&](int64_t lo, int64_t hi) {
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
// --- part 2: RoPE ---

// x, and x2 when given (k beside q: one call per layer; x2 must not overlap x), rotated in
// place by each row's position
void rope_inplace(torch::Tensor positions, torch::Tensor x, torch::Tensor cos_sin,
                  int64_t head_size, std::optional<torch::Tensor> x2) {
  check_rows(cos_sin, "cos_sin_cache");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.size(1) == head_size,
              "cos_sin_cache must be contiguous [max_position, head_size=", head_size, "]");
  // the batch's positions are int32: read them as they are (no copy per layer)
  auto pos = positions.contiguous();
  TORCH_CHECK(pos.device().is_cpu() && pos.dim() == 1 &&
              (pos.scalar_type() == torch::kInt32 || pos.scalar_type() == torch::kInt64),
              "positions must be a 1-D int32 or int64 CPU tensor");
  const bool wide = pos.scalar_type() == torch::kInt64;
  const int32_t* p32 = wide ? nullptr : pos.data_ptr<int32_t>();
  const int64_t* p64 = wide ? pos.data_ptr<int64_t>() : nullptr;
  auto position = [&](int64_t t) -> int64_t { return wide ? p64[t] : p32[t]; };
  const int64_t T = pos.size(0), P = cos_sin.size(0), half = head_size / 2;
  for (const torch::Tensor* t : {&x, x2.has_value() ? &*x2 : nullptr}) {
    if (t == nullptr) continue;
    const char* name = t == &x ? "x" : "x2";
    check_rows(*t, name);
    TORCH_CHECK(head_size % 2 == 0 && t->size(1) % head_size == 0, name, "'s last dim (",
                t->size(1), ") must be a multiple of the (even) head_size ", head_size);
    TORCH_CHECK(t->size(0) == T, "positions has ", T, " entries, ", name, " has ", t->size(0),
                " rows");
  }
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(position(t) >= 0 && position(t) < P, "position ", position(t),
                " is outside the rope table (", P, " positions): raise max_position");
  const float* cp = cos_sin.data_ptr<float>();
  for (const torch::Tensor* t : {&x, x2.has_value() ? &*x2 : nullptr}) {
    if (t == nullptr) continue;
    float* xp = t->data_ptr<float>();
    const int64_t H = t->size(1) / head_size, xs = t->stride(0);
    split_rows(T, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const float* c = cp + position(r) * head_size;
        const float* s = c + half;
        for (int64_t h = 0; h < H; ++h) {
          float* v = xp + r * xs + h * head_size;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c[i] - x2 * s[i];
            v[i + half] = x2 * c[i] + x1 * s[i];
          }
        }
      }
    });
  }
}
// --- part 3: greedy sampling ---

// Greedy sampling: the index of each row's largest logit, as torch.argmax gives it (the first
// index on a tie; the first NaN when a row has one). One pass, a vector at a time: each lane
// keeps its largest value and where it was (strictly larger replaces, so the earlier index
// stays on a tie), then the lanes are compared. torch's argmax takes ~50 us per 49152-word row.
struct Best {
  float m = -INFINITY;
  int64_t arg = -1;  // -1: every logit is -inf (or a NaN)
  bool nan = false;
};
Best best_in(const float* r, int64_t j, int64_t end) {  // columns [j, end) of a row
  veci at = {}, idx = {}, nan = {};
  for (int l = 0; l < kLanes; ++l) idx[l] = int32_t(j + l);
  vecf best = {};
  best -= INFINITY;
  for (; j + kLanes <= end; j += kLanes, idx += kLanes) {
    const vecf v = loadv(r + j);
    const veci larger = v > best;
    best = larger ? v : best;
    at = larger ? idx : at;
    nan |= v != v;
  }
  Best b;
  for (int l = 0; l < kLanes; ++l)  // the lanes' winners: largest, then earliest
    if (best[l] > b.m || (best[l] == b.m && at[l] < b.arg)) b.m = best[l], b.arg = at[l];
  for (; j < end; ++j) {  // the tail, after every lane: later indices
    b.nan |= r[j] != r[j];
    if (r[j] > b.m) b.m = r[j], b.arg = j;
  }
  for (int l = 0; l < kLanes; ++l) b.nan |= nan[l] != 0;
  return b;
}

// Each row in two pieces, its front and back halves (from two vectors on), as tasks: all front
// halves first, then all back halves. The workers take tasks from the front and the caller from
// the back (common.h part 4), as they took the LM head's output features: so each thread reads
// mostly logits it wrote itself, still in its own core's cache. At batch 1 the row read by one
// thread took 92 us in the step (half of it from the other core), 7 us with warm caches.
torch::Tensor argmax_rows(torch::Tensor logits) {
  check_rows(logits, "logits");
  const int64_t B = logits.size(0), V = logits.size(1), ls = logits.stride(0);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "logits must have 1 to 2^31 - 1 columns, got ",
              V);
  auto out = torch::empty({B}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t P = V >= 2 * kLanes ? 2 : 1, cut = V / 2 / kLanes * kLanes;  // pieces, boundary
  std::vector<Best> piece(B * P);
  split_rows(B * P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t % B, p = t / B;  // task t: piece p of row b
      piece[t] = best_in(lp + b * ls, P == 1 || p == 0 ? 0 : cut, P == 1 || p == 1 ? V : cut);
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    Best w;  // the pieces in column order: strictly larger replaces, so the earlier wins a tie
    for (int64_t p = 0; p < P; ++p) {
      const Best& c = piece[p * B + b];
      w.nan |= c.nan;
      if (c.arg >= 0 && (w.arg < 0 || c.m > w.m)) w.m = c.m, w.arg = c.arg;
    }
    if (w.nan) {  // rare: a damaged row; find the first NaN plainly
      const float* r = lp + b * ls;
      int64_t j = 0;
      while (r[j] == r[j]) ++j;
      w.arg = j;
    }
    op[b] = w.arg < 0 ? 0 : w.arg;  // arg < 0: every logit is -inf
  }
  return out;
}
