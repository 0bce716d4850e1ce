// Cutting experts into per-NUMA-node shards of the intermediate dimension (see moe_shards.h).
#include "moe_shards.h"

#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

namespace hm {

namespace {

using I64 = int64_t;

I64 ceil_div(I64 a, I64 b) { return (a + b - 1) / b; }
I64 align64(I64 v) { return (v + 63) / 64 * 64; }

size_t scale_bytes(const Matrix& w) { return w.scale_type == ScaleType::F32 ? 4 : 2; }

// Bytes of one row's stored data (int rows include their zero padding).
I64 data_row_bytes(const Matrix& w) {
  switch (w.fmt) {
    case WFormat::F32: return w.cols * 4;
    case WFormat::BF16:
    case WFormat::F16: return w.cols * 2;
    case WFormat::FP8: return w.cols;
    case WFormat::INT8: return w.padded_cols;
    case WFormat::INT4: return w.padded_cols / 2;
  }
  return 0;
}

// Scale rows and scale columns of w (none for dense).
std::pair<I64, I64> scale_shape(const Matrix& w) {
  if (w.fmt == WFormat::FP8) return {ceil_div(w.rows, w.block_rows), ceil_div(w.cols, w.block_cols)};
  if (is_int_format(w.fmt)) return {w.rows, w.padded_cols / w.group};
  return {0, 0};
}

Matrix row_shard(Matrix w, I64 r0, I64 r1) {
  const I64 r = r0;
  w.rows = r1 - r0;
  w.data += r * w.row_bytes;
  if (w.fmt == WFormat::FP8) {
    w.scales = static_cast<const float*>(w.scales) + (r / w.block_rows) * w.scale_stride;
    w.row_flags += r;
    w.subnormal_blocks += r * w.subnormal_stride;
  } else if (is_int_format(w.fmt)) {
    w.scales = static_cast<const uint16_t*>(w.scales) + r * w.scale_stride;
  }
  return w;
}

// Columns [c0, c1) of w; fp8 flags for the shard are written into `flags` (which must outlive the view).
Matrix col_shard(Matrix w, I64 c0, I64 c1, std::vector<uint8_t>& flags) {
  const Matrix whole = w;
  w.cols = c1 - c0;
  w.padded_cols = w.cols;
  switch (w.fmt) {
    case WFormat::F32: w.data += c0 * 4; break;
    case WFormat::BF16:
    case WFormat::F16: w.data += c0 * 2; break;
    case WFormat::FP8: w.data += c0; break;
    case WFormat::INT8: w.data += c0; break;
    case WFormat::INT4: w.data += c0 / 2; break;
  }
  if (is_int_format(w.fmt)) {
    w.padded_cols = ceil_div(w.cols, w.group) * w.group;
    w.scales = static_cast<const uint16_t*>(w.scales) + c0 / w.group;
  } else if (w.fmt == WFormat::FP8) {
    const I64 kb0 = c0 / w.block_cols, blocks = ceil_div(w.cols, w.block_cols);
    w.scales = static_cast<const float*>(w.scales) + kb0;
    // Per row: the shard's subnormal block bits, and the row flags (a NaN anywhere in the row stays flagged:
    // that row's output is NaN on every node, as in the whole matrix).
    w.subnormal_stride = (blocks + 7) / 8;
    flags.assign(static_cast<size_t>(w.rows * (1 + w.subnormal_stride)), 0);
    uint8_t* bits = flags.data() + w.rows;
    for (I64 r = 0; r < w.rows; ++r) {
      bool any = false;
      for (I64 kb = 0; kb < blocks; ++kb)
        if (block_has_subnormal(whole, r, kb0 + kb)) {
          bits[r * w.subnormal_stride + (kb >> 3)] |= static_cast<uint8_t>(1u << (kb & 7));
          any = true;
        }
      flags[r] = static_cast<uint8_t>((whole.row_flags[r] & kRowHasNan) | (any ? kRowHasSubnormal : 0));
    }
    w.row_flags = flags.data();
    w.subnormal_blocks = bits;
  }
  return w;
}

I64 copy_bytes(const Matrix& w) {
  const auto [srows, scols] = scale_shape(w);
  I64 bytes = align64(w.rows * data_row_bytes(w)) + align64(srows * scols * static_cast<I64>(scale_bytes(w)));
  if (w.fmt == WFormat::FP8) bytes += align64(w.rows * (1 + w.subnormal_stride));
  return bytes;
}

// Copies w compactly to `dst` (copy_bytes(w) bytes; `write` false: another process did) and returns the matrix
// reading the copy.
Matrix copy_matrix(Matrix w, uint8_t* dst, bool write) {
  const I64 rb = data_row_bytes(w);
  for (I64 r = 0; write && r < w.rows; ++r)
    std::memcpy(dst + r * rb, w.data + r * w.row_bytes, static_cast<size_t>(rb));
  w.data = dst;
  w.row_bytes = rb;
  dst += align64(w.rows * rb);
  const auto [srows, scols] = scale_shape(w);
  if (srows) {
    const I64 sb = static_cast<I64>(scale_bytes(w));
    for (I64 r = 0; write && r < srows; ++r)
      std::memcpy(dst + r * scols * sb, static_cast<const uint8_t*>(w.scales) + r * w.scale_stride * sb,
                  static_cast<size_t>(scols * sb));
    w.scales = dst;
    w.scale_stride = scols;
    dst += align64(srows * scols * sb);
  }
  if (w.fmt == WFormat::FP8) {
    if (write) {
      std::memcpy(dst, w.row_flags, static_cast<size_t>(w.rows));
      std::memcpy(dst + w.rows, w.subnormal_blocks, static_cast<size_t>(w.rows * w.subnormal_stride));
    }
    w.row_flags = dst;
    w.subnormal_blocks = dst + w.rows;
  }
  return w;
}

}  // namespace

I64 shard_granularity(const ExpertMatrices& e) {
  if (e.gate.fmt == WFormat::FP8) return std::lcm(static_cast<I64>(e.gate.block_rows), static_cast<I64>(e.down.block_cols));
  if (is_int_format(e.gate.fmt)) return e.down.group;
  return 32;
}

std::vector<std::pair<I64, I64>> split_range(I64 n, I64 granularity, int parts) {
  if (parts < 1 || granularity < 1) throw std::invalid_argument("split_range: parts and granularity must be >= 1");
  const I64 units = ceil_div(n, granularity);
  std::vector<std::pair<I64, I64>> ranges;
  for (int p = 0; p < parts; ++p) {
    const I64 u0 = units * p / parts, u1 = units * (p + 1) / parts;
    ranges.emplace_back(std::min(n, u0 * granularity), std::min(n, u1 * granularity));
  }
  return ranges;
}

namespace {

// The key of a matrix given for several experts (the same memory, scales and shape): copied once, shared again.
using MatrixKey = std::tuple<const uint8_t*, const void*, I64, I64, I64>;
MatrixKey matrix_key(const Matrix& m) { return MatrixKey{m.data, m.scales, m.rows, m.cols, m.row_bytes}; }

// The nodes' shards as views of the experts, and the intermediate ranges (copies not made yet).
std::vector<NodeShard> view_shards(const std::vector<ExpertMatrices>& experts, I64 intermediate, int N,
                                   std::vector<std::vector<uint8_t>>& down_flags) {
  const I64 granularity = shard_granularity(experts.at(0));
  for (const ExpertMatrices& e : experts)
    if (shard_granularity(e) != granularity)
      throw std::invalid_argument("experts must share one block / group size to be split over NUMA nodes");
  const auto ranges = split_range(intermediate, granularity, N);
  std::vector<NodeShard> shards;
  for (int n = 0; n < N; ++n) {
    NodeShard shard;
    shard.begin = ranges[n].first;
    shard.end = ranges[n].second;
    if (shard.begin < shard.end) {
      for (const ExpertMatrices& e : experts) {
        down_flags.emplace_back();
        shard.experts.push_back({row_shard(e.gate, shard.begin, shard.end), row_shard(e.up, shard.begin, shard.end),
                                 col_shard(e.down, shard.begin, shard.end, down_flags.back())});
      }
    }
    shards.push_back(std::move(shard));
  }
  return shards;
}

I64 node_copy_bytes(const NodeShard& shard) {
  std::set<MatrixKey> distinct;
  I64 bytes = 0;
  for (const ExpertMatrices& e : shard.experts)
    for (const Matrix* m : {&e.gate, &e.up, &e.down})
      if (distinct.insert(matrix_key(*m)).second) bytes += copy_bytes(*m);
  return bytes;
}

// The shard's matrices copied to dst (written unless `write` is false), in expert order, so that each expert's
// matrices lie together.
void copy_shard(NodeShard& shard, uint8_t* dst, bool write) {
  std::map<MatrixKey, Matrix> copies;
  for (ExpertMatrices& e : shard.experts)
    for (Matrix* m : {&e.gate, &e.up, &e.down}) {
      const auto [it, first] = copies.emplace(matrix_key(*m), *m);
      if (first) {
        it->second = copy_matrix(*m, dst, write);
        dst += copy_bytes(*m);
      }
      *m = it->second;
    }
}

bool splits_experts(const NumaTopology& topology) { return topology.num_nodes() > 1 || topology.copy_shards; }

}  // namespace

std::vector<size_t> shard_copy_bytes(const std::vector<ExpertMatrices>& experts, I64 intermediate,
                                     const NumaTopology& topology) {
  if (!topology.copy_shards || experts.empty()) return {};
  std::vector<std::vector<uint8_t>> flags;
  std::vector<size_t> bytes;
  for (const NodeShard& shard : view_shards(experts, intermediate, topology.num_nodes(), flags))
    bytes.push_back(static_cast<size_t>(node_copy_bytes(shard)));
  return bytes;
}

ShardedExperts shard_experts(const std::vector<ExpertMatrices>& experts, I64 intermediate,
                             const NumaTopology& topology, const std::vector<ShardBuffer>& buffers) {
  ShardedExperts out;
  const int N = topology.num_nodes();
  if (!splits_experts(topology)) {
    out.nodes.push_back(NodeShard{0, intermediate, experts, 0, false});
    return out;
  }
  out.nodes = view_shards(experts, intermediate, N, out.down_flags);
  if (!buffers.empty() && (!topology.copy_shards || static_cast<int>(buffers.size()) != N))
    throw std::invalid_argument("shard buffers: " + std::to_string(buffers.size()) + " given, the topology copies " +
                                (topology.copy_shards ? std::to_string(N) : std::string("none")));
  for (int n = 0; topology.copy_shards && n < N; ++n) {
    NodeShard& shard = out.nodes[n];
    if (shard.experts.empty()) continue;
    const I64 bytes = node_copy_bytes(shard);
    if (buffers.empty()) {
      out.memory.push_back(std::make_unique<NodeMemory>(static_cast<size_t>(bytes), topology.memory_node[n]));
      copy_shard(shard, out.memory.back()->data(), true);
      shard.bound = out.memory.back()->bound();
      shard.huge_pages = out.memory.back()->huge_pages();
    } else {
      const ShardBuffer& b = buffers[n];
      if (b.bytes != static_cast<size_t>(bytes))
        throw std::invalid_argument("shard buffer of node " + std::to_string(n) + ": " + std::to_string(b.bytes) +
                                    " bytes, its copies take " + std::to_string(bytes));
      if (!b.filled) shard.bound = bind_to_node(b.data, b.bytes, topology.memory_node[n]);
      copy_shard(shard, b.data, !b.filled);
    }
    shard.copied_bytes = static_cast<size_t>(bytes);
  }
  if (topology.copy_shards) out.down_flags.clear();  // the copies hold their own flags
  return out;
}

}  // namespace hm
