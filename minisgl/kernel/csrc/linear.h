// Chapter 07 (07_stage1_milestone.ipynb): `linear`: x @ w.T for a decode batch's few rows.
#pragma once
#include "common.h"

namespace {

// 1 to 7 rows of x: each weight row is read once, against all the rows of x (in L1).
// Streams. A chunk's weight rows lie one after another: read front to back they are one stream,
// and a core reading one stream keeps too few lines on their way from memory (2 threads of a Zen
// 2: 32-33 GB/s, one stream each; 48-51 GB/s with four: bench_streams.py). So the chunk is cut
// into S runs of q rows, and the loop takes row i of every run at once: S streams, each read
// front to back. The rows past S * q, fewer than S, follow as one stream.
// Sums and registers. Each weight vector meets the MM rows of x, into U partial sums per row of
// x and stream: an FMA into a sum waits for the one before it, so 8 or more independent sums
// keep FMAs in flight, and at most 14 leave AVX2's 16 vector registers room for the operands.
// A pass loads each vector of x once for all S streams and each weight vector once for all MM
// rows: in_register (common.h) keeps them there. Left alone, GCC 12's AVX-512 build read them
// again inside the FMAs (21 loads for 12 FMAs at 4 rows: half the speed in L2 on a Zen 4). Rows
// of x the registers cannot hold (AVX2, 4 rows and more) are read from L1 by every stream.
// Width. L floats a vector: kLanes, but 8 at 2-8 rows in an AVX-512 build (lanes_for_rows, also
// part 2's): a Zen 4 runs a 16-float FMA as two halves; 16 took 1.03-1.16x the step at 4-7 rows.
// Prefetch. From 2 rows of x on, the loop also asks for each stream's line `ahead` floats on
// (with more instructions between two lines the core looks less far ahead), with hint Loc: 0
// non-temporal (prefetchnta on x86), 1 into L2 (prefetcht2). At 2 to 4 rows a Zen 2's step did
// best with the first, a Zen 4's with the second: part 5 tunes both, per row count, in the calls.
// Never inlined: each instance gets registers of its own, and a test reads its inner loop.
constexpr int lanes_for_rows(int64_t M) { return kLanes == 16 && M > 1 && M <= 8 ? 8 : kLanes; }
template <int MM, int S, int U, int Loc, int L = lanes_for_rows(MM)>
__attribute__((noinline)) void linear_few_rows(const float* x, int64_t ldx, const float* w,
                                               int64_t ldw, int64_t K, const float* bias,
                                               float* y, int64_t ldy, int64_t lo, int64_t hi,
                                               int64_t ahead) {
  typedef typename VecOf<L>::type vec;
  // the rows of x held in registers: as many as the sums and the weight vector leave room for
  constexpr int kPinned = std::max(0, std::min(MM, kVecRegs - MM * S * U - 1));
  const int64_t q = (hi - lo) / S;  // rows per stream
  for (int64_t i = 0; i < q; ++i) {
    const float* ws[S];  // row i of each run
    for (int s = 0; s < S; ++s) ws[s] = w + (lo + s * q + i) * ldw;
    vec acc[MM][S][U] = {};
    int64_t k = 0;
    for (; k + U * L <= K; k += U * L)
      for (int u = 0; u < U; ++u) {
        vec xv[MM];  // this vector of each row of x, loaded once for all S streams
        for (int m = 0; m < MM; ++m) {
          xv[m] = load_vec<L>(x + m * ldx + k + u * L);
          if (m < kPinned) in_register(xv[m]);
        }
        for (int s = 0; s < S; ++s) {
          if (MM > 1 && u * L % 16 == 0)  // one row: the hardware keeps up by itself
            __builtin_prefetch(ws[s] + k + u * L + ahead, 0, Loc);
          vec a = load_vec<L>(ws[s] + k + u * L);
          if (MM > 1) in_register(a);  // one row: a single FMA takes it from memory itself
          for (int m = 0; m < MM; ++m) acc[m][s][u] += xv[m] * a;
        }
      }
    for (; k + L <= K; k += L)  // K % L columns left: add_tail_columns
      for (int s = 0; s < S; ++s) {
        const vec a = load_vec<L>(ws[s] + k);
        for (int m = 0; m < MM; ++m) acc[m][s][0] += load_vec<L>(x + m * ldx + k) * a;
      }
    for (int m = 0; m < MM; ++m)
      for (int s = 0; s < S; ++s) {
        const int64_t n = lo + s * q + i;
        const float v = hsum_of<L>(sum_pairwise<U>(acc[m][s]));
        y[m * ldy + n] = bias ? v + bias[n] : v;
      }
  }
  // the last (hi - lo) % S rows: one stream, with the same U, so that every output is summed
  // in the same order wherever a chunk ends (the same bits on 1, 2 or 3 threads)
  if constexpr (S > 1)
    if (lo + S * q < hi)
      linear_few_rows<MM, 1, U, Loc, L>(x, ldx, w, ldw, K, bias, y, ldy, lo + S * q, hi, ahead);
}

// The last K % lanes columns (none for SmolLM2's 576 and 1536), added to y a float at a time
// after the vector loop: a zero-padded vector for them there became branches among the sums.
__attribute__((noinline)) void add_tail_columns(const float* x, int64_t ldx, int64_t M,
                                                const float* w, int64_t ldw, int64_t K, float* y,
                                                int64_t ldy, int64_t lo, int64_t hi, int lanes) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = lo; n < hi; ++n) {
      float s = 0.0f;
      for (int64_t k = K - K % lanes; k < K; ++k) s += x[m * ldx + k] * w[n * ldw + k];
      y[m * ldy + n] += s;
    }
}

// Output features [lo, hi) for 1 to 7 rows of x (8 and more: part 2). Streams x sums, measured
// in the step (the chapter's table): 4 x 2 at 1 row, 4 x 1 at 2-3, 3 x 1 at 4, then 2 x 1.
std::atomic<int64_t> g_ran_locality{-1}, g_ran_ahead{-1};  // for tests: the last prefetch run
template <int Loc>
void linear_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t ldw,
                 int64_t K, const float* bias, float* y, int64_t N, int64_t lo, int64_t hi,
                 int64_t ahead) {
  if (M >= 2 && M <= 7 && (g_ran_locality.load(std::memory_order_relaxed) != Loc ||
                           g_ran_ahead.load(std::memory_order_relaxed) != ahead)) {
    g_ran_locality.store(Loc, std::memory_order_relaxed);  // only on a change: once tuned, the
    g_ran_ahead.store(ahead, std::memory_order_relaxed);   // threads only read this line
  }
  if (M > 7) {  // more rows than part 2 takes (over 4 vectors): 4 rows of x at a time
    for (int64_t m = 0; m < M; m += 4)
      linear_rows<Loc>(x + m * ldx, ldx, std::min<int64_t>(4, M - m), w, ldw, K, bias,
                       y + m * N, N, lo, hi, ahead);
    return;
  }
  switch (M) {  // one row prefetches nothing: one instance
    case 1: linear_few_rows<1, 4, 2, 0>(x, ldx, w, ldw, K, bias, y, N, lo, hi, ahead); break;
    case 2: linear_few_rows<2, 4, 1, Loc>(x, ldx, w, ldw, K, bias, y, N, lo, hi, ahead); break;
    case 3: linear_few_rows<3, 4, 1, Loc>(x, ldx, w, ldw, K, bias, y, N, lo, hi, ahead); break;
    case 4: linear_few_rows<4, 3, 1, Loc>(x, ldx, w, ldw, K, bias, y, N, lo, hi, ahead); break;
    case 5: linear_few_rows<5, 2, 1, Loc>(x, ldx, w, ldw, K, bias, y, N, lo, hi, ahead); break;
    case 6: linear_few_rows<6, 2, 1, Loc>(x, ldx, w, ldw, K, bias, y, N, lo, hi, ahead); break;
    default: linear_few_rows<7, 2, 1, Loc>(x, ldx, w, ldw, K, bias, y, N, lo, hi, ahead); break;
  }
  const int lanes = lanes_for_rows(M);  // the loop's L
  if (K % lanes) add_tail_columns(x, ldx, M, w, ldw, K, y, N, lo, hi, lanes);
}

}  // namespace
// --- part 2: many rows ---
namespace {

// From kManyRows rows on, x is transposed (xt[k] holds column k of x, MV vectors, zeros past row
// M), and each weight element, broadcast to a vector, meets MV vectors of rows at once: TR weight
// rows x MV vectors of running sums, per k one load of each xt vector and one broadcast per
// weight row, and no horizontal sum at the end. Part 1's loop pays twice for many rows: its
// sums (rows x streams x sums) would outgrow AVX2's 16 registers, and each of its outputs ends
// in a horizontal sum (hsum: of 16 lanes with AVX-512), next to 36 FMAs for K = 576.
constexpr int64_t kManyRows = 8;  // measured on AVX2 and on AVX-512 (chapter 07)

// The vectors here hold L floats: kLanes, except that an AVX-512 build takes 8-float vectors for
// 8 rows or fewer. A 16-float vector would carry a zero for every row missing from 16, and a
// zero costs what a row costs: Zen 4 runs a 16-float FMA as two 8-float halves, so 8 rows in
// 16-float vectors took the time of 16 (chapter 07 measures it).
template <int L, int MV, int TR>
void linear_tile_t(const float* xt, const float* const* wr, int64_t K, int64_t pf, float* yt) {
  typedef typename VecOf<L>::type vec;
  vec acc[TR][MV] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 16) {  // 16 floats: one cache line of each weight row
    for (int i = 0; i < TR; ++i) __builtin_prefetch(wr[i] + k0 + pf, 0, 1);  // into L2
    for (int64_t k = k0; k < std::min<int64_t>(K, k0 + 16); ++k) {
      // each x vector loaded on its own: copied as an array (vec xv[MV], one memcpy), GCC 12
      // kept the sums in memory on AVX2, 12 stores per 12 FMAs (16 rows took 4.3x as long)
      const float* xk = xt + k * MV * L;
      for (int i = 0; i < TR; ++i) {
        const float wk = wr[i][k];
        for (int v = 0; v < MV; ++v) acc[i][v] += wk * load_vec<L>(xk + v * L);
      }
    }
  }
  // sum (i, v) lane l is y[v * L + l, n0 + i]: the tile's outputs, one row of yt per weight row
  for (int i = 0; i < TR; ++i) std::memcpy(yt + i * MV * L, acc[i], sizeof(acc[i]));
}

// Output features [lo, hi) for all M rows, TR weight rows at a time (as linear_rows above).
// The tiles' sums go to a small buffer first, a group of tiles' worth, and from there to y row
// by row. y's M rows are N floats apart, and where N is a multiple of 1024 (gate_up's 3072, the LM
// head's 49152) that is a multiple of 4 KB: all M rows fall into one set of L1 (8 lines), and of
// L2 too for multiples of 64 KB. Written output by output, each tile went over those M lines TR
// times in turn, more lines than the set holds, and missed on most stores.
// Never inlined: a test finds each instance in the compiled library and reads its inner loop
// (tests/test_ch07_kernels.py: the sums stay in registers with 4, 8 and 16-float vectors).
// Tiles a group stages: 2 (1 to 4 measured alike on AVX2, 8 no better than none), or more, so
// that a group holds whole blocks of L outputs for write_sums_t (AVX2's 6-row tiles: 4).
constexpr int staged_tiles(int TR, int L) {
  int outputs = 2 * TR;
  while (outputs % L != 0) outputs += TR;
  return outputs / TR;
}
// The threads' chunks are a multiple of kChunkRowStep weight rows: a whole number of every
// tile (3 of 8, 4 of 6, 6 of 4, 8 of 3), so that only the call's last tile can be short.
constexpr int64_t kChunkRowStep = 24;

// Part 3: a group's sums from yt (a row of W floats per output) to y, in L x L blocks.
template <int L, int W>
void write_sums_t(const float* yt, int64_t M, const float* bias, float* y, int64_t N,
                  int64_t g0, int64_t nn);

template <int L, int MV, int TR>
__attribute__((noinline)) void linear_rows_t(const float* xt, int64_t M, const float* w,
                                             int64_t ldw, int64_t K, const float* bias, float* y,
                                             int64_t N, int64_t lo, int64_t hi) {
  static_assert(kChunkRowStep % TR == 0, "a chunk must hold whole tiles: change kChunkRowStep");
  constexpr int G = staged_tiles(TR, L) * TR;  // outputs a group
  alignas(64) float yt[G * MV * L];  // row r: output g0 + r, one lane per row of x
  for (int64_t g0 = lo; g0 < hi; g0 += G) {
    const int64_t g1 = std::min<int64_t>(hi, g0 + G);
    for (int64_t n0 = g0; n0 < g1; n0 += TR) {
      const int64_t nn = std::min<int64_t>(TR, hi - n0);
      const float* wr[TR];  // a short last tile repeats its last row (never written to y)
      for (int i = 0; i < TR; ++i) wr[i] = w + (n0 + std::min<int64_t>(i, nn - 1)) * ldw;
      const int64_t pf = n0 + 2 * TR <= hi ? TR * ldw : 0;
      linear_tile_t<L, MV, TR>(xt, wr, K, pf, yt + (n0 - g0) * MV * L);
    }
    write_sums_t<L, MV * L>(yt, M, bias, y, N, g0, g1 - g0);  // each row of y: g1 - g0 floats
  }
}

// The rows [lo, hi) of y from xt (`lanes` floats a vector, mv vectors a column): 12 sums a
// tile (12 of AVX2's 16 vector registers; the others hold x and a broadcast), except with one
// vector a column: 8 weight rows, 8 sums. Each weight row needs its pointer in a general
// register, and 12 of them with the loop's own counters are more than x86-64's 16: GCC kept
// some in vector registers and moved them back in the loop (with the weight in L2 on a Zen 4,
// 16 rows of x took 1.21x the time of 8 weight rows a tile; 8 rows of x, 1.05x).
void linear_rows_many(const float* xt, int64_t lanes, int mv, int64_t M, const float* w,
                      int64_t ldw, int64_t K, const float* bias, float* y, int64_t N,
                      int64_t lo, int64_t hi) {
  if constexpr (kLanes == 16) {
    if (lanes == 8) return linear_rows_t<8, 1, 8>(xt, M, w, ldw, K, bias, y, N, lo, hi);
  }
  switch (mv) {
    case 1: linear_rows_t<kLanes, 1, 8>(xt, M, w, ldw, K, bias, y, N, lo, hi); break;
    case 2: linear_rows_t<kLanes, 2, 6>(xt, M, w, ldw, K, bias, y, N, lo, hi); break;
    case 3: linear_rows_t<kLanes, 3, 4>(xt, M, w, ldw, K, bias, y, N, lo, hi); break;
    default: linear_rows_t<kLanes, 4, 3>(xt, M, w, ldw, K, bias, y, N, lo, hi); break;
  }
}

}  // namespace
// --- part 3: x transposed, in blocks ---
namespace {

// W x W floats transposed in registers: W rows in, W columns out. Stage H swaps the off-diagonal
// H x H blocks of every 2H x 2H block (H = 1, 2, ..., W/2): log2(W) stages of W shuffles, where
// a float at a time takes W * W loads and as many stores.
template <int W, int H, std::size_t... I>
inline void swap_blocks(typename VecOf<W>::type& a, typename VecOf<W>::type& b,
                        std::index_sequence<I...>) {
  const auto lo = __builtin_shufflevector(a, b, ((I & H) ? W + I - H : I)...);
  const auto hi = __builtin_shufflevector(a, b, ((I & H) ? W + I : I + H)...);
  a = lo;
  b = hi;
}
template <int W, int H = 1>
inline void transpose_block(typename VecOf<W>::type* r) {  // r[i][l] becomes r[l][i]
  if constexpr (H < W) {
    for (int i = 0; i < W; ++i)
      if ((i & H) == 0) swap_blocks<W, H>(r[i], r[i + H], std::make_index_sequence<W>{});
    transpose_block<W, 2 * H>(r);
  }
}

// The sums of a group of nn outputs, staged in yt (output g0 + i in row i, its W lanes the rows
// of x, zeros past row M), to y, whose rows hold the outputs: L x L blocks of yt transposed, so
// that each row of y gets L outputs at a time, not a float at a time (M x nn scalar loads and
// stores took 1.01x-1.09x the batch-16 step). A short last block reads only yt's first n rows.
template <int L, int W>
void write_sums_t(const float* yt, int64_t M, const float* bias, float* y, int64_t N,
                  int64_t g0, int64_t nn) {
  typedef typename VecOf<L>::type vec;
  for (int64_t b0 = 0; b0 < nn; b0 += L) {  // outputs g0 + b0 ... g0 + b0 + n - 1
    const int64_t n = std::min<int64_t>(L, nn - b0);
    vec b = {};
    if (bias) std::memcpy(&b, bias + g0 + b0, n * sizeof(float));
    for (int64_t m0 = 0; m0 < M; m0 += L) {  // rows m0 ... m0 + L - 1 of x
      vec r[L];  // a short block: its n rows, then zeros
      for (int i = 0; i < L; ++i) r[i] = i < n ? load_vec<L>(yt + (b0 + i) * W + m0) : vec{};
      transpose_block<L>(r);  // r[m - m0]: row m's outputs
      for (int64_t m = m0; m < std::min<int64_t>(M, m0 + L); ++m) {
        if (bias) r[m - m0] += b;
        float* out = y + m * N + g0 + b0;
        if (n == L) std::memcpy(out, &r[m - m0], sizeof(vec));
        else for (int64_t i = 0; i < n; ++i) out[i] = r[m - m0][i];
      }
    }
  }
}

// x [M, K] (rows ldx apart) -> t = xt [K, width]: column k of x, zeros past row M, in blocks of
// W rows x W columns, then the last K % W columns a float at a time.
template <int W>
void transpose_into(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t width, float* t) {
  typedef typename VecOf<W>::type vec;
  int64_t k0 = 0;
  for (; k0 + W <= K; k0 += W)
    for (int64_t m0 = 0; m0 < width; m0 += W) {
      vec r[W];
      for (int i = 0; i < W; ++i) r[i] = m0 + i < M ? load_vec<W>(x + (m0 + i) * ldx + k0) : vec{};
      transpose_block<W>(r);
      for (int i = 0; i < W; ++i) std::memcpy(t + (k0 + i) * width + m0, &r[i], sizeof(vec));
    }
  for (; k0 < K; ++k0)
    for (int64_t m = 0; m < width; ++m) t[k0 * width + m] = m < M ? x[m * ldx + k0] : 0.0f;
}

// Each thread's own xt for call number `call`: the thread transposes x on its first chunk of the
// call, into a buffer it keeps from call to call (starting on a 64-byte line, so that no vector
// load of xt straddles two lines). One xt written by the calling thread and read by the workers
// cost twice: every line the caller wrote was still in a worker's cache from the last call, so
// each store first took the line back from that core, and each worker waited for the whole copy
// before its first chunk (16 rows of 576 floats: 11 us, of 1536: 31 us). Now the copies run at
// once, each into lines its own core holds; only x crosses from core to core, as it would anyway.
std::atomic<uint64_t> g_linear_calls{0};  // numbers the calls of `linear`

const float* thread_xt(uint64_t call, const float* x, int64_t ldx, int64_t M, int64_t K,
                       int64_t width) {
  thread_local uint64_t done = 0;  // the call this thread's xt holds
  thread_local std::vector<float> mem;
  const size_t need = size_t(K * width) + 16;  // a call needs more only before its first copy
  if (mem.size() < need) mem.resize(need);
  const uintptr_t at = reinterpret_cast<uintptr_t>(mem.data());
  float* t = reinterpret_cast<float*>((at + 63) & ~uintptr_t(63));
  if (done != call) {
    if (kLanes == 16 && width % 16 == 0) transpose_into<16>(x, ldx, M, K, width, t);
    else if (width % 8 == 0) transpose_into<8>(x, ldx, M, K, width, t);
    else transpose_into<4>(x, ldx, M, K, width, t);
    done = call;
  }
  return t;
}

}  // namespace
// --- part 4: reading ahead ---
namespace {

// Which weight followed which, call by call. A decode step calls the same matmuls in the same
// order every step, so after a call with weight w the workers read ahead the weights that
// followed w last time, up to g_read_ahead bytes in all: as much as one core's L2 holds. Lines
// read further ahead spill into the last-level cache, which the cores share, and push out what
// the caller's norms, attention and Python need next: on a Zen 2 an LLC-sized budget made the
// decode step 5% slower at batch 1 and 9% at batch 4 than no read-ahead at all.
int64_t cache_bytes(int level) {  // Linux names each cache's level and size in sysfs
  const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index";
  for (int i = 0; i < 8; ++i) {
    std::ifstream lf(dir + std::to_string(i) + "/level"), sf(dir + std::to_string(i) + "/size");
    int lv = 0;
    int64_t kib = 0;
    char unit = 0;
    if (lf >> lv && lv == level && sf >> kib >> unit && unit == 'K' && kib > 0) return kib << 10;
  }
  return int64_t(level == 2 ? 512 : 8 << 10) << 10;  // where sysfs does not say
}
int64_t g_read_ahead = cache_bytes(2);
struct Next { const float* w; int64_t bytes; };
std::unordered_map<const float*, Next> g_after;  // weight -> the weight called after it
const float* g_last = nullptr;

void record_call(const float* w, int64_t bytes) {
  if (g_last != nullptr && g_last != w) {
    if (g_after.size() > 4096) g_after.clear();  // a process that loads model after model
    g_after[g_last] = {w, bytes};
  }
  g_last = w;
}

// The memory the workers may read ahead: buffers this library mapped for the Engine's weights
// (weight_buffer, below) and has not unmapped. A plan names only weights inside one of them.
std::mutex g_buffers_mu;
std::vector<std::pair<const char*, const char*>> g_buffers;  // [lo, hi) of each

bool in_buffer(const char* lo, const char* hi) {  // with g_buffers_mu held
  for (const auto& b : g_buffers)
    if (b.first <= lo && hi <= b.second) return true;
  return false;
}

void plan_kv_rows(const float* w, KvRuns& kv);  // attention.h, part 4

ReadAhead plan_read_ahead(const float* w) {
  ReadAhead ahead;
  plan_kv_rows(w, ahead.kv);  // if an attention followed w: its rows, at the latest slots
  // g_frees before the buffers are looked at (part 4 of common.h): a free between the two then
  // voids the plan. (Python plans and frees under its GIL, never at once; a C++ caller may not.)
  ahead.frees = g_frees.load();
  std::lock_guard<std::mutex> lock(g_buffers_mu);
  int64_t left = g_read_ahead;
  for (auto it = g_after.find(w); it != g_after.end() && it->second.w != w &&
       ahead.n < ReadAhead::kSpans && left > 0; it = g_after.find(it->second.w)) {
    const int64_t b = std::min(left, it->second.bytes);
    const char* lo = reinterpret_cast<const char*>(it->second.w);
    if (!in_buffer(lo, lo + b)) break;  // a test's tensor, freed memory: not read
    ahead.lo[ahead.n] = lo;
    ahead.hi[ahead.n] = lo + b;
    ++ahead.n;
    left -= b;
  }
  return ahead;
}

// The Engine's weights, in one buffer of nbytes (weights.py copies them in): mapped here,
// starting on a 2 MB boundary, with 2 MB pages asked for, and listed as memory the workers may
// read. The last tensor that views it frees it: off the list first, then before_free() waits
// for any worker still reading it, and only then is it unmapped (or, after its time limit, it
// stays mapped, with a message).
torch::Tensor weight_buffer(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "weight_buffer needs 0 or more bytes, got ", nbytes);
  const size_t page = 2 << 20, len = size_t(nbytes) + page;
  // private and anonymous: a shared mapping would be shmem, whose huge pages are off by default
  void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK_WITH(OutOfMemoryError, base != MAP_FAILED, "mmap of ", len, " bytes failed: ",
                   std::strerror(errno));
  char* lo = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + page - 1) &
                                     ~uintptr_t(page - 1));
#ifdef MADV_HUGEPAGE
  madvise(lo, nbytes, MADV_HUGEPAGE);  // refused (no huge pages here): 4 KB pages, same values
#endif
  {
    std::lock_guard<std::mutex> lock(g_buffers_mu);
    g_buffers.emplace_back(lo, lo + nbytes);
  }
  auto unmap = [base, len, lo, nbytes](void*) {
    {
      std::lock_guard<std::mutex> lock(g_buffers_mu);
      const auto it = std::find_if(g_buffers.begin(), g_buffers.end(),
                                   [lo](const auto& b) { return b.first == lo; });
      if (it != g_buffers.end()) g_buffers.erase(it);
    }
    if (!before_free()) {  // a reader stopped for seconds: its next load must not fault
      std::fprintf(stderr, "minisgl.kernel: a weight buffer (%zu MB) was freed while a kernel "
                   "thread was reading ahead in it, and that thread has not moved for %g s (is "
                   "the machine overloaded, or a debugger stopping it?). The buffer stays mapped "
                   "so that the read cannot crash the process; its memory comes back when the "
                   "process exits.\n", size_t(nbytes) >> 20, g_free_wait);
      return;
    }
    munmap(base, len);
  };
  return torch::from_blob(lo, {nbytes}, unmap, torch::TensorOptions().dtype(torch::kUInt8));
}

}  // namespace
// --- part 5: how far ahead to prefetch ---
namespace {

// A call's output features go to the threads in chunks of about this many: 4 chunks per thread
// (a paused thread holds back a quarter of its share), each 64 KB of the weight or more, in
// whole tiles of `tile` weight rows.
int64_t chunk_rows(int64_t N, int64_t K, int64_t tile) {
  const int64_t rows = std::max<int64_t>((64 << 10) / (4 * std::max<int64_t>(K, 1)),
                                         N / (4 * workers().size()));
  return std::max<int64_t>(1, rows / tile) * tile;
}

// How the 2-7-row loop (part 1) asks for the weight ahead, hint and distance: tuned in the
// calls themselves. The best of them differ from CPU to CPU and from row count to row count: in
// a Zen 2's decode step prefetchnta 64-96 floats ahead at 2 rows, 128 at 3, 256-384 at 4 to 7;
// in a Zen 4's prefetcht2, 256 to 2048 floats ahead (its prefetchnta took 1.1x the time). A
// pass over one large weight, the measurement used before, picked other distances than the step
// (0 at 2 rows, 96-128 at 4 on the Zen 2), so now the step measures. While a row count is
// tuning, call n of each weight takes candidate n % kCandidates, and the weight keeps its
// fastest call at each candidate. A decode step calls each weight once, so one whole step runs
// with one candidate, the next step with the next. When a weight starts a new round with R
// whole rounds behind it, and R times the bytes of the weights with two rounds or more is
// kTuneBytes or more, the candidate whose fastest calls add up to the least time over those
// weights is kept for good. Fastest, not total: the first step after a prefill runs slower,
// whatever its candidate, and in totals the candidate it fell to came out 1.3x-1.5x the best
// at every row count, whichever that was.
struct Prefetch {
  int locality;    // __builtin_prefetch's: 0 non-temporal (prefetchnta), 1 into L2 (prefetcht2)
  int64_t floats;  // how far ahead; -1: still tuning
};
constexpr Prefetch kAheads[] = {{0, 64}, {0, 128}, {0, 256}, {0, 384},
                                {1, 256}, {1, 512}, {1, 1024}, {1, 2048}};
constexpr int kCandidates = std::size(kAheads);
constexpr double kTuneBytes = double(768 << 20);  // SmolLM2-135M (538 MB): two rounds, 16 steps

struct Tuning {
  struct Weight {
    uint64_t calls = 0;
    double bytes = 0, fastest[kCandidates];  // seconds: its fastest call with each candidate
    Weight() { std::fill_n(fastest, kCandidates, INFINITY); }
  };
  Prefetch chosen{0, -1};  // floats -1: still tuning
  std::unordered_map<const float*, Weight> weights;  // each weight called while tuning

  // Over the weights with two whole rounds or more: each candidate's fastest calls, added up
  // (sec), and their bytes (the same for every candidate).
  double accounts(double* sec) const {
    double bytes = 0;
    std::fill_n(sec, kCandidates, 0.0);
    for (const auto& [w, tw] : weights)
      if (tw.calls >= 2 * kCandidates) {
        bytes += tw.bytes;
        for (int i = 0; i < kCandidates; ++i) sec[i] += tw.fastest[i];
      }
    return bytes;
  }
};
Tuning g_tuning[8];  // by rows of x: 2 to 7

// This call's hint and distance, and the candidate it times (-1: none). More than 7 rows go
// through part 1 four at a time: they take the 4-row choice, and time nothing.
std::pair<Prefetch, int> pick_ahead(int64_t rows, const float* w) {
  Tuning& t = g_tuning[rows > 7 ? 4 : rows];
  if (t.chosen.floats >= 0) return {t.chosen, -1};
  if (rows > 7) return {kAheads[kCandidates / 2], -1};
  if (t.weights.size() > 4096) t.weights.clear();  // a process that loads model after model
  Tuning::Weight& tw = t.weights[w];
  const uint64_t rounds = tw.calls / kCandidates;
  const int c = int(tw.calls++ % kCandidates);
  double sec[kCandidates];
  if (c == 0 && double(rounds) * t.accounts(sec) >= kTuneBytes) {  // once a round per weight
    t.chosen = kAheads[std::min_element(sec, sec + kCandidates) - sec];
    return {t.chosen, -1};
  }
  return {kAheads[c], c};
}

void time_call(int64_t rows, const float* w, int c, double sec, int64_t bytes) {
  Tuning::Weight& tw = g_tuning[rows].weights[w];
  tw.bytes = double(bytes);
  tw.fastest[c] = std::min(tw.fastest[c], sec);
}

}  // namespace
// --- part 6: what tests and benchmarks may look at and set ---

// What the workers read ahead after a call with weight w, as (address, bytes) spans; and the
// budget for it (0: nothing is read ahead), returning the previous one. For tests and
// benchmarks: the kernels work the same either way, only their speed differs.
std::vector<std::pair<int64_t, int64_t>> read_ahead_plan(torch::Tensor w) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  const ReadAhead ahead = plan_read_ahead(w.data_ptr<float>());
  for (int s = 0; s < ahead.n; ++s)
    spans.emplace_back(reinterpret_cast<int64_t>(ahead.lo[s]), ahead.hi[s] - ahead.lo[s]);
  return spans;
}
int64_t set_read_ahead(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "read-ahead budget must be >= 0 bytes, got ", bytes);
  return std::exchange(g_read_ahead, bytes);
}
// For tests: how long a free waits for a reader (seconds), returning the old limit; and
// `delta` readers counted as if workers were reading ahead (one the OS stopped), returning the
// count. The kernels' results never change; only whether a free waits.
double set_free_wait(double seconds) {
  TORCH_CHECK(seconds >= 0 && seconds <= 3600, "the free's wait must be 0 to 3600 seconds, got ",
              seconds);
  return std::exchange(g_free_wait, seconds);
}
int64_t count_readers(int64_t delta) {  // the check and the change are one step
  int now = g_reading.load();
  do {
    TORCH_CHECK(now + delta >= 0, "count_readers(", delta, ") would leave fewer than 0 readers (",
                now, " now)");
    TORCH_CHECK(now + delta <= (1 << 20), "count_readers(", delta, ") would count more than "
                "2^20 readers (", now, " now)");
  } while (!g_reading.compare_exchange_weak(now, now + int(delta)));
  return now + delta;
}

// How far ahead the 2-7-row loop prefetches at `rows` rows of x, in floats (-1: still tuning),
// and with which hint (its locality); a hint and distance fixed in their place (floats -1: tune
// again, from empty accounts), returning the old distance; and the tuning's accounts:
// (locality, floats, seconds, bytes) per candidate, over the weights with two whole rounds
// (part 5), kTuneBytes, and the hint and distance the loop last ran with (part 1's
// g_ran_*: that the choice is what runs). For tests and benchmarks: the results never change,
// only their speed.
Tuning& tuning_for(int64_t rows) {
  TORCH_CHECK(rows >= 2 && rows <= 7, "the prefetch distance is tuned for 2 to 7 rows of x "
              "(1 row prefetches nothing; more go 4 at a time), got ", rows);
  return g_tuning[rows];
}
int64_t prefetch_ahead(int64_t rows) { return tuning_for(rows).chosen.floats; }
int64_t prefetch_locality(int64_t rows) {
  const Prefetch p = tuning_for(rows).chosen;
  return p.floats < 0 ? -1 : p.locality;
}
int64_t set_prefetch_ahead(int64_t rows, int64_t floats, int64_t locality) {
  TORCH_CHECK(floats >= -1, "prefetch distance must be >= 0 floats (or -1: tune again), got ",
              floats);
  TORCH_CHECK(locality == 0 || locality == 1, "prefetch locality must be 0 (non-temporal, "
              "prefetchnta) or 1 (into L2, prefetcht2), the two hints the loop is built with; "
              "got ", locality);
  Tuning& t = tuning_for(rows);
  const int64_t old = t.chosen.floats;
  if (floats < 0) t = Tuning{};
  else t.chosen = {int(locality), floats};
  return old;
}
int64_t prefetch_tune_bytes() { return int64_t(kTuneBytes); }  // R rounds x bytes to decide
std::pair<int64_t, int64_t> last_prefetch() {  // what the 2-7-row loop last ran with
  return {g_ran_locality.load(), g_ran_ahead.load()};
}
std::vector<std::tuple<int64_t, int64_t, double, double>> prefetch_tuning(int64_t rows) {
  double sec[kCandidates];
  const double bytes = tuning_for(rows).accounts(sec);
  std::vector<std::tuple<int64_t, int64_t, double, double>> out;
  for (int i = 0; i < kCandidates; ++i)
    out.emplace_back(kAheads[i].locality, kAheads[i].floats, sec[i], bytes);
  return out;
}

int64_t vector_lanes() { return kLanes; }  // floats per vector in this build
std::string vector_isa() { return MINISGL_ISA; }  // the vector instructions this build targets
// --- part 7: the function Python calls ---

// y = x @ w.T (+ bias) for a few rows of x (a decode batch), w [N, K] in the checkpoint's
// layout: each output feature's K weights contiguous. MKL's GEMM, tuned for large products,
// reads the weight much more slowly with 2-16 rows than with one; here every weight byte is
// read once, whatever the row count, and the threads take the output features in chunks,
// each one contiguous stretch of the weight.
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
  const int64_t ldx = x.stride(0), ldw = w.stride(0);
  const int64_t bytes = ((N - 1) * ldw + K) * 4;  // of the weight
  record_call(wp, bytes);
  const ReadAhead ahead = plan_read_ahead(wp);
  if (M >= kManyRows && M <= 4 * kLanes) {  // part 2
    const int64_t lanes = lanes_for_rows(M);
    const int mv = (int)((M + lanes - 1) / lanes);
    const uint64_t call = ++g_linear_calls;
    workers().run(N, chunk_rows(N, K, kChunkRowStep), [&](int64_t lo, int64_t hi) {
      const float* xt = thread_xt(call, xp, ldx, M, K, mv * lanes);
      linear_rows_many(xt, lanes, mv, M, wp, ldw, K, bp, yp, N, lo, hi);
    }, ahead);
    return y;
  }
  const std::pair<Prefetch, int> pick =
      M >= 2 ? pick_ahead(M, wp) : std::pair<Prefetch, int>{{0, 0}, -1};
  const Prefetch pf = pick.first;
  const int candidate = pick.second;
  const auto run = [&] {
    workers().run(N, chunk_rows(N, K, 1), [&](int64_t lo, int64_t hi) {
      if (pf.locality == 1) linear_rows<1>(xp, ldx, M, wp, ldw, K, bp, yp, N, lo, hi, pf.floats);
      else linear_rows<0>(xp, ldx, M, wp, ldw, K, bp, yp, N, lo, hi, pf.floats);
    }, ahead);
  };
  if (candidate < 0) {  // tuned, or a loop without the distance: no clock on the way
    run();
    return y;
  }
  const auto t0 = std::chrono::steady_clock::now();  // tuning (part 5): time the call
  run();
  const std::chrono::duration<double> t = std::chrono::steady_clock::now() - t0;
  time_call(M, wp, candidate, t.count(), bytes);
  return y;
}
