// Chapter 07 (07_stage1_milestone.ipynb): checks, vectors and threads the kernels share.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <pthread.h>
#include <sys/mman.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
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

void check_weight(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 1 &&
              w.is_contiguous() && w.size(0) == x.size(1),
              "weight must be a contiguous float32 CPU vector of ", x.size(1), " values");
}

}  // namespace
// --- part 2: vectors ---
// One vector register of floats, the widest this build's target has: 16 with AVX-512, 8 with
// AVX2, 4 otherwise (SSE, an ARM laptop's NEON). The compiler's flags choose it (-march=native:
// this CPU), and with it the number of vector registers (16 with AVX2, 32 with AVX-512 and
// NEON), which bounds how many running sums a kernel keeps without spilling (linear.h).
// GCC's vector extension lets one source serve all of them: `acc += x * w` on vecf is one
// vector instruction (an FMA), and memcpy is how C++ reads a vector from any float address.
#if defined(__AVX512F__)
#define MINISGL_LANES 16
#define MINISGL_ISA "AVX-512"
#elif defined(__AVX2__) && defined(__FMA__)
#define MINISGL_LANES 8
#define MINISGL_ISA "AVX2+FMA"
#elif defined(__AVX__)
#define MINISGL_LANES 8
#define MINISGL_ISA "AVX"
#elif defined(__ARM_NEON)
#define MINISGL_LANES 4
#define MINISGL_ISA "NEON"
#else
#define MINISGL_LANES 4
#define MINISGL_ISA "SSE2 (the x86-64 baseline) or scalar"
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
inline void cpu_relax() { _mm_pause(); }  // "this thread is spinning": frees the core a little
#elif defined(__aarch64__)
inline void cpu_relax() { asm volatile("yield"); }
#else
inline void cpu_relax() {}
#endif

namespace {

constexpr int kLanes = MINISGL_LANES;
// vector registers a loop can fill with values: SSE's multiply writes over an operand, so
// there a product needs one of the 16 for a copy
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kVecRegs = 32;
#elif defined(__AVX__)
constexpr int kVecRegs = 16;
#else
constexpr int kVecRegs = 15;
#endif
// v, from here on, lives in a vector register: the compiler may not read it from memory again
// (an empty asm statement that takes v in a register and may have changed it)
template <typename V>
inline void in_register(V& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}
typedef float vecf __attribute__((vector_size(MINISGL_LANES * sizeof(float))));
// A vector of N floats, for code that needs another width than vecf's (N a power of two),
// read from any float address.
template <int N>
struct VecOf {
  typedef float type __attribute__((vector_size(N * sizeof(float))));
};
template <int N>
inline typename VecOf<N>::type load_vec(const float* p) {
  typename VecOf<N>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vecf loadv(const float* p) { return load_vec<kLanes>(p); }
inline void storev(float* p, vecf v) { std::memcpy(p, &v, sizeof(v)); }
// The sum of a vector's lanes, as a tree: the upper half added onto the lower until two lanes
// are left (4 adds for 16 lanes). Added one by one, each of the 15 additions waits for the one
// before; decode attention ended every score in such a sum, and took 1.35x as long with them
// (now it sums a vector of keys' scores at once: attention.h, part 1).
// The halves are shuffles of v's lanes: taken with memcpy instead, GCC kept 16-float vectors
// summed this way in memory, even running sums of a matmul loop (linear.h, part 1).
template <int N, std::size_t... I>
inline float tree_sum(typename VecOf<N>::type v, std::index_sequence<I...>) {
  if constexpr (N == 2) {
    return v[0] + v[1];
  } else {
    const typename VecOf<N / 2>::type lo = __builtin_shufflevector(v, v, I...);
    const typename VecOf<N / 2>::type hi = __builtin_shufflevector(v, v, (N / 2 + I)...);
    return tree_sum<N / 2>(lo + hi, std::make_index_sequence<N / 4>{});
  }
}
template <int N>
inline float hsum_of(typename VecOf<N>::type v) {
  return tree_sum<N>(v, std::make_index_sequence<N / 2>{});
}
inline float hsum(vecf v) { return hsum_of<kLanes>(v); }

// a[0] + ... + a[U - 1], pairwise, one expression once inlined: every index is a constant, so
// the sums stay in registers (as a loop over a, GCC stored them to the stack and read them back)
template <int U, typename V>
inline V sum_pairwise(const V* a) {
  if constexpr (U == 1) return a[0];
  else return sum_pairwise<U / 2>(a) + sum_pairwise<U - U / 2>(a + U / 2);
}

}  // namespace
// --- part 3: dot products and e^x ---
namespace {

// sum(a[i] * b[i]) in four vectors of partial sums (the FMAs into one vector wait for each other)
inline float dot(const float* a, const float* b, int64_t n) {
  vecf acc[4] = {};
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes)
    for (int u = 0; u < 4; ++u) acc[u] += loadv(a + i + u * kLanes) * loadv(b + i + u * kLanes);
  for (; i + kLanes <= n; i += kLanes) acc[0] += loadv(a + i) * loadv(b + i);
  float s = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// e^x for a whole vector. std::exp is one float at a time (about 7 ns each: 1536 of them per
// row of the MLP); here e^x = 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2, e^r by a
// polynomial (Cephes' expf coefficients: within about 1e-7 relative), 2^n written straight
// into the float's exponent bits. x is clamped to where e^x is a finite, normal float.
typedef int32_t veci __attribute__((vector_size(MINISGL_LANES * sizeof(int32_t))));
inline vecf expv(vecf x) {
  const vecf zero = {};
  x = x < zero + 88.3762626647949f ? x : zero + 88.3762626647949f;
  x = x > zero - 87.3365447504019f ? x : zero - 87.3365447504019f;
  const vecf t = x * 1.44269504088896341f;                             // x / ln 2
  const veci n = __builtin_convertvector(t + (t < zero ? zero - 0.5f : zero + 0.5f), veci);
  const vecf nf = __builtin_convertvector(n, vecf);
  const vecf r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;       // x - n ln 2, in two steps
  vecf p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vecf er = p * r * r + r + 1.0f;
  vecf scale;  // 2^n: the biased exponent n + 127 in bits 23..30
  const veci bits = (n + 127) << 23;
  std::memcpy(&scale, &bits, sizeof(scale));
  return er * scale;
}

// y = w * (x / sqrt(mean(x^2) + eps)), the order Hugging Face multiplies in
inline void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / (float)n + eps);
  for (int64_t k = 0; k < n; ++k) y[k] = w[k] * (x[k] * r);
}

}  // namespace
// --- part 4: a call's chunks ---
namespace {

// The caller and (threads - 1) workers share a call's items, `chunk` items at a time: the
// workers take chunks from the front, the caller from the back, until the two meet. A thread
// the OS has paused holds back one chunk at most, never the whole call (with fixed shares, the
// call would wait for its share). The workers start at the front because that is what they
// read ahead (part 5): lines a worker read sit in its own core's cache, and a caller that
// started there would fetch them from the other core (on a Zen 2, one counter for all made the
// decode step 1-2% slower at batches 1 to 8).

// The key and value rows the next decode attention will read (attention.h, part 4): runs of
// consecutive slots of one layer's caches, `row` floats a slot. A worker touches them with
// prefetch hints, not loads: a hint never faults, so a pool freed meanwhile costs nothing.
struct KvRuns {
  static constexpr int kMax = 32;  // runs: one per request whose slots are consecutive
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t row = 0;
  int n = 0;
  int64_t first[kMax] = {}, count[kMax] = {};  // slots first[r] .. first[r] + count[r] - 1
  // the bytes [lo, hi) of run r in the keys (c = 0) or the values (c = 1), as integers: the
  // pool may have been freed, and then these are addresses, never pointers to read through
  std::pair<uintptr_t, uintptr_t> span(int r, int c) const {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(c ? v : k) + first[r] * row * sizeof(float);
    return {lo, lo + count[r] * row * sizeof(float)};
  }
};

// Memory a call asks the workers to read ahead once its chunks are taken: the rows the next
// attention reads, then the weights the next calls will read (linear.h). Between two matmuls of
// a decode step the caller runs a norm, rope, attention, Python: memory would sit idle, and a
// worker would only spin.
struct ReadAhead {
  static constexpr int kSpans = 8;
  const char* lo[kSpans] = {};
  const char* hi[kSpans] = {};
  int n = 0;
  uint64_t frees = 0;  // g_frees when the spans were planned
  KvRuns kv;           // none (n = 0) but after a layer's last matmul before its attention
};

// The workers read ahead with plain loads, which bring each line into the reading core's cache for
// sure; a prefetch is only a hint, which the core may drop (on a Zen 2 the decode step at batch 1
// gained 3% with loads, nothing with prefetches). A load of freed memory kills the process, so the
// workers read only memory that cannot be freed while they read it: the Engine's weight buffer
// (linear.h, part 4), whose deleter first counts itself in g_frees and then waits until no worker
// reads. A worker counts itself in g_reading before it first looks at g_frees, so either the
// deleter sees it and waits, or it sees the new count and reads nothing of a plan made before the
// free.
std::atomic<uint64_t> g_frees{0};  // buffers the workers may read that were freed so far
std::atomic<int> g_reading{0};     // workers reading ahead right now

// Called before memory the workers may read is unmapped. A reader sees the new count within 16
// lines once it runs, so the wait is microseconds; only a worker the OS keeps stopped (a machine
// overloaded for seconds, a debugger) could hold it longer. That wait has a limit, g_free_wait
// seconds: then before_free returns false, and the caller keeps the memory mapped rather than
// wait on (a late read of it stays harmless) and says so.
double g_free_wait = 5.0;
bool before_free() {
  ++g_frees;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; g_reading.load() > 0; ++i) {
    if (i < 4096) {
      cpu_relax();
      continue;
    }
    std::this_thread::yield();
    if (i % 256 == 0) {  // the clock now and then, not on every turn
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - t0;
      if (waited.count() > g_free_wait) return false;
    }
  }
  return true;
}

struct Job {  // one call, on the caller's stack; the workers reach it through Workers::job_
  void (*call)(const void* fn, int64_t lo, int64_t hi);
  const void* fn;
  int64_t total, chunk, chunks;
  ReadAhead ahead;
  std::atomic<int64_t> ends{0}, done{0};  // not yet taken [front, back): back << 32 | front
  int64_t take(bool back) {  // the next chunk from the front or the back; -1: none left
    // one atomic word holds both ends, so a compare-exchange moves one end only if the other
    // has not moved meanwhile: the two can never take the same chunk
    for (int64_t e = ends.load();;) {
      const int64_t f = e & 0xffffffff, b = e >> 32;
      if (f >= b) return -1;
      if (ends.compare_exchange_weak(e, back ? (b - 1) << 32 | f : b << 32 | (f + 1)))
        return back ? b - 1 : f;
    }
  }
  void drain(bool back) {
    for (int64_t c; (c = take(back)) >= 0; done.fetch_add(1))
      call(fn, c * chunk, std::min(total, (c + 1) * chunk));
  }
};

}  // namespace
// --- part 5: threads that wait ---
namespace {

// The kernels' threads. After a call a worker reads ahead what the call named, then spins for
// kSpin -- long enough to catch the next kernel of the same decode step -- then sleeps on a
// condition variable: no thread burns a core between steps, or while other programs need it
// (OpenMP's threads, torch's, spin for milliseconds).
constexpr auto kSpin = std::chrono::microseconds(1000);

class Workers {
  std::vector<std::thread> threads_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> gen_{0};              // one more per call: wakes the workers
  std::atomic<int> inside_{0}, sleeping_{0};  // workers looking at job_, workers asleep
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;

  void wait_for_call(uint64_t seen, const ReadAhead& ahead) {
    // first the rows the next attention reads, a hint per cache line, until a call comes
    for (int r = 0; r < ahead.kv.n; ++r)
      for (int c = 0; c < 2; ++c) {
        auto [p, end] = ahead.kv.span(r, c);
        while (p < end && gen_.load() == seen)
          for (int j = 0; j < 16 && p < end; ++j, p += 64)
            __builtin_prefetch(reinterpret_cast<const void*>(p), 0, 3);
      }
    // then the memory the last call named, one load per cache line, until a call comes or a
    // buffer is freed (part 4: g_reading counts this worker before it looks at g_frees)
    if (ahead.n > 0) {  // most calls (the small ops, attention) name nothing
      ++g_reading;
      for (int s = 0; s < ahead.n; ++s)
        for (const char* p = ahead.lo[s];
             p < ahead.hi[s] && gen_.load() == seen && g_frees.load() == ahead.frees;)
          for (int j = 0; j < 16 && p < ahead.hi[s]; ++j, p += 64)
            static_cast<void>(*reinterpret_cast<const volatile char*>(p));
      --g_reading;
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 1; gen_.load() == seen; ++i) {
      // spin, and after the first few microseconds give the core to any other thread that
      // wants it (torch's own threads, another program): yield returns at once if none does
      i < 256 ? cpu_relax() : std::this_thread::yield();
      if (i % 64 == 0 && std::chrono::steady_clock::now() - t0 > kSpin) {
        std::unique_lock<std::mutex> lock(mu_);  // spun long enough: sleep until a call
        ++sleeping_;
        cv_.wait(lock, [&] { return gen_.load() != seen; });
        --sleeping_;
        return;
      }
    }
  }
  void loop() {
    ReadAhead ahead;
    for (uint64_t seen = 0;;) {
      wait_for_call(seen, ahead);
      seen = gen_.load();
      if (stop_) return;
      ++inside_;
      ahead.n = 0;
      if (Job* job = job_.load()) {
        job->drain(false);
        ahead = job->ahead;  // copied while the caller still waits for this worker
      }
      --inside_;
    }
  }

 public:
  explicit Workers(int n) {
    for (int i = 1; i < n; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~Workers() {
    { std::lock_guard<std::mutex> lock(mu_); stop_ = true; ++gen_; }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return (int)threads_.size() + 1; }

  template <typename F>  // f(lo, hi) over consecutive pieces of [0, total), on every thread
  void run(int64_t total, int64_t chunk, const F& f, const ReadAhead& ahead = {}) {
    if (threads_.empty() || total <= chunk) {
      if (total > 0) f(0, total);
      return;
    }
    chunk = std::max(chunk, (total >> 31) + 1);  // fewer than 2^31 chunks: each end fits 32 bits
    Job job{[](const void* fn, int64_t lo, int64_t hi) { (*static_cast<const F*>(fn))(lo, hi); },
            &f, total, chunk, (total + chunk - 1) / chunk, ahead};
    job.ends.store(job.chunks << 32);
    job_.store(&job);
    ++gen_;
    if (sleeping_.load() > 0) { std::lock_guard<std::mutex> lock(mu_); cv_.notify_all(); }
    job.drain(true);  // the caller works too, then waits only for chunks still being computed
    for (int i = 0; job.done.load() < job.chunks; ++i)
      i < 4096 ? cpu_relax() : std::this_thread::yield();
    job_.store(nullptr);
    while (inside_.load() > 0) cpu_relax();  // a late worker may still be looking at `job`
  }
};

}  // namespace
// --- part 6: one pool for the process ---
namespace {

// One Workers for the process, with as many threads as torch has (the Engine's num_threads),
// rebuilt when that number changes. A forked child has none of its parent's threads: it
// starts without any, and none of them is reading ahead there.
Workers* g_workers = nullptr;
Workers& workers() {
  static const int registered = pthread_atfork(nullptr, nullptr, [] {
    g_workers = nullptr;
    g_reading.store(0);
  });
  (void)registered;
  const int n = std::max(1, at::get_num_threads());
  if (g_workers == nullptr || g_workers->size() != n) {
    delete g_workers;
    g_workers = new Workers(n);
  }
  return *g_workers;
}

// f(lo, hi) over [0, n) in chunks of `chunk` items, spread over the threads (one chunk or
// less: on the calling thread alone).
template <typename F>
void split_rows(int64_t n, int64_t chunk, const F& f) { workers().run(n, chunk, f); }

constexpr int64_t kRowGrain = 64;  // a prefill's rows per chunk in RoPE

// Rows per chunk for a row-by-row op on rows of `width` floats: about `floats` a chunk, so that
// a decode batch's few long rows go to both threads too, not only a prefill's many.
inline int64_t rows_per_chunk(int64_t width, int64_t floats) {
  return std::max<int64_t>(1, floats / std::max<int64_t>(width, 1));
}

// For tests: the chunks of a split of [0, n) that the calling thread took, in its order, and
// those the workers took. Each chunk first waits `us` microseconds, so that the workers have
// time to join in.
std::vector<std::vector<int64_t>> split_order(int64_t n, int64_t chunk, int64_t us) {
  TORCH_CHECK(n >= 0 && chunk >= 1 && us >= 0 && us <= 1000000, "split_order needs n >= 0 "
              "items, chunks of 1 or more and 0 to 1000000 us per chunk; got n=", n, ", chunk=",
              chunk, ", us=", us);
  std::mutex mu;
  std::vector<std::vector<int64_t>> took(2);
  const auto caller = std::this_thread::get_id();
  split_rows(n, chunk, [&](int64_t lo, int64_t) {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(us)) cpu_relax();
    std::lock_guard<std::mutex> lock(mu);
    took[std::this_thread::get_id() == caller ? 0 : 1].push_back(lo / chunk);
  });
  return took;
}

}  // namespace
