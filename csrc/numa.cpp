// NUMA topology detection, cpulist parsing and node-bound memory (see numa.h).
#include "numa.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <new>
#include <set>
#include <sstream>
#include <stdexcept>

#include "thread_pool.h"

#if defined(__linux__)
#include <dirent.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hm {

int NumaTopology::total_cpus() const {
  int n = 0;
  for (const auto& cpus : node_cpus) n += static_cast<int>(cpus.size());
  return n;
}

std::string NumaTopology::describe() const {
  std::string s = std::to_string(num_nodes()) + (num_nodes() == 1 ? " node" : " nodes") +
                  (emulated ? " (emulated)" : " (detected)") +
                  (copy_shards ? ", experts copied at load into huge-page node memory" : "");
  for (int n = 0; n < num_nodes(); ++n)
    s += "; node " + std::to_string(n) + " cpus " + format_cpulist(node_cpus[n]) + " memory " +
         (memory_node[n] >= 0 ? std::to_string(memory_node[n]) : std::string("unbound"));
  return s;
}

std::vector<int> parse_cpulist(const std::string& text, const std::string& what) {
  std::vector<int> cpus;
  std::stringstream ss(text);
  std::string item;
  auto bad = [&](const std::string& why) {
    throw std::invalid_argument(what + ": bad cpulist '" + text + "' (" + why + "; expected e.g. 0-3,8)");
  };
  while (std::getline(ss, item, ',')) {
    item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
    if (item.empty()) bad("empty item");
    const size_t dash = item.find('-');
    char* end = nullptr;
    const long lo = std::strtol(item.c_str(), &end, 10);
    if (end == item.c_str() || (dash == std::string::npos ? *end != '\0' : *end != '-')) bad("'" + item + "'");
    long hi = lo;
    if (dash != std::string::npos) {
      const char* start = item.c_str() + dash + 1;
      hi = std::strtol(start, &end, 10);
      if (end == start || *end != '\0') bad("'" + item + "'");
    }
    if (lo < 0 || hi < lo || hi > 65535) bad("range '" + item + "'");
    for (long c = lo; c <= hi; ++c) cpus.push_back(static_cast<int>(c));
  }
  if (cpus.empty()) bad("no CPUs");
  return cpus;
}

std::string format_cpulist(const std::vector<int>& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    s += (s.empty() ? "" : ",") + std::to_string(cpus[i]) + (j > i ? "-" + std::to_string(cpus[j]) : "");
    i = j + 1;
  }
  return s;
}

namespace {

// The CPUs this process may use (as when the library was loaded: the calling thread may be pinned since).
std::set<int> allowed_cpus() {
  const std::vector<int> initial = initial_cpus();
  std::set<int> cpus(initial.begin(), initial.end());
  if (cpus.empty())
    for (int c = 0; c < available_cpus(); ++c) cpus.insert(c);
  return cpus;
}

NumaTopology one_node(const std::set<int>& cpus) {
  NumaTopology t;
  t.node_cpus.push_back(std::vector<int>(cpus.begin(), cpus.end()));
  t.memory_node.push_back(-1);
  return t;
}

}  // namespace

NumaTopology detect_numa_topology() {
  const std::set<int> allowed = allowed_cpus();
  NumaTopology t;
#if defined(__linux__)
  std::vector<int> node_ids;
  if (DIR* dir = opendir("/sys/devices/system/node")) {
    while (dirent* entry = readdir(dir)) {
      const std::string name = entry->d_name;
      if (name.size() > 4 && name.compare(0, 4, "node") == 0 &&
          name.find_first_not_of("0123456789", 4) == std::string::npos)
        node_ids.push_back(std::atoi(name.c_str() + 4));
    }
    closedir(dir);
  }
  std::sort(node_ids.begin(), node_ids.end());
  for (int id : node_ids) {
    std::ifstream f("/sys/devices/system/node/node" + std::to_string(id) + "/cpulist");
    std::string text;
    if (!std::getline(f, text) || text.empty()) continue;  // memory-only node
    std::vector<int> cpus;
    for (int c : parse_cpulist(text, "node" + std::to_string(id) + "/cpulist"))
      if (allowed.count(c)) cpus.push_back(c);
    if (cpus.empty()) continue;
    t.node_cpus.push_back(cpus);
    t.memory_node.push_back(id);
  }
#endif
  if (t.node_cpus.empty()) return one_node(allowed);
  if (t.num_nodes() == 1) t.memory_node[0] = -1;  // one node: nothing to place
  t.copy_shards = t.num_nodes() > 1;
  return t;
}

NumaTopology default_numa_topology() {
  const char* env = std::getenv("HYBRIDMOE_NUMA_NODES");
  NumaTopology t;
  if (!env || !*env) {
    t = detect_numa_topology();
  } else {
    t.emulated = true;
    std::stringstream ss(env);
    std::string node;
    while (std::getline(ss, node, ';')) {
      t.node_cpus.push_back(parse_cpulist(node, "HYBRIDMOE_NUMA_NODES node " + std::to_string(t.num_nodes())));
      t.memory_node.push_back(-1);
    }
  }
  if (const char* copy = std::getenv("HYBRIDMOE_COPY_EXPERTS"); copy && *copy) {
    const std::string value = copy;
    if (value != "0" && value != "1")
      throw std::invalid_argument("HYBRIDMOE_COPY_EXPERTS must be 0 (experts read in place) or 1 (copied at load "
                                  "into the kernels' huge-page memory), got \"" + value + "\"");
    t.copy_shards = value == "1";
  }
  return t;
}

void validate_numa_topology(const NumaTopology& topology, const std::vector<int>& allowed) {
  if (topology.num_nodes() < 1) throw std::invalid_argument("NUMA topology needs at least one node");
  if (topology.memory_node.size() != topology.node_cpus.size())
    throw std::invalid_argument("NUMA topology: one memory node per node needed");
  const std::set<int> usable(allowed.begin(), allowed.end());
  for (int n = 0; n < topology.num_nodes(); ++n) {
    const std::string where = "NUMA node " + std::to_string(n);
    if (topology.node_cpus[n].empty()) throw std::invalid_argument(where + " has no CPUs");
    for (int cpu : topology.node_cpus[n]) {
      if (cpu < 0 || cpu >= 1024) throw std::invalid_argument(where + ": CPU " + std::to_string(cpu) + " is not a valid CPU");
      if (!usable.empty() && !usable.count(cpu))
        throw std::invalid_argument(where + ": CPU " + std::to_string(cpu) + " is not available to this process (it may use " +
                                    format_cpulist(allowed) + ")");
    }
  }
}

namespace {

// mbind(MPOL_BIND) of the page-aligned [p, p + bytes) to OS node `node` with `flags`; false where not done.
bool bind_range(void* p, size_t bytes, int node, unsigned flags) {
#if defined(__linux__)
  if (node < 0 || node >= 1024 || bytes == 0) return false;
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
  constexpr int kMpolBind = 2;
  return syscall(SYS_mbind, p, bytes, kMpolBind, mask, sizeof(mask) * 8, flags) == 0;
#else
  (void)p, (void)bytes, (void)node, (void)flags;
  return false;
#endif
}

}  // namespace

bool bind_to_node(void* p, size_t bytes, int node) {
#if defined(__linux__)
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  constexpr unsigned kMpolMfMove = 2;  // pages already there move to the node
  return end > start && bind_range(reinterpret_cast<void*>(start), end - start, node, kMpolMfMove);
#else
  (void)p, (void)bytes, (void)node;
  return false;
#endif
}

NodeMemory::NodeMemory(size_t bytes, int node) : size_(bytes) {
  if (bytes == 0) return;
#if defined(__linux__)
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  mapped_ = (bytes + page - 1) / page * page;
  if (mapped_ >= kHugePageBytes) {
    // 2 MB-aligned and advised before the first touch, so that the kernel backs it with transparent huge pages
    // where THP is "madvise" or "always": weights streamed at the bandwidth limit then cost one TLB entry per
    // 2 MB instead of per 4 KB. The unaligned head and tail of an oversized mapping are returned.
    const size_t over = mapped_ + kHugePageBytes;
    void* p = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t start = reinterpret_cast<uintptr_t>(p);
    const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    if (aligned > start) munmap(p, aligned - start);
    const uintptr_t end = aligned + mapped_;
    if (start + over > end) munmap(reinterpret_cast<void*>(end), start + over - end);
    data_ = reinterpret_cast<uint8_t*>(aligned);
    huge_pages_ = madvise(data_, mapped_, MADV_HUGEPAGE) == 0;
  } else {
    void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = static_cast<uint8_t*>(p);
  }
  bound_ = bind_range(data_, mapped_, node, 0);
#else
  (void)node;
  data_ = static_cast<uint8_t*>(::operator new(bytes));
#endif
}

NodeMemory::~NodeMemory() {
  if (!data_) return;
#if defined(__linux__)
  munmap(data_, mapped_);
#else
  ::operator delete(data_);
#endif
}

}  // namespace hm
