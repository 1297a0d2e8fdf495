// Which kernel serves an eager LayerNorm/RMSNorm/adaptive norm call: the answers
// cudnorm._decisions measured.
//
// Python decides each call signature once (op, training or not, dtypes, width, a bucket of row
// counts: cudnorm._candidates.Signature), timing cuDNN, PyTorch's op and cudnorm's own kernel
// where it may; this table keeps the answers, so a later call of the signature pays one hashed
// lookup here and nothing in Python. Python empties it whenever its decisions change
// (cudnorm.clear_cache()); the configuration is part of the key (Settings::config).
#include "native.h"

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

namespace cudnorm {

namespace {

using Key = std::array<int64_t, 10>;

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

std::shared_mutex decisions_mutex;
// never freed, as the recipe table: process exit must not run destructors after cuDNN unloaded
std::unordered_map<Key, Server, KeyHash>& decisions = *new std::unordered_map<Key, Server, KeyHash>();
uint64_t decisions_generation = 0;

int64_t bit_length(int64_t v) { return v > 0 ? 64 - __builtin_clzll(static_cast<uint64_t>(v)) : 0; }

thread_local std::optional<Server> forced;

}  // namespace

std::optional<Server> forced_server() { return forced; }

ServeAs::ServeAs(std::optional<Server> server) : previous_(forced) { forced = server; }

ServeAs::~ServeAs() { forced = previous_; }

Server server_for(MeasuredOp op, bool training, const Tensor& input, int64_t n, const OptTensor& weight,
                  const OptTensor& bias) {
  // cudnorm._candidates.signature: row counts within a factor of two share a decision
  const Key key{static_cast<int64_t>(op), training, static_cast<int64_t>(input.scalar_type()), dtype_code(weight), dtype_code(bias), n,
                bit_length(input.numel() / n), input.get_device(), at::globalContext().deterministicAlgorithms(),
                settings().config};
  uint64_t seen;
  {
    std::shared_lock<std::shared_mutex> lock(decisions_mutex);
    auto it = decisions.find(key);
    if (it != decisions.end()) return it->second;
    seen = decisions_generation;
  }
  // Python may build plans and time candidates: no lock held meanwhile
  static auto serve_py = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("cudnorm::_serve_py", "")
                             .typed<std::vector<int64_t>(c10::string_view, const Tensor&, int64_t, const OptTensor&,
                                                         const OptTensor&, bool)>();
  static const char* const names[] = {"layer_norm",           "rms_norm",
                                      "ada_layer_norm",       "token_ada_layer_norm",
                                      "token_ada_rms_norm",   "gated_ada_layer_norm",
                                      "modulated_layer_norm"};
  const auto answer = serve_py.call(names[static_cast<int64_t>(op)], input, n, weight, bias, training);
  TORCH_CHECK(answer.size() == 2, "cudnorm: malformed decision from Python");
  const auto server = static_cast<Server>(answer[0]);
  if (answer[1]) {  // kept: a decision made with timing allowed (not while capturing)
    std::unique_lock<std::shared_mutex> lock(decisions_mutex);
    if (decisions_generation == seen) decisions.emplace(key, server);
  }
  return server;
}

void clear_decisions() {
  std::unique_lock<std::shared_mutex> lock(decisions_mutex);
  decisions.clear();
  ++decisions_generation;
}

}  // namespace cudnorm
