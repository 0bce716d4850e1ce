// Per-NUMA-node shards of a MoE layer's experts: node n owns the intermediate range [begin, end) of every
// expert, i.e. rows [begin, end) of gate/up [I, H] and columns [begin, end) of down [H, I]. Ranges are cut on
// the format's granularity (fp8: whole 128x128 scale blocks; int: whole groups of down's columns; dense: 32
// columns), so a node's partial down projection uses exactly the scales / groups of the whole matrix, and
// the partial outputs of the nodes sum to the layer's output. Nothing is duplicated: shards are views of the
// weights, or (topology.copy_shards: several real nodes, or HYBRIDMOE_COPY_EXPERTS=1 also on one node) copies
// placed in the node's memory instead, 2 MB-aligned and advised for transparent huge pages, or into buffers the
// caller gives (ShardBuffer: a shared-memory segment that several processes map, written by one of them).
//
// Legend: I expert intermediate, H hidden, N nodes.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "hm_types.h"
#include "numa.h"

namespace hm {

struct ExpertMatrices {
  Matrix gate, up, down;  // gate/up [I, H], down [H, I]
};

struct NodeShard {
  int64_t begin = 0, end = 0;           // intermediate range; empty when I has fewer units than nodes
  std::vector<ExpertMatrices> experts;  // gate/up rows [begin, end), down columns [begin, end)
  size_t copied_bytes = 0;              // weight bytes copied into this node's memory (0: views)
  bool bound = false;                   // that memory is bound to the node (mbind)
  bool huge_pages = false;              // that memory is advised for transparent huge pages (madvise)
};

// Where one node's copies go instead of memory of their own (shard_copy_bytes(...)[node] bytes): written there,
// the buffer first bound to the node's memory (its pages moved), unless `filled` (another process wrote the same
// copies there: only the matrices' pointers are laid out).
struct ShardBuffer {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  bool filled = false;
};

struct ShardedExperts {
  std::vector<NodeShard> nodes;
  std::vector<std::unique_ptr<NodeMemory>> memory;   // the copies' storage
  std::vector<std::vector<uint8_t>> down_flags;      // fp8 down view shards: their column blocks' code flags
};

// Columns of the intermediate dimension a shard boundary must be a multiple of, for `e`'s format.
int64_t shard_granularity(const ExpertMatrices& e);
// [0, n) cut into `parts` contiguous ranges of whole `granularity` units (the last unit may be partial),
// as even as the units allow; some ranges are empty when there are fewer units than parts.
std::vector<std::pair<int64_t, int64_t>> split_range(int64_t n, int64_t granularity, int parts);
// The experts cut over the topology's nodes (one node: the experts themselves, no copy); with copies, into
// `buffers` when given (one per node), else into memory of each node's own.
ShardedExperts shard_experts(const std::vector<ExpertMatrices>& experts, int64_t intermediate,
                             const NumaTopology& topology, const std::vector<ShardBuffer>& buffers = {});
// The bytes of each node's copies (empty: the topology makes none).
std::vector<size_t> shard_copy_bytes(const std::vector<ExpertMatrices>& experts, int64_t intermediate,
                                     const NumaTopology& topology);

}  // namespace hm
