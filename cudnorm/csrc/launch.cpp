// Launching recipes: a slot per variant-pack entry (where its buffer starts, how it moves with
// a row offset), one launch, chunk launches over row offsets, or one launch per AdaLN sample.
// Layouts follow the Python path's (cudnorm._norm, cudnorm._rows, cudnorm._ada_strategies).
#include "native.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <dlfcn.h>

#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

namespace cudnorm {

namespace {

Tensor workspace_for(const Recipe& recipe, const at::Device& device) {
  int64_t bytes = 0;
  for (const auto& launch : recipe.launches) {
    bytes = std::max(bytes, workspace_bytes(*launch.plan));
  }
  // per call from torch's caching allocator: stream-ordered like the outputs, and taken from
  // the graph's private pool while a CUDA graph is being captured
  return bytes > 0 ? at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device)) : Tensor();
}

void* address(uintptr_t base, int64_t offset) { return reinterpret_cast<void*>(base + offset); }

// cuLaunchKernel from the CUDA driver, looked up once: the extension does not link libcuda
// (the driver is loaded in every CUDA process already, by PyTorch).
using LaunchKernelFn = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                               unsigned block_y, unsigned block_z, unsigned shared, void* stream, void** params,
                               void** extra);

LaunchKernelFn driver_launch() {
  static LaunchKernelFn fn = [] {
    void* library = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (library == nullptr) library = dlopen("libcuda.so.1", RTLD_LAZY);
    return library == nullptr ? nullptr : reinterpret_cast<LaunchKernelFn>(dlsym(library, "cuLaunchKernel"));
  }();
  TORCH_CHECK(fn != nullptr, "cudnorm: cuLaunchKernel not found in libcuda.so.1");
  return fn;
}

// cuLaunchKernel runs in the context current on the calling thread, and a thread may have none:
// c10 skips cudaSetDevice when the device asked for is already the thread's (device 0 on a new
// thread), so PyTorch's autograd worker, or a user's own thread, reaches a backward or forward
// whose first CUDA call is this launch without one, and the launch failed with
// CUDA_ERROR_INVALID_CONTEXT (201; the fp32-weights sweep's first training cell). cudaSetDevice
// binds the device's primary context (the one PyTorch's streams belong to), once per thread.
void bind_primary_context() {
  thread_local bool bound = false;
  if (!bound) {
    C10_CUDA_CHECK(cudaSetDevice(c10::cuda::current_device()));
    bound = true;
  }
}

}  // namespace

void launch_kernel(const KernelLaunch& kernel, int64_t blocks, const std::vector<const void*>& pointers,
                   const std::vector<int32_t>& ints) {
  std::vector<const void*> values(pointers);
  values.resize(pointers.size() + kernel.scratch, nullptr);  // the compiler's scratch buffers: unused, null
  std::vector<void*> params;
  params.reserve(values.size() + ints.size());
  for (size_t i = 0; i < pointers.size(); ++i) params.push_back(const_cast<const void**>(&values[i]));
  for (const int32_t& value : ints) params.push_back(const_cast<int32_t*>(&value));
  for (size_t i = pointers.size(); i < values.size(); ++i) params.push_back(const_cast<const void**>(&values[i]));
  bind_primary_context();
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const int status = driver_launch()(reinterpret_cast<void*>(kernel.function), static_cast<unsigned>(blocks), 1, 1,
                                     static_cast<unsigned>(kernel.threads), 1, 1,
                                     static_cast<unsigned>(kernel.shared), stream, params.data(), nullptr);
  TORCH_CHECK(status == 0, "cudnorm: launching its compiled kernel failed (CUresult ", status, ")");
}

void launch_single(const Recipe& recipe, const std::vector<Slot>& slots) {
  const Plan& plan = *recipe.launches.at(0).plan;
  void* ptrs[16];
  TORCH_CHECK(slots.size() <= 16, "cudnorm: too many variant-pack slots");
  for (size_t i = 0; i < slots.size(); ++i) ptrs[i] = address(slots[i].base, 0);
  int64_t bytes = workspace_bytes(plan);
  Tensor workspace;
  if (bytes > 0) {
    workspace = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::cuda::current_device()));
  }
  execute(plan, ptrs, static_cast<int64_t>(slots.size()), workspace.defined() ? workspace.data_ptr() : nullptr);
}

void launch_per_sample(const Recipe& recipe, const std::vector<Slot>& slots, int64_t count) {
  const Plan& plan = *recipe.launches.at(0).plan;
  Tensor workspace = workspace_for(recipe, at::Device(at::kCUDA, c10::cuda::current_device()));
  void* ws = workspace.defined() ? workspace.data_ptr() : nullptr;
  void* ptrs[16];
  TORCH_CHECK(slots.size() <= 16, "cudnorm: too many variant-pack slots");
  for (int64_t k = 0; k < count; ++k) {
    for (size_t i = 0; i < slots.size(); ++i) ptrs[i] = address(slots[i].base, k * slots[i].row_bytes);
    execute(plan, ptrs, static_cast<int64_t>(slots.size()), ws);
  }
}

// Chunk launches (cudnorm._rows.ChunkedPlan): launches[0] ends at row M and overlaps the
// `overlap` rows before it when the chunks do not tile M; it runs first and later launches
// rewrite those rows. Backward: its dy is a copy whose overlapped rows are zero (they add
// nothing to dW/dB), and every launch writes its dW/dB into an fp32 partial row, summed after.
// Statistics at an offset that breaks cuDNN's 16-byte alignment go through fresh buffers.
void launch_chunked(const Recipe& recipe, const std::vector<Slot>& slots, int64_t cols) {
  const auto device = at::Device(at::kCUDA, c10::cuda::current_device());
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  Tensor workspace = workspace_for(recipe, device);
  void* ws = workspace.defined() ? workspace.data_ptr() : nullptr;
  std::vector<size_t> sums, stats;
  size_t dy_slot = slots.size();
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].role == Slot::Sum) sums.push_back(i);
    if (slots[i].role == Slot::Stats) stats.push_back(i);
    if (slots[i].role == Slot::Dy) dy_slot = i;
  }
  const int64_t launches = static_cast<int64_t>(recipe.launches.size());
  Tensor partials;  // [launches, sums, cols] fp32
  if (!sums.empty()) partials = at::empty({launches, static_cast<int64_t>(sums.size()), cols}, f32);
  void* ptrs[16];
  TORCH_CHECK(slots.size() <= 16, "cudnorm: too many variant-pack slots");
  for (int64_t k = 0; k < launches; ++k) {
    const Launch& launch = recipe.launches[k];
    const int64_t start = launch.start;
    for (size_t i = 0; i < slots.size(); ++i) {
      const Slot& slot = slots[i];
      ptrs[i] = address(slot.base, slot.role == Slot::Fixed || slot.role == Slot::Sum ? 0 : start * slot.row_bytes);
    }
    for (size_t j = 0; j < sums.size(); ++j) {
      ptrs[sums[j]] = static_cast<char*>(partials.data_ptr()) + (k * static_cast<int64_t>(sums.size()) + j) * cols * 4;
    }
    const bool remainder = k == 0 && recipe.overlap > 0;
    if (!remainder) {
      execute(*launch.plan, ptrs, static_cast<int64_t>(slots.size()), ws);
      continue;
    }
    const int64_t overlap = recipe.overlap;
    bool misaligned = false;
    for (size_t i : stats) misaligned |= ((slots[i].base + start * 4) % 16) != 0;
    if (dy_slot < slots.size()) {  // backward
      Tensor dy = at::constant_pad_nd(slots[dy_slot].rows.slice(0, start + overlap), {0, 0, overlap, 0});
      ptrs[dy_slot] = dy.data_ptr();
      std::vector<Tensor> copies;
      if (misaligned) {
        for (size_t i : stats) {
          copies.push_back(slots[i].rows.slice(0, start).clone(at::MemoryFormat::Contiguous));
          ptrs[i] = copies.back().data_ptr();
        }
      }
      execute(*launch.plan, ptrs, static_cast<int64_t>(slots.size()), ws);
      continue;  // dy and the copies are freed stream-ordered after the launch
    }
    Tensor fresh;  // forward: statistics of an unaligned remainder land here first
    if (misaligned && !stats.empty()) {
      fresh = at::empty({static_cast<int64_t>(stats.size()), launch.rows}, f32);
      for (size_t s = 0; s < stats.size(); ++s) ptrs[stats[s]] = fresh[s].data_ptr();
    }
    execute(*launch.plan, ptrs, static_cast<int64_t>(slots.size()), ws);
    if (fresh.defined()) {
      for (size_t s = 0; s < stats.size(); ++s) {
        slots[stats[s]].rows.slice(0, start + overlap).copy_(fresh[s].slice(0, overlap));
      }
    }
  }
  for (size_t j = 0; j < sums.size(); ++j) {
    Tensor out = slots[sums[j]].rows;
    Tensor column = partials.select(1, static_cast<int64_t>(j));
    if (out.scalar_type() == at::kFloat) {
      at::sum_out(out, column, {0});
    } else {
      out.copy_(column.sum(0));  // summed in fp32, rounded once
    }
  }
}

Tensor cudnn_rows(const Tensor& x) {
  // packed rows at a 16-byte aligned address (cudnorm._dispatch.cudnn_rows): cuDNN 9.19 declines
  // a graph whose x rows lie further apart than its output's, so padded rows are copied
  Tensor rows = x;
  if (rows.size(0) == 1 && rows.stride(0) != rows.size(1) && rows.stride(1) == 1) {
    rows = rows.as_strided(rows.sizes(), {rows.size(1), 1});  // one row: its row stride means nothing
  }
  if (rows.stride(1) != 1 || rows.stride(0) != rows.size(1)) {
    rows = rows.contiguous();
  }
  if (reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 != 0) {
    rows = rows.clone(at::MemoryFormat::Contiguous);
  }
  return rows;
}

bool is_packed(const Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

Tensor packed(const Tensor& t) { return is_packed(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

Tensor constant(double value, int64_t n, at::ScalarType dtype, const at::Device& device) {
  // Read-only vectors standing in for an absent weight or bias, kept per (value, n, dtype,
  // device): a few per model width, never freed (at process exit CUDA tensors released this
  // late may outlive the caching allocator). Each is made and waited for once on a thread of its
  // own, because while torch.compile's CUDA-graph modes warm up or record, every allocation of
  // the calling thread goes to the graphs' memory pool, and a kept tensor from that pool fails
  // cudagraph trees' check that each live pool tensor is a graph output (cudnorm._runtime._kept).
  // While the caller's stream is being captured (no waiting allowed) a fresh one comes from the
  // graph's pool, kept alive by the graph.
  static std::mutex mutex;
  static auto& cache = *new std::map<std::tuple<int64_t, int64_t, int, int>, Tensor>();
  auto key = std::make_tuple(double_bits(value), n, static_cast<int>(dtype), static_cast<int>(device.index()));
  auto options = at::TensorOptions().dtype(dtype).device(device);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return at::full({n}, value, options);
  }
  Tensor t;
  std::exception_ptr error;
  std::thread([&] {
    try {
      c10::cuda::CUDAGuard device_guard(device.index());
      auto stream = c10::cuda::getStreamFromPool(false, device.index());
      c10::cuda::CUDAStreamGuard stream_guard(stream);
      t = at::full({n}, value, options);
      stream.synchronize();
    } catch (...) {
      error = std::current_exception();
    }
  }).join();
  if (error) std::rethrow_exception(error);
  cache.emplace(key, t);
  return t;
}

Tensor stats_buffer(int64_t rows, int64_t count, const at::Device& device) {
  return at::empty({count, (rows + 3) / 4 * 4}, at::TensorOptions().dtype(at::kFloat).device(device));
}

bool is_plain(const Tensor& t) {
  // exactly a dense CUDA tensor's keys (with autograd's, or without them for an inference
  // tensor): anything else (a tensor subclass, a fake or functional tensor, functorch's
  // wrappers, conjugate/negative views) takes cudnorm's Python path, which handles it
  static const c10::DispatchKeySet with_autograd =
      c10::DispatchKeySet(c10::DispatchKey::CUDA) |
      c10::getAutogradRelatedKeySetFromBackend(c10::BackendComponent::CUDABit) |
      c10::getAutocastRelatedKeySetFromBackend(c10::BackendComponent::CUDABit);
  static const c10::DispatchKeySet inference = with_autograd - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
  const auto ks = t.key_set();
  return ks == with_autograd || ks == inference;
}

bool is_plain(const OptTensor& t) { return !t.has_value() || !t->defined() || is_plain(*t); }

bool no_dispatch_modes() {
  const auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return !included.has(c10::DispatchKey::Python) && !included.has(c10::DispatchKey::PythonTLSSnapshot) &&
         !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

int64_t dtype_code(const OptTensor& t) {
  return t.has_value() && t->defined() ? static_cast<int64_t>(t->scalar_type()) : -1;
}

bool device_supported(int64_t device) {
  static std::once_flag once;
  static std::vector<bool> supported;
  std::call_once(once, [] {
    const int count = c10::cuda::device_count();
    for (int i = 0; i < count; ++i) {
      int major = 0;
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, i);
      supported.push_back(major >= 8);
    }
  });
  return device >= 0 && device < static_cast<int64_t>(supported.size()) && supported[device];
}

}  // namespace cudnorm
