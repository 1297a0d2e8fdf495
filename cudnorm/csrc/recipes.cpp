// Call signatures -> recipes, the configuration Python pushes, and every call into Python.
//
// A recipe is what Python resolved for one call signature (cudnorm._native.resolve): which
// plans launch and how. The first call of a signature asks Python (which may build plans);
// later calls find the recipe here. The configuration is part of the key (Settings::config), so
// switching configurations back and forth finds each one's recipes; Python empties the table
// whenever its own state changes what a signature resolves to (evicted plans, forgotten
// decisions, cudnorm.clear_cache()).
#include "native.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

namespace cudnorm {

namespace {

constexpr size_t kKeySize = 15;
// A bound on the signatures kept: a run over ever new shapes starts the table over rather
// than growing it (a signature costs one call into Python to resolve again).
constexpr size_t kMaxRecipes = 4096;
using Key = std::array<int64_t, kKeySize>;

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) {
      h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

std::shared_mutex table_mutex;
// never freed: destroyed at process exit, its plans would call into cuDNN after it unloaded
std::unordered_map<Key, RecipeRef, KeyHash>& table = *new std::unordered_map<Key, RecipeRef, KeyHash>();
uint64_t generation = 0;  // bumped by clear_recipes(): a resolve racing a clear is not kept
std::atomic<int64_t> hits{0};
std::atomic<int64_t> misses{0};

Settings current;
std::mutex settings_mutex;

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::NormForward: return "norm_fwd";
    case Kind::NormBackward: return "norm_bwd";
    case Kind::AdaForward: return "ada_fwd";
    case Kind::AdaBackward: return "ada_bwd";
    case Kind::KernelForward: return "kernel_fwd";
    case Kind::KernelBackward: return "kernel_bwd";
    case Kind::ModulatedForward: return "mod_fwd";
    case Kind::TokenBackward: return "token_bwd";
    case Kind::AdaRmsBackward: return "ada_rms_bwd";
    case Kind::GatedBackward: return "gated_bwd";
  }
  return "?";
}

Key make_key(Kind kind, const Tensor& x, const std::vector<int64_t>& ints, const std::vector<double>& floats) {
  Key key{};
  size_t i = 0;
  key[i++] = static_cast<int64_t>(kind);
  key[i++] = x.size(0);
  key[i++] = x.size(1);
  key[i++] = x.stride(0);
  key[i++] = static_cast<int64_t>(x.scalar_type());
  key[i++] = x.get_device();
  key[i++] = current.config;
  TORCH_CHECK(ints.size() + floats.size() <= kKeySize - i, "cudnorm: call signature too long");
  for (int64_t v : ints) key[i++] = v;
  for (double v : floats) key[i++] = double_bits(v);
  return key;
}

c10::OperatorHandle python_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

RecipeRef parse(const std::vector<int64_t>& ints, bool* cacheable) {
  // [cacheable, mode, param dtype, fused add, overlap, launches, (plan id, start, rows) per launch],
  // then for a Kernel recipe: function, threads, shared bytes, chunks, scratch parameters, programs, tiles
  TORCH_CHECK(ints.size() >= 6, "cudnorm: malformed recipe from Python");
  auto recipe = std::make_shared<Recipe>();
  *cacheable = ints[0] != 0;
  recipe->mode = static_cast<Mode>(ints[1]);
  recipe->param_dtype = static_cast<at::ScalarType>(ints[2]);
  recipe->fused_add = ints[3] != 0;
  recipe->overlap = ints[4];
  int64_t count = ints[5];
  // a Kernel recipe: its kernel's launch (7 ints), and a norm backward's finishing sum (7 more)
  const int64_t extra = recipe->mode == Mode::Kernel ? static_cast<int64_t>(ints.size()) - 6 - 3 * count : 0;
  TORCH_CHECK(extra == 0 || extra == 7 || extra == 14, "cudnorm: malformed recipe from Python");
  TORCH_CHECK(static_cast<int64_t>(ints.size()) == 6 + 3 * count + extra, "cudnorm: malformed recipe from Python");
  for (int64_t k = 0; k < count; ++k) {
    Launch launch;
    launch.plan = find_plan(ints[6 + 3 * k]);
    launch.start = ints[7 + 3 * k];
    launch.rows = ints[8 + 3 * k];
    recipe->launches.push_back(std::move(launch));
  }
  if (extra) {
    const int64_t* k = ints.data() + 6 + 3 * count;
    recipe->kernel = KernelLaunch{k[0], k[1], k[2], k[3], k[4], k[5], k[6]};
    if (extra == 14) recipe->finish = KernelLaunch{k[7], k[8], k[9], k[10], k[11], k[12], k[13]};
  }
  return recipe;
}

}  // namespace

RecipeRef recipe_for(Kind kind, const Tensor& x, const std::vector<int64_t>& ints,
                     const std::vector<double>& floats) {
  Key key = make_key(kind, x, ints, floats);
  uint64_t seen;
  {
    std::shared_lock<std::shared_mutex> lock(table_mutex);
    auto it = table.find(key);
    if (it != table.end()) {
      hits.fetch_add(1, std::memory_order_relaxed);
      return it->second;
    }
    seen = generation;
  }
  misses.fetch_add(1, std::memory_order_relaxed);
  // Python resolves without any lock held here: it may build plans and add them (add_plan)
  static auto op = python_op("cudnorm::_resolve_py")
                       .typed<std::vector<int64_t>(c10::string_view, const Tensor&, c10::IntArrayRef,
                                                   c10::ArrayRef<double>)>();
  auto answer = op.call(kind_name(kind), x, ints, floats);
  bool cacheable = false;
  RecipeRef recipe = parse(answer, &cacheable);
  if (cacheable) {
    std::unique_lock<std::shared_mutex> lock(table_mutex);
    if (generation == seen) {
      if (table.size() >= kMaxRecipes) table.clear();
      table.emplace(key, recipe);
    }
  }
  return recipe;
}

void clear_recipes() {
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  table.clear();
  ++generation;
}

std::vector<int64_t> counters() {
  int64_t size;
  {
    std::shared_lock<std::shared_mutex> lock(table_mutex);
    size = static_cast<int64_t>(table.size());
  }
  return {hits.load(), misses.load(), size, plan_count()};
}

const Settings& settings() { return current; }

void configure(bool enabled, bool policy_auto, int64_t cudnn_min_elements, bool measured, int64_t config) {
  // Python changes the configuration between calls (cudnorm.config); the fields are read
  // without a lock on every call, and a call racing a change sees the old or the new value.
  std::lock_guard<std::mutex> lock(settings_mutex);
  current.policy_auto = policy_auto;
  current.cudnn_min_elements = cudnn_min_elements;
  current.measured = measured;
  current.enabled = enabled;
  current.config = config;
}

std::vector<Tensor> kernel_py(const std::string& name, const std::vector<OptTensor>& tensors,
                              const std::vector<double>& scalars) {
  static auto op = python_op("cudnorm::_kernel_py")
                       .typed<std::vector<Tensor>(c10::string_view, const c10::List<OptTensor>&,
                                                  c10::ArrayRef<double>)>();
  c10::List<OptTensor> list;
  for (const auto& t : tensors) list.push_back(t);
  return op.call(name, list, scalars);
}

std::vector<Tensor> composite_py(const std::string& name, const std::vector<OptTensor>& tensors,
                                 const std::vector<double>& scalars, c10::SymIntArrayRef shape) {
  // a measurement times a candidate through its entry point (ServeAs): handed to Python, the call
  // would ask for the very decision being measured and measure again
  TORCH_CHECK(!forced_server().has_value(), "cudnorm: a measured candidate's call left the native path (", name, ")");
  static auto op = python_op("cudnorm::_composite_py")
                       .typed<std::vector<Tensor>(c10::string_view, const c10::List<OptTensor>&,
                                                  c10::ArrayRef<double>, c10::SymIntArrayRef)>();
  c10::List<OptTensor> list;
  for (const auto& t : tensors) list.push_back(t);
  return op.call(name, list, scalars, shape);
}

int64_t double_bits(double value) {
  int64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

}  // namespace cudnorm
