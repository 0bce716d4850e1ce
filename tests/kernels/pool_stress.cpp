// The thread pool's task sets under stress, for test_pool_stress.py (built there with ThreadSanitizer): many short
// parallel_for and parallel_for_nodes calls back to back on more threads than CPUs, with the idle spin at 0 and
// short pauses in between so that workers also go to sleep and must be woken; every task must run exactly once a
// call (once on each node for a node-split call). Prints "ok" or the first wrong counts; exit status 1 on any.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "thread_pool.h"

int main() {
  using hm::ThreadPool;
  constexpr int kThreads = 6, kCalls = 3000;
  int failures = 0;
  for (int nodes : {1, 3}) {
    std::vector<int> thread_nodes;
    for (int t = 0; t < kThreads; ++t) thread_nodes.push_back(t % nodes);
    ThreadPool pool(kThreads, {}, thread_nodes);
    for (int call = 0; call < kCalls; ++call) {
      hm::set_idle_spin_us(call % 2 ? 0 : hm::kDefaultIdleSpinUs);  // every other call, workers sleep at once
      if (call % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
      const int n = 1 + call % 37;
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      for (auto& r : runs) r.store(0);
      if (nodes == 1) {
        pool.parallel_for(n, [&](int64_t task, int) { runs[task].fetch_add(1); });
      } else {
        pool.parallel_for_nodes(std::vector<int64_t>(nodes, n),
                                [&](int, int64_t task, int) { runs[task].fetch_add(1); });
      }
      for (int i = 0; i < n; ++i)
        if (runs[i].load() != nodes && ++failures <= 5)
          std::printf("%d node(s), call %d, task %d: %d runs\n", nodes, call, i, runs[i].load());
    }
  }
  std::printf("%s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
