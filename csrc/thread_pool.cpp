// Thread pool, job executor and the process-wide instances (see thread_pool.h).
#include "thread_pool.h"

#include <cstdlib>
#include <stdexcept>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace hm {

namespace {

constexpr int kSpinIterations = 4000;  // ~0.1-0.3 ms of pause before sleeping

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

void pin_current_thread(int cpu) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
#else
  (void)cpu;
#endif
}

}  // namespace

void enable_denormals() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr(_mm_getcsr() & ~(0x8040u));  // FTZ (bit 15) and DAZ (bit 6) off
#endif
}

int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

ThreadPool::ThreadPool(int num_threads, std::vector<int> cpus) : num_threads_(num_threads), cpus_(std::move(cpus)) {
  if (num_threads < 1) throw std::invalid_argument("thread pool: num_threads must be >= 1");
  for (int t = 1; t < num_threads_; ++t) workers_.emplace_back([this, t] { worker_main(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  start_cv_.notify_all();
  for (std::thread& w : workers_) w.join();
}

void ThreadPool::run_tasks(int thread) {
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= num_tasks_) return;
    try {
      (*fn_)(task, thread);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      next_task_.store(num_tasks_, std::memory_order_relaxed);  // stop handing out tasks
    }
  }
}

void ThreadPool::worker_main(int thread) {
  enable_denormals();
  if (!cpus_.empty()) pin_current_thread(cpus_[thread % cpus_.size()]);
  uint64_t seen = 0;
  for (;;) {
    // Spin briefly for the next parallel_for (decode issues several per layer), then sleep.
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int i = 0; i < kSpinIterations && gen == seen; ++i) {
      cpu_relax();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      gen = generation_.load(std::memory_order_acquire);
    }
    seen = gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    run_tasks(thread);
    if (busy_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t num_tasks, const std::function<void(int64_t, int)>& fn) {
  if (num_tasks <= 0) return;
  if (!caller_pinned_ && !cpus_.empty()) {
    pin_current_thread(cpus_[0]);
    caller_pinned_ = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    num_tasks_ = num_tasks;
    error_ = nullptr;
    next_task_.store(0, std::memory_order_relaxed);
    busy_workers_.store(num_threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  start_cv_.notify_all();
  run_tasks(0);
  for (int i = 0; i < kSpinIterations && busy_workers_.load(std::memory_order_acquire) != 0; ++i) cpu_relax();
  if (busy_workers_.load(std::memory_order_acquire) != 0) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return busy_workers_.load(std::memory_order_acquire) == 0; });
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = nullptr;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

void JobState::finish(std::string error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

bool JobState::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::string JobState::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  return error_;
}

Executor::Executor() : thread_([this] { main_loop(); }) {}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<JobState> Executor::submit(std::function<void()> job) {
  auto state = std::make_shared<JobState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(job), state);
  }
  cv_.notify_one();
  return state;
}

void Executor::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !running_job_; });
}

void Executor::main_loop() {
  enable_denormals();
  for (;;) {
    std::function<void()> job;
    std::shared_ptr<JobState> state;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      job = std::move(queue_.front().first);
      state = std::move(queue_.front().second);
      queue_.pop_front();
      running_job_ = true;
    }
    std::string error;
    try {
      job();
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "unknown error in expert kernels";
    } catch (...) {
      error = "unknown error in expert kernels";
    }
    job = nullptr;
    state->finish(std::move(error));
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_job_ = false;
    }
    idle_cv_.notify_all();
  }
}

namespace {

std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool;

int default_threads() {
  if (const char* env = std::getenv("HYBRIDMOE_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || n < 1 || n > 4096)
      throw std::invalid_argument(std::string("HYBRIDMOE_NUM_THREADS must be a positive integer, got '") + env + "'");
    return static_cast<int>(n);
  }
  return available_cpus();
}

}  // namespace

Executor& global_executor() {
  static Executor* executor = new Executor();  // never destroyed: jobs may still run at interpreter exit
  return *executor;
}

ThreadPool& global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(default_threads(), std::vector<int>{});
  return *g_pool;
}

void configure_threads(int num_threads, const std::vector<int>& cpus) {
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
  global_executor().drain();
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_pool.reset();
  g_pool = std::make_unique<ThreadPool>(num_threads, cpus);
}

}  // namespace hm
