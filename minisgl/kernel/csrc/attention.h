// Chapter 07 (07_stage1_milestone.ipynb): decode attention over the paged KV pool.
#pragma once
#include "common.h"

namespace {

// A score is a sum of D products, and a sum ends in a vector's lanes added together (hsum,
// common.h: log2(kLanes) shuffles and adds, each waiting for the one before). For kLanes keys at
// once, fold their kLanes vectors of partial sums instead: pairs of vectors become one, the first
// half of each group of lanes beside the second half, added; kLanes - 1 folds in all, and lane i
// of the last vector is key i's sum. Before a fold a vector holds groups of S lanes (at first one
// group: a whole key), after it groups of S / 2 (a pair's groups side by side).
constexpr int fold_lane(int S, int i) {  // x's lanes are 0 .. kLanes - 1, y's the next kLanes
  const int half = kLanes / 2, at = i % half;
  return (i < half ? 0 : kLanes) + at / (S / 2) * S + at % (S / 2);
}
template <int S, std::size_t... I>
inline vecf fold_pair(vecf x, vecf y, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, y, fold_lane(S, I)...) +
         __builtin_shufflevector(x, y, (fold_lane(S, I) + S / 2)...);
}
template <int S, std::size_t... P>
inline void fold_level(vecf* a, std::index_sequence<P...>) {  // S vectors into S / 2
  ((a[P] = fold_pair<S>(a[2 * P], a[2 * P + 1], std::make_index_sequence<kLanes>{})), ...);
}
template <int S = kLanes>
inline vecf sums_of(vecf* a) {  // lane i: the sum of a[i]'s lanes (a is overwritten)
  if constexpr (S == 1) {
    return a[0];
  } else {
    fold_level<S>(a, std::make_index_sequence<S / 2>{});
    return sums_of<S / 2>(a);
  }
}

// p[g * L + j] = (q_g . k_j) * scale for the G query heads of one KV head and its n keys, the
// key of slot sl[j] at kh + sl[j] * row. kLanes keys at a time, one vector of scores per query
// head (with 16 lanes: 4 FMAs per key and head, then 15 folds for 16 keys, where 16 horizontal
// sums took 64 shuffle-and-add steps, 4 in a row waiting for each other); fetch(j) asks for slot
// j's rows `ahead` slots before their use.
template <typename Fetch>
void score_keys(const float* qh, const float* kh, const int64_t* sl, int64_t row, int64_t n,
                int64_t D, int64_t G, int64_t L, float scale, float* p, int64_t ahead,
                const Fetch& fetch) {
  for (int64_t j = 0; j < std::min(n, ahead); ++j) fetch(j);
  int64_t j = 0;
  for (; D % kLanes == 0 && j + kLanes <= n; j += kLanes) {
    const float* kb[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      if (j + i + ahead < n) fetch(j + i + ahead);
      kb[i] = kh + sl[j + i] * row;
    }
    for (int64_t g = 0; g < G; ++g) {
      vecf acc[kLanes] = {};
      for (int64_t d = 0; d < D; d += kLanes) {
        const vecf qv = loadv(qh + g * D + d);
        for (int i = 0; i < kLanes; ++i) acc[i] += qv * loadv(kb[i] + d);
      }
      storev(p + g * L + j, sums_of(acc) * scale);
    }
  }
  for (; j < n; ++j) {  // the keys left over (all of them when D is not whole vectors)
    if (j + ahead < n) fetch(j + ahead);
    for (int64_t g = 0; g < G; ++g) p[g * L + j] = dot(qh + g * D, kh + sl[j] * row, D) * scale;
  }
}

}  // namespace
// --- part 2: decode attention ---
namespace {
void remember_kv_rows(const float* k, const float* v, int64_t row, const int64_t* slots,
                      const int64_t* lens, int64_t B, int64_t L);  // part 4
}  // namespace

// Decode attention over the paged pool, one query per request. The caller has already written
// this step's k, v into the pool (store_kv: the pool has one writer), so request b attends to
// slots kv_slots[b*L .. b*L + seq_lens[b]), its new token included.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor kv_slots, torch::Tensor seq_lens, int64_t max_kv_len,
                               int64_t head_dim) {
  // q: [B, Hq * D], or [B, Hq, D] as the attention layer hands it over (o is then the same)
  const bool heads = q.dim() == 3;
  if (heads)
    TORCH_CHECK(q.size(2) == head_dim && q.stride(2) == 1 && q.stride(1) == head_dim,
                "a 3-D q must be [B, Hq, head_dim=", head_dim, "] with each row's heads "
                "contiguous, got ", q.sizes(), " with strides ", q.strides());
  const torch::Tensor q2 = heads ? q.view({q.size(0), -1}) : q;
  check_rows(q2, "q");
  check_rows(k_cache, "k_cache");
  check_rows(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must be contiguous "
              "[slots, Hkv * head_dim] views of the same shape");
  const int64_t B = q.size(0), D = head_dim, row = k_cache.size(1), S = k_cache.size(0);
  TORCH_CHECK(D > 0 && row % D == 0 && q2.size(1) % row == 0, "q [B, Hq*D] and the caches "
              "[slots, Hkv*D] must agree with head_dim ", D, " and Hq a multiple of Hkv");
  const int64_t Hkv = row / D, Hq = q2.size(1) / D, G = Hq / Hkv, L = max_kv_len;
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
  remember_kv_rows(kc, vc, row, slots, lens, B, L);  // what the workers read ahead (part 4)
  auto o = torch::empty({B, Hq * D}, q.options());
  const float scale = 1.0f / std::sqrt((float)D);
  const float* qp = q2.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const int64_t qs = q2.stride(0);
  // one task per (request, KV head): its G query heads read each key and value row once. With
  // two requests or more per thread, a thread takes a whole request at a time (its Hkv tasks,
  // one after another) and its first task fetches every head's part of each slot's row: the
  // other heads then read from cache. With fewer, the tasks are handed out one at a time, so
  // both threads work from the first request on.
  const int64_t tasks = B * Hkv;
  const bool whole = B >= 2 * workers().size();
  split_rows(tasks, whole ? Hkv : 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> p(G * L);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv, n = lens[b];
      const int64_t* sl = slots + b * L;
      const float* qh = qp + b * qs + hk * G * D;  // the G query heads of KV head hk
      // A head's D floats of a slot are a few cache lines, one slot's row apart from the next
      // slot's, and the weights streamed since the last layer have pushed them out of every
      // cache: ask for key and value rows kAhead slots before they are needed, so that their
      // misses overlap instead of waiting one after another.
      const bool all_heads = whole && hk == 0;  // the whole row: Hkv * D floats
      const auto fetch = [&](int64_t j) {
        const int64_t at = sl[j] * row + (all_heads ? 0 : hk * D);
        for (int64_t d = 0; d < (all_heads ? row : D); d += 16) {  // 16 floats: a cache line
          __builtin_prefetch(kc + at + d, 0, 3);
          __builtin_prefetch(vc + at + d, 0, 2);  // read after the softmax: L2 is enough
        }
      };
      constexpr int64_t kAhead = 16;
      score_keys(qh, kc + hk * D, sl, row, n, D, G, L, scale, p.data(), kAhead, fetch);
      for (int64_t g = 0; g < G; ++g) {  // softmax over the request's keys
        float* pg = p.data() + g * L;
        float m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < n; ++j) m = std::max(m, pg[j]);
        int64_t j = 0;
        for (; j + kLanes <= n; j += kLanes) {  // e^(s - m), a vector of keys at a time
          const vecf e = expv(loadv(pg + j) - m);
          std::memcpy(pg + j, &e, sizeof(e));
          sum += hsum(e);
        }
        for (; j < n; ++j) sum += (pg[j] = std::exp(pg[j] - m));
        for (j = 0; j < n; ++j) pg[j] /= sum;
      }
      // o = sum_j p_j v_j: 4 vectors of o in registers over all the keys (a fixed count: with a
      // count known only at run time, GCC kept the sums on the stack, a store and a load around
      // every FMA), then single vectors, then the D % kLanes floats one by one
      float* oh = op + b * Hq * D + hk * G * D;
      const float* vh = vc + hk * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = p.data() + g * L;
        int64_t d0 = 0;
        for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) {
          vecf acc[4] = {};
          for (int64_t j = 0; j < n; ++j)
            for (int v = 0; v < 4; ++v) acc[v] += pg[j] * loadv(vh + sl[j] * row + d0 + v * kLanes);
          for (int v = 0; v < 4; ++v) storev(oh + g * D + d0 + v * kLanes, acc[v]);
        }
        for (; d0 + kLanes <= D; d0 += kLanes) {
          vecf acc = {};
          for (int64_t j = 0; j < n; ++j) acc += pg[j] * loadv(vh + sl[j] * row + d0);
          storev(oh + g * D + d0, acc);
        }
        for (; d0 < D; ++d0) {
          float s = 0;
          for (int64_t j = 0; j < n; ++j) s += pg[j] * vh[sl[j] * row + d0];
          oh[g * D + d0] = s;
        }
      }
    }
  });
  return heads ? o.view({B, Hq, D}) : o;
}
// --- part 3: the pool's writer ---

// The pool's store_kv (chapter 04's contract): row j of k and v into slot out_loc[j] of one
// layer's caches. The torch code pays for views, an int64 copy of out_loc and two index_copy_
// dispatches; here it is one call and a row copy per token.
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor out_loc) {
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.scalar_type() == torch::kFloat32 &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() >= 2 &&
              v_cache.scalar_type() == torch::kFloat32 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be one layer's contiguous float32 CPU caches "
              "[..., Hkv, D] of the same shape");
  const int64_t T = k.size(0), row = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && row == k_cache.size(-2) * k_cache.size(-1), "k and v "
              "must be [T, Hkv * D] = [T, ", k_cache.size(-2) * k_cache.size(-1), "], got ",
              k.sizes(), " and ", v.sizes());
  const bool i64 = out_loc.scalar_type() == torch::kInt64;
  TORCH_CHECK(out_loc.device().is_cpu() && out_loc.dim() == 1 && out_loc.is_contiguous() &&
              (i64 || out_loc.scalar_type() == torch::kInt32) && out_loc.size(0) == T,
              "out_loc must be a contiguous int32 or int64 CPU vector of ", T, " slots");
  const int64_t S = k_cache.numel() / row;
  std::vector<int64_t> slot(T);
  for (int64_t j = 0; j < T; ++j) {
    slot[j] = i64 ? out_loc.data_ptr<int64_t>()[j] : out_loc.data_ptr<int32_t>()[j];
    TORCH_CHECK(slot[j] >= 0 && slot[j] < S, "out_loc[", j, "] = ", slot[j], " is outside "
                "the pool (", S, " slots); nothing was written");
  }
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t j = 0; j < T; ++j) {
    std::memcpy(kc + slot[j] * row, kp + j * k.stride(0), row * sizeof(float));
    std::memcpy(vc + slot[j] * row, vp + j * v.stride(0), row * sizeof(float));
  }
}
// --- part 4: the rows the next attention reads ---
namespace {

// Every layer of a decode step reads the same slots (the step's requests'), each in its own
// caches. So decode_attention notes the weight of the matmul just before it (g_last, linear.h:
// the layer's qkv projection) with its caches, and the slots it read, as runs of consecutive
// slots. Next time that matmul runs, its plan (plan_read_ahead) names those caches at the
// latest slots, and the workers prefetch them while the caller runs rope, store_kv and the
// Python before the attention. Layer 0 gets the last step's slots: one key fewer per request,
// and that key store_kv has just written, so it is in cache anyway.
struct KvLayer { const float* k; const float* v; int64_t row; };
std::unordered_map<const float*, KvLayer> g_kv_after;  // weight -> the caches attention read next
KvRuns g_kv_slots;  // the slots the last decode attention read (its k and v unused)
bool g_kv_read_ahead = true;

void remember_kv_rows(const float* k, const float* v, int64_t row, const int64_t* slots,
                      const int64_t* lens, int64_t B, int64_t L) {
  if (g_last != nullptr) {
    if (g_kv_after.size() > 4096) g_kv_after.clear();  // a process that loads model after model
    g_kv_after[g_last] = {k, v, row};
  }
  int n = 0;  // the first KvRuns::kMax runs; a request's slots past them are not prefetched
  for (int64_t b = 0; b < B && n < KvRuns::kMax; ++b) {
    const int64_t* sl = slots + b * L;
    for (int64_t j = 0, e; j < lens[b] && n < KvRuns::kMax; j = e, ++n) {
      for (e = j + 1; e < lens[b] && sl[e] == sl[e - 1] + 1; ++e) {}
      g_kv_slots.first[n] = sl[j];
      g_kv_slots.count[n] = e - j;
    }
  }
  g_kv_slots.n = n;
}

void plan_kv_rows(const float* w, KvRuns& kv) {
  const auto it = g_kv_read_ahead ? g_kv_after.find(w) : g_kv_after.end();
  if (it == g_kv_after.end()) return;
  kv = g_kv_slots;
  kv.k = it->second.k;
  kv.v = it->second.v;
  kv.row = it->second.row;
}

}  // namespace

// For tests and benchmarks: the (address, bytes) spans the workers prefetch after a matmul with
// weight w, in their order (each run's keys, then its values); turning that on or off (the notes
// are kept either way), which returns the old setting; and forgetting every note. Only the
// speed can change: a prefetch changes no result.
std::vector<std::pair<int64_t, int64_t>> kv_read_ahead_plan(torch::Tensor w) {
  KvRuns kv;
  plan_kv_rows(w.data_ptr<float>(), kv);
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int r = 0; r < kv.n; ++r)
    for (int c = 0; c < 2; ++c) {
      const auto [lo, hi] = kv.span(r, c);
      spans.emplace_back(int64_t(lo), int64_t(hi - lo));
    }
  return spans;
}
bool set_kv_read_ahead(bool on) { return std::exchange(g_kv_read_ahead, on); }
void forget_kv_rows() {
  g_kv_after.clear();
  g_kv_slots.n = 0;
}
