// A persistent thread pool whose parallel_for hands out task indices dynamically (one shared atomic counter),
// so that uneven tasks (experts with more tokens) balance, with one counter per NUMA node when the threads
// are grouped by node (a node's threads take only its tasks); and a single-thread executor that runs submitted
// jobs in order, so that Python can submit work and wait for it later.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "numa.h"

namespace hm {

class ThreadPool {
 public:
  // `num_threads` compute threads in all: num_threads - 1 workers plus the thread calling parallel_for.
  // `cpus` (may be empty): pin thread i to cpus[i % cpus.size()]; a calling thread is pinned to cpus[0] on its
  // first call (and one pinned by an earlier pool is unpinned by a pool without cpus).
  // `thread_nodes` (may be empty: all node 0): the NUMA node of each thread; every node needs a thread.
  ThreadPool(int num_threads, std::vector<int> cpus, std::vector<int> thread_nodes = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }
  // Times a worker went to sleep after spinning idle for idle_spin_us() (it then needs a wake-up).
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }
  const std::vector<int>& cpus() const { return cpus_; }
  int num_nodes() const { return num_nodes_; }
  int node_threads(int node) const { return node_threads_[node]; }
  const std::vector<int>& thread_nodes() const { return thread_nodes_; }

  // Calls fn(task, thread) for every task in [0, num_tasks) on all threads (thread 0 = the caller) and
  // returns when all are done; rethrows the first exception a task threw.
  void parallel_for(int64_t num_tasks, const std::function<void(int64_t, int)>& fn);
  // Calls fn(node, task, thread) for every task in [0, tasks_per_node[node]) of every node, each on a thread
  // of that node only. One entry: a plain parallel_for over all threads. Otherwise one entry per node.
  void parallel_for_nodes(const std::vector<int64_t>& tasks_per_node,
                          const std::function<void(int, int64_t, int)>& fn);

 private:
  void worker_main(int thread);
  void run_tasks(int thread);
  void run_node_tasks(int thread);
  void launch_and_join();
  void record_error();

  int num_threads_;
  std::vector<int> cpus_;
  std::vector<int> thread_nodes_, node_threads_;
  int num_nodes_ = 1;
  std::vector<std::thread> workers_;
  // Workers sleep on start_cv_ and the caller on done_cv_ (both under mu_) only after spinning; joining and
  // leaving a task set take no lock (state_, joined_, active_), so that many workers waking at once do not
  // queue on mu_.
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  std::atomic<int> sleepers_{0};             // workers waiting on start_cv_
  std::atomic<uint64_t> sleeps_{0};          // times a worker went to sleep
  std::atomic<bool> caller_waiting_{false};  // the caller waits on done_cv_
  std::atomic<bool> stop_{false};
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  // node mode (parallel_for_nodes with several nodes): one padded counter per node
  struct alignas(64) NodeCounter {
    std::atomic<int64_t> next{0};
    int64_t count = 0;
  };
  const std::function<void(int, int64_t, int)>* node_fn_ = nullptr;
  std::unique_ptr<NodeCounter[]> node_counters_;
  bool node_mode_ = false;
  // The current task set: state_ = generation << 1 | open (open while workers may join it; each set stored
  // before its generation is opened), joined_ workers joined it, and active_ workers are joining, running its
  // tasks or leaving (a worker counts itself active before it checks state_, the caller closes state_ before it
  // waits for active_ to reach 0: one of the two sees the other).
  std::atomic<uint64_t> state_{0};
  std::atomic<int> joined_{0};
  std::atomic<int> active_{0};
  std::exception_ptr error_;
};

// Completion state of one submitted job.
class JobState {
 public:
  void finish(std::string error);
  bool done();
  // Blocks until done; returns the error message ("" on success).
  std::string wait();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
};

// Runs jobs one after another on its own thread (the jobs use the pool, joining it as thread 0).
class Executor {
 public:
  Executor();
  ~Executor();
  std::shared_ptr<JobState> submit(std::function<void()> job);
  // Runs job and returns its error message ("" on success). When nothing is queued or running and `here` is
  // true, on the calling thread (a caller that waits anyway is spared the hand-off to the executor thread and
  // back, two thread wake-ups); otherwise queued behind the others, and waited for.
  std::string run(std::function<void()> job, bool here);
  void drain();  // returns when every submitted job has finished

 private:
  void main_loop();
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<JobState>>> queue_;
  bool running_job_ = false, stop_ = false;
  std::thread thread_;
};

// The process-wide pool and executor. The pool is created on first use for the NUMA topology
// (default_numa_topology) with HYBRIDMOE_NUM_THREADS threads or one per CPU of the topology (one node: the CPUs
// this process may run on, unpinned); with several nodes threads are split over the nodes in proportion to
// their CPUs and pinned to them. configure_threads / configure_numa replace it (after in-flight jobs finish).
// fn(begin, end) over [0, count) in blocks of at least kSmallOpBlockValues values (items of per_item values): on
// the calling thread when that is one block (a hand-off to the pool costs more than a small op), else on the pool.
constexpr int64_t kSmallOpBlockValues = 1 << 16;
template <class Fn>
void for_item_blocks(ThreadPool& pool, int64_t count, int64_t per_item, Fn&& fn) {
  const int64_t per_block = std::max<int64_t>(1, kSmallOpBlockValues / std::max<int64_t>(1, per_item));
  const int64_t blocks = (count + per_block - 1) / per_block;
  if (blocks <= 1) return fn(int64_t{0}, count);
  pool.parallel_for(blocks, [&](int64_t b, int) { fn(b * per_block, std::min(count, (b + 1) * per_block)); });
}

ThreadPool& global_pool();
Executor& global_executor();
// Same topology, `num_threads` threads; `cpus` pins them (one node only: with several, threads follow nodes).
void configure_threads(int num_threads, const std::vector<int>& cpus);
// New topology; num_threads 0 = one per CPU of the topology.
void configure_numa(const NumaTopology& topology, int num_threads);
NumaTopology global_numa_topology();
// How long an idle worker spins for the next task set before it sleeps, in microseconds, for every pool:
// HYBRIDMOE_SPIN_US (read at first use), else kDefaultIdleSpinUs; set_idle_spin_us changes it at once, for
// workers spinning now too. A worker that slept needs a wake-up, and on a VM a vCPU left idle computes its next
// call slower (docs/kernels.md, "Threads and async"); a spinning worker holds its CPU.
constexpr int64_t kDefaultIdleSpinUs = 100;
constexpr int64_t kMaxIdleSpinUs = 10'000'000;
int64_t idle_spin_us();
void set_idle_spin_us(int64_t us);  // 0 <= us <= kMaxIdleSpinUs
int available_cpus();
// The CPUs this process could run on when the library was loaded (before any thread was pinned).
std::vector<int> initial_cpus();

// Clears the flush-to-zero / denormals-are-zero modes on this thread (FP8 subnormals decode through
// float32 denormals).
void enable_denormals();

}  // namespace hm
