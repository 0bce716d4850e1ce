// Python bindings (nanobind) of the expert-kernel core: weight matrices, the fused MoE layer with async
// submit/wait, a plain matmul, ISA and thread control, and machine probes. Arrays arrive as typed ndarrays
// (torch tensors through DLPack, numpy arrays) without copies; dtype, shape, device and layout are checked here
// with errors that say which argument is wrong. Kernels run on the C++ executor with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "cpu_features.h"
#include "decode_stack.h"
#include "dequantize.h"
#include "fp_convert.h"
#include "moe.h"
#include "norm.h"
#include "rope.h"
#include "router.h"
#include "numa.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace hm {
namespace {

using Array = nb::ndarray<nb::ro>;
using MutArray = nb::ndarray<>;
using DT = nb::dlpack::dtype;
using Code = nb::dlpack::dtype_code;

constexpr DT dt(Code c, int bits) { return DT{static_cast<uint8_t>(c), static_cast<uint8_t>(bits), 1}; }
const DT kF32 = dt(Code::Float, 32), kF16 = dt(Code::Float, 16), kBF16 = dt(Code::Bfloat, 16);
const DT kU8 = dt(Code::UInt, 8), kI8 = dt(Code::Int, 8), kFP8 = dt(Code::Float8_E4M3FN, 8);
const DT kI16 = dt(Code::Int, 16), kU16 = dt(Code::UInt, 16), kI32 = dt(Code::Int, 32), kI64 = dt(Code::Int, 64);

std::string dtype_name(DT d) {
  if (d == kF32) return "float32";
  if (d == kF16) return "float16";
  if (d == kBF16) return "bfloat16";
  if (d == kU8) return "uint8";
  if (d == kI8) return "int8";
  if (d == kFP8) return "float8_e4m3fn";
  if (d == kI16) return "int16";
  if (d == kU16) return "uint16";
  if (d == kI32) return "int32";
  if (d == kI64) return "int64";
  return "dtype(code=" + std::to_string(d.code) + ", bits=" + std::to_string(d.bits) + ")";
}

template <class A>
std::string shape_str(const A& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

[[noreturn]] void fail(const std::string& what, const std::string& why) { throw std::invalid_argument(what + ": " + why); }

// A CPU array of one of `dtypes`.
template <class A>
void check_cpu_dtype(const std::string& what, const A& a, std::initializer_list<DT> dtypes) {
  if (a.device_type() != nb::device::cpu::value) fail(what, "must be on the CPU");
  bool ok = false;
  std::string names;
  for (DT d : dtypes) {
    ok |= a.dtype() == d;
    names += (names.empty() ? "" : " or ") + dtype_name(d);
  }
  if (!ok) fail(what, "dtype must be " + names + ", got " + dtype_name(a.dtype()));
}

// A CPU array of ndim 2 whose rows are contiguous, with one of `dtypes`.
template <class A>
void check_2d(const std::string& what, const A& a, std::initializer_list<DT> dtypes) {
  check_cpu_dtype(what, a, dtypes);
  if (a.ndim() != 2) fail(what, "must be 2-D, got shape " + shape_str(a));
  if (a.shape(1) > 1 && a.stride(1) != 1) fail(what, "rows must be contiguous (stride 1 along the last dim)");
  if (a.shape(0) > 1 && a.stride(0) < static_cast<int64_t>(a.shape(1))) fail(what, "rows overlap (row stride < row length)");
}

template <class A>
void check_shape(const std::string& what, const A& a, int64_t rows, int64_t cols) {
  if (static_cast<int64_t>(a.shape(0)) != rows || static_cast<int64_t>(a.shape(1)) != cols)
    fail(what, "expected shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " + shape_str(a));
}

// A weight matrix, the arrays that own its memory, and (fp8) its per-row code flags.
struct PyMatrix {
  Matrix m;
  nb::object data, scales;
  std::shared_ptr<std::vector<uint8_t>> row_flags;
};

void run_sync(std::function<void()> fn);

PyMatrix make_matrix(const std::string& fmt, nb::object data_obj, nb::object scales_obj, int64_t rows, int64_t cols,
                     int block_rows, int block_cols, int group, const std::string& name) {
  PyMatrix pm;
  Matrix& m = pm.m;
  const Array data = nb::cast<Array>(data_obj, false);
  m.rows = rows;
  m.cols = cols;
  m.padded_cols = cols;
  if (rows < 1 || cols < 1) fail(name, "rows and cols must be >= 1");
  auto need_no_scales = [&] {
    if (!scales_obj.is_none()) fail(name + " scales", "format " + fmt + " takes no scales");
  };
  if (fmt == "f32" || fmt == "bf16" || fmt == "f16") {
    need_no_scales();
    m.fmt = fmt == "f32" ? WFormat::F32 : fmt == "bf16" ? WFormat::BF16 : WFormat::F16;
    if (fmt == "f32") check_2d(name, data, {kF32});
    else if (fmt == "bf16") check_2d(name, data, {kBF16, kI16, kU16});
    else check_2d(name, data, {kF16, kI16, kU16});
    check_shape(name, data, rows, cols);
  } else if (fmt == "fp8") {
    m.fmt = WFormat::FP8;
    check_2d(name, data, {kFP8, kU8});
    check_shape(name, data, rows, cols);
    if (block_rows < 1 || block_cols < 16 || block_cols % 16)
      fail(name, "fp8 block size must have rows >= 1 and cols a multiple of 16, got [" + std::to_string(block_rows) +
                     ", " + std::to_string(block_cols) + "]");
    if (scales_obj.is_none()) fail(name + " scales", "fp8 needs float32 block scales");
    const Array sc = nb::cast<Array>(scales_obj, false);
    check_2d(name + " scales", sc, {kF32});
    check_shape(name + " scales", sc, (rows + block_rows - 1) / block_rows, (cols + block_cols - 1) / block_cols);
    const float* s = static_cast<const float*>(sc.data());
    for (size_t r = 0; r < sc.shape(0); ++r)
      for (size_t c = 0; c < sc.shape(1); ++c) {
        const float v = s[r * sc.stride(0) + c];
        if (!(std::fabs(v) < 128.0f) && v == v)
          fail(name + " scales", "block scale " + std::to_string(v) + " at [" + std::to_string(r) + ", " +
                                     std::to_string(c) + "] is out of range (|scale| must be < 128)");
      }
    m.scales = sc.data();
    m.scale_type = ScaleType::F32;
    m.scale_stride = sc.stride(0);
    m.block_rows = block_rows;
    m.block_cols = block_cols;
  } else if (fmt == "int4" || fmt == "int8") {
    m.fmt = fmt == "int4" ? WFormat::INT4 : WFormat::INT8;
    if (group != 32 && group != 128) fail(name, "int group size must be 32 or 128, got " + std::to_string(group));
    m.group = group;
    m.padded_cols = (cols + group - 1) / group * group;
    check_2d(name, data, fmt == "int4" ? std::initializer_list<DT>{kU8} : std::initializer_list<DT>{kI8});
    check_shape(name, data, rows, fmt == "int4" ? m.padded_cols / 2 : m.padded_cols);
    if (scales_obj.is_none()) fail(name + " scales", fmt + " needs bfloat16 or float16 group scales");
    const Array sc = nb::cast<Array>(scales_obj, false);
    check_2d(name + " scales", sc, {kBF16, kF16});
    check_shape(name + " scales", sc, rows, m.padded_cols / group);
    m.scales = sc.data();
    m.scale_type = sc.dtype() == kBF16 ? ScaleType::BF16 : ScaleType::F16;
    m.scale_stride = sc.stride(0);
  } else {
    fail(name, "unknown weight format '" + fmt + "' (f32, bf16, f16, fp8, int4, int8)");
  }
  m.data = static_cast<const uint8_t*>(data.data());
  m.row_bytes = data.stride(0) * static_cast<int64_t>(data.dtype().bits / 8);
  if (m.fmt == WFormat::FP8) {  // one pass at load: where the NaN and subnormal codes are
    const int64_t stride = ((cols + block_cols - 1) / block_cols + 7) / 8;
    pm.row_flags = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(rows * (1 + stride)));
    const Matrix view = m;
    uint8_t* flags = pm.row_flags->data();
    run_sync([view, flags, rows, stride] { scan_fp8_rows(view, flags, flags + rows, stride, global_pool()); });
    m.row_flags = flags;
    m.subnormal_blocks = flags + rows;
    m.subnormal_stride = stride;
  }
  pm.data = data_obj;
  pm.scales = scales_obj;
  return pm;
}

MatmulPath parse_path(const std::string& path) {
  if (path == "auto") return MatmulPath::Auto;
  if (path == "gemv") return MatmulPath::Gemv;
  if (path == "gemm") return MatmulPath::Gemm;
  fail("path", "must be 'auto', 'gemv' or 'gemm', got '" + path + "'");
}

// Runs fn as the pool's thread 0 and waits, with the GIL released: on this thread when the executor is idle and
// the pool pins no CPUs (a pinned pool's thread 0 stays the executor's), else on the executor.
std::string run_blocking(std::function<void()> fn) {
  nb::gil_scoped_release release;
  return global_executor().run(std::move(fn), global_pool().cpus().empty());
}

void run_sync(std::function<void()> fn) {
  const std::string error = run_blocking(std::move(fn));
  if (!error.empty()) throw std::runtime_error(error);
}

// A submitted MoE computation: keeps its inputs and output alive until it has finished.
struct MoEHandle {
  std::shared_ptr<JobState> job;
  nb::object layer, out;
  // The imported arrays (not only the Python objects passed in): when those were DLPack capsules, the arrays
  // are what keeps the memory alive until the computation is done.
  Array hidden, ids, weights;
  MutArray out_array;

  MoEHandle() = default;
  MoEHandle(MoEHandle&&) = default;
  MoEHandle& operator=(MoEHandle&&) = default;
  MoEHandle(const MoEHandle&) = delete;
  MoEHandle& operator=(const MoEHandle&) = delete;

  nb::object wait() {
    std::string error;
    {
      nb::gil_scoped_release release;
      error = job->wait();
    }
    if (!error.empty()) throw std::runtime_error("expert kernels failed: " + error);
    return out;
  }
  bool done() const { return job->done(); }
  ~MoEHandle() {
    if (job && !job->done()) {  // dropped unfinished: the arrays must outlive the computation
      nb::gil_scoped_release release;
      job->wait();
    }
  }
};

using MutU8 = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// One layer's experts from the lists of their matrices (kept alive in `owners`, when given).
std::vector<ExpertMatrices> expert_matrices(nb::list gate, nb::list up, nb::list down, std::vector<PyMatrix>* owners) {
  const size_t E = nb::len(gate);
  if (nb::len(up) != E || nb::len(down) != E)
    fail("experts", "gate, up and down lists must have the same length, got " + std::to_string(E) + ", " +
                        std::to_string(nb::len(up)) + ", " + std::to_string(nb::len(down)));
  std::vector<ExpertMatrices> experts(E);
  for (size_t e = 0; e < E; ++e) {
    const PyMatrix g = nb::cast<PyMatrix>(gate[e]), u = nb::cast<PyMatrix>(up[e]), d = nb::cast<PyMatrix>(down[e]);
    experts[e] = {g.m, u.m, d.m};
    if (owners) owners->insert(owners->end(), {g, u, d});
  }
  return experts;
}

struct PyMoE {
  std::unique_ptr<MoELayer> layer;
  std::vector<PyMatrix> matrices;  // owners of the weights' memory

  // buffers: per node, (uint8 array of its copies' bytes, filled) where the copies go (shard_experts)
  PyMoE(nb::list gate, nb::list up, nb::list down, int64_t hidden, int64_t intermediate, nb::list buffers) {
    std::vector<ExpertMatrices> experts = expert_matrices(gate, up, down, &matrices);
    std::vector<ShardBuffer> where;
    for (nb::handle b : buffers) {
      auto [array, filled] = nb::cast<std::pair<MutU8, bool>>(b);
      where.push_back({array.data(), array.size(), filled});
    }
    {
      nb::gil_scoped_release release;  // copying shards into node memory may take a while
      layer = std::make_unique<MoELayer>(std::move(experts), hidden, intermediate, global_numa_topology(), where);
    }
    if (layer->owns_weights()) matrices.clear();  // every node reads its own copy: let the originals go
  }
};

// A topology as Python sees it: {"nodes": [[cpu, ...], ...], "memory_nodes": [...], "emulated", "copy_shards"}.
nb::dict topology_dict(const NumaTopology& t) {
  nb::dict d;
  d["nodes"] = t.node_cpus;
  d["memory_nodes"] = t.memory_node;
  d["emulated"] = t.emulated;
  d["copy_shards"] = t.copy_shards;
  d["description"] = t.describe();
  return d;
}

// One MoE call's layer and inputs, checked, and the arrays that hold their memory.
struct MoECall {
  const MoELayer* layer;
  MoEInput in;
  Array hidden, ids, weights;
  MutArray out;
};

MoECall prepare_call(nb::object self_obj, nb::object hidden_obj, nb::object ids_obj, nb::object weights_obj,
                     nb::object out_obj, const std::string& path) {
  PyMoE& self = nb::cast<PyMoE&>(self_obj);
  const Array hidden = nb::cast<Array>(hidden_obj, false);
  const Array ids = nb::cast<Array>(ids_obj, false);
  const Array weights = nb::cast<Array>(weights_obj, false);
  const MutArray out = nb::cast<MutArray>(out_obj, false);
  const int64_t H = self.layer->hidden(), E = self.layer->num_experts();
  check_2d("hidden", hidden, {kF32, kBF16});
  const int64_t T = hidden.shape(0);
  check_shape("hidden", hidden, T, H);
  check_2d("topk_ids", ids, {kI64});
  const int64_t K = ids.shape(1);
  check_shape("topk_ids", ids, T, K);
  check_2d("topk_weights", weights, {kF32});
  check_shape("topk_weights", weights, T, K);
  check_2d("out", out, {hidden.dtype()});
  check_shape("out", out, T, H);
  for (const auto& [name, a] : {std::pair<const char*, const Array*>{"hidden", &hidden}, {"topk_ids", &ids},
                                {"topk_weights", &weights}})
    if (a->shape(0) > 1 && a->stride(0) != static_cast<int64_t>(a->shape(1))) fail(name, "must be contiguous");
  if (T > 1 && out.stride(0) != H) fail("out", "must be contiguous");
  const int64_t* id = static_cast<const int64_t*>(ids.data());
  for (int64_t a = 0; a < T * K; ++a)
    if (id[a] < 0 || id[a] >= E)
      fail("topk_ids", "expert id " + std::to_string(id[a]) + " at [" + std::to_string(a / K) + ", " +
                           std::to_string(a % K) + "] is out of range [0, " + std::to_string(E) + ")");
  MoEInput in;
  in.hidden = hidden.data();
  in.hidden_bf16 = hidden.dtype() == kBF16;
  in.tokens = T;
  in.top_k = K;
  in.ids = id;
  in.weights = static_cast<const float*>(weights.data());
  in.out = out.data();
  in.path = parse_path(path);
  return {self.layer.get(), in, hidden, ids, weights, out};
}

MoEHandle submit(nb::object self_obj, nb::object hidden_obj, nb::object ids_obj, nb::object weights_obj,
                 nb::object out_obj, const std::string& path) {
  const MoECall call = prepare_call(self_obj, hidden_obj, ids_obj, weights_obj, out_obj, path);
  const KernelTable* kt = active_kernels();
  MoEHandle handle;
  handle.layer = self_obj;
  handle.out = out_obj;
  handle.hidden = call.hidden;
  handle.ids = call.ids;
  handle.weights = call.weights;
  handle.out_array = call.out;
  {
    nb::gil_scoped_release release;
    handle.job = global_executor().submit([layer = call.layer, in = call.in, kt] {
      layer->compute(in, *kt, global_pool());
    });
  }
  return handle;
}

// submit + wait in one, run on the calling thread when the executor is idle (see run_blocking).
void run_moe(nb::object self_obj, nb::object hidden_obj, nb::object ids_obj, nb::object weights_obj,
             nb::object out_obj, const std::string& path) {
  const MoECall call = prepare_call(self_obj, hidden_obj, ids_obj, weights_obj, out_obj, path);
  const KernelTable* kt = active_kernels();
  const std::string error = run_blocking([&] { call.layer->compute(call.in, *kt, global_pool()); });
  if (!error.empty()) throw std::runtime_error("expert kernels failed: " + error);
}

void matmul(const PyMatrix& w, nb::object x_obj, nb::object out_obj, const std::string& path) {
  const Array x = nb::cast<Array>(x_obj, false);
  const MutArray out = nb::cast<MutArray>(out_obj, false);
  check_2d("x", x, {kF32, kBF16});
  const int64_t M = x.shape(0);
  check_shape("x", x, M, w.m.cols);
  check_2d("out", out, {kF32, kBF16});
  check_shape("out", out, M, w.m.rows);
  if (M > 1 && out.stride(0) != w.m.rows) fail("out", "must be contiguous");
  const MatmulPath p = parse_path(path);
  const KernelTable* kt = active_kernels();
  const void* xp = x.data();
  const bool x_bf16 = x.dtype() == kBF16, y_bf16 = out.dtype() == kBF16;
  const int64_t ldx = M > 1 ? x.stride(0) : w.m.cols;
  void* yp = out.data();
  const Matrix m = w.m;
  run_sync([=] { run_matmul(m, xp, x_bf16, M, ldx, yp, y_bf16, p, *kt, global_pool()); });
}

// out = rows [r0, r1) of an int4 / int8 matrix as bf16 (dequantize_rows_bf16).
void dequantize_bf16(const PyMatrix& w, int64_t r0, int64_t r1, nb::object out_obj) {
  if (!is_int_format(w.m.fmt)) fail("w", "must be int4 or int8");
  if (r0 < 0 || r1 < r0 || r1 > w.m.rows)
    fail("rows", "[" + std::to_string(r0) + ", " + std::to_string(r1) + ") is not within the matrix's " +
                     std::to_string(w.m.rows) + " rows");
  const MutArray out = nb::cast<MutArray>(out_obj, false);
  check_2d("out", out, {kBF16});
  check_shape("out", out, r1 - r0, w.m.cols);
  uint16_t* p = static_cast<uint16_t*>(out.data());
  const int64_t ld = r1 - r0 > 1 ? out.stride(0) : w.m.cols;
  const Matrix m = w.m;
  run_sync([=] { dequantize_rows_bf16(m, r0, r1, p, ld, global_pool()); });
}

std::vector<Matrix> matrices_of(const std::vector<const PyMatrix*>& ws) {
  std::vector<Matrix> mats;
  for (const PyMatrix* w : ws) mats.push_back(w->m);
  return mats;
}

// out[i] = x @ W_i^T for several matrices of one input in one call (run_matmul_group).
void matmul_group(const std::vector<const PyMatrix*>& ws, nb::object x_obj, nb::list outs, const std::string& path) {
  if (ws.empty()) fail("ws", "no matrices");
  if (nb::len(outs) != ws.size())
    fail("outs", std::to_string(nb::len(outs)) + " outputs for " + std::to_string(ws.size()) + " matrices");
  const std::vector<Matrix> mats = matrices_of(ws);
  if (const char* what = matmul_group_mismatch(mats.data(), static_cast<int>(mats.size())))
    fail("ws", std::string("the matrices differ in ") + what + ": they cannot share one input's activations");
  const Array x = nb::cast<Array>(x_obj, false);
  check_2d("x", x, {kF32, kBF16});
  const int64_t M = x.shape(0);
  check_shape("x", x, M, mats[0].cols);
  std::vector<void*> ys;
  std::vector<MutArray> held;  // the imported outputs, alive until the kernels are done
  bool y_bf16 = false;
  for (size_t i = 0; i < mats.size(); ++i) {
    const MutArray& out = held.emplace_back(nb::cast<MutArray>(outs[i], false));
    const std::string name = "outs[" + std::to_string(i) + "]";
    check_2d(name, out, {kF32, kBF16});
    check_shape(name, out, M, mats[i].rows);
    if (M > 1 && out.stride(0) != mats[i].rows) fail(name, "must be contiguous");
    if (i == 0) y_bf16 = out.dtype() == kBF16;
    else if ((out.dtype() == kBF16) != y_bf16) fail(name, "dtype differs from outs[0]'s");
    ys.push_back(out.data());
  }
  const MatmulPath p = parse_path(path);
  const KernelTable* kt = active_kernels();
  const void* xp = x.data();
  const bool x_bf16 = x.dtype() == kBF16;
  const int64_t ldx = M > 1 ? x.stride(0) : mats[0].cols;
  run_sync([&] {
    run_matmul_group(mats.data(), static_cast<int>(mats.size()), xp, x_bf16, M, ldx, ys.data(), y_bf16, p, *kt,
                     global_pool());
  });
}

// One weight matrix per head, all of one format and shape [M, K] (run_matmul_heads), holding their arrays.
struct PyHeads {
  std::vector<PyMatrix> owners;
  std::vector<Matrix> m;

  explicit PyHeads(nb::list matrices) {
    const size_t n = nb::len(matrices);
    if (n == 0) fail("matrices", "need at least one head's matrix");
    for (size_t i = 0; i < n; ++i) {
      if (!nb::isinstance<PyMatrix>(matrices[i])) fail("matrices[" + std::to_string(i) + "]", "must be a Matrix");
      owners.push_back(nb::cast<PyMatrix>(matrices[i]));
      const Matrix& a = owners.back().m;
      const Matrix& first = owners.front().m;
      if (a.fmt != first.fmt || a.group != first.group)
        fail("matrices[" + std::to_string(i) + "]", "format differs from matrices[0]'s (every head needs the same)");
      if (a.rows != first.rows || a.cols != first.cols)
        fail("matrices[" + std::to_string(i) + "]", "shape [" + std::to_string(a.rows) + ", " + std::to_string(a.cols) +
                                                        "] differs from matrices[0]'s [" + std::to_string(first.rows) +
                                                        ", " + std::to_string(first.cols) + "]");
      m.push_back(a);
    }
  }
  int64_t heads() const { return static_cast<int64_t>(m.size()); }
};

// A CPU array [T, N, D] of one of `dtypes`, D contiguous, and its strides over (T, N) in elements (0 where that
// dim has one entry).
template <class A>
std::pair<int64_t, int64_t> check_heads_array(const std::string& what, const A& a, std::initializer_list<DT> dtypes,
                                              int64_t tokens, int64_t heads, int64_t dim) {
  check_cpu_dtype(what, a, dtypes);
  if (a.ndim() != 3) fail(what, "must be 3-D [tokens, heads, features], got shape " + shape_str(a));
  if ((tokens >= 0 && static_cast<int64_t>(a.shape(0)) != tokens) || static_cast<int64_t>(a.shape(1)) != heads ||
      static_cast<int64_t>(a.shape(2)) != dim)
    fail(what, "expected shape [" + (tokens >= 0 ? std::to_string(tokens) : std::string("T")) + ", " +
                   std::to_string(heads) + ", " + std::to_string(dim) + "], got " + shape_str(a));
  if (a.shape(2) > 1 && a.stride(2) != 1) fail(what, "rows must be contiguous (stride 1 along the last dim)");
  const int64_t st = a.shape(0) > 1 ? a.stride(0) : 0, sh = a.shape(1) > 1 ? a.stride(1) : 0;
  if (st < 0 || sh < 0) fail(what, "negative strides are not supported");
  return {st, sh};
}

// out[t, n] = x[t, n] @ W_n^T for every head n (x [T, N, K], out [T, N, M]; both strided over tokens and heads).
void matmul_heads(const PyHeads& w, nb::object x_obj, nb::object out_obj, const std::string& path) {
  const Array x = nb::cast<Array>(x_obj, false);
  const MutArray out = nb::cast<MutArray>(out_obj, false);
  const int64_t N = w.heads(), M = w.m[0].rows, K = w.m[0].cols;
  const std::pair<int64_t, int64_t> xs = check_heads_array("x", x, {kF32, kBF16}, -1, N, K);
  const int64_t T = x.shape(0);
  const std::pair<int64_t, int64_t> ys = check_heads_array("out", out, {kF32, kBF16}, T, N, M);
  const int64_t xst = xs.first, xsh = xs.second, yst = ys.first, ysh = ys.second;
  {  // out's rows [M] must not overlap: the smaller stride spans at least a row, the larger all of the smaller's
    std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, entries) of the dims with more than one entry
    if (T > 1) dims.emplace_back(yst, T);
    if (N > 1) dims.emplace_back(ysh, N);
    std::sort(dims.begin(), dims.end());
    if ((!dims.empty() && dims[0].first < M) || (dims.size() == 2 && dims[1].first < dims[0].first * dims[0].second))
      fail("out", "rows overlap (strides " + std::to_string(out.stride(0)) + ", " + std::to_string(out.stride(1)) +
                      " over shape " + shape_str(out) + ")");
  }
  const MatmulPath p = parse_path(path);
  if (T == 0) return;
  const KernelTable* kt = active_kernels();
  const void* xp = x.data();
  void* yp = out.data();
  const bool x_bf16 = x.dtype() == kBF16, y_bf16 = out.dtype() == kBF16;
  const Matrix* mats = w.m.data();
  run_sync([=] {
    run_matmul_heads(mats, N, xp, x_bf16, T, xst, xsh, yp, y_bf16, yst, ysh, p, *kt, global_pool());
  });
}

AttnType attn_type(const std::string& what, DT d) {
  if (d == kF32) return AttnType::F32;
  if (d == kBF16) return AttnType::BF16;
  if (d == kF16) return AttnType::F16;
  fail(what, "dtype must be float32, bfloat16 or float16, got " + dtype_name(d));
}

template <class A>
void check_nd(const std::string& what, const A& a, size_t ndim) {
  if (a.device_type() != nb::device::cpu::value) fail(what, "must be on the CPU");
  if (a.ndim() != ndim) fail(what, "must be " + std::to_string(ndim) + "-D, got shape " + shape_str(a));
  if (a.shape(ndim - 1) > 1 && a.stride(ndim - 1) != 1) fail(what, "last dim must be contiguous");
}

// RMSNorm of x's rows into out, after residual += x where a residual is given (hm::rms_norm).
void rms_norm_py(nb::object x_obj, nb::object weight_obj, nb::object out_obj, double eps, nb::object residual_obj) {
  const Array x = nb::cast<Array>(x_obj, false);
  const Array w = nb::cast<Array>(weight_obj, false);
  const MutArray out = nb::cast<MutArray>(out_obj, false);
  check_nd("x", x, 2);
  check_nd("weight", w, 1);
  check_nd("out", out, 2);
  check_cpu_dtype("x", x, {kF32, kBF16});
  RmsNormArgs a;
  a.rows = x.shape(0);
  a.dim = x.shape(1);
  a.bf16 = x.dtype() == kBF16;
  if (w.dtype() != x.dtype() || out.dtype() != x.dtype())
    fail("weight", "weight " + dtype_name(w.dtype()) + " and out " + dtype_name(out.dtype()) + " must be x's " +
                       dtype_name(x.dtype()));
  if (static_cast<int64_t>(w.shape(0)) != a.dim) fail("weight", "shape " + shape_str(w) + " does not match x " + shape_str(x));
  if (out.shape(0) != x.shape(0) || out.shape(1) != x.shape(1)) fail("out", "shape " + shape_str(out) + " != x's " + shape_str(x));
  a.x = x.data();
  a.x_stride = a.rows > 1 ? x.stride(0) : a.dim;
  a.weight = w.data();
  a.out = out.data();
  a.out_stride = a.rows > 1 ? out.stride(0) : a.dim;
  a.eps = static_cast<float>(eps);
  if (!residual_obj.is_none()) {
    const MutArray res = nb::cast<MutArray>(residual_obj, false);
    check_nd("residual", res, 2);
    if (res.dtype() != x.dtype()) fail("residual", "dtype " + dtype_name(res.dtype()) + " != x's " + dtype_name(x.dtype()));
    if (res.shape(0) != x.shape(0) || res.shape(1) != x.shape(1))
      fail("residual", "shape " + shape_str(res) + " != x's " + shape_str(x));
    a.residual = res.data();
    a.residual_stride = a.rows > 1 ? res.stride(0) : a.dim;
  }
  if (a.rows == 0 || a.dim == 0) return;
  run_sync([&a] { rms_norm(a, global_pool()); });
}

// Rotary embedding of x [T, N, R] into out (hm::rope).
void rope_py(nb::object x_obj, nb::object cos_obj, nb::object sin_obj, nb::object out_obj, bool interleaved,
             nb::object norm_obj, double eps) {
  const Array x = nb::cast<Array>(x_obj, false);
  const Array c = nb::cast<Array>(cos_obj, false);
  const Array s = nb::cast<Array>(sin_obj, false);
  const MutArray out = nb::cast<MutArray>(out_obj, false);
  check_nd("x", x, 3);
  check_nd("out", out, 3);
  check_nd("cos", c, 2);
  check_nd("sin", s, 2);
  check_cpu_dtype("x", x, {kF32, kBF16});
  RopeArgs a;
  a.tokens = x.shape(0);
  a.heads = x.shape(1);
  a.dim = x.shape(2);
  a.bf16 = x.dtype() == kBF16;
  if (a.dim % 2) fail("x", "the rotary dim must be even, got shape " + shape_str(x));
  for (const auto& [name, arr] : {std::pair<const char*, const Array*>{"cos", &c}, {"sin", &s}}) {
    if (arr->dtype() != x.dtype()) fail(name, "dtype " + dtype_name(arr->dtype()) + " != x's " + dtype_name(x.dtype()));
    if (static_cast<int64_t>(arr->shape(0)) != a.tokens || static_cast<int64_t>(arr->shape(1)) != a.dim / 2 ||
        (a.tokens > 1 && arr->stride(0) != a.dim / 2))
      fail(name, "must be contiguous [" + std::to_string(a.tokens) + ", " + std::to_string(a.dim / 2) + "], got " +
                     shape_str(*arr));
  }
  if (out.dtype() != x.dtype()) fail("out", "dtype " + dtype_name(out.dtype()) + " != x's " + dtype_name(x.dtype()));
  if (out.shape(0) != x.shape(0) || out.shape(1) != x.shape(1) || out.shape(2) != x.shape(2))
    fail("out", "shape " + shape_str(out) + " != x's " + shape_str(x));
  a.x = x.data();
  a.x_token = x.stride(0);
  a.x_head = x.stride(1);
  a.out = out.data();
  a.out_token = out.stride(0);
  a.out_head = out.stride(1);
  a.cos = c.data();
  a.sin = s.data();
  a.interleaved = interleaved;
  if (!norm_obj.is_none()) {
    const Array w = nb::cast<Array>(norm_obj, false);
    check_nd("norm_weight", w, 1);
    if (w.dtype() != x.dtype()) fail("norm_weight", "dtype " + dtype_name(w.dtype()) + " != x's " + dtype_name(x.dtype()));
    if (static_cast<int64_t>(w.shape(0)) != a.dim) fail("norm_weight", "shape " + shape_str(w) + " does not match x " + shape_str(x));
    a.norm_weight = w.data();
    a.eps = static_cast<float>(eps);
  }
  if (a.tokens == 0 || a.heads == 0 || a.dim == 0) return;
  run_sync([&a] { rope(a, global_pool()); });
}

// The router's top-k experts and weights of each token from its gate logits (hm::route).
void route_py(nb::object logits_obj, int64_t k, bool sigmoid, nb::object bias_obj, int64_t groups, int64_t topk_groups,
              bool normalize, double norm_eps, double scale, nb::object ids_obj, nb::object weights_obj) {
  const Array x = nb::cast<Array>(logits_obj, false);
  const MutArray ids = nb::cast<MutArray>(ids_obj, false);
  const MutArray w = nb::cast<MutArray>(weights_obj, false);
  check_nd("logits", x, 2);
  check_nd("ids", ids, 2);
  check_nd("weights", w, 2);
  check_cpu_dtype("logits", x, {kF32});
  check_cpu_dtype("ids", ids, {kI64});
  check_cpu_dtype("weights", w, {kF32});
  RouteArgs a;
  a.tokens = x.shape(0);
  a.experts = x.shape(1);
  a.logits_stride = a.tokens > 1 ? x.stride(0) : a.experts;
  if (k < 1 || k > a.experts) fail("k", "must be in [1, " + std::to_string(a.experts) + "], got " + std::to_string(k));
  if (groups < 1 || a.experts % groups) fail("groups", std::to_string(groups) + " does not divide " + std::to_string(a.experts) + " experts");
  if (topk_groups < 1 || topk_groups > groups || (groups > 1 && k > topk_groups * (a.experts / groups)))
    fail("topk_groups", std::to_string(topk_groups) + " groups of " + std::to_string(groups) + " cannot hold " +
                            std::to_string(k) + " experts");
  for (const auto& [name, arr] : {std::pair<const char*, const MutArray*>{"ids", &ids}, {"weights", &w}})
    if (static_cast<int64_t>(arr->shape(0)) != a.tokens || static_cast<int64_t>(arr->shape(1)) != k ||
        (a.tokens > 1 && arr->stride(0) != k))
      fail(name, "must be contiguous [" + std::to_string(a.tokens) + ", " + std::to_string(k) + "], got " + shape_str(*arr));
  if (!bias_obj.is_none()) {
    const Array b = nb::cast<Array>(bias_obj, false);
    check_nd("bias", b, 1);
    check_cpu_dtype("bias", b, {kF32});
    if (static_cast<int64_t>(b.shape(0)) != a.experts) fail("bias", "shape " + shape_str(b) + " does not match logits " + shape_str(x));
    a.bias = static_cast<const float*>(b.data());
  }
  a.logits = static_cast<const float*>(x.data());
  a.k = static_cast<int>(k);
  a.sigmoid = sigmoid;
  a.groups = static_cast<int>(groups);
  a.topk_groups = static_cast<int>(topk_groups);
  a.normalize = normalize;
  a.norm_eps = static_cast<float>(norm_eps);
  a.scale = static_cast<float>(scale);
  a.ids = static_cast<int64_t*>(ids.data());
  a.weights = static_cast<float*>(w.data());
  route(a);
}

// Each sequence's context length from seq_lens [S] (int32 or int64), checked against its row of block_tables
// [S, max_blocks]: at least 1, within the table, and every block it reads in [0, num_blocks).
std::vector<int64_t> checked_seq_lens(const Array& bt, const Array& sl, int64_t S, int64_t num_blocks,
                                      int64_t block_size) {
  if (bt.dtype() != kI32 && bt.dtype() != kI64) fail("block_tables", "dtype must be int32 or int64");
  if (sl.dtype() != kI32 && sl.dtype() != kI64) fail("seq_lens", "dtype must be int32 or int64");
  if (static_cast<int64_t>(bt.shape(0)) != S || static_cast<int64_t>(sl.shape(0)) != S)
    fail("block_tables", "block_tables " + shape_str(bt) + " and seq_lens " + shape_str(sl) + " must have " +
                             std::to_string(S) + " rows (q's sequences)");
  const int64_t MB = bt.shape(1), stride = bt.stride(0);
  const bool i32 = bt.dtype() == kI32;
  std::vector<int64_t> lens(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    const int64_t len = sl.dtype() == kI32 ? static_cast<const int32_t*>(sl.data())[s * sl.stride(0)]
                                           : static_cast<const int64_t*>(sl.data())[s * sl.stride(0)];
    if (len < 1 || len > MB * block_size)
      fail("seq_lens", "sequence " + std::to_string(s) + ": length " + std::to_string(len) + " outside [1, " +
                           std::to_string(MB * block_size) + "] (block table of " + std::to_string(MB) + " blocks of " +
                           std::to_string(block_size) + ")");
    lens[s] = len;
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t i = s * stride + b;
      const int64_t id = i32 ? static_cast<const int32_t*>(bt.data())[i] : static_cast<const int64_t*>(bt.data())[i];
      if (id < 0 || id >= num_blocks)
        fail("block_tables", "block " + std::to_string(id) + " at [" + std::to_string(s) + ", " + std::to_string(b) +
                                 "] is out of range [0, " + std::to_string(num_blocks) + ")");
    }
  }
  return lens;
}

// out[s, h] = softmax(q[s, h] . K_s^T * scale) V_s over sequence s's context in the paged cache.
void decode_attention_py(nb::object q_obj, nb::object k_obj, nb::object v_obj, nb::object bt_obj, nb::object sl_obj,
                         nb::object out_obj, double scale, int64_t window) {
  const Array q = nb::cast<Array>(q_obj, false);
  const Array k = nb::cast<Array>(k_obj, false);
  const Array v = nb::cast<Array>(v_obj, false);
  const Array bt = nb::cast<Array>(bt_obj, false);
  const Array sl = nb::cast<Array>(sl_obj, false);
  const MutArray out = nb::cast<MutArray>(out_obj, false);
  check_nd("q", q, 3);
  check_nd("k_cache", k, 4);
  check_nd("v_cache", v, 4);
  check_nd("block_tables", bt, 2);
  check_nd("seq_lens", sl, 1);
  check_nd("out", out, 3);
  DecodeAttnArgs a;
  a.num_seqs = q.shape(0);
  a.num_heads = q.shape(1);
  a.head_dim = q.shape(2);
  a.num_kv_heads = k.shape(2);
  a.block_size = k.shape(1);
  a.v_head_dim = v.shape(3);
  const int64_t S = a.num_seqs, N = a.num_heads, NB = k.shape(0);
  if (static_cast<int64_t>(k.shape(3)) != a.head_dim)
    fail("k_cache", "head dim " + std::to_string(k.shape(3)) + " != q's " + std::to_string(a.head_dim));
  if (v.shape(0) != k.shape(0) || v.shape(1) != k.shape(1) || v.shape(2) != k.shape(2))
    fail("v_cache", "shape " + shape_str(v) + " does not match k_cache " + shape_str(k) + " in its first 3 dims");
  if (a.num_kv_heads < 1 || N % a.num_kv_heads)
    fail("q", std::to_string(N) + " heads is not a multiple of the cache's " + std::to_string(a.num_kv_heads) +
                  " KV heads");
  if (a.head_dim < 1 || a.v_head_dim < 1 || a.block_size < 1) fail("k_cache", "empty dims in " + shape_str(k));
  a.q_type = attn_type("q", q.dtype());
  a.kv_type = attn_type("k_cache", k.dtype());
  if (v.dtype() != k.dtype()) fail("v_cache", "dtype " + dtype_name(v.dtype()) + " != k_cache's " + dtype_name(k.dtype()));
  a.out_type = attn_type("out", out.dtype());
  if (static_cast<int64_t>(out.shape(0)) != S || static_cast<int64_t>(out.shape(1)) != N ||
      static_cast<int64_t>(out.shape(2)) != a.v_head_dim)
    fail("out", "expected shape [" + std::to_string(S) + ", " + std::to_string(N) + ", " +
                    std::to_string(a.v_head_dim) + "], got " + shape_str(out));
  const std::vector<int64_t> lens = checked_seq_lens(bt, sl, S, NB, a.block_size);
  a.block_tables_i32 = bt.dtype() == kI32;
  a.block_table_stride = bt.stride(0);
  a.q = q.data();
  a.q_stride_seq = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.k = k.data();
  a.k_stride_block = k.stride(0);
  a.k_stride_token = k.stride(1);
  a.k_stride_head = k.stride(2);
  a.v = v.data();
  a.v_stride_block = v.stride(0);
  a.v_stride_token = v.stride(1);
  a.v_stride_head = v.stride(2);
  a.block_tables = bt.data();
  a.seq_lens = lens.data();
  a.out = out.data();
  a.out_stride_seq = out.stride(0);
  a.out_stride_head = out.stride(1);
  a.scale = static_cast<float>(scale);
  a.window = window > 0 ? window : 0;
  if (S == 0) return;
  const KernelTable* kt = active_kernels();
  run_sync([&a, kt] { decode_attention(a, *kt, global_pool()); });
}

// A decode step's decoder layers in one call (hm::DecodeStack), holding what it reads: matrices, norms, experts and
// KV caches.
struct PyDecodeStack {
  std::unique_ptr<DecodeStack> stack;
  std::vector<nb::object> held;
  int64_t num_slots = 0, num_blocks = 0, block_size = 0, rotary_half = 0;

  // shape: hidden, heads, mla, kv_heads and head_dim (GQA) or nope_dim, rope_dim, v_dim, lora, q_lora (MLA), bf16,
  // eps, scale, window, interleaved. routing: kernels.router.route's settings (k, sigmoid, groups, topk_groups,
  // normalize, norm_eps, scale).
  // layers: one dict each: o, cache, post_norm, next_norm; GQA: q, k, v (Matrix), q_norm, k_norm (arrays or None);
  // MLA: q_first, q_b (or None), kv_a (Matrix), q_a_norm (or None), kv_a_norm, uk, uv (MatrixHeads); the MLP:
  // experts (MoE or None), gate (the router's float32 Matrix), bias (or None), mlp ((gate, up, down) Matrices of the
  // shared experts or the dense MLP, or None).
  PyDecodeStack(nb::dict shape, nb::dict routing, nb::list layers) {
    auto get = [](const nb::dict& d, const char* where, const char* key) -> nb::object {
      if (!d.contains(key)) fail(where, std::string("missing '") + key + "'");
      return d[key];
    };
    auto integer = [&](const char* key) { return nb::cast<int64_t>(get(shape, "shape", key)); };
    auto number = [&](const char* key) { return static_cast<float>(nb::cast<double>(get(shape, "shape", key))); };
    DecodeStackShape sh;
    sh.hidden = integer("hidden");
    sh.heads = integer("heads");
    sh.mla = nb::cast<bool>(get(shape, "shape", "mla"));
    sh.bf16 = nb::cast<bool>(get(shape, "shape", "bf16"));
    sh.eps = number("eps");
    sh.scale = number("scale");
    sh.window = std::max<int64_t>(0, integer("window"));
    sh.interleaved = nb::cast<bool>(get(shape, "shape", "interleaved"));
    if (sh.mla) {
      sh.nope_dim = integer("nope_dim");
      sh.rope_dim = integer("rope_dim");
      sh.v_dim = integer("v_dim");
      sh.lora = integer("lora");
      sh.q_lora = integer("q_lora");
      if (sh.nope_dim < 1 || sh.rope_dim < 2 || sh.rope_dim % 2 || sh.v_dim < 1 || sh.lora < 1 || sh.q_lora < 0)
        fail("shape", "MLA dims must be positive, the rope dim even");
      rotary_half = sh.rope_dim / 2;
    } else {
      sh.kv_heads = integer("kv_heads");
      sh.head_dim = integer("head_dim");
      if (sh.kv_heads < 1 || sh.heads % sh.kv_heads || sh.head_dim < 2 || sh.head_dim % 2)
        fail("shape", "heads must be a multiple of kv_heads, head_dim even");
      rotary_half = sh.head_dim / 2;
    }
    if (sh.hidden < 1 || sh.heads < 1) fail("shape", "hidden and heads must be positive");
    const DT compute = sh.bf16 ? kBF16 : kF32;
    const int64_t H = sh.hidden, N = sh.heads;
    std::vector<DecodeStackLayer> built;
    for (size_t i = 0; i < nb::len(layers); ++i) {
      const std::string at = "layers[" + std::to_string(i) + "]";
      const nb::dict d = nb::cast<nb::dict>(layers[i]);
      auto item = [&](const char* key) -> nb::object {
        nb::object value = get(d, at.c_str(), key);
        held.push_back(value);
        return value;
      };
      auto check = [&](const Matrix& m, const std::string& key, int64_t rows, int64_t cols) {
        if (m.rows != rows || m.cols != cols)
          fail(at + "." + key, "shape [" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "] != [" +
                                   std::to_string(rows) + ", " + std::to_string(cols) + "]");
        return m;
      };
      auto matrix = [&](const char* key, int64_t rows, int64_t cols) {
        return check(nb::cast<const PyMatrix&>(item(key)).m, key, rows, cols);
      };
      auto vector = [&](const char* key, int64_t n, DT dtype, bool optional) -> const void* {
        nb::object value = item(key);
        if (optional && value.is_none()) return nullptr;
        const Array a = nb::cast<Array>(value, false);
        check_nd(at + "." + key, a, 1);
        check_cpu_dtype(at + "." + key, a, {dtype});
        if (static_cast<int64_t>(a.shape(0)) != n)
          fail(at + "." + key, "shape " + shape_str(a) + " != [" + std::to_string(n) + "]");
        return a.data();
      };
      auto heads = [&](const char* key, int64_t rows, int64_t cols) {
        const PyHeads& h = nb::cast<const PyHeads&>(item(key));
        if (h.heads() != N) fail(at + "." + key, std::to_string(h.heads()) + " heads != " + std::to_string(N));
        check(h.m[0], key, rows, cols);
        return h.m;
      };
      DecodeStackLayer l;
      int64_t kv_heads, key_dim;  // the cache's
      if (sh.mla) {
        const int64_t P = sh.nope_dim, R = sh.rope_dim, L = sh.lora;
        l.q_first = matrix("q_first", sh.q_lora ? sh.q_lora : N * (P + R), H);
        if (sh.q_lora) {
          l.q_b = matrix("q_b", N * (P + R), sh.q_lora);
          l.q_a_norm = vector("q_a_norm", sh.q_lora, compute, false);
        }
        l.kv_a = matrix("kv_a", L + R, H);
        l.kv_a_norm = vector("kv_a_norm", L, compute, false);
        const Matrix first[2] = {l.q_first, l.kv_a};
        l.first_grouped = matmul_group_mismatch(first, 2) == nullptr;
        l.uk = heads("uk", L, P);
        l.uv = heads("uv", sh.v_dim, L);
        l.o = matrix("o", H, N * sh.v_dim);
        kv_heads = 1;
        key_dim = L + R;
      } else {
        const int64_t D = sh.head_dim;
        l.q = matrix("q", N * D, H);
        l.k = matrix("k", sh.kv_heads * D, H);
        l.v = matrix("v", sh.kv_heads * D, H);
        l.o = matrix("o", H, N * D);
        const Matrix qkv[3] = {l.q, l.k, l.v};
        l.qkv_grouped = matmul_group_mismatch(qkv, 3) == nullptr;
        l.q_norm = vector("q_norm", D, compute, true);
        l.k_norm = vector("k_norm", D, compute, true);
        if ((l.q_norm == nullptr) != (l.k_norm == nullptr)) fail(at, "q_norm and k_norm: both or neither");
        kv_heads = sh.kv_heads;
        key_dim = D;
      }
      l.post_norm = vector("post_norm", H, compute, false);
      l.next_norm = vector("next_norm", H, compute, false);
      nb::object mlp = item("mlp");
      if (!mlp.is_none()) {
        const nb::tuple parts = nb::cast<nb::tuple>(mlp);
        if (parts.size() != 3) fail(at + ".mlp", "must be (gate, up, down)");
        const Matrix& g = nb::cast<const PyMatrix&>(parts[0]).m;
        const int64_t I = g.rows;
        l.mlp.gate = check(g, "mlp gate", I, H);
        l.mlp.up = check(nb::cast<const PyMatrix&>(parts[1]).m, "mlp up", I, H);
        l.mlp.down = check(nb::cast<const PyMatrix&>(parts[2]).m, "mlp down", H, I);
        const Matrix gu[2] = {l.mlp.gate, l.mlp.up};
        l.mlp.grouped = matmul_group_mismatch(gu, 2) == nullptr;
      }
      nb::object experts = item("experts");
      if (experts.is_none()) {
        if (mlp.is_none()) fail(at, "neither experts nor an MLP");
      } else {
        l.has_shared = !mlp.is_none();
        l.gate = nb::cast<const PyMatrix&>(item("gate")).m;
        const int64_t E = l.gate.rows;
        if (l.gate.fmt != WFormat::F32 || l.gate.cols != H) fail(at + ".gate", "must be float32 [E, hidden]");
        const int64_t top_k = nb::cast<int64_t>(get(routing, "routing", "k"));
        const int64_t groups = nb::cast<int64_t>(get(routing, "routing", "groups"));
        const int64_t topk_groups = nb::cast<int64_t>(get(routing, "routing", "topk_groups"));
        if (top_k < 1 || top_k > E || groups < 1 || E % groups || topk_groups < 1 || topk_groups > groups)
          fail(at + ".gate", "routing of " + std::to_string(top_k) + " experts in " + std::to_string(topk_groups) +
                                 " of " + std::to_string(groups) + " groups does not fit " + std::to_string(E) +
                                 " experts");
        l.route.k = static_cast<int>(top_k);
        l.route.sigmoid = nb::cast<bool>(get(routing, "routing", "sigmoid"));
        l.route.bias = static_cast<const float*>(vector("bias", E, kF32, true));
        l.route.groups = static_cast<int>(groups);
        l.route.topk_groups = static_cast<int>(topk_groups);
        l.route.normalize = nb::cast<bool>(get(routing, "routing", "normalize"));
        l.route.norm_eps = static_cast<float>(nb::cast<double>(get(routing, "routing", "norm_eps")));
        l.route.scale = static_cast<float>(nb::cast<double>(get(routing, "routing", "scale")));
        const MoELayer* layer = nb::cast<const PyMoE&>(experts).layer.get();
        if (layer->hidden() != H || layer->num_experts() != E)
          fail(at + ".experts", std::to_string(layer->num_experts()) + " experts of hidden " +
                                    std::to_string(layer->hidden()) + " for a router of " + std::to_string(E) +
                                    " and hidden " + std::to_string(H));
        l.experts = layer;
      }
      // the cache: GQA [2, NB, BS, Nk, D] (K, V); MLA [NB, BS, L+R] (the latents, read as V by their first L)
      const MutArray cache = nb::cast<MutArray>(item("cache"), false);
      check_nd(at + ".cache", cache, sh.mla ? 3 : 5);
      const int64_t lead = sh.mla ? 0 : 1;
      if ((!sh.mla && (cache.shape(0) != 2 || static_cast<int64_t>(cache.shape(3)) != kv_heads)) ||
          static_cast<int64_t>(cache.shape(cache.ndim() - 1)) != key_dim)
        fail(at + ".cache", "shape " + shape_str(cache) + " does not hold " + std::to_string(kv_heads) + " x " +
                                std::to_string(key_dim) + " values a token");
      const int64_t NB = cache.shape(lead), BS = cache.shape(lead + 1);
      if (i == 0) num_blocks = NB, block_size = BS;
      else if (NB != num_blocks || BS != block_size) fail(at + ".cache", "blocks differ from layers[0]'s");
      const AttnType type = attn_type(at + ".cache", cache.dtype());
      const size_t esize = type == AttnType::F32 ? 4 : 2;
      for (int half = 0; half < 2; ++half) {
        CacheView& c = half ? l.v_cache : l.k_cache;
        c.data = static_cast<char*>(cache.data()) + (sh.mla ? 0 : half * cache.stride(0) * esize);
        c.type = type;
        c.stride_block = cache.stride(lead);
        c.stride_token = cache.stride(lead + 1);
        c.stride_head = sh.mla ? key_dim : cache.stride(3);
        c.block_size = BS;
      }
      built.push_back(std::move(l));
    }
    num_slots = num_blocks * block_size;
    stack = std::make_unique<DecodeStack>(sh, std::move(built));
  }

  void run(nb::object residual_obj, nb::object x_obj, nb::object cos_obj, nb::object sin_obj, nb::object slots_obj,
           nb::object bt_obj, nb::object sl_obj) {
    const DecodeStackShape& sh = stack->shape();
    const DT compute = sh.bf16 ? kBF16 : kF32;
    const MutArray residual = nb::cast<MutArray>(residual_obj, false);
    const MutArray x = nb::cast<MutArray>(x_obj, false);
    const Array c = nb::cast<Array>(cos_obj, false), s = nb::cast<Array>(sin_obj, false);
    const Array slots = nb::cast<Array>(slots_obj, false), bt = nb::cast<Array>(bt_obj, false);
    const Array sl = nb::cast<Array>(sl_obj, false);
    check_2d("residual", residual, {compute});
    const int64_t S = residual.shape(0);
    auto rows = [&](const char* name, const auto& a, int64_t cols) {
      check_2d(name, a, {compute});
      check_shape(name, a, S, cols);
      if (S > 1 && a.stride(0) != cols) fail(name, "must be contiguous");
    };
    rows("residual", residual, sh.hidden);
    rows("x", x, sh.hidden);
    rows("cos", c, rotary_half);
    rows("sin", s, rotary_half);
    check_nd("slots", slots, 1);
    check_cpu_dtype("slots", slots, {kI64});
    if (static_cast<int64_t>(slots.shape(0)) != S)
      fail("slots", "shape " + shape_str(slots) + " != [" + std::to_string(S) + "]");
    const int64_t* slot = static_cast<const int64_t*>(slots.data());
    for (int64_t i = 0; i < S; ++i)
      if (slot[i] < 0 || slot[i] >= num_slots)
        fail("slots", "slot " + std::to_string(slot[i]) + " of sequence " + std::to_string(i) +
                          " is outside the cache's [0, " + std::to_string(num_slots) + ")");
    check_nd("block_tables", bt, 2);
    check_nd("seq_lens", sl, 1);
    const std::vector<int64_t> lens = checked_seq_lens(bt, sl, S, num_blocks, block_size);
    if (S == 0) return;
    DecodeStackStep step;
    step.seqs = S;
    step.residual = residual.data();
    step.x = x.data();
    step.cos = c.data();
    step.sin = s.data();
    step.slots = slot;
    step.block_tables = bt.data();
    step.block_tables_i32 = bt.dtype() == kI32;
    step.block_table_stride = bt.stride(0);
    step.seq_lens = lens.data();
    const KernelTable* kt = active_kernels();
    DecodeStack* st = stack.get();
    run_sync([&step, st, kt] { st->run(step, *kt, global_pool()); });
  }
};
}  // namespace
}  // namespace hm

NB_MODULE(_native, mod) {
  using namespace hm;
  mod.doc() = "hybridmoe C++ expert kernels (FP8/INT4/INT8/BF16 fused MoE on the CPU)";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  nb::class_<PyMatrix>(mod, "Matrix", "A weight matrix [rows, cols] in one format, holding its arrays")
      .def_prop_ro("rows", [](const PyMatrix& p) { return p.m.rows; })
      .def_prop_ro("cols", [](const PyMatrix& p) { return p.m.cols; })
      .def_prop_ro("padded_cols", [](const PyMatrix& p) { return p.m.padded_cols; })
      .def_prop_ro("gemm_min_tokens",
                   [](const PyMatrix& p) {
                     return gemm_min_tokens(p.m.fmt, active_kernels()->bf16_dot, active_kernels()->amx);
                   },
                   "Tokens from which path='auto' takes the GEMM path (fewer: the GEMV path), for the active ISA "
                   "(amx: its AMX tiles for bf16 and fp8 weights); int4 and int8: 2**63 - 1 (any number of tokens "
                   "on the GEMV path, 128 at a time; amx: its AMX tiles from amx_int_min_tokens()).")
      .def("rounds_activations_to_bf16",
           [](const PyMatrix& p, int64_t tokens, const std::string& path) {
             return rounds_activations_to_bf16(*active_kernels(), p.m.fmt, p.m.row_bytes, tokens, parse_path(path));
           },
           "tokens"_a, "path"_a,
           "Whether a matmul of `tokens` tokens on `path` rounds the activations to bf16 under the active ISA (bf16 "
           "dot products or AMX tiles for bf16 and fp8 weights, and for int4 and int8 on the amx ISA).")
      .def_prop_ro("bf16_dot_min_tokens",
                   [](const PyMatrix& p) -> int64_t {
                     if (!active_kernels()->bf16_dot || !has_bf16_dot_path(p.m.fmt)) return -1;
                     return bf16_dot_min_tokens(p.m.fmt, p.m.row_bytes);
                   },
                   "Tokens from which the GEMV path multiplies with bf16 dot products (activations rounded to bf16) "
                   "under the active ISA; -1 where it never does (ISA or format).")
      .def_prop_ro("flag_bytes", [](const PyMatrix& p) { return p.row_flags ? p.row_flags->size() : size_t{0}; },
                   "fp8: bytes of the per-row NaN / per-block subnormal flags made at load")
      .def_prop_ro("nan_rows", [](const PyMatrix& p) {
        std::vector<int64_t> rows;
        for (int64_t r = 0; p.row_flags && r < p.m.rows; ++r)
          if ((*p.row_flags)[r] & kRowHasNan) rows.push_back(r);
        return rows;
      }, "fp8: rows holding a NaN code (their outputs are NaN)");
  mod.def("make_matrix", &make_matrix, "fmt"_a, "data"_a, "scales"_a.none(), "rows"_a, "cols"_a,
          "block_rows"_a = 128, "block_cols"_a = 128, "group"_a = 0, "name"_a = "weight",
          "Wraps arrays (no copy) as a weight matrix; checks dtype, shape and layout for the format.");

  mod.def("shard_copy_bytes", [](nb::list gate, nb::list up, nb::list down, int64_t intermediate) {
    const std::vector<ExpertMatrices> experts = expert_matrices(gate, up, down, nullptr);
    return shard_copy_bytes(experts, intermediate, global_numa_topology());
  }, "gate"_a, "up"_a, "down"_a, "intermediate"_a,
  "Per NUMA node, the bytes of its copies of these experts' shards (empty: the topology reads them in place).");
  mod.def("silu_mul", [](nb::ndarray<const float, nb::c_contig, nb::device::cpu> gate,
                         nb::ndarray<const float, nb::c_contig, nb::device::cpu> up,
                         nb::ndarray<float, nb::c_contig, nb::device::cpu> out) {
    if (gate.size() != up.size() || out.size() != gate.size())
      fail("silu_mul", "gate, up and out must have as many values (" + std::to_string(gate.size()) + ", " +
                           std::to_string(up.size()) + ", " + std::to_string(out.size()) + ")");
    active_kernels()->silu_mul(gate.data(), up.data(), out.data(), static_cast<int64_t>(gate.size()));
  }, "gate"_a, "up"_a, "out"_a, "out = silu(gate) * up over contiguous float32 arrays (the active ISA's kernel).");
  mod.def("round_to_half", [](nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> values) {
    const size_t n = values.shape(0);
    auto* bits = new uint16_t[n];
    for (size_t i = 0; i < n; ++i) bits[i] = float_to_half(values.data()[i]);
    nb::capsule owner(bits, [](void* p) noexcept { delete[] static_cast<uint16_t*>(p); });
    return nb::ndarray<nb::numpy, uint16_t, nb::ndim<1>>(bits, {n}, owner);
  }, "values"_a, "float32 values -> float16 bit patterns (uint16), rounded as the decode stack writes a float16 KV "
     "cache.");
  nb::class_<PyDecodeStack>(mod, "DecodeStack",
                             "A decode step's layers (GQA or MLA attention, MoE or dense MLP) in one call, each part "
                             "the kernel call the Python decoder makes")
      .def(nb::init<nb::dict, nb::dict, nb::list>(), "shape"_a, "routing"_a, "layers"_a)
      .def_prop_ro("num_layers", [](const PyDecodeStack& p) { return p.stack->layers().size(); })
      .def("run", &PyDecodeStack::run, "residual"_a, "x"_a, "cos"_a, "sin"_a, "slots"_a, "block_tables"_a,
           "seq_lens"_a,
           "Every layer for one token a sequence: residual [S, H] updated in place, x [S, H] the first layer's "
           "normed input in and the final norm's output out.");
  nb::class_<MoEHandle>(mod, "MoEHandle")
      .def("wait", &MoEHandle::wait, "Blocks (GIL released) until done; returns the output array.")
      .def("done", &MoEHandle::done);
  nb::class_<PyMoE>(mod, "MoE", "One layer's routed experts for the fused MoE kernels")
      .def(nb::init<nb::list, nb::list, nb::list, int64_t, int64_t, nb::list>(), "gate"_a, "up"_a, "down"_a,
           "hidden"_a, "intermediate"_a, "buffers"_a = nb::list())
      .def_prop_ro("num_experts", [](const PyMoE& m) { return m.layer->num_experts(); })
      .def_prop_ro("numa_shards", [](const PyMoE& m) {
        nb::list shards;
        for (const NodeShard& s : m.layer->shards())
          shards.append(nb::make_tuple(s.begin, s.end, s.copied_bytes, s.bound, s.huge_pages));
        return shards;
      }, "Per NUMA node: (begin, end) of its intermediate range, bytes copied into its memory, bound (mbind), "
         "huge pages advised (madvise)")
      .def_prop_ro("owns_weights", [](const PyMoE& m) { return m.layer->owns_weights(); },
                   "Every node computes from its own copy; the tensors the layer was built from are not used")
      .def("submit", [](nb::object self, nb::object hidden, nb::object ids, nb::object weights, nb::object out,
                        const std::string& path) { return submit(self, hidden, ids, weights, out, path); },
           "hidden"_a, "topk_ids"_a, "topk_weights"_a, "out"_a, "path"_a = "auto")
      .def("run", [](nb::object self, nb::object hidden, nb::object ids, nb::object weights, nb::object out,
                     const std::string& path) { run_moe(self, hidden, ids, weights, out, path); },
           "hidden"_a, "topk_ids"_a, "topk_weights"_a, "out"_a, "path"_a = "auto",
           "submit + wait in one (blocking; on the calling thread when no submitted job is pending).");

  mod.def("rope", &rope_py, "x"_a, "cos"_a, "sin"_a, "out"_a, "interleaved"_a, "norm_weight"_a.none() = nb::none(),
          "eps"_a = 1e-6,
          "Rotary embedding (blocking): out[t, n] = (x1 c - x2 s, x2 c + x1 s) over x [T, N, R]'s pairs (interleaved "
          "or half-split), cos / sin [T, R/2]; the result in half-split layout; float32 or bfloat16 alike; out may be x. "
          "norm_weight [R]: each row RMS-normalised by it first, as rms_norm would (Qwen3's q / k norms).");
  mod.def("route", &route_py, "logits"_a, "k"_a, "sigmoid"_a, "bias"_a.none(), "groups"_a, "topk_groups"_a,
          "normalize"_a, "norm_eps"_a, "scale"_a, "ids"_a, "weights"_a,
          "MoE routing (blocking, the calling thread): each token's k experts (descending, ties to the lower id) and "
          "weights from its gate logits [T, E] float32: softmax or sigmoid scores; with bias [E], chosen by scores + "
          "bias and weighted by scores; groups > 1: only experts of the topk_groups groups of largest top-2 sum; "
          "normalize: weights / (sum + norm_eps); times scale. Into ids [T, k] int64 and weights [T, k] float32.");
  mod.def("rms_norm", &rms_norm_py, "x"_a, "weight"_a, "out"_a, "eps"_a, "residual"_a.none(),
          "out = weight * rms-normalised rows of x (blocking), float32 or bfloat16 alike; with a residual, residual += x "
          "first (in place) and its rows are normalised (the decoder's residual stream and the next norm in one call).");
  mod.def("decode_attention", &decode_attention_py, "q"_a, "k_cache"_a, "v_cache"_a, "block_tables"_a, "seq_lens"_a,
          "out"_a, "scale"_a, "window"_a = 0,
          "Paged decode attention (one query per sequence, blocking): out[s, h] = softmax(q[s, h] . K^T * scale) V "
          "over sequence s's first seq_lens[s] keys, read through block_tables[s] from k_cache / v_cache [num_blocks, "
          "block_size, Nk, D / Dv]; query head h reads KV head h // (N / Nk); window > 0: only the last `window` keys.");
  nb::class_<PyHeads>(mod, "MatrixHeads", "One weight matrix [M, K] per head, all of one format and shape")
      .def(nb::init<nb::list>(), "matrices"_a)
      .def_prop_ro("heads", &PyHeads::heads)
      .def_prop_ro("rows", [](const PyHeads& h) { return h.m[0].rows; })
      .def_prop_ro("cols", [](const PyHeads& h) { return h.m[0].cols; });
  mod.def("matmul_heads", &matmul_heads, "heads"_a, "x"_a, "out"_a, "path"_a = "auto",
          "out[t, n] = x[t, n] @ W_n^T for every head n (blocking): x [T, N, K] and out [T, N, M] float32 or bfloat16 "
          "(out rounded to nearest even), strided over tokens and heads with contiguous rows; one pool dispatch over "
          "(heads, row block) tasks.");
  mod.def("matmul_group_mismatch", [](const std::vector<const PyMatrix*>& ws) -> std::optional<std::string> {
            const std::vector<Matrix> mats = matrices_of(ws);
            const char* what = matmul_group_mismatch(mats.data(), static_cast<int>(mats.size()));
            return what ? std::optional<std::string>(what) : std::nullopt;
          }, "ws"_a,
          "What the matrices differ in that matmul_group's one preparation of the input cannot serve, else None.");
  mod.def("matmul_group", &matmul_group, "ws"_a, "x"_a, "outs"_a, "path"_a = "auto",
          "outs[i][M, N_i] = x[M, K] @ W_i^T for matrices of one input (blocking): the activations prepared once, one "
          "pool dispatch over every matrix's row blocks; x and outs float32 or bfloat16 (outs alike).");
  mod.def("matmul", &matmul, "w"_a, "x"_a, "out"_a, "path"_a = "auto", "out[M, N] = x[M, K] @ W^T (blocking); x and out float32 or bfloat16 (out rounded to nearest even).");
  mod.def("dequantize_bf16", &dequantize_bf16, "w"_a, "r0"_a, "r1"_a, "out"_a,
          "out[r1 - r0, cols] (bfloat16) = rows [r0, r1) of an int4 / int8 matrix, code times scale rounded to bf16.");
  mod.def("quantize_rows", [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x, int64_t padded,
                              int group) {
    if (group < 1 || padded % group || padded < static_cast<int64_t>(x.shape(1)))
      hm::fail("quantize_rows", "padded must be a multiple of group and >= the row length");
    const int64_t M = x.shape(0), K = x.shape(1), G = padded / group;
    auto* q = new int8_t[M * padded];
    auto* s = new float[M * G];
    auto* qs = new float[M * G];
    const KernelTable* kt = active_kernels();
    for (int64_t r = 0; r < M; ++r)
      kt->quantize_row(x.data() + r * K, K, padded, group, q + r * padded, s + r * G, qs + r * G);
    nb::capsule oq(q, [](void* p) noexcept { delete[] static_cast<int8_t*>(p); });
    nb::capsule os(s, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    nb::capsule oqs(qs, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    return nb::make_tuple(nb::ndarray<nb::numpy, int8_t, nb::ndim<2>>(q, {size_t(M), size_t(padded)}, oq),
                          nb::ndarray<nb::numpy, float, nb::ndim<2>>(s, {size_t(M), size_t(G)}, os),
                          nb::ndarray<nb::numpy, float, nb::ndim<2>>(qs, {size_t(M), size_t(G)}, oqs));
  }, "x"_a, "padded"_a, "group"_a,
     "The activation quantiser the int kernels use (the active ISA's): (q, scale, scale*sum(q)).");

  mod.def("isa_names", &isa_names);
  mod.def("isa_unavailable_reason", &isa_unavailable_reason, "name"_a);
  mod.def("isa_auto_selected", &isa_auto_selected, "name"_a,
          "Whether `name` may be chosen without HYBRIDMOE_ISA (false for the avx2bf16 emulation kept for tests; "
          "avx512bf16 on AMD CPUs only)");
  mod.def("active_isa", [] { return std::string(active_kernels()->name); });
  mod.def("isa_bf16_dot", [](const std::string& name) { return kernels_for(name)->bf16_dot; }, "name"_a,
          "Whether ISA `name` rounds the activations of bf16 and fp8 matmuls to bf16 (bf16 dot products); "
          "ValueError if it cannot run here");
  mod.def("isa_amx", [](const std::string& name) { return kernels_for(name)->amx; }, "name"_a,
          "Whether ISA `name` multiplies bf16 and fp8 weights by AMX tiles (activations rounded to bf16) from "
          "amx_min_tokens() tokens per expert; ValueError if it cannot run here");
  mod.def("amx_int_min_tokens", [] { return kAmxIntMinTokens; },
          "Tokens per expert from which the amx ISA's auto path multiplies int4 and int8 weights by AMX tiles.");
  mod.def("amx_min_tokens", [] { return kAmxMinTokens; },
          "Tokens per expert from which the amx ISA's auto path multiplies bf16 and fp8 weights by AMX tiles.");
  mod.def("bf16_dot_min_tokens", [] {
    return std::vector<std::pair<std::string, int64_t>>{{"fp8", bf16_dot_min_tokens(WFormat::FP8, 0)},
                                                        {"bf16", bf16_dot_min_tokens(WFormat::BF16, 0)}};  // short rows
  }, "Tokens per expert from which a bf16 dot-product ISA takes its bf16 dot products, per weight format (bf16 "
     "rows of bf16_dot_long_row_bytes() and more: from one token).");
  mod.def("bf16_dot_long_row_bytes", [] { return kBf16DotLongRowBytes; },
          "bf16 row length in bytes from which a bf16 dot-product ISA takes its bf16 dot products from one token.");
  mod.def("set_isa", [](const std::string& name) {
    global_executor().drain();
    set_active_isa(name);
  }, "name"_a);
  mod.def("cpu_features", &cpu_feature_list);
  mod.def("cpu_family", [] { return cpu_features().family; }, "The CPU's cpuid display family (0: not x86).");
  mod.def("short_row_prefetch", [] { return std::string(prefetch_level_name(short_row_prefetch())); },
          "Where the GEMV's far prefetch puts short rows at one token: 'l1' or 'l2'.");
  mod.def("default_short_row_prefetch", [] { return std::string(prefetch_level_name(default_short_row_prefetch())); },
          "This CPU's default for short_row_prefetch() (without HYBRIDMOE_SHORT_ROW_PREFETCH).");
  mod.def("set_short_row_prefetch",
          [](const std::string& level) { set_short_row_prefetch(parse_prefetch_level(level)); }, "level"_a,
          "Set short_row_prefetch() ('l1' or 'l2') for the matrices computed from now on.");
  mod.def("long_row_prefetch", [] { return std::string(long_row_prefetch() ? "on" : "off"); },
          "Whether the GEMV's one-row tiles of long rows prefetch the next row: 'on' or 'off'.");
  mod.def("default_long_row_prefetch", [] { return std::string(default_long_row_prefetch() ? "on" : "off"); },
          "This CPU's default for long_row_prefetch() (without HYBRIDMOE_LONG_ROW_PREFETCH).");
  mod.def("set_long_row_prefetch",
          [](const std::string& state) { set_long_row_prefetch(parse_on_off(state, "long row prefetch")); },
          "state"_a, "Set long_row_prefetch() ('on' or 'off') for the matrices computed from now on.");
  mod.def("configure_threads", [](int n, std::vector<int> cpus) {
    nb::gil_scoped_release release;
    configure_threads(n, cpus);
  }, "num_threads"_a, "cpus"_a = std::vector<int>{});
  mod.def("numa_topology", [] { return topology_dict(global_numa_topology()); }, "The topology the pool uses.");
  mod.def("detect_numa_topology", [] { return topology_dict(detect_numa_topology()); },
          "The machine's NUMA nodes from /sys (ignores overrides).");
  mod.def("configure_numa", [](std::vector<std::vector<int>> nodes, std::vector<int> memory_nodes, bool copy_shards,
                               int num_threads) {
    NumaTopology t;
    if (nodes.empty()) {
      t = detect_numa_topology();
      t.copy_shards = t.copy_shards || copy_shards;
    } else {
      t.node_cpus = std::move(nodes);
      t.emulated = true;
      t.copy_shards = copy_shards;
      t.memory_node = memory_nodes.empty() ? std::vector<int>(t.node_cpus.size(), -1) : memory_nodes;
      if (t.memory_node.size() != t.node_cpus.size())
        fail("memory_nodes", "one per node needed, got " + std::to_string(t.memory_node.size()) + " for " +
                                 std::to_string(t.node_cpus.size()) + " nodes");
    }
    nb::gil_scoped_release release;
    configure_numa(t, num_threads);
  }, "nodes"_a, "memory_nodes"_a = std::vector<int>{}, "copy_shards"_a = false, "num_threads"_a = 0,
     "Replace the topology (empty nodes: detect) and the pool; layers built afterwards are split over it.");
  mod.def("thread_nodes", [] { return global_pool().thread_nodes(); });
  mod.def("work_buffers", [] {
    std::vector<WorkBufferInfo> info;
    run_sync([&info] { info = work_buffers(); });
    nb::list out;
    for (const WorkBufferInfo& b : info) out.append(nb::make_tuple(b.node, b.memory_node, b.bytes, b.bound));
    return out;
  }, "The executor's MoE work buffers: (node (-1: shared input), OS memory node (-1: unbound), bytes, bound)");
  mod.def("split_range", &split_range, "n"_a, "granularity"_a, "parts"_a);
  mod.def("num_threads", [] { return global_pool().size(); });
  mod.def("idle_spin_us", &idle_spin_us, "How long an idle pool worker spins before it sleeps (microseconds).");
  mod.def("set_idle_spin_us", &set_idle_spin_us, "us"_a);
  mod.def("pool_sleeps", [] { return global_pool().sleeps(); }, "Times the pool's workers went to sleep.");
  mod.def("thread_cpus", [] { return global_pool().cpus(); });
  mod.def("available_cpus", &available_cpus);
  mod.def("measure_read_bandwidth", [](nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> buf,
                                       int repeats) {
    double bw = 0;
    const KernelTable* kt = active_kernels();
    const uint64_t* p = buf.data();
    const int64_t n = buf.shape(0);
    run_sync([&] { bw = measure_read_bandwidth(p, n, repeats, *kt, global_pool()); });
    return bw;
  }, "buffer"_a, "repeats"_a = 3, "Read bandwidth (bytes/s) over a uint64 buffer, all pool threads.");
  mod.def("measure_fma_peak", [](double seconds) {
    double flops = 0;
    const KernelTable* kt = active_kernels();
    run_sync([&] { flops = measure_fma_peak(seconds, *kt, global_pool()); });
    return flops;
  }, "seconds"_a = 0.2, "Float ops per second of FMA chains on all pool threads (active ISA).");
}
