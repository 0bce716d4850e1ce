// Thread pool, job executor and the process-wide instances (see thread_pool.h).
#include "thread_pool.h"

#include <algorithm>
#include <chrono>
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

constexpr int kSpinIterations = 4000;  // ~0.1-0.3 ms of pause: the caller's wait for its workers before sleeping

// -1: not read yet (HYBRIDMOE_SPIN_US is read at first use)
std::atomic<int64_t> g_idle_spin_us{-1};

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

#if defined(__linux__)
// The CPUs the process could use when the library was loaded (before any pinning).
const cpu_set_t g_initial_affinity = [] {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0)
    for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  return set;
}();
#endif

void unpin_current_thread() {
#if defined(__linux__)
  pthread_setaffinity_np(pthread_self(), sizeof(g_initial_affinity), &g_initial_affinity);
#endif
}

// The CPU a pool pinned the calling thread to as its thread 0 (-1: not pinned by a pool).
thread_local int t_caller_cpu = -1;

// A job's error message ("" on success).
std::string run_job(const std::function<void()>& job) {
  try {
    job();
  } catch (const std::exception& e) {
    return e.what()[0] ? e.what() : "unknown error in expert kernels";
  } catch (...) {
    return "unknown error in expert kernels";
  }
  return "";
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

std::vector<int> initial_cpus() {
  std::vector<int> cpus;
#if defined(__linux__)
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &g_initial_affinity)) cpus.push_back(c);
#endif
  return cpus;
}

ThreadPool::ThreadPool(int num_threads, std::vector<int> cpus, std::vector<int> thread_nodes)
    : num_threads_(num_threads), cpus_(std::move(cpus)), thread_nodes_(std::move(thread_nodes)) {
  if (num_threads < 1) throw std::invalid_argument("thread pool: num_threads must be >= 1");
  idle_spin_us();  // a bad HYBRIDMOE_SPIN_US throws here, before a worker reads it
  if (thread_nodes_.empty()) thread_nodes_.assign(static_cast<size_t>(num_threads), 0);
  if (static_cast<int>(thread_nodes_.size()) != num_threads)
    throw std::invalid_argument("thread pool: one NUMA node per thread needed");
  num_nodes_ = *std::max_element(thread_nodes_.begin(), thread_nodes_.end()) + 1;
  node_threads_.assign(static_cast<size_t>(num_nodes_), 0);
  for (int node : thread_nodes_) {
    if (node < 0) throw std::invalid_argument("thread pool: negative NUMA node");
    ++node_threads_[node];
  }
  for (int n = 0; n < num_nodes_; ++n)
    if (!node_threads_[n]) throw std::invalid_argument("thread pool: NUMA node " + std::to_string(n) + " has no thread");
  node_counters_.reset(new NodeCounter[static_cast<size_t>(num_nodes_)]);
  for (int t = 1; t < num_threads_; ++t) workers_.emplace_back([this, t] { worker_main(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  state_.store(((state_.load() >> 1) + 1) << 1);  // a new generation, closed: the workers wake and see stop_
  { std::lock_guard<std::mutex> lock(mu_); }
  start_cv_.notify_all();
  for (std::thread& w : workers_) w.join();
}

void ThreadPool::record_error() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_) error_ = std::current_exception();
  next_task_.store(num_tasks_, std::memory_order_relaxed);  // stop handing out tasks
  for (int n = 0; n < num_nodes_; ++n)
    node_counters_[n].next.store(node_counters_[n].count, std::memory_order_relaxed);
}

void ThreadPool::run_tasks(int thread) {
  if (node_mode_) return run_node_tasks(thread);
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= num_tasks_) return;
    try {
      (*fn_)(task, thread);
    } catch (...) {
      record_error();
    }
  }
}

void ThreadPool::run_node_tasks(int thread) {
  const int node = thread_nodes_[thread];
  NodeCounter& counter = node_counters_[node];
  for (;;) {
    const int64_t task = counter.next.fetch_add(1, std::memory_order_relaxed);
    if (task >= counter.count) return;
    try {
      (*node_fn_)(node, task, thread);
    } catch (...) {
      record_error();
    }
  }
}

void ThreadPool::worker_main(int thread) {
  using Clock = std::chrono::steady_clock;
  enable_denormals();
  if (!cpus_.empty()) pin_current_thread(cpus_[thread % cpus_.size()]);
  uint64_t seen = 0;  // the last generation this worker looked at
  for (;;) {
    // Spin for the next parallel_for (decode issues several per layer) for idle_spin_us(), read again as it
    // spins, then sleep. The caller wakes sleepers after it opens a set; a worker counts itself a sleeper before
    // it checks the state under mu_, so that one of the two sees the other.
    uint64_t state = state_.load(std::memory_order_acquire);
    const Clock::time_point idle_since = Clock::now();
    for (int i = 0; (state >> 1) == seen; ++i) {
      if (i % 64 == 0 && Clock::now() - idle_since >= std::chrono::microseconds(idle_spin_us())) break;
      cpu_relax();
      state = state_.load(std::memory_order_acquire);
    }
    if ((state >> 1) == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      sleepers_.fetch_add(1);
      start_cv_.wait(lock, [&] { return (state_.load() >> 1) != seen; });
      sleepers_.fetch_sub(1);
      state = state_.load();
    }
    seen = state >> 1;
    if (stop_.load()) return;
    // Join the set only while it is open: thread 0 closes a flat one once every task is taken, so that a worker
    // slow to wake (an idle vCPU can take 0.1-0.7 ms) does not hold up its return.
    active_.fetch_add(1);
    if (state_.load() == (seen << 1 | 1)) {
      joined_.fetch_add(1);
      run_tasks(thread);
    }
    if (active_.fetch_sub(1) == 1 && caller_waiting_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t num_tasks, const std::function<void(int64_t, int)>& fn) {
  if (num_tasks <= 0) return;
  if (num_tasks == 1) {  // nothing to share: waking the workers would only add their hand-off
    fn(0, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    node_mode_ = false;
    fn_ = &fn;
    num_tasks_ = num_tasks;
    next_task_.store(0, std::memory_order_relaxed);
  }
  launch_and_join();
}

void ThreadPool::parallel_for_nodes(const std::vector<int64_t>& tasks_per_node,
                                    const std::function<void(int, int64_t, int)>& fn) {
  if (tasks_per_node.size() == 1) {
    parallel_for(tasks_per_node[0], [&](int64_t task, int thread) { fn(0, task, thread); });
    return;
  }
  if (static_cast<int>(tasks_per_node.size()) != num_nodes_)
    throw std::invalid_argument("work split for " + std::to_string(tasks_per_node.size()) +
                                " NUMA nodes, but the thread pool has " + std::to_string(num_nodes_));
  int64_t total = 0;
  for (int64_t n : tasks_per_node) total += std::max<int64_t>(n, 0);
  if (total == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    node_mode_ = true;
    node_fn_ = &fn;
    for (int n = 0; n < num_nodes_; ++n) {
      node_counters_[n].count = tasks_per_node[n];
      node_counters_[n].next.store(0, std::memory_order_relaxed);
    }
  }
  launch_and_join();
}

// Opens the task set stored by the caller to the workers (waking any that sleep), runs tasks as thread 0 and
// waits for the workers that joined the set (every worker, for a node-split set).
void ThreadPool::launch_and_join() {
  const int caller_cpu = cpus_.empty() ? -1 : cpus_[0];
  if (t_caller_cpu != caller_cpu) {  // pin the caller, or unpin one an earlier pool pinned
    if (caller_cpu < 0) unpin_current_thread();
    else pin_current_thread(caller_cpu);
    t_caller_cpu = caller_cpu;
  }
  joined_.store(0);
  const uint64_t generation = (state_.load() >> 1) + 1;
  state_.store(generation << 1 | 1);  // opens the set stored before it
  if (sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> lock(mu_); }  // a sleeper is either waiting now or will see the new state
    start_cv_.notify_all();
  }
  run_tasks(0);
  // Flat: every task is taken, so close the set and wait for the workers that joined it only. Nodes: a node's
  // tasks wait for its own threads, so every worker must join (and finish) first.
  const int must_join = node_mode_ ? num_threads_ - 1 : 0;
  if (!node_mode_) state_.store(generation << 1);
  auto finished = [&] { return joined_.load() >= must_join && active_.load() == 0; };
  for (int i = 0; i < kSpinIterations && !finished(); ++i) cpu_relax();
  if (!finished()) {
    std::unique_lock<std::mutex> lock(mu_);
    caller_waiting_.store(true);
    done_cv_.wait(lock, finished);
    caller_waiting_.store(false);
  }
  state_.store(generation << 1);
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = nullptr;
    node_fn_ = nullptr;
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

std::string Executor::run(std::function<void()> job, bool here) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!here || running_job_ || !queue_.empty()) {
      lock.unlock();
      return submit(std::move(job))->wait();
    }
    running_job_ = true;
  }
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned int mxcsr = _mm_getcsr();  // the caller's own setting (torch may flush denormals) comes back
#endif
  enable_denormals();
  std::string error = run_job(job);
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr(mxcsr);
#endif
  bool queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_job_ = false;
    queued = !queue_.empty();
  }
  // Only a job submitted meanwhile needs the executor thread: waking it for nothing costs a futex syscall and a
  // context switch per call.
  if (queued) cv_.notify_one();
  idle_cv_.notify_all();
  return error;
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
      cv_.wait(lock, [&] { return (stop_ && !running_job_) || (!queue_.empty() && !running_job_); });
      if (queue_.empty()) return;  // stop_ and nothing left
      job = std::move(queue_.front().first);
      state = std::move(queue_.front().second);
      queue_.pop_front();
      running_job_ = true;
    }
    std::string error = run_job(job);
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
std::unique_ptr<NumaTopology> g_numa;

int env_threads() {
  if (const char* env = std::getenv("HYBRIDMOE_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || n < 1 || n > 4096)
      throw std::invalid_argument(std::string("HYBRIDMOE_NUM_THREADS must be a positive integer, got '") + env + "'");
    return static_cast<int>(n);
  }
  return 0;
}

// A pool of num_threads (0: one per CPU of the topology) for `topology`; caller holds g_pool_mu.
std::unique_ptr<ThreadPool> make_pool(const NumaTopology& topology, int num_threads, std::vector<int> cpus) {
  const int N = topology.num_nodes();
  if (N == 1) {
    // a node given by an override pins its threads to its CPUs; a detected one leaves them free
    if (cpus.empty() && topology.emulated) cpus = topology.node_cpus[0];
    if (num_threads == 0) num_threads = env_threads();
    if (num_threads == 0) num_threads = topology.emulated ? static_cast<int>(cpus.size()) : available_cpus();
    return std::make_unique<ThreadPool>(num_threads, std::move(cpus));
  }
  if (!cpus.empty())
    throw std::invalid_argument("with " + std::to_string(N) + " NUMA nodes threads are pinned to their node's CPUs; "
                                "set the nodes' CPUs with configure_numa instead of pinning threads");
  if (num_threads == 0) num_threads = env_threads();
  if (num_threads == 0) num_threads = topology.total_cpus();
  if (num_threads < N)
    throw std::invalid_argument("need at least one thread per NUMA node: " + std::to_string(num_threads) +
                                " threads for " + std::to_string(N) + " nodes");
  // Node n gets a share of the threads in proportion to its CPUs (at least one), threads grouped by node.
  const int total = topology.total_cpus();
  std::vector<int> count(static_cast<size_t>(N), 1);
  int left = num_threads - N;
  for (int n = 0; n < N; ++n) {
    const int share = static_cast<int>(static_cast<int64_t>(num_threads) * topology.node_cpus[n].size() / total) - 1;
    count[n] += std::max(0, std::min(left, share));
    left -= count[n] - 1;
  }
  for (int n = 0; left > 0; n = (n + 1) % N, --left) ++count[n];
  std::vector<int> thread_nodes, thread_cpus;
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < count[n]; ++j) {
      thread_nodes.push_back(n);
      thread_cpus.push_back(topology.node_cpus[n][j % topology.node_cpus[n].size()]);
    }
  return std::make_unique<ThreadPool>(num_threads, std::move(thread_cpus), std::move(thread_nodes));
}

const NumaTopology& numa_locked() {
  if (!g_numa) {
    NumaTopology topology = default_numa_topology();
    if (topology.emulated) validate_numa_topology(topology, initial_cpus());  // HYBRIDMOE_NUMA_NODES
    g_numa = std::make_unique<NumaTopology>(std::move(topology));
  }
  return *g_numa;
}

}  // namespace

int64_t idle_spin_us() {
  int64_t us = g_idle_spin_us.load(std::memory_order_relaxed);
  if (us >= 0) return us;
  us = kDefaultIdleSpinUs;
  if (const char* env = std::getenv("HYBRIDMOE_SPIN_US")) {
    char* end = nullptr;
    const long long n = std::strtoll(env, &end, 10);
    if (end == env || *end != '\0' || n < 0 || n > kMaxIdleSpinUs)
      throw std::invalid_argument("HYBRIDMOE_SPIN_US must be an integer between 0 and " +
                                  std::to_string(kMaxIdleSpinUs) + " (microseconds), got '" + env + "'");
    us = n;
  }
  int64_t unread = -1;
  g_idle_spin_us.compare_exchange_strong(unread, us, std::memory_order_relaxed);
  return g_idle_spin_us.load(std::memory_order_relaxed);
}

void set_idle_spin_us(int64_t us) {
  if (us < 0 || us > kMaxIdleSpinUs)
    throw std::invalid_argument("idle spin must be between 0 and " + std::to_string(kMaxIdleSpinUs) +
                                " microseconds, got " + std::to_string(us));
  g_idle_spin_us.store(us, std::memory_order_relaxed);
}

Executor& global_executor() {
  static Executor* executor = new Executor();  // never destroyed: jobs may still run at interpreter exit
  return *executor;
}

ThreadPool& global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) g_pool = make_pool(numa_locked(), 0, {});
  return *g_pool;
}

NumaTopology global_numa_topology() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  return numa_locked();
}

void configure_threads(int num_threads, const std::vector<int>& cpus) {
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
  global_executor().drain();
  std::lock_guard<std::mutex> lock(g_pool_mu);
  std::unique_ptr<ThreadPool> pool = make_pool(numa_locked(), num_threads, cpus);  // throws before replacing
  g_pool = std::move(pool);
}

void configure_numa(const NumaTopology& topology, int num_threads) {
  validate_numa_topology(topology, initial_cpus());
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0, got " + std::to_string(num_threads));
  global_executor().drain();
  std::lock_guard<std::mutex> lock(g_pool_mu);
  std::unique_ptr<ThreadPool> pool = make_pool(topology, num_threads, {});
  g_pool = std::move(pool);
  g_numa = std::make_unique<NumaTopology>(topology);
}

}  // namespace hm
