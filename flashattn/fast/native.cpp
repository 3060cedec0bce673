// The fast path's autograd node in C++ (``native.py`` says when it runs and how it is built).
//
// A *plan* (``plans.py``) is the launches one call of the fast kernels made, recorded once per
// signature: for each kernel its CUfunction, grid, block and shared memory, and its parameters
// as 8-byte words, some of them slots for tensors. Python replays a plan with ~10 us of host time
// per launch, and its autograd node costs ~50 us more per call than a C++ one (an H200's host;
// ``results/host_gap_h200.md``). Here the same plan is replayed from C++: the forward's launch
// inside a C++ autograd Function, the backward's launches (delta, dQ, dK/dV: three at most head
// dims) in its backward, which autograd's engine then runs without taking Python's GIL.
//
// No CUDA header is needed to build this file: the three driver calls it makes are looked up in
// the libcuda that torch has already loaded, as Triton's own launcher does.
#include <torch/extension.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------
// The CUDA driver, by its C ABI: CUresult is an int, handles are pointers, a device an int.
using CUresult = int;
using LaunchKernel = CUresult (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                  unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                                  void* stream, void** params, void** extra);
using GetErrorString = CUresult (*)(CUresult, const char**);
using CtxGetCurrent = CUresult (*)(void** context);
using DeviceGet = CUresult (*)(int* device, int ordinal);
using PrimaryCtxRetain = CUresult (*)(void** context, int device);
using CtxSetCurrent = CUresult (*)(void* context);

struct Driver {
  LaunchKernel launch = nullptr;
  GetErrorString error_string = nullptr;
  CtxGetCurrent ctx_get_current = nullptr;
  DeviceGet device_get = nullptr;
  PrimaryCtxRetain primary_ctx_retain = nullptr;
  CtxSetCurrent ctx_set_current = nullptr;
};

const Driver& driver() {
  static const Driver found = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) throw std::runtime_error(std::string("flashattn native: cannot open libcuda.so.1: ") + dlerror());
    d.launch = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
    d.error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    d.ctx_get_current = reinterpret_cast<CtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
    d.device_get = reinterpret_cast<DeviceGet>(dlsym(lib, "cuDeviceGet"));
    d.primary_ctx_retain = reinterpret_cast<PrimaryCtxRetain>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    d.ctx_set_current = reinterpret_cast<CtxSetCurrent>(dlsym(lib, "cuCtxSetCurrent"));
    if (!(d.launch && d.error_string && d.ctx_get_current && d.device_get && d.primary_ctx_retain &&
          d.ctx_set_current)) {
      throw std::runtime_error("flashattn native: libcuda.so.1 lacks a driver entry point it needs");
    }
    return d;
  }();
  return found;
}

// Errors are plain std::runtime_error (what the binding below and autograd's engine turn into a
// Python RuntimeError), not c10::Error: see ``in_python``.
void check(CUresult result, const char* what) {
  if (result == 0) return;
  const char* message = nullptr;
  driver().error_string(result, &message);
  throw std::runtime_error(std::string("flashattn native: ") + what + " failed: " +
                           (message ? message : "unknown CUDA error") + " (CUresult " + std::to_string(result) + ")");
}

// Triton loaded the kernels into the device's primary context; a thread that has not used the
// driver yet (rare: torch's own threads have) gets that context made current, as Triton's
// launcher does.
void ensure_context(int device_index) {
  const Driver& d = driver();
  void* context = nullptr;
  check(d.ctx_get_current(&context), "cuCtxGetCurrent");
  if (context != nullptr) return;
  int device = 0;
  check(d.device_get(&device, device_index), "cuDeviceGet");
  check(d.primary_ctx_retain(&context, device), "cuDevicePrimaryCtxRetain");
  check(d.ctx_set_current(context), "cuCtxSetCurrent");
}

// ---------------------------------------------------------------------------------------------
// A plan, as native.py hands it over.
struct Launch {
  // The CUfunction Triton loaded. A raw handle, not owned: Triton (3.6, 3.7) keeps every compiled
  // kernel, and its module, loaded for the life of the process, so the handle stays valid.
  void* function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 0;                // 32 x num_warps
  unsigned shared_bytes = 0;
  int64_t scratch_bytes = 0;           // Triton's global scratch for the whole grid (tensor descriptors)
  int64_t scratch_align = 1;
  int64_t scratch_param = -1;          // which parameter receives its address
  std::vector<uint64_t> words;         // every parameter as one 8-byte word, in the kernel's order
  std::vector<std::pair<int64_t, int64_t>> tensors;   // (parameter, slot): a tensor's address goes there
};

struct Fresh {                         // an output the launches write, allocated per call
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

struct Half {                          // the forward's launches, or the backward's
  std::vector<Launch> launches;
  std::vector<Fresh> fresh;            // slots after the inputs', in this order
  std::vector<int64_t> returns;        // slot of each result; -1: not computed (None)
};

struct Plan : torch::CustomClassHolder {
  Half forward;                        // slots: q, k, v, then fresh (O, LSE)
  Half backward;                       // slots: q, k, v, O, dO, LSE, then fresh (delta, dQ, dK, dV)
  std::vector<int64_t> do_strides;     // the dO layout the backward was recorded with (dense)
};

std::vector<at::Tensor> run(const Half& half, std::vector<at::Tensor> slots, const at::Tensor& like) {
  const c10::Device device = like.device();
  for (const Fresh& f : half.fresh) {
    slots.push_back(at::empty(f.shape, like.options().dtype(f.dtype)));
  }
  c10::impl::VirtualGuardImpl guard_impl(c10::DeviceType::CUDA);
  void* stream = guard_impl.getStream(device).native_handle();
  ensure_context(device.index());
  std::vector<uint64_t> words;
  std::vector<void*> params;
  for (const Launch& launch : half.launches) {
    words = launch.words;
    for (const auto& [param, slot] : launch.tensors) {
      words[param] = reinterpret_cast<uint64_t>(slots[slot].data_ptr());
    }
    at::Tensor scratch;   // freed after the launch: the caching allocator orders reuse on this stream
    if (launch.scratch_bytes > 0) {
      scratch = at::empty({launch.scratch_bytes + launch.scratch_align}, like.options().dtype(at::kByte));
      uint64_t address = reinterpret_cast<uint64_t>(scratch.data_ptr());
      const uint64_t align = static_cast<uint64_t>(launch.scratch_align);
      words[launch.scratch_param] = (address + align - 1) / align * align;
    }
    params.resize(words.size());
    for (size_t i = 0; i < words.size(); ++i) params[i] = &words[i];
    check(driver().launch(launch.function, launch.grid[0], launch.grid[1], launch.grid[2], launch.threads, 1, 1,
                          launch.shared_bytes, stream, params.data(), nullptr),
          "cuLaunchKernel");
  }
  std::vector<at::Tensor> results;
  for (int64_t slot : half.returns) {
    results.push_back(slot < 0 ? at::Tensor() : slots[slot]);
  }
  return results;
}

// ---------------------------------------------------------------------------------------------
// Plans by signature: what plans.signature holds for the forward (each tensor's shape, strides,
// dtype, device and 16-byte alignment; which inputs are one tensor; causal, scale), and which of
// q, k, v require a gradient (the backward computes only those).
std::string signature(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
  std::string key;
  key.reserve(320);
  auto put = [&key](int64_t value) { key.append(reinterpret_cast<const char*>(&value), sizeof value); };
  int64_t scale_bits = 0;
  std::memcpy(&scale_bits, &scale, sizeof scale);
  put(q.device().index());
  put(causal);
  put(scale_bits);
  const c10::TensorImpl* impls[3] = {q.unsafeGetTensorImpl(), k.unsafeGetTensorImpl(), v.unsafeGetTensorImpl()};
  put((impls[0] == impls[1]) | (impls[0] == impls[2]) << 1 | (impls[1] == impls[2]) << 2);
  for (const at::Tensor* t : {&q, &k, &v}) {
    put(static_cast<int64_t>(t->scalar_type()));
    put(t->dim());
    for (int64_t size : t->sizes()) put(size);
    for (int64_t stride : t->strides()) put(stride);
    put(reinterpret_cast<uint64_t>(t->data_ptr()) & 15);
    put(t->requires_grad());
  }
  return key;
}

constexpr size_t kMaxPlans = 512;   // a model fed ever new shapes must not grow the map unbounded
std::mutex plans_mutex;
std::unordered_map<std::string, c10::intrusive_ptr<Plan>> plans;
std::atomic<int64_t> native_calls{0};

bool usable(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (!q.defined() || !k.defined() || !v.defined() || !q.is_cuda()) return false;
  if (k.device() != q.device() || v.device() != q.device()) return false;
  c10::impl::VirtualGuardImpl guard_impl(c10::DeviceType::CUDA);
  return guard_impl.getDevice().index() == q.device().index();   // Triton launches on the current device
}

c10::intrusive_ptr<Plan> find(const std::string& key) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  auto found = plans.find(key);
  return found == plans.end() ? c10::intrusive_ptr<Plan>() : found->second;
}

// ---------------------------------------------------------------------------------------------
// The autograd node: O = attention(q, k, v); saves q, k, v, O and LSE, as ops.EagerAttention does.
struct NativeAttention : public torch::autograd::Function<NativeAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const c10::intrusive_ptr<Plan>& plan) {
    std::vector<at::Tensor> out = run(plan->forward, {q, k, v}, q);
    // the five tensors ops.EagerAttention saves, in its order: activation checkpointing compares a
    // recomputed forward's saved tensors with the first's, and saved-tensor hooks see all five
    ctx->save_for_backward({q, k, v, out[0], out[1]});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    native_calls.fetch_add(1, std::memory_order_relaxed);
    return out[0];
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    auto plan = c10::static_intrusive_pointer_cast<Plan>(ctx->saved_data["plan"].toCapsule());
    at::Tensor d_o = grads[0];
    if (d_o.scalar_type() != o.scalar_type() || d_o.sizes() != o.sizes()) {
      throw std::runtime_error("flashattn native: dO of shape " + c10::str(d_o.sizes()) + " and dtype " +
                               c10::toString(d_o.scalar_type()) + " for O of shape " + c10::str(o.sizes()) +
                               " and dtype " + c10::toString(o.scalar_type()));
    }
    // the layout the backward was recorded with: any other (out.sum()'s stride-0 dO, another
    // view, a misaligned slice) is copied into it, one copy of O's size
    if (d_o.strides() != c10::IntArrayRef(plan->do_strides) || (reinterpret_cast<uint64_t>(d_o.data_ptr()) & 15)) {
      at::Tensor laid_out = at::empty_strided(d_o.sizes(), plan->do_strides, d_o.options());
      laid_out.copy_(d_o);
      d_o = laid_out;
    }
    c10::DeviceGuard device_guard(q.device());
    std::vector<at::Tensor> grads_qkv = run(plan->backward, {q, k, v, o, d_o, lse}, q);
    return {grads_qkv[0], grads_qkv[1], grads_qkv[2], at::Tensor()};
  }
};

// ---------------------------------------------------------------------------------------------
// What Python calls.

// O by the plan kept for this signature, through the C++ node; None (an undefined tensor) where
// no plan is kept, and the caller takes the Python path.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
  if (!usable(q, k, v)) return at::Tensor();
  c10::intrusive_ptr<Plan> plan = find(signature(q, k, v, causal, scale));
  if (!plan) return at::Tensor();
  return NativeAttention::apply(q, k, v, plan);
}

// What Python calls runs through ``in_python``: the GIL released while C++ allocates and launches
// (a launch can block on a full queue), and any error set as a Python exception here, in this
// module, rather than thrown through pybind11 to torch's exception translators (on torch 2.11's
// CUDA build a c10::Error thrown from this module through the binding crashed the process; an
// H200, 2026-11-29). An out-of-memory error stays torch.OutOfMemoryError.
void set_python_error(const char* torch_type, PyObject* fallback, const char* message) {
  PyObject* type = nullptr;
  if (PyObject* torch_module = PyImport_ImportModule("torch")) {
    type = PyObject_GetAttrString(torch_module, torch_type);
    Py_DECREF(torch_module);
  }
  PyErr_Clear();
  PyErr_SetString(type != nullptr ? type : fallback, message);
  Py_XDECREF(type);
}

template <typename Body>
auto in_python(Body body) -> decltype(body()) {
  try {
    pybind11::gil_scoped_release no_gil;   // (taken back as the stack unwinds, before a handler runs)
    return body();
  } catch (const c10::OutOfMemoryError& error) {
    set_python_error("OutOfMemoryError", PyExc_RuntimeError, error.what_without_backtrace());
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  throw pybind11::error_already_set();
}

using LaunchSpec = std::tuple<uint64_t, std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, int64_t,
                              std::vector<uint64_t>, std::vector<std::pair<int64_t, int64_t>>>;
using HalfSpec = std::tuple<std::vector<LaunchSpec>, std::vector<std::pair<std::vector<int64_t>, std::string>>,
                            std::vector<int64_t>>;

bool dtype_named(const std::string& name, at::ScalarType* dtype) {
  if (name == "float16") *dtype = at::kHalf;
  else if (name == "bfloat16") *dtype = at::kBFloat16;
  else if (name == "float32") *dtype = at::kFloat;
  else if (name == "int64") *dtype = at::kLong;
  else if (name == "int32") *dtype = at::kInt;
  else return false;
  return true;
}

// A plan's half from its spec; what is wrong with the spec goes to *problem (nothing is thrown:
// a malformed plan is refused, and the call keeps the Python path).
Half half_of(const HalfSpec& spec, int64_t inputs, std::string* problem) {
  Half half;
  const auto& [launch_specs, fresh_specs, returns] = spec;
  const int64_t slots = inputs + static_cast<int64_t>(fresh_specs.size());
  for (const auto& [function, grid, threads, shared, scratch_bytes, scratch_align, scratch_param, words, tensors] :
       launch_specs) {
    if (grid.size() != 3 || grid[0] <= 0 || grid[1] <= 0 || grid[2] <= 0 || threads <= 0 || threads > 1024 ||
        scratch_align <= 0) {
      *problem = "a malformed launch (" + std::to_string(grid.size()) + " grid dimensions, " +
                 std::to_string(threads) + " threads)";
      return half;
    }
    Launch launch;
    launch.function = reinterpret_cast<void*>(function);
    for (int i = 0; i < 3; ++i) launch.grid[i] = static_cast<unsigned>(grid[i]);
    launch.threads = static_cast<unsigned>(threads);
    launch.shared_bytes = static_cast<unsigned>(shared);
    launch.scratch_bytes = scratch_bytes;
    launch.scratch_align = scratch_align;
    launch.scratch_param = scratch_param;
    launch.words = words;
    launch.tensors = tensors;
    const auto n_words = static_cast<int64_t>(words.size());
    if (scratch_bytes != 0 && (scratch_param < 0 || scratch_param >= n_words)) {
      *problem = "the scratch parameter " + std::to_string(scratch_param) + " is out of range";
      return half;
    }
    for (const auto& [param, slot] : tensors) {
      if (param < 0 || param >= n_words || slot < 0 || slot >= slots) {
        *problem = "tensor slot " + std::to_string(slot) + " -> parameter " + std::to_string(param) +
                   " is out of range";
        return half;
      }
    }
    half.launches.push_back(std::move(launch));
  }
  for (const auto& [shape, name] : fresh_specs) {
    at::ScalarType dtype;
    if (!dtype_named(name, &dtype)) {
      *problem = "no fresh output of dtype " + name;
      return half;
    }
    half.fresh.push_back(Fresh{shape, dtype});
  }
  for (int64_t slot : returns) {
    if (slot < -1 || slot >= slots) {
      *problem = "result slot " + std::to_string(slot) + " is out of range";
      return half;
    }
  }
  half.returns = returns;
  return half;
}

// Keep a plan for the signature of (q, k, v, causal, scale); the specs are native.py's. Returns ""
// if the plan is kept, else what is wrong with it (then nothing is kept).
std::string keep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                 const HalfSpec& forward, const HalfSpec& backward, const std::vector<int64_t>& do_strides) {
  if (std::get<2>(forward).size() != 2) return "the forward returns O and LSE";
  if (std::get<2>(backward).size() != 3) return "the backward returns dQ, dK, dV";
  if (do_strides.size() != static_cast<size_t>(q.dim())) return "dO's strides do not match O's dimensions";
  auto plan = c10::make_intrusive<Plan>();
  std::string problem;
  plan->forward = half_of(forward, 3, &problem);
  if (problem.empty()) plan->backward = half_of(backward, 6, &problem);
  if (!problem.empty()) return problem;
  plan->do_strides = do_strides;
  std::string key = signature(q, k, v, causal, scale);
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (plans.size() >= kMaxPlans) plans.clear();
  plans[key] = plan;
  return "";
}

void clear() {
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.clear();
}

int64_t kept() {
  std::lock_guard<std::mutex> lock(plans_mutex);
  return static_cast<int64_t>(plans.size());
}

int64_t calls() { return native_calls.load(); }

// The signature as bytes (the tests check what it tells apart)
pybind11::bytes key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
  return pybind11::bytes(in_python([&] { return signature(q, k, v, causal, scale); }));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
    return in_python([&] { return attention(q, k, v, causal, scale); });
  }, "O through the C++ node, or None where no plan is kept");
  m.def("keep", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                   const HalfSpec& forward, const HalfSpec& backward, const std::vector<int64_t>& do_strides) {
    return in_python([&] { return keep(q, k, v, causal, scale, forward, backward, do_strides); });
  }, "keep a plan for this signature: \"\" if kept, else what is wrong with it");
  m.def("key", &key, "the signature plans are kept under, as bytes");
  m.def("clear", &clear, "forget every plan");
  m.def("kept", &kept, "how many plans are kept");
  m.def("calls", &calls, "how many forwards the C++ node has run in this process");
}
