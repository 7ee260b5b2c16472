// The C++ call path of tileops ops (docs/design.md, "The C++ call path"; tilelang_ops/fastpath.py).
//
// A Python op resolves its kernels once per (static dims, dtype, device) key, but still pays a
// C++ -> Python crossing, its checks, allocations from Python and tvm_ffi's argument packing on
// every call (~7 us of a ~15 us call on the GPU hosts). Here each op's backend kernel is a boxed
// C++ kernel that keys the call on everything the Python implementation's launches can depend on
// (each tensor's dtype, device, sizes, strides, 16-byte alignment and storage aliasing; the other
// arguments' values; the stream; the deterministic flag). A key seen before replays the plan the
// Python implementation recorded for it: allocate the outputs and scratch, launch the same compiled
// host functions with the same arguments re-pointed at this call's tensors. Anything else (a new
// key, a key whose call could not be recorded, CUDA graph capture) calls the Python implementation.
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>

#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// ---- the tvm_ffi C ABI (tvm/ffi/c_api.h), mirrored: TileLang's host functions take packed args
struct DLDev { int32_t type, id; };
struct DLType { uint8_t code, bits; uint16_t lanes; };
struct DLTensorABI {
  void* data; DLDev device; int32_t ndim; DLType dtype;
  const int64_t* shape; const int64_t* strides; uint64_t byte_offset;
};
struct FFIAny {
  int32_t type_index; uint32_t pad;
  union { int64_t v_int64; double v_float64; void* v_ptr; };
};
enum : int32_t { kNone = 0, kInt = 1, kBool = 2, kFloat = 3, kDLTensorPtr = 7 };
using CallFn = int (*)(void*, FFIAny*, int32_t, FFIAny*);
using SetStreamFn = int (*)(int32_t, int32_t, void*, void**);
using MoveErrFn = void (*)(void**);
using DecRefFn = int (*)(void*);
CallFn ffi_call = nullptr;
SetStreamFn ffi_set_stream = nullptr;
MoveErrFn ffi_move_error = nullptr;
DecRefFn ffi_decref = nullptr;
// CUDA graph capture: the Python implementation decides (a captured dynamic walk needs a tile
// counter of its own); read through the driver, so this file builds without CUDA headers.
using IsCapturingFn = int (*)(void*, int*);
IsCapturingFn cu_stream_is_capturing = nullptr;

std::atomic<int64_t> epoch{0};  // bumped by invalidate(): every key of every op misses again

// ---- plans
enum : int { kInput = 0, kAlloc = 1, kConst = 2 };
struct TensorRef {  // a launch argument: a view of an input, an allocation or a constant
  int kind, idx;
  int64_t byte_offset;  // from that tensor's data pointer
  std::vector<int64_t> sizes, strides;
  DLType dtype;
};
struct Arg { int32_t type; int64_t i; double f; TensorRef t; };
struct Launch { void* fn; std::vector<Arg> args; };  // fn: a tvm_ffi Function handle, kept alive by Python
struct AllocSpec { std::vector<int64_t> sizes, strides; c10::ScalarType dtype; };
struct OutSpec { int kind, idx; int64_t storage_offset; std::vector<int64_t> sizes, strides; bool whole; };
struct Plan {
  std::vector<AllocSpec> allocs;
  std::vector<at::Tensor> consts;
  std::vector<Launch> launches;
  std::vector<OutSpec> outs;  // kind kAlloc (a view of allocation idx) or -1 (None)
};
struct Entry { int misses = 0; bool python_only = false; std::shared_ptr<Plan> plan; };

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

// After this many calls of one key that could not be recorded, the key stays on the Python path
// (recording runs the call under a dispatch mode: slower than the plain Python path).
constexpr int kMaxRecordTries = 3;
// Keys kept per op (a plan is ~1 KB): beyond, new keys run on the Python path. Bounds the memory of
// a process that sees ever new shapes (a server with free sequence lengths).
constexpr size_t kMaxKeys = 4096;

struct OpState {
  py::object handler;  // handler(args, record) -> (result, plan or None)
  std::mutex mu;
  std::unordered_map<std::vector<int64_t>, Entry, KeyHash> entries;
  int64_t epoch_seen = 0;
  int64_t hits = 0, calls = 0;
};
// Never destroyed: they hold Python objects, which must not be released at process exit after
// the interpreter is gone, and the dispatcher holds their kernels until then anyway.
std::vector<OpState*> states;
std::vector<torch::Library*> libraries;

void push_tensor_key(std::vector<int64_t>& key, const at::Tensor& t, std::vector<const c10::StorageImpl*>& storages) {
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
  key.push_back(t.dim());
  for (int64_t s : t.sizes()) key.push_back(s);
  for (int64_t s : t.strides()) key.push_back(s);
  key.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15);
  // Which earlier tensor argument shares this one's storage (-1: none): a plan re-points each
  // launch argument at the input it was a view of, which is only right for the same aliasing.
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  int64_t alias = -1;
  for (size_t i = 0; i < storages.size(); ++i)
    if (storages[i] == s) { alias = static_cast<int64_t>(i); break; }
  key.push_back(alias);
  storages.push_back(s);
}

const c10::DispatchKeySet kNotPlain({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                     c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                     c10::DispatchKey::PythonTLSSnapshot});

// The call's key, or false where an argument is of a kind no plan covers; also the device of its
// first tensor and, on CUDA, the current stream there (read once a call: key, capture, launch).
bool make_key(const torch::jit::Stack& stack, size_t first, size_t n, std::vector<int64_t>& key, c10::Device& device, void*& stream) {
  std::vector<const c10::StorageImpl*> storages;
  bool have_device = false;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) { key.push_back(-101); continue; }
      // fake, functional and functorch-wrapped tensors (torch.compile's tracing, torch.func) and
      // anything but plain strided memory: the Python path, which dispatches them as before
      if (t.layout() != c10::kStrided || !t.has_storage() || t.is_meta() || t.key_set().has_any(kNotPlain)) return false;
      key.push_back(-100);
      push_tensor_key(key, t, storages);
      if (!have_device) { device = t.device(); have_device = true; }
    } else if (v.isNone()) {
      key.push_back(-102);
    } else if (v.isBool()) {
      key.push_back(-103); key.push_back(v.toBool());
    } else if (v.isInt()) {
      key.push_back(-104); key.push_back(v.toInt());
    } else if (v.isDouble()) {
      double d = v.toDouble(); int64_t bits; std::memcpy(&bits, &d, 8);
      key.push_back(-105); key.push_back(bits);
    } else if (v.isString()) {
      key.push_back(-106); key.push_back(static_cast<int64_t>(std::hash<std::string>{}(v.toStringRef())));
    } else if (v.isIntList()) {
      auto l = v.toIntList();
      key.push_back(-107); key.push_back(static_cast<int64_t>(l.size()));
      for (int64_t x : l) key.push_back(x);
    } else {
      return false;
    }
  }
  if (!have_device) return false;
  key.push_back(at::globalContext().deterministicAlgorithms());
  if (device.type() != c10::DeviceType::CPU) {
    stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
    key.push_back(reinterpret_cast<int64_t>(stream));
  }
  return true;
}

void* tensor_ptr(const TensorRef& r, const torch::jit::Stack& stack, size_t first,
                 const std::vector<at::Tensor>& allocs, const Plan& plan) {
  const at::Tensor& base = r.kind == kInput ? stack[first + r.idx].toTensor()
                         : r.kind == kAlloc ? allocs[r.idx] : plan.consts[r.idx];
  return static_cast<char*>(base.data_ptr()) + r.byte_offset;
}

// Runs `plan` on the call's arguments; false (nothing pushed, nothing left in flight that matters:
// the outputs are fresh) when a launch reports an error, so the Python path reruns the call and
// raises its own error.
bool replay(const Plan& plan, torch::jit::Stack& stack, size_t first, size_t n, const c10::Device& device, void* stream) {
  std::vector<at::Tensor> allocs;
  allocs.reserve(plan.allocs.size());
  for (const auto& a : plan.allocs)
    allocs.push_back(at::empty_strided(a.sizes, a.strides, at::TensorOptions().dtype(a.dtype).device(device)));
  DLDev dev{device.type() == c10::DeviceType::CUDA ? 2 : 1, device.type() == c10::DeviceType::CUDA ? device.index() : 0};
  void* prev_stream = nullptr;
  bool set_stream = device.type() == c10::DeviceType::CUDA;
  if (set_stream) ffi_set_stream(dev.type, dev.id, stream, &prev_stream);
  bool ok = true;
  DLTensorABI tensors[32];
  FFIAny args[48];
  for (const auto& l : plan.launches) {
    size_t nt = 0, na = l.args.size();
    if (na > 48) { ok = false; break; }
    for (size_t i = 0; i < na; ++i) {
      const Arg& a = l.args[i];
      args[i].pad = 0;
      if (a.type == kDLTensorPtr) {
        if (nt == 32) { ok = false; break; }
        DLTensorABI& d = tensors[nt++];
        d.data = tensor_ptr(a.t, stack, first, allocs, plan);
        d.device = dev; d.ndim = static_cast<int32_t>(a.t.sizes.size()); d.dtype = a.t.dtype;
        d.shape = a.t.sizes.data(); d.strides = a.t.strides.data(); d.byte_offset = 0;
        args[i].type_index = kDLTensorPtr; args[i].v_ptr = &d;
      } else if (a.type == kFloat) {
        args[i].type_index = kFloat; args[i].v_float64 = a.f;
      } else {
        args[i].type_index = a.type; args[i].v_int64 = a.i;
      }
    }
    if (!ok) break;
    FFIAny result; result.type_index = kNone; result.pad = 0; result.v_int64 = 0;
    if (ffi_call(l.fn, args, static_cast<int32_t>(na), &result) != 0) {
      void* err = nullptr;
      ffi_move_error(&err);
      if (err) ffi_decref(err);
      ok = false;
      break;
    }
    if (result.type_index >= 64 && result.v_ptr) ffi_decref(result.v_ptr);  // kernels return None
  }
  if (set_stream) ffi_set_stream(dev.type, dev.id, prev_stream, nullptr);
  if (!ok) return false;
  torch::jit::drop(stack, n);
  for (const auto& o : plan.outs) {
    if (o.kind < 0) { stack.emplace_back(); continue; }
    const at::Tensor& base = allocs[o.idx];
    stack.emplace_back(o.whole ? base : base.as_strided(o.sizes, o.strides, o.storage_offset));
  }
  return true;
}

std::vector<int64_t> int_vec(const py::handle& h) {
  std::vector<int64_t> v;
  for (auto x : h) v.push_back(x.cast<int64_t>());
  return v;
}

std::shared_ptr<Plan> parse_plan(const py::handle& p) {
  auto plan = std::make_shared<Plan>();
  auto t = p.cast<py::tuple>();
  for (auto a : t[0]) {
    auto at_ = a.cast<py::tuple>();
    plan->allocs.push_back({int_vec(at_[0]), int_vec(at_[1]), reinterpret_cast<THPDtype*>(at_[2].ptr())->scalar_type});
  }
  for (auto c : t[1]) plan->consts.push_back(THPVariable_Unpack(c.ptr()));
  for (auto l : t[2]) {
    auto lt = l.cast<py::tuple>();
    Launch launch{reinterpret_cast<void*>(lt[0].cast<uintptr_t>()), {}};
    for (auto a : lt[1]) {
      auto at_ = a.cast<py::tuple>();
      Arg arg{at_[0].cast<int32_t>(), 0, 0.0, {}};
      if (arg.type == kDLTensorPtr) {
        auto dt = at_[6].cast<py::tuple>();
        arg.t = {at_[1].cast<int>(), at_[2].cast<int>(), at_[3].cast<int64_t>(), int_vec(at_[4]), int_vec(at_[5]),
                 {dt[0].cast<uint8_t>(), dt[1].cast<uint8_t>(), dt[2].cast<uint16_t>()}};
      } else if (arg.type == kFloat) {
        arg.f = at_[1].cast<double>();
      } else {
        arg.i = at_[1].cast<int64_t>();
      }
      launch.args.push_back(std::move(arg));
    }
    plan->launches.push_back(std::move(launch));
  }
  for (auto o : t[3]) {
    auto ot = o.cast<py::tuple>();
    OutSpec spec{ot[0].cast<int>(), ot[1].cast<int>(), ot[2].cast<int64_t>(), int_vec(ot[3]), int_vec(ot[4]), false};
    if (spec.kind >= 0) {
      const auto& a = plan->allocs.at(spec.idx);
      spec.whole = spec.storage_offset == 0 && spec.sizes == a.sizes && spec.strides == a.strides;
    }
    plan->outs.push_back(std::move(spec));
  }
  return plan;
}

// The call's arguments as Python objects, as torch's Python bindings give them: a ScalarType
// argument (an int on the stack) as a torch.dtype.
py::tuple args_to_py(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first, size_t n) {
  const auto& arguments = op.schema().arguments();
  py::tuple args(n);
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = stack[first + i];
    auto t = arguments[i].real_type();  // type() says int for a ScalarType
    if (auto o = t->cast<c10::OptionalType>()) t = o->getElementType();
    if (v.isInt() && t->kind() == c10::TypeKind::ScalarTypeType)
      args[i] = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
    else
      args[i] = torch::jit::toPyObject(v);
  }
  return args;
}

// A Python result onto the stack, as the op's schema returns it.
void push_result(const c10::OperatorHandle& op, torch::jit::Stack* stack, const py::object& result) {
  const auto& returns = op.schema().returns();
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(result, returns[0].type()));
  } else {
    auto tup = result.cast<py::tuple>();
    for (size_t i = 0; i < returns.size(); ++i) stack->push_back(torch::jit::toIValue(tup[i], returns[i].type()));
  }
}

// The Python implementation on this call; with `record`, it also returns a plan for the key.
void call_python(OpState& st, const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first, size_t n,
                 const std::vector<int64_t>* key, bool record) {
  py::gil_scoped_acquire gil;
  py::tuple args = args_to_py(op, *stack, first, n);
  py::tuple r = st.handler(args, record).cast<py::tuple>();
  py::object result = r[0];
  if (key != nullptr) {
    std::lock_guard<std::mutex> lock(st.mu);
    Entry& e = st.entries[*key];
    if (!r[1].is_none()) e.plan = parse_plan(r[1]);
    else if (record && ++e.misses >= kMaxRecordTries) e.python_only = true;
  }
  torch::jit::drop(*stack, n);
  push_result(op, stack, result);
}

// Whether the process sees more than one device of this (accelerator) type; read once: only CUDA
// tensors reach the guard below.
bool several_devices(c10::DeviceType type) {
  static const bool several = c10::impl::getDeviceGuardImpl(type)->deviceCount() > 1;
  return several;
}

bool capturing(const c10::Device& device, void* stream) {
  if (device.type() != c10::DeviceType::CUDA || cu_stream_is_capturing == nullptr) return false;
  int status = 0;
  return cu_stream_is_capturing(stream, &status) != 0 || status != 0;
}

struct BackendKernel final : c10::OperatorKernel {
  OpState* st;
  explicit BackendKernel(OpState* s) : st(s) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    size_t n = op.schema().arguments().size();
    size_t first = stack->size() - n;
    std::vector<int64_t> key;
    key.reserve(64);
    c10::Device device(c10::DeviceType::CPU);
    void* stream = nullptr;
    if (!make_key(*stack, first, n, key, device, stream) || capturing(device, stream)) {
      call_python(*st, op, stack, first, n, nullptr, false);
      return;
    }
    // The first tensor's GPU is current for the launches and the Python path, and the caller's
    // device again on return, as in PyTorch's CUDA ops: TileLang's host function makes its
    // tensors' GPU current and leaves it so. With one GPU it always is: no guard (~0.3 us a call).
    c10::OptionalDeviceGuard guard;
    if (device.type() != c10::DeviceType::CPU && several_devices(device.type())) guard.reset_device(device);
    std::shared_ptr<Plan> plan;
    bool record = false, full = false;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      int64_t e = epoch.load();
      if (st->epoch_seen != e) { st->entries.clear(); st->epoch_seen = e; }
      ++st->calls;
      auto it = st->entries.find(key);
      if (it == st->entries.end()) {
        full = st->entries.size() >= kMaxKeys;
        if (!full) st->entries.emplace(key, Entry{});  // first call: run as is (it may fill the op's caches)
      } else if (it->second.plan) {
        plan = it->second.plan;
        ++st->hits;
      } else {
        record = !it->second.python_only;  // second call: record (caches are filled by now)
      }
    }
    if (plan && replay(*plan, *stack, first, n, device, stream)) return;
    call_python(*st, op, stack, first, n, full ? nullptr : &key, record);
  }
};

// ---- autograd: the op's Python formula, recorded setup
// What the op's setup_context did for a key (fastpath._SetupRecorder): which inputs (schema
// argument index) or outputs it saved, the attributes it set, which outputs it marked
// non-differentiable. Never freed: it holds Python objects, and a node may outlive invalidate().
struct GradSpec {
  std::vector<std::pair<int, int>> saved;  // (kInput / kAlloc for an output / -1 for None, index)
  std::vector<bool> non_diff;               // per output
  py::object attrs;                         // dict
};
struct GradOp {
  py::object grad_handler;  // grad_handler(keyset, args, record) -> (result, spec or None)
  py::object backward;      // backward(ctx, *grads) -> one gradient (or None) per argument
  py::object ctx_cls;       // ctx_cls(saved_tensors, needs_input_grad, attrs)
  std::vector<size_t> tensor_args;  // schema positions of Tensor / Tensor? arguments
  size_t n_args = 0;
  std::mutex mu;
  std::unordered_map<std::vector<int64_t>, Entry, KeyHash> entries;  // Entry.plan unused
  std::unordered_map<std::vector<int64_t>, GradSpec*, KeyHash> specs;
  int64_t epoch_seen = 0;
  int64_t hits = 0, calls = 0;
};
std::vector<GradOp*> grad_ops;

struct ForwardData {  // what PyFormula::forward needs besides the tensors
  GradOp* g; GradSpec* spec; const c10::OperatorHandle* op; c10::DispatchKeySet ks; torch::jit::Stack* stack;
  std::vector<int64_t> pos;  // the argument positions of the tensors (a None Tensor? is not an input)
};

// A C++ custom autograd Function whose backward is the op's Python formula.
struct PyFormula : torch::autograd::Function<PyFormula> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors, ForwardData* d) {
    size_t n = d->g->n_args, first = d->stack->size() - n;
    std::vector<c10::IValue> args((*d->stack).begin() + first, (*d->stack).end());
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      d->op->redispatchBoxed(d->ks & c10::after_autograd_keyset, d->stack);
    }
    size_t m = d->op->schema().returns().size();
    torch::autograd::variable_list outs;
    for (size_t i = d->stack->size() - m; i < d->stack->size(); ++i) outs.push_back((*d->stack)[i].toTensor());
    torch::jit::drop(*d->stack, m);
    torch::autograd::variable_list to_save, non_diff;
    for (const auto& [kind, idx] : d->spec->saved)
      to_save.push_back(kind == kInput ? (args[idx].isTensor() ? args[idx].toTensor() : at::Tensor()) : kind == kAlloc ? outs[idx] : at::Tensor());
    for (size_t j = 0; j < outs.size(); ++j)
      if (d->spec->non_diff[j]) non_diff.push_back(outs[j]);
    ctx->save_for_backward(std::move(to_save));
    if (!non_diff.empty()) ctx->mark_non_differentiable(non_diff);
    ctx->set_materialize_grads(false);
    ctx->saved_data["g"] = reinterpret_cast<int64_t>(d->g);
    ctx->saved_data["spec"] = reinterpret_cast<int64_t>(d->spec);
    ctx->saved_data["pos"] = d->pos;
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* g = reinterpret_cast<GradOp*>(ctx->saved_data["g"].toInt());
    auto* spec = reinterpret_cast<GradSpec*>(ctx->saved_data["spec"].toInt());
    auto pos = ctx->saved_data["pos"].toIntVector();  // the inputs' argument positions
    auto saved = ctx->get_saved_variables();
    torch::autograd::variable_list result(pos.size() + 1);  // + ForwardData*'s slot
    py::gil_scoped_acquire gil;
    py::tuple st(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) st[i] = saved[i].defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(saved[i])) : py::none();
    py::tuple needs(g->n_args);
    for (size_t i = 0; i < g->n_args; ++i) needs[i] = py::bool_(false);
    for (size_t k = 0; k < pos.size(); ++k) needs[pos[k]] = py::bool_(ctx->needs_input_grad(k));
    py::object c = g->ctx_cls(st, needs, spec->attrs);
    py::tuple gs(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) gs[i] = grads[i].defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(grads[i])) : py::none();
    py::object r = g->backward(c, *gs);
    py::tuple rt = py::isinstance<py::tuple>(r) ? r.cast<py::tuple>() : py::make_tuple(r);
    for (size_t k = 0; k < pos.size(); ++k) {
      size_t p = static_cast<size_t>(pos[k]);
      if (p < rt.size() && !rt[p].is_none()) result[k] = THPVariable_Unpack(rt[p].ptr());
    }
    return result;
  }
};

// A call with no gradient to record goes straight on to the backend kernel (true: done).
bool without_grad(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack, size_t first, size_t n) {
  if (c10::GradMode::is_enabled()) {
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& v = (*stack)[first + i];
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad()) return false;
    }
  }
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
  return true;
}

// Under a functorch transform (grad, vmap) a C++ autograd Function is refused; Python's handles it.
bool functorch_active() {
  const auto& tls = at::functorch::functorchTLSAccessor();
  if (!tls) return false;  // functorch never used on this thread
  try {
    tls->checkSupportsCppAutogradFunction();  // throws while a transform is active
    return false;
  } catch (const c10::Error&) {
    return true;
  }
}

// The Autograd kernel: without a gradient to record, straight to the backend kernel (no Python);
// with one, the C++ Function above once a key's setup is recorded, else the op's Python autograd
// path (`grad_handler`). Under functorch transforms always the Python path (its Function.apply).
struct AutogradKernel final : c10::OperatorKernel {
  GradOp* g;
  explicit AutogradKernel(GradOp* op) : g(op) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    size_t n = g->n_args;
    size_t first = stack->size() - n;
    if (without_grad(op, ks, stack, first, n)) return;
    std::vector<int64_t> key;
    c10::Device device(c10::DeviceType::CPU);
    void* stream = nullptr;
    GradSpec* spec = nullptr;
    bool record = false, keyed = !functorch_active() && make_key(*stack, first, n, key, device, stream);
    if (keyed) {
      std::lock_guard<std::mutex> lock(g->mu);
      int64_t e = epoch.load();
      if (g->epoch_seen != e) { g->entries.clear(); g->specs.clear(); g->epoch_seen = e; }
      ++g->calls;
      auto it = g->specs.find(key);
      if (it != g->specs.end()) {
        spec = it->second;
        ++g->hits;
      } else {
        auto ent = g->entries.find(key);
        if (ent != g->entries.end()) record = !ent->second.python_only;
        else if (g->entries.size() < kMaxKeys) g->entries.emplace(key, Entry{});
        else keyed = false;
      }
    }
    if (spec != nullptr) {
      std::vector<at::Tensor> tensors;
      ForwardData d{g, spec, &op, ks, stack, {}};
      for (size_t p : g->tensor_args) {
        const c10::IValue& v = (*stack)[first + p];
        if (v.isTensor() && v.toTensor().defined()) {
          tensors.push_back(v.toTensor());
          d.pos.push_back(static_cast<int64_t>(p));
        }
      }
      auto outs = PyFormula::apply(at::TensorList(tensors), &d);  // its forward consumed the arguments
      for (auto& o : outs) stack->push_back(std::move(o));
      return;
    }
    py::gil_scoped_acquire gil;
    py::tuple args = args_to_py(op, *stack, first, n);
    py::tuple r = g->grad_handler(py::cast(ks), args, record).cast<py::tuple>();
    if (keyed && (record || !r[1].is_none())) {
      std::lock_guard<std::mutex> lock(g->mu);
      if (!r[1].is_none()) {
        auto t = r[1].cast<py::tuple>();
        auto* sp = new GradSpec();
        for (auto sv : t[0]) {
          if (sv.is_none()) { sp->saved.emplace_back(-1, 0); continue; }
          auto st = sv.cast<py::tuple>();
          sp->saved.emplace_back(st[0].cast<int>(), st[1].cast<int>());
        }
        for (auto b : t[1]) sp->non_diff.push_back(b.cast<bool>());
        sp->attrs = py::reinterpret_borrow<py::object>(t[2]);
        g->specs[key] = sp;
      } else if (++g->entries[key].misses >= kMaxRecordTries) {
        g->entries[key].python_only = true;
      }
    }
    torch::jit::drop(*stack, n);
    push_result(op, stack, r[0]);
  }
};

// flash_attn's autograd: a gradient is recorded by another op with the same arguments
// (flash_attn_with_lse), of whose outputs this op returns one.
struct AutogradViaKernel final : c10::OperatorKernel {
  c10::OperatorHandle other;
  size_t pick;
  AutogradViaKernel(c10::OperatorHandle o, size_t p) : other(std::move(o)), pick(p) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    size_t n = op.schema().arguments().size(), first = stack->size() - n;
    if (without_grad(op, ks, stack, first, n)) return;
    other.callBoxed(stack);
    size_t m = other.schema().returns().size();
    c10::IValue keep = (*stack)[stack->size() - m + pick];
    torch::jit::drop(*stack, m);
    stack->push_back(std::move(keep));
  }
};

c10::DispatchKey parse_key(const std::string& k) {
  if (k == "CUDA") return c10::DispatchKey::CUDA;
  if (k == "CPU") return c10::DispatchKey::CPU;
  throw std::invalid_argument("dispatch key " + k + " is not a backend the fast path serves (CUDA, CPU)");
}

}  // namespace

void init_ffi(const std::string& libtvm_ffi) {
  void* h = dlopen(libtvm_ffi.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (h == nullptr) h = dlopen(libtvm_ffi.c_str(), RTLD_LAZY);
  if (h == nullptr) throw std::runtime_error("cannot open " + libtvm_ffi);
  ffi_call = reinterpret_cast<CallFn>(dlsym(h, "TVMFFIFunctionCall"));
  ffi_set_stream = reinterpret_cast<SetStreamFn>(dlsym(h, "TVMFFIEnvSetStream"));
  ffi_move_error = reinterpret_cast<MoveErrFn>(dlsym(h, "TVMFFIErrorMoveFromRaised"));
  ffi_decref = reinterpret_cast<DecRefFn>(dlsym(h, "TVMFFIObjectDecRef"));
  if (!ffi_call || !ffi_set_stream || !ffi_move_error || !ffi_decref)
    throw std::runtime_error(libtvm_ffi + " lacks the tvm_ffi C API this file was written against");
  void* cu = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (cu != nullptr) cu_stream_is_capturing = reinterpret_cast<IsCapturingFn>(dlsym(cu, "cuStreamIsCapturing"));
}

// Registers the backend kernel of `name` for `key` ("CUDA"; "CPU" in tests); returns its index.
int64_t register_backend(const std::string& ns, const std::string& name, const std::string& key, py::object handler) {
  auto* st = new OpState();
  st->handler = std::move(handler);
  auto* lib = new torch::Library(torch::Library::IMPL, ns, parse_key(key), __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<BackendKernel>(st)));
  libraries.push_back(lib);
  states.push_back(st);
  return static_cast<int64_t>(states.size() - 1);
}

// The Autograd kernel of `name`; returns its index (grad_stats).
int64_t register_autograd(const std::string& ns, const std::string& name, py::object grad_handler, py::object backward, py::object ctx_cls) {
  auto* g = new GradOp();
  g->grad_handler = std::move(grad_handler);
  g->backward = std::move(backward);
  g->ctx_cls = std::move(ctx_cls);
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + name).c_str(), "");
  const auto& arguments = handle.schema().arguments();
  g->n_args = arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    auto t = arguments[i].type();
    if (auto o = t->cast<c10::OptionalType>()) t = o->getElementType();
    if (t->cast<c10::TensorType>()) g->tensor_args.push_back(i);
  }
  auto* lib = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradKernel>(g)));
  libraries.push_back(lib);
  grad_ops.push_back(g);
  return static_cast<int64_t>(grad_ops.size() - 1);
}

void register_autograd_via(const std::string& ns, const std::string& name, const std::string& other, int64_t pick) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + other).c_str(), "");
  auto* lib = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradViaKernel>(handle, static_cast<size_t>(pick))));
  libraries.push_back(lib);
}

py::dict grad_stats(int64_t index) {
  GradOp& g = *grad_ops.at(index);
  std::lock_guard<std::mutex> lock(g.mu);
  int64_t python_only = 0;
  for (const auto& kv : g.entries) python_only += kv.second.python_only;
  py::dict d;
  d["calls"] = g.calls; d["hits"] = g.hits; d["specs"] = static_cast<int64_t>(g.specs.size());
  d["python_only"] = python_only;
  return d;
}

void invalidate() { ++epoch; }

// The stream the kernels are launched on, as this file reads it (fastpath.load checks it against
// torch.cuda.current_stream before turning the path on).
int64_t current_stream(int64_t device_index) {
  c10::Device d(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
  return reinterpret_cast<int64_t>(c10::impl::getDeviceGuardImpl(d.type())->getStream(d).native_handle());
}

// A stand-in kernel for the CPU tests, with a compiled kernel's calling convention (a tvm_ffi
// function taking tensors as DLTensor pointers or tvm_ffi Tensor objects): out = alpha * x and
// rowsum[i] = sum_j x[i, j], over float32 2-D tensors of any strides. It reads and writes through
// the pointers and strides it is given, so a replayed plan that points anywhere else fails.
const DLTensorABI* test_tensor(const FFIAny& a) {
  if (a.type_index == kDLTensorPtr) return static_cast<const DLTensorABI*>(a.v_ptr);
  if (a.type_index == 70) return reinterpret_cast<const DLTensorABI*>(static_cast<char*>(a.v_ptr) + 24);  // kTVMFFITensor
  return nullptr;
}

int test_kernel_call(void*, const FFIAny* args, int32_t n, FFIAny* result) {
  result->type_index = kNone;
  const DLTensorABI *x = n == 4 ? test_tensor(args[0]) : nullptr, *out = n == 4 ? test_tensor(args[1]) : nullptr,
                    *rowsum = n == 4 ? test_tensor(args[2]) : nullptr;
  if (!x || !out || !rowsum || args[3].type_index != kFloat || x->ndim != 2 || out->ndim != 2 || rowsum->ndim != 1) return -1;
  float alpha = static_cast<float>(args[3].v_float64);
  const float* xp = static_cast<const float*>(x->data);
  float* op = static_cast<float*>(out->data);
  float* rp = static_cast<float*>(rowsum->data);
  for (int64_t i = 0; i < x->shape[0]; ++i) {
    float acc = 0;
    for (int64_t j = 0; j < x->shape[1]; ++j) {
      float v = xp[i * x->strides[0] + j * x->strides[1]];
      op[i * out->strides[0] + j * out->strides[1]] = alpha * v;
      acc += v;
    }
    rp[i * rowsum->strides[0]] = acc;
  }
  return 0;
}

// Registers the stand-in as the tvm_ffi global function `name` (tvm_ffi.get_global_func).
void register_test_kernel(const std::string& libtvm_ffi, const std::string& name) {
  void* h = dlopen(libtvm_ffi.c_str(), RTLD_LAZY);
  using CreateFn = int (*)(void*, int (*)(void*, const FFIAny*, int32_t, FFIAny*), void (*)(void*), void**);
  using SetGlobalFn = int (*)(const void*, void*, int);
  auto create = reinterpret_cast<CreateFn>(dlsym(h, "TVMFFIFunctionCreate"));
  auto set_global = reinterpret_cast<SetGlobalFn>(dlsym(h, "TVMFFIFunctionSetGlobal"));
  void* f = nullptr;
  if (!create || !set_global || create(nullptr, &test_kernel_call, nullptr, &f) != 0) throw std::runtime_error("TVMFFIFunctionCreate failed");
  struct { const char* data; size_t size; } bytes{name.data(), name.size()};
  if (set_global(&bytes, f, 1) != 0) throw std::runtime_error("TVMFFIFunctionSetGlobal failed");
  reinterpret_cast<DecRefFn>(dlsym(h, "TVMFFIObjectDecRef"))(f);  // the registry holds it now
}

py::dict stats(int64_t index) {
  OpState& st = *states.at(index);
  std::lock_guard<std::mutex> lock(st.mu);
  int64_t plans = 0, python_only = 0;
  for (const auto& kv : st.entries) { plans += kv.second.plan != nullptr; python_only += kv.second.python_only; }
  py::dict d;
  d["calls"] = st.calls; d["hits"] = st.hits; d["keys"] = static_cast<int64_t>(st.entries.size());
  d["plans"] = plans; d["python_only"] = python_only;
  return d;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init_ffi", &init_ffi);
  m.def("register_backend", &register_backend);
  m.def("register_autograd", &register_autograd);
  m.def("register_autograd_via", &register_autograd_via);
  m.def("grad_stats", &grad_stats);
  m.def("invalidate", &invalidate);
  m.def("stats", &stats);
  m.def("current_stream", &current_stream);
  m.def("register_test_kernel", &register_test_kernel);
}
