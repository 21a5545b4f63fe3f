"""The 2-7-row matmul loop at two vector widths: why an AVX-512 build takes 8 floats there.

Chapter 07's ``linear_few_rows`` (``linear.h`` part 1) runs in 16-float vectors at one row and,
in an AVX-512 build, in 8-float vectors from 2 rows on. This benchmark is the measurement
behind that choice, outside the library so that one build holds both widths: a C++ program
(compiled here with the system's C++ compiler and ``-march=native``, no torch) with the same
loop as part 1 (S streams of weight rows, each x vector and weight vector loaded once a pass,
a prefetch ``ahead`` floats on from 2 rows), the 121 matmuls' shapes of SmolLM2-135M in one
538 MB buffer, both halves of every weight's rows on two threads. Each round passes over all
121 weights once per variant; reported per variant: the median pass and the median of the
rounds' ratios to the 1-row loop's pass (16-float vectors, as the library runs it).

    python benchmarks/bench_few_rows_width.py [--rounds 9]

Prints only (the figures go in a note and the README's session 56 section).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.measure import c_compiler, cpu_info

CXX_SOURCE = r"""
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <sys/mman.h>
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
template <typename V> V ld(const float* p) { V v; std::memcpy(&v, p, sizeof(V)); return v; }
template <typename V> void in_register(V& v) {  // as common.h's: v stays in a register
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("" : "+x"(v));
#elif defined(__aarch64__)
  asm volatile("" : "+w"(v));
#endif
}

// part 1's loop: MM rows of x, S streams, U sums per row and stream, L = sizeof(V) / 4 floats
template <typename V, int MM, int S, int U>
void few(const float* x, const float* w, int64_t K, float* y, int64_t N, int64_t lo,
         int64_t hi, int64_t ahead) {
  constexpr int L = sizeof(V) / 4;
  const int64_t q = (hi - lo) / S;
  for (int64_t i = 0; i < q; ++i) {
    const float* ws[S];
    for (int s = 0; s < S; ++s) ws[s] = w + (lo + s * q + i) * K;
    V acc[MM][S][U] = {};
    for (int64_t k = 0; k + U * L <= K; k += U * L)
      for (int u = 0; u < U; ++u) {
        V xv[MM];
        for (int m = 0; m < MM; ++m) {
          xv[m] = ld<V>(x + m * K + k + u * L);
          if (MM > 1) in_register(xv[m]);
        }
        for (int s = 0; s < S; ++s) {
          if (MM > 1 && u * L % 16 == 0) __builtin_prefetch(ws[s] + k + u * L + ahead, 0, 1);
          V a = ld<V>(ws[s] + k + u * L);
          if (MM > 1) in_register(a);
          for (int m = 0; m < MM; ++m) acc[m][s][u] += xv[m] * a;
        }
      }
    for (int m = 0; m < MM; ++m)
      for (int s = 0; s < S; ++s) {
        V t = acc[m][s][0];
        for (int u = 1; u < U; ++u) t += acc[m][s][u];
        float sum = 0;
        for (int l = 0; l < L; ++l) sum += t[l];
        y[m * N + lo + s * q + i] = sum;
      }
  }
  if constexpr (S > 1)
    if (lo + S * q < hi) few<V, MM, 1, U>(x, w, K, y, N, lo + S * q, hi, ahead);
}

typedef void (*Fn)(const float*, const float*, int64_t, float*, int64_t, int64_t, int64_t,
                   int64_t);
struct Weight { const float* p; int64_t N, K; };
struct Variant { const char* name; Fn fn; };
std::vector<Weight> g_weights;
std::vector<float> g_x(8 * 1536, 0.5f), g_y(8 * 49152);
std::atomic<int> g_arrived{0}, g_phase{0};

void pass(Fn fn, int t) {  // this thread's half of every weight's rows, a barrier after each
  for (const Weight& w : g_weights) {
    const int64_t half = w.N / 2;
    fn(g_x.data(), w.p, w.K, g_y.data(), w.N, t ? half : 0, t ? w.N : half, 1024);
    const int ph = g_phase.load();
    if (g_arrived.fetch_add(1) == 1) { g_arrived.store(0); g_phase.fetch_add(1); }
    else while (g_phase.load() == ph) {}
  }
}

int main(int argc, char** argv) {  // rounds: prints variant, round, seconds
  const int rounds = atoi(argv[1]);
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int l = 0; l < 30; ++l)
    for (auto s : {std::pair<int64_t, int64_t>{960, 576}, {576, 576}, {3072, 576}, {576, 1536}})
      shapes.push_back(s);
  shapes.push_back({49152, 576});
  size_t total = 0;
  for (auto& s : shapes) total += s.first * s.second;
  char* raw = (char*)mmap(0, total * 4 + (2 << 20), PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) { perror("mmap"); return 1; }
  float* buf = (float*)(((uintptr_t)raw + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1));
  for (size_t i = 0; i < total; ++i) buf[i] = (i % 7) * 0.01f;
  size_t off = 0;
  for (auto& s : shapes) { g_weights.push_back({buf + off, s.first, s.second}); off += s.first * s.second; }
  const Variant vars[] = {
      {"1 row, 16-float vectors (as built)", few<v16, 1, 4, 2>},
      {"4 rows, 16-float vectors", few<v16, 4, 3, 1>},
      {"4 rows, 8-float vectors (as built)", few<v8, 4, 3, 1>},
      {"7 rows, 16-float vectors", few<v16, 7, 2, 1>},
      {"7 rows, 8-float vectors (as built)", few<v8, 7, 2, 1>},
  };
  const int n = sizeof(vars) / sizeof(vars[0]);
  std::atomic<int> go{0}, done{0};
  std::atomic<bool> stop{false};
  std::atomic<Fn> cur{nullptr};
  std::thread worker([&] {
    for (int seen = 0;;) {
      while (go.load() == seen) {}
      seen = go.load();
      if (stop) return;
      pass(cur.load(), 1);
      done.fetch_add(1);
    }
  });
  for (int r = 0; r < rounds; ++r)
    for (int j = 0; j < n; ++j) {
      const int v = r % 2 ? n - 1 - j : j;  // alternate the order from round to round
      cur.store(vars[v].fn);
      const int d = done.load();
      const auto t0 = std::chrono::steady_clock::now();
      go.fetch_add(1);
      pass(vars[v].fn, 0);
      while (done.load() == d) {}
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      printf("%d\t%d\t%.9f\t%s\n", v, r, dt.count(), vars[v].name);
    }
  stop = true;
  go.fetch_add(1);
  worker.join();
  return 0;
}
"""


def main() -> None:
    import argparse
    import statistics

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be 1 or more, got {args.rounds}")
    cxx = c_compiler("bench_few_rows_width", cxx=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "width.cpp", Path(tmp) / "width"
        src.write_text(CXX_SOURCE)
        r = subprocess.run([cxx, "-O3", "-march=native", "-std=c++17", "-falign-loops=64",
                            "-pthread", str(src), "-o", str(exe)], capture_output=True,
                           text=True, timeout=300, check=False)
        if r.returncode:
            raise SystemExit(f"{cxx} could not compile the benchmark: {r.stderr.strip()[-500:]}")
        try:
            out = subprocess.run([str(exe), str(args.rounds)], capture_output=True, text=True,
                                 timeout=1800, check=True).stdout
        except subprocess.TimeoutExpired:
            raise SystemExit("the benchmark took over 30 minutes (a few seconds a round when "
                             "idle): is the machine very busy?") from None
    sec: dict[int, dict[int, float]] = {}
    names = {}
    for line in out.splitlines():
        v, rnd, t, name = line.split("\t")
        sec.setdefault(int(v), {})[int(rnd)] = float(t)
        names[int(v)] = name
    model, isa = cpu_info()
    print(f"{model} ({isa}), {os.cpu_count()} CPUs; 2 threads; 538 MB a pass (SmolLM2-135M's "
          f"121 matmuls); {args.rounds} interleaved rounds\n")
    print("| variant | pass, ms | GB/s | against 1 row, paired |")
    print("|---|---:|---:|---:|")
    for v in sorted(sec):
        med = statistics.median(sec[v].values())
        ratio = statistics.median(sec[v][r] / sec[0][r] for r in sec[v])
        print(f"| {names[v]} | {med * 1e3:.2f} | {538e6 / med / 1e9:.1f} | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
