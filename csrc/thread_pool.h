// A persistent thread pool whose parallel_for hands out task indices dynamically (one shared atomic counter),
// so that uneven tasks (experts with more tokens) balance; and a single-thread executor that runs submitted
// jobs in order, so that Python can submit work and wait for it later.
#pragma once

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

namespace hm {

class ThreadPool {
 public:
  // `num_threads` compute threads in all: num_threads - 1 workers plus the thread calling parallel_for.
  // `cpus` (may be empty): pin thread i to cpus[i % cpus.size()]; the caller is pinned on its first call.
  ThreadPool(int num_threads, std::vector<int> cpus);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }
  const std::vector<int>& cpus() const { return cpus_; }

  // Calls fn(task, thread) for every task in [0, num_tasks) on all threads (thread 0 = the caller) and
  // returns when all are done; rethrows the first exception a task threw.
  void parallel_for(int64_t num_tasks, const std::function<void(int64_t, int)>& fn);

 private:
  void worker_main(int thread);
  void run_tasks(int thread);

  int num_threads_;
  std::vector<int> cpus_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::atomic<int> busy_workers_{0};
  std::exception_ptr error_;
  bool caller_pinned_ = false;
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
  void drain();  // returns when every submitted job has finished

 private:
  void main_loop();
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<JobState>>> queue_;
  bool running_job_ = false, stop_ = false;
  std::thread thread_;
};

// The process-wide pool and executor. The pool is created on first use with HYBRIDMOE_NUM_THREADS or the
// number of CPUs this process may run on; configure_threads replaces it (after in-flight jobs finish).
ThreadPool& global_pool();
Executor& global_executor();
void configure_threads(int num_threads, const std::vector<int>& cpus);
int available_cpus();

// Clears the flush-to-zero / denormals-are-zero modes on this thread (FP8 subnormals decode through
// float32 denormals).
void enable_denormals();

}  // namespace hm
