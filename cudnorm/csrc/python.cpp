// The Python module of the native path: the public functions' entry points as plain CPython
// functions (METH_FASTCALL), so an eager call reaches C++ without the dispatcher's boxed
// argument parsing (measured at ~10 us of host time per call on a lent H100 host, as much
// as the rest of a cached call). Arguments are parsed strictly: anything unexpected raises
// TypeError and cudnorm's Python function words the error (its argument checks).
#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "native.h"

namespace {

using cudnorm::OptTensor;
using cudnorm::Tensor;

[[noreturn]] void bad(const char* what) { throw torch::TypeError(std::string("cudnorm native entry: ") + what); }

Tensor tensor(PyObject* obj) {
  if (!THPVariable_Check(obj)) bad("expected a tensor");
  return THPVariable_Unpack(obj);
}

OptTensor optional_tensor(PyObject* obj) { return obj == Py_None ? OptTensor() : OptTensor(tensor(obj)); }

bool integer(PyObject* obj) { return PyLong_Check(obj) && !PyBool_Check(obj); }

double number(PyObject* obj) {
  if (PyFloat_Check(obj)) return PyFloat_AS_DOUBLE(obj);
  if (integer(obj)) return PyLong_AsDouble(obj);
  bad("expected a number");
}

std::optional<double> optional_number(PyObject* obj) {
  return obj == Py_None ? std::optional<double>() : std::optional<double>(number(obj));
}

bool boolean(PyObject* obj) {
  if (!PyBool_Check(obj)) bad("expected a bool");
  return obj == Py_True;
}

// normalized_shape: an int or a tuple / list / torch.Size of ints
std::vector<c10::SymInt> shape(PyObject* obj) {
  std::vector<c10::SymInt> out;
  if (integer(obj)) {
    out.emplace_back(PyLong_AsLongLong(obj));
  } else if (PyTuple_Check(obj) || PyList_Check(obj)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!integer(items[i])) bad("expected a shape of ints");
      out.emplace_back(PyLong_AsLongLong(items[i]));
    }
  } else {
    bad("expected a shape");
  }
  return out;
}

void arity(Py_ssize_t got, Py_ssize_t want) {
  if (got != want) bad("wrong number of arguments");
}

PyObject* wrap(Tensor t) { return THPVariable_Wrap(std::move(t)); }

PyObject* wrap(std::tuple<Tensor, Tensor> pair) {
  PyObject* first = wrap(std::move(std::get<0>(pair)));
  PyObject* second = wrap(std::move(std::get<1>(pair)));
  if (first == nullptr || second == nullptr) {
    Py_XDECREF(first);
    Py_XDECREF(second);
    return nullptr;
  }
  PyObject* out = PyTuple_Pack(2, first, second);
  Py_DECREF(first);
  Py_DECREF(second);
  return out;
}

// Run an entry point with the interpreter lock released, as PyTorch's own bindings do: a
// call that needs Python (a new signature, a fallback) takes it back through the dispatcher.
template <typename F>
auto unlocked(F f) {
  PyThreadState* state = PyEval_SaveThread();
  try {
    auto out = f();
    PyEval_RestoreThread(state);
    return out;
  } catch (...) {
    PyEval_RestoreThread(state);
    throw;
  }
}

// A plain norm's optional last argument: the server a measurement forces (cudnorm._candidates,
// codes as cudnorm._entry.SERVERS), else the call's own policy and decision.
std::optional<cudnorm::Server> forced(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t plain) {
  if (nargs != plain && nargs != plain + 1) bad("wrong number of arguments");
  if (nargs == plain) return std::nullopt;
  PyObject* code = args[plain];
  const long value = integer(code) ? PyLong_AsLong(code) : -1;
  if (value < static_cast<long>(cudnorm::Server::Cudnn) || value > static_cast<long>(cudnorm::Server::Kernel)) {
    bad("expected a server code");
  }
  return static_cast<cudnorm::Server>(value);
}

// layer_norm(input, normalized_shape, weight, bias, eps[, server])
PyObject* layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const auto server = forced(args, nargs, 5);
  Tensor input = tensor(args[0]);
  auto dims = shape(args[1]);
  OptTensor weight = optional_tensor(args[2]), bias = optional_tensor(args[3]);
  double eps = number(args[4]);
  return wrap(unlocked([&] {
    cudnorm::ServeAs as(server);
    return cudnorm::layer_norm_entry(input, dims, weight, bias, eps);
  }));
  END_HANDLE_TH_ERRORS
}

// rms_norm(input, normalized_shape, weight, eps or None, weight_offset[, server])
PyObject* rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const auto server = forced(args, nargs, 5);
  Tensor input = tensor(args[0]);
  auto dims = shape(args[1]);
  OptTensor weight = optional_tensor(args[2]);
  auto eps = optional_number(args[3]);
  double offset = number(args[4]);
  return wrap(unlocked([&] {
    cudnorm::ServeAs as(server);
    return cudnorm::rms_norm_entry(input, dims, weight, eps, offset);
  }));
  END_HANDLE_TH_ERRORS
}

// add_layer_norm(input, residual, normalized_shape, weight, bias, eps) -> (y, h)
PyObject* add_layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  arity(nargs, 6);
  Tensor input = tensor(args[0]), residual = tensor(args[1]);
  auto dims = shape(args[2]);
  OptTensor weight = optional_tensor(args[3]), bias = optional_tensor(args[4]);
  double eps = number(args[5]);
  return wrap(unlocked([&] { return cudnorm::add_layer_norm_entry(input, residual, dims, weight, bias, eps); }));
  END_HANDLE_TH_ERRORS
}

// add_rms_norm(input, residual, normalized_shape, weight, eps or None, weight_offset) -> (y, h)
PyObject* add_rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  arity(nargs, 6);
  Tensor input = tensor(args[0]), residual = tensor(args[1]);
  auto dims = shape(args[2]);
  OptTensor weight = optional_tensor(args[3]);
  auto eps = optional_number(args[4]);
  double offset = number(args[5]);
  return wrap(unlocked([&] { return cudnorm::add_rms_norm_entry(input, residual, dims, weight, eps, offset); }));
  END_HANDLE_TH_ERRORS
}

// ada_layer_norm(input, scale, shift, eps, one_plus_scale)
PyObject* ada_layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  arity(nargs, 5);
  Tensor input = tensor(args[0]), scale = tensor(args[1]), shift = tensor(args[2]);
  double eps = number(args[3]);
  bool dit = boolean(args[4]);
  return wrap(unlocked([&] { return cudnorm::ada_layer_norm_entry(input, scale, shift, eps, dit); }));
  END_HANDLE_TH_ERRORS
}

// The arguments of the modulated norms' entry points: (input, scale, shift or None, eps,
// one_plus_scale[, rms]); the adaptive RMSNorm's take no rms flag
struct ModulatedCall {
  Tensor input, scale;
  OptTensor shift;
  double eps;
  bool one_plus, rms;
};

ModulatedCall modulated_call(PyObject* const* args, Py_ssize_t nargs, bool with_rms) {
  arity(nargs, with_rms ? 6 : 5);
  return {tensor(args[0]), tensor(args[1]), optional_tensor(args[2]), number(args[3]), boolean(args[4]),
          with_rms ? boolean(args[5]) : true};
}

PyObject* wrap_or_none(std::optional<Tensor> out) {
  if (!out.has_value()) Py_RETURN_NONE;
  return wrap(std::move(*out));
}

// token_ada_norm(input, scale, shift or None, eps, one_plus_scale, rms): a norm modulated per token
PyObject* token_ada_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  ModulatedCall c = modulated_call(args, nargs, true);
  return wrap(
      unlocked([&] { return cudnorm::token_ada_norm_entry(c.input, c.scale, c.shift, c.eps, c.one_plus, c.rms); }));
  END_HANDLE_TH_ERRORS
}

// token_ada_kernel(...): the same through the kernels without a decision (the dispatcher's
// "kernel" candidate), or None where the native path does not serve these arguments
PyObject* token_ada_kernel(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  ModulatedCall c = modulated_call(args, nargs, true);
  return wrap_or_none(
      unlocked([&] { return cudnorm::token_ada_kernel_entry(c.input, c.scale, c.shift, c.eps, c.one_plus, c.rms); }));
  END_HANDLE_TH_ERRORS
}

// ada_rms_kernel(input, scale, shift or None, eps, one_plus_scale): the adaptive RMSNorm through
// the kernels, or None where the native path does not serve these arguments
PyObject* ada_rms_kernel(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  ModulatedCall c = modulated_call(args, nargs, false);
  return wrap_or_none(
      unlocked([&] { return cudnorm::ada_rms_kernel_entry(c.input, c.scale, c.shift, c.eps, c.one_plus); }));
  END_HANDLE_TH_ERRORS
}

// The arguments of the gated residual's entry points: (residual, branch, gate, scale, shift,
// eps, one_plus_scale)
struct GatedCall {
  Tensor residual, branch, gate, scale, shift;
  double eps;
  bool one_plus;
};

GatedCall gated_call(PyObject* const* args, Py_ssize_t nargs) {
  arity(nargs, 7);
  return {tensor(args[0]), tensor(args[1]), tensor(args[2]), tensor(args[3]), tensor(args[4]), number(args[5]),
          boolean(args[6])};
}

PyObject* wrap_or_none(std::optional<std::tuple<Tensor, Tensor>> out) {
  if (!out.has_value()) Py_RETURN_NONE;
  return wrap(std::move(*out));
}

// gated_kernel(residual, branch, gate, scale, shift, eps, one_plus_scale): the gated residual's
// fused op, (y, h), or None where the native path does not serve these arguments
PyObject* gated_kernel(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  GatedCall c = gated_call(args, nargs);
  return wrap_or_none(unlocked(
      [&] { return cudnorm::gated_kernel_entry(c.residual, c.branch, c.gate, c.scale, c.shift, c.eps, c.one_plus); }));
  END_HANDLE_TH_ERRORS
}

// gated_ada_layer_norm(...): the public function's call, (y, h), or None where Python takes it
PyObject* gated_ada_layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  GatedCall c = gated_call(args, nargs);
  return wrap_or_none(
      unlocked([&] { return cudnorm::gated_entry(c.residual, c.branch, c.gate, c.scale, c.shift, c.eps, c.one_plus); }));
  END_HANDLE_TH_ERRORS
}

// modulated_layer_norm(x, scale, shift, eps, weight or None, bias or None): an affine
// LayerNorm's per-sample modulated call, or None where Python takes it
PyObject* modulated_layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  arity(nargs, 6);
  Tensor x = tensor(args[0]), scale = tensor(args[1]), shift = tensor(args[2]);
  double eps = number(args[3]);
  OptTensor weight = optional_tensor(args[4]), bias = optional_tensor(args[5]);
  return wrap_or_none(
      unlocked([&] { return cudnorm::modulated_layer_norm_entry(x, scale, shift, eps, weight, bias); }));
  END_HANDLE_TH_ERRORS
}

// affine_fold(scale, shift, weight, bias, one_plus_scale, like): (gain, shift) in like's dtype
PyObject* affine_fold(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  arity(nargs, 6);
  Tensor scale = tensor(args[0]), shift = tensor(args[1]);
  OptTensor weight = optional_tensor(args[2]), bias = optional_tensor(args[3]);
  bool dit = boolean(args[4]);
  const at::ScalarType dtype = tensor(args[5]).scalar_type();
  return wrap(unlocked([&] { return cudnorm::affine_fold(scale, shift, weight, bias, dit, dtype); }));
  END_HANDLE_TH_ERRORS
}

// launch(function, blocks, threads, shared, scratch, pointers, ints): a kernel Triton compiled,
// through cuLaunchKernel on the current stream (cudnorm._triton_launch.launch): `pointers` a tuple
// of CUDA tensors (their data pointers, in order), `ints` a tuple of int32 values (a fp32 scalar as
// its bits). Triton's own Python launcher costs far more host time per launch.
PyObject* launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  arity(nargs, 7);
  for (Py_ssize_t i = 0; i < 5; ++i) {
    if (!integer(args[i])) bad("expected an int");
  }
  if (!PyTuple_Check(args[5]) || !PyTuple_Check(args[6])) bad("expected tuples of tensors and ints");
  cudnorm::KernelLaunch kernel;
  kernel.function = PyLong_AsLongLong(args[0]);
  const int64_t blocks = PyLong_AsLongLong(args[1]);
  kernel.threads = PyLong_AsLongLong(args[2]);
  kernel.shared = PyLong_AsLongLong(args[3]);
  kernel.scratch = PyLong_AsLongLong(args[4]);
  std::vector<const void*> pointers;
  pointers.reserve(PyTuple_GET_SIZE(args[5]));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[5]); ++i) {
    pointers.push_back(tensor(PyTuple_GET_ITEM(args[5], i)).data_ptr());
  }
  std::vector<int32_t> ints;
  ints.reserve(PyTuple_GET_SIZE(args[6]));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[6]); ++i) {
    PyObject* item = PyTuple_GET_ITEM(args[6], i);
    if (!integer(item)) bad("expected an int32 scalar");
    ints.push_back(static_cast<int32_t>(PyLong_AsLong(item)));
  }
  cudnorm::launch_kernel(kernel, blocks, pointers, ints);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(launch)), METH_FASTCALL, nullptr},
    {"layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(layer_norm)), METH_FASTCALL, nullptr},
    {"rms_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rms_norm)), METH_FASTCALL, nullptr},
    {"add_layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add_layer_norm)), METH_FASTCALL,
     nullptr},
    {"add_rms_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add_rms_norm)), METH_FASTCALL,
     nullptr},
    {"ada_layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ada_layer_norm)), METH_FASTCALL,
     nullptr},
    {"token_ada_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(token_ada_norm)), METH_FASTCALL,
     nullptr},
    {"token_ada_kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(token_ada_kernel)),
     METH_FASTCALL, nullptr},
    {"ada_rms_kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ada_rms_kernel)), METH_FASTCALL,
     nullptr},
    {"gated_kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(gated_kernel)), METH_FASTCALL,
     nullptr},
    {"gated_ada_layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(gated_ada_layer_norm)),
     METH_FASTCALL, nullptr},
    {"modulated_layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(modulated_layer_norm)),
     METH_FASTCALL, nullptr},
    {"affine_fold", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(affine_fold)), METH_FASTCALL,
     nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "cudnorm_native",
                      "cudnorm's native launch path: the entry points of the public functions.", -1, methods};

}  // namespace

#define CUDNORM_CONCAT(a, b) a##b
#define CUDNORM_INIT(name) CUDNORM_CONCAT(PyInit_, name)

PyMODINIT_FUNC CUDNORM_INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
