// NUMA topology of the kernels' thread pool, and memory bound to a node.
//
// The topology is a list of nodes, each with the CPUs its threads are pinned to and the OS node whose memory
// holds that node's weight shards. Detected from /sys/devices/system/node (intersected with the CPUs this
// process may use); HYBRIDMOE_NUMA_NODES="0-3;4-7" (cpulists separated by ';') or configure_numa() overrides
// it, which lets tests emulate several nodes on one (emulated nodes bind no memory unless told to).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hm {

struct NumaTopology {
  std::vector<std::vector<int>> node_cpus;  // per node: the CPUs its threads run on
  std::vector<int> memory_node;             // per node: OS node to bind its shards to, -1 = do not bind
  bool emulated = false;                    // from an override, not from /sys
  bool copy_shards = false;                 // copy each node's weight shards into its memory at load (THP)
  int num_nodes() const { return static_cast<int>(node_cpus.size()); }
  int total_cpus() const;
  std::string describe() const;             // "2 nodes (detected): node 0 cpus 0-3 memory 0; ..."
};

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; throws std::invalid_argument naming `what` on bad syntax.
std::vector<int> parse_cpulist(const std::string& text, const std::string& what);
std::string format_cpulist(const std::vector<int>& cpus);

// The machine's nodes (those with CPUs this process may use); one node of all usable CPUs where /sys has none.
// Several real nodes copy their shards into node memory.
NumaTopology detect_numa_topology();
// HYBRIDMOE_NUMA_NODES when set (emulated, no memory binding), else detect_numa_topology(); then
// HYBRIDMOE_COPY_EXPERTS=1 / 0 turns the load-time copies on (one node too: the experts whole) / off.
NumaTopology default_numa_topology();

// The whole pages of [p, p + bytes) bound (mbind MPOL_BIND) to OS node `node`, the pages already there moved
// (MPOL_MF_MOVE); false where not done (node < 0, no whole page, or the kernel refused).
bool bind_to_node(void* p, size_t bytes, int node);

// Anonymous memory of `bytes` bound (mbind MPOL_BIND) to OS node `node` (no binding when node < 0 or the
// kernel refuses: `bound` says which). From 2 MB on it is 2 MB-aligned and advised for transparent huge pages
// (`huge_pages`: the advice was taken; the kernel grants them where THP is not "never"). Freed with the object.
class NodeMemory {
 public:
  static constexpr size_t kHugePageBytes = size_t{2} << 20;
  NodeMemory(size_t bytes, int node);
  ~NodeMemory();
  NodeMemory(const NodeMemory&) = delete;
  NodeMemory& operator=(const NodeMemory&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool bound() const { return bound_; }
  bool huge_pages() const { return huge_pages_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0, mapped_ = 0;
  bool bound_ = false, huge_pages_ = false;
};

// A growable scratch array of T in memory bound to OS node `node` (< 0: unbound). grow() never shrinks and does
// not keep the contents; asking for another node reallocates. Pages are placed on the node whoever touches
// them first, so buffers a node's threads write live on that node even when another thread sized them.
template <class T>
class NodeBuffer {
 public:
  T* grow(int64_t count, int node) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T);
    if (!memory_ || memory_->size() < bytes || node != node_) {
      memory_.reset();  // free before allocating the replacement
      memory_ = std::make_unique<NodeMemory>(bytes, node);
      node_ = node;
    }
    return data();
  }
  T* data() const { return memory_ ? reinterpret_cast<T*>(memory_->data()) : nullptr; }
  size_t bytes() const { return memory_ ? memory_->size() : 0; }
  int node() const { return node_; }
  bool bound() const { return memory_ && memory_->bound(); }

 private:
  std::unique_ptr<NodeMemory> memory_;
  int node_ = -1;
};

// Throws std::invalid_argument naming the problem: no node, a node without CPUs, a CPU outside [0, 1024) or
// not available to this process (`allowed`, empty: not checked), memory_node not one per node.
void validate_numa_topology(const NumaTopology& topology, const std::vector<int>& allowed);

}  // namespace hm
