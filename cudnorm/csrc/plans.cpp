// The plan table: cuDNN-frontend graphs deserialized from what Python built, executed on
// torch's current stream through a per-thread cuDNN handle. The only translation unit that
// includes the cuDNN frontend (a header-only library whose compile dominates the build).
#include "native.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cudnn_frontend.h>

#include <chrono>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace cudnorm {

struct Plan {
  cudnn_frontend::graph::Graph graph;
  int64_t workspace = 0;
  int64_t slots = 0;
  int device = 0;
};

namespace {

constexpr int kMaxDevices = 64;

// Handles of threads that have ended, per device, for the next thread to reuse. Never freed:
// at process exit this (and the tables below) would otherwise be destroyed after cuDNN's own
// libraries have unloaded, and destroying a handle or a plan then crashes the process.
struct HandlePool {
  std::mutex mutex;
  std::vector<cudnnHandle_t> free[kMaxDevices];
};
HandlePool& handle_pool = *new HandlePool();

// This thread's cuDNN handle per device and the stream it is bound to: cudnnSetStream only
// when torch's current stream changed since this thread's last launch on that device.
struct ThreadHandles {
  cudnnHandle_t handle[kMaxDevices] = {};
  cudaStream_t stream[kMaxDevices] = {};
  ~ThreadHandles() {  // at thread exit (the main thread's: at process exit): back to the pool
    std::lock_guard<std::mutex> lock(handle_pool.mutex);
    for (int device = 0; device < kMaxDevices; ++device) {
      if (handle[device] != nullptr) {
        handle_pool.free[device].push_back(handle[device]);
      }
    }
  }
};

cudnnHandle_t bound_handle(int device, cudaStream_t stream) {
  thread_local ThreadHandles handles;
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "cudnorm: device index ", device, " out of range");
  cudnnHandle_t& handle = handles.handle[device];
  if (handle == nullptr) {
    {
      std::lock_guard<std::mutex> lock(handle_pool.mutex);
      auto& free = handle_pool.free[device];
      if (!free.empty()) {
        handle = free.back();
        free.pop_back();
      }
    }
    if (handle == nullptr) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      auto status = cudnnCreate(&handle);
      TORCH_CHECK(status == CUDNN_STATUS_SUCCESS, "cudnorm: cudnnCreate failed: ", cudnnGetErrorString(status));
    }
    handles.stream[device] = nullptr;
    cudnnSetStream(handle, nullptr);
  }
  if (handles.stream[device] != stream) {
    auto status = cudnnSetStream(handle, stream);
    TORCH_CHECK(status == CUDNN_STATUS_SUCCESS, "cudnorm: cudnnSetStream failed: ", cudnnGetErrorString(status));
    handles.stream[device] = stream;
  }
  return handle;
}

std::mutex table_mutex;
std::unordered_map<int64_t, PlanRef>& table = *new std::unordered_map<int64_t, PlanRef>();  // never freed: see HandlePool
int64_t next_id = 1;

}  // namespace

int64_t add_plan(const Tensor& blob, int64_t device, int64_t slots) {
  TORCH_CHECK(blob.device().is_cpu() && blob.scalar_type() == at::kByte && blob.dim() == 1,
              "cudnorm: a serialized plan is a 1-D uint8 CPU tensor");
  auto contiguous = blob.contiguous();
  const uint8_t* data = contiguous.data_ptr<uint8_t>();
  std::vector<uint8_t> bytes(data, data + contiguous.numel());
  auto plan = std::make_shared<Plan>();
  plan->device = static_cast<int>(device);
  plan->slots = slots;
  {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    auto status = plan->graph.deserialize(bound_handle(plan->device, stream), bytes);
    TORCH_CHECK(status.is_good(), "cudnorm: the native path could not load a plan: ", status.get_message());
    int64_t workspace = 0;
    status = plan->graph.get_workspace_size(workspace);
    TORCH_CHECK(status.is_good(), "cudnorm: workspace size of a loaded plan: ", status.get_message());
    plan->workspace = workspace;
  }
  std::lock_guard<std::mutex> lock(table_mutex);
  int64_t id = next_id++;
  table.emplace(id, std::move(plan));
  return id;
}

void drop_plan(int64_t id) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.erase(id);  // recipes holding it keep it alive until they go
}

int64_t plan_count() {
  std::lock_guard<std::mutex> lock(table_mutex);
  return static_cast<int64_t>(table.size());
}

PlanRef find_plan(int64_t id) {
  std::lock_guard<std::mutex> lock(table_mutex);
  auto it = table.find(id);
  TORCH_CHECK(it != table.end(), "cudnorm: no native plan with id ", id);
  return it->second;
}

int64_t workspace_bytes(const Plan& plan) { return plan.workspace; }

void execute(const Plan& plan, void* const* ptrs, int64_t count, void* workspace) {
  TORCH_CHECK(count == plan.slots, "cudnorm: a launch passed ", count, " buffers to a plan of ", plan.slots);
  auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(plan.device)).stream();
  auto status = plan.graph.execute(bound_handle(plan.device, stream), const_cast<void**>(ptrs),
                                   static_cast<int>(count), workspace);
  TORCH_CHECK(status.is_good(), "cudnorm: cuDNN execute failed: ", status.get_message());
}

double execute_floor_us(int64_t id, const std::vector<int64_t>& ptrs, int64_t reps) {
  auto plan = find_plan(id);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(plan->device));
  Tensor workspace;
  if (plan->workspace > 0) {
    workspace = at::empty({plan->workspace}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, plan->device));
  }
  std::vector<void*> slots(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) {
    slots[i] = reinterpret_cast<void*>(ptrs[i]);
  }
  void* ws = workspace.defined() ? workspace.data_ptr() : nullptr;
  execute(*plan, slots.data(), static_cast<int64_t>(slots.size()), ws);  // first-launch costs stay out
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i) {
    execute(*plan, slots.data(), static_cast<int64_t>(slots.size()), ws);
  }
  std::chrono::duration<double, std::micro> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / static_cast<double>(reps);
}

}  // namespace cudnorm
