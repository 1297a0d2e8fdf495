// cudnorm's native launch path: what its translation units share.
//
// One job: launch built cuDNN plans fast. Python describes, builds, tunes and stores the
// graphs and decides which plans serve a call (cudnorm._native); this code keeps what
// Python resolved for each call signature (a Recipe), and per call checks the arguments,
// allocates the outputs, fills the variant pack and executes, with the autograd of the ops.
//
//   plans.cpp     the plan table (deserialized cuDNN-frontend graphs), per-thread handles,
//                 execute: the only file that includes the cuDNN frontend
//   recipes.cpp   call signatures -> recipes, the configuration Python pushes, the calls
//                 into Python (resolving a new signature, the PyTorch fallbacks)
//   decisions.cpp call signatures -> which kernel serves (measured by cudnorm._decisions)
//   launch.cpp    pointer slots, single / chunked / per-sample launches
//   norm.cpp      LayerNorm / RMSNorm (and the fused residual add) forward and backward
//   ada.cpp       adaptive LayerNorm forward and backward
//   gated.cpp     a gated residual into an adaptive LayerNorm: its fused backward kernel
//   kernel.cpp    cudnorm's own LayerNorm / RMSNorm kernels (Triton-compiled), launched by handle,
//                 and the norms modulated per token or per sample (adaptive RMSNorm)
//   autograd.cpp  the autograd nodes of the forward ops
//   entry.cpp     the public entry points (argument checks, kernel policy, flattening)
//   register.cpp  every registration with the dispatcher
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cudnorm {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// ---------------------------------------------------------------- plans (plans.cpp)
struct Plan;  // a deserialized cuDNN-frontend graph with its workspace size and device
using PlanRef = std::shared_ptr<const Plan>;

// Deserialize `blob` (uint8 CPU tensor from the frontend's serialize()) on `device`; `slots`
// is the number of caller-filled variant-pack slots. Returns the plan's id.
int64_t add_plan(const Tensor& blob, int64_t device, int64_t slots);
void drop_plan(int64_t id);
int64_t plan_count();
PlanRef find_plan(int64_t id);
int64_t workspace_bytes(const Plan& plan);
// Execute `plan` on torch's current stream with `ptrs` in variant-pack (ascending uid) order.
void execute(const Plan& plan, void* const* ptrs, int64_t count, void* workspace);
// Host microseconds per execute of `plan` over `reps` back-to-back launches (no sync): the
// floor of any launch path, measured in C++.
double execute_floor_us(int64_t id, const std::vector<int64_t>& ptrs, int64_t reps);

// ---------------------------------------------------------------- recipes (recipes.cpp)
enum class Kind : int64_t {
  NormForward = 0,
  NormBackward = 1,
  AdaForward = 2,
  AdaBackward = 3,
  KernelForward = 4,  // cudnorm's own norm kernels (kernel.cpp)
  KernelBackward = 5,
  ModulatedForward = 6,  // the norm kernel modulated per token or per sample (kernel.cpp)
  TokenBackward = 7,     // per token (cudnorm._token_ada)
  AdaRmsBackward = 8,    // the adaptive RMSNorm's (cudnorm._ada_rms)
  GatedBackward = 9,     // a gated residual into an adaptive LayerNorm (gated.cpp, cudnorm._gated)
};

// How a call signature is served. Python (cudnorm._native.resolve) decides; C++ executes.
enum class Mode : int64_t {
  Single = 0,     // one launch of plans[0]
  Chunked = 1,    // launches of chunk plans over row offsets (cudnorm._rows)
  PerSample = 2,  // plans[0] launched once per AdaLN sample
  Aten = 3,       // PyTorch's fused kernel (LayerNorm / RMSNorm forward); per token: the formula's ops
  Python = 4,     // cudnorm's Python implementation (cases no plan serves)
  Kernel = 5,     // cudnorm's own compiled kernel (norm kernels, the fused AdaLN backward), launched by handle
};

// A kernel Python compiled (cudnorm._ada_kernel.native_launch, cudnorm._norm_kernel.native_launch)
// and C++ launches through the CUDA driver: its function handle and launch configuration.
struct KernelLaunch {
  int64_t function = 0;  // CUfunction, loaded in the device's primary context
  int64_t threads = 0;   // per block
  int64_t shared = 0;    // dynamic shared memory bytes
  int64_t chunks = 0;    // programs per AdaLN sample
  int64_t scratch = 0;   // trailing scratch-pointer parameters the compiler added (passed null)
  int64_t programs = 0;  // norm kernels: the grid, for the recipe's row count
  int64_t tiles = 0;     // norm kernels: tiles of rows the programs share
};

struct Launch {
  PlanRef plan;
  int64_t start = 0;  // first row (Chunked)
  int64_t rows = 0;   // rows of the chunk (Chunked)
};

struct Recipe {
  Mode mode = Mode::Python;
  at::ScalarType param_dtype = at::kFloat;  // forward: the dtype the graph reads scale/bias (gain/shift) in
  bool fused_add = false;                   // NormForward with a residual: the add runs inside the graph
  int64_t overlap = 0;                      // Chunked: rows of launches[0] that later launches rewrite
  std::vector<Launch> launches;
  KernelLaunch kernel;                      // Kernel
  KernelLaunch finish;                      // Kernel, a norm backward's: the parameter gradients' sum (or none)
};
using RecipeRef = std::shared_ptr<const Recipe>;

// The recipe of a call: from the table, else resolved by Python (which may build plans).
// `ints`/`floats` describe the call beyond x's shape, strides, dtype and device.
RecipeRef recipe_for(Kind kind, const Tensor& x, const std::vector<int64_t>& ints,
                     const std::vector<double>& floats);
void clear_recipes();
std::vector<int64_t> counters();  // hits, misses (resolved by Python), recipes held, plans held

struct Settings {
  bool enabled = false;            // the native path serves (Python pushed a configuration)
  bool policy_auto = true;         // Config.policy is "auto" or "torch" (same-dtype calls may run PyTorch's op)
  int64_t cudnn_min_elements = 0;  // same-dtype eager calls below this run PyTorch's op
  bool measured = false;           // Config.policy == "auto": larger calls take the measured decision
  // which configuration this is (cudnorm._native.config_id): part of every recipe's and
  // decision's key, so a configuration set again finds what it resolved before
  int64_t config = 0;
};
const Settings& settings();
void configure(bool enabled, bool policy_auto, int64_t cudnn_min_elements, bool measured, int64_t config);

// ---------------------------------------------------------------- decisions (decisions.cpp)
// What serves an eager LayerNorm / RMSNorm / adaptive LayerNorm call: cuDNN's plans (this
// library), PyTorch's op (the adaptive LayerNorm's: diffusers' formula), or cudnorm's own
// kernel (kernel.cpp).
enum class Server : int64_t { Cudnn = 0, Torch = 1, Kernel = 2 };
// The ops C++ asks decisions for (cudnorm._candidates.Signature.op: "layer_norm", "rms_norm",
// "ada_layer_norm", "token_ada_layer_norm", "token_ada_rms_norm", "gated_ada_layer_norm",
// "modulated_layer_norm")
enum class MeasuredOp : int64_t {
  LayerNorm = 0,
  RmsNorm = 1,
  AdaLayerNorm = 2,
  TokenLayerNorm = 3,
  TokenRmsNorm = 4,
  GatedAdaLayerNorm = 5,
  ModulatedLayerNorm = 6
};
// The measured decision of the call's signature (cudnorm._decisions): from the table, else
// decided by Python (which may time the candidates on `input`). An adaptive LayerNorm's weight
// and bias are its scale and shift ([B, n]).
Server server_for(MeasuredOp op, bool training, const Tensor& input, int64_t n, const OptTensor& weight,
                  const OptTensor& bias);
void clear_decisions();
// The server a measurement forces on this thread's plain LayerNorm/RMSNorm entry calls, which
// the entries' kernel policy takes before any rule or decision: cudnorm._candidates times each
// candidate through the entry a user's call takes, so each is charged the host time that call
// pays (a custom op called from Python cost up to 16 us more). Set for one call by ServeAs.
std::optional<Server> forced_server();
class ServeAs {
 public:
  explicit ServeAs(std::optional<Server> server);
  ~ServeAs();
  ServeAs(const ServeAs&) = delete;
  ServeAs& operator=(const ServeAs&) = delete;

 private:
  std::optional<Server> previous_;
};

// cudnorm's Python implementation of an op or an entry point (cudnorm._native): the fallbacks.
// kernel_py runs below autograd (CompositeExplicitAutograd), composite_py above it
// (CompositeImplicitAutograd: PyTorch's autograd records what it computes).
std::vector<Tensor> kernel_py(const std::string& name, const std::vector<OptTensor>& tensors,
                              const std::vector<double>& scalars);
std::vector<Tensor> composite_py(const std::string& name, const std::vector<OptTensor>& tensors,
                                 const std::vector<double>& scalars, c10::SymIntArrayRef shape = {});

// ---------------------------------------------------------------- launching (launch.cpp)
// One variant-pack slot: where the buffer starts and how it moves with a row offset.
struct Slot {
  enum Role : uint8_t { Fixed, Rows, Stats, Dy, Sum };
  uintptr_t base = 0;
  int64_t row_bytes = 0;  // bytes per row (Rows, Stats, Dy)
  Role role = Fixed;
  Tensor rows;            // Stats: the [M] fp32 view; Dy: dy [M, N]; Sum: the [N] output
};

void launch_single(const Recipe& recipe, const std::vector<Slot>& slots);
void launch_chunked(const Recipe& recipe, const std::vector<Slot>& slots, int64_t cols);
// plans[0] launched `count` times, launch k on `slot.base + k * slot.row_bytes` of every slot
void launch_per_sample(const Recipe& recipe, const std::vector<Slot>& slots, int64_t count);
// recipe.kernel on `blocks` blocks with these pointer and int32 arguments, in its parameter order
void launch_kernel(const KernelLaunch& kernel, int64_t blocks, const std::vector<const void*>& pointers,
                   const std::vector<int32_t>& ints);

// ---------------------------------------------------------------- helpers (launch.cpp)
Tensor cudnn_rows(const Tensor& x);                  // [M, N] in a layout cuDNN reads (copy if needed)
Tensor packed(const Tensor& t);                      // contiguous, 16-byte aligned (copy if needed)
bool is_packed(const Tensor& t);
Tensor constant(double value, int64_t n, at::ScalarType dtype, const at::Device& device);
Tensor stats_buffer(int64_t rows, int64_t count, const at::Device& device);  // fp32 [count, ceil4(rows)]
bool is_plain(const Tensor& t);                      // a dense CUDA tensor: no subclass, functionalization, ...
bool is_plain(const OptTensor& t);
bool no_dispatch_modes();                            // no Python dispatch mode or functorch transform active
int64_t dtype_code(const OptTensor& t);              // the ScalarType's number, -1 for an absent tensor
int64_t double_bits(double value);
bool device_supported(int64_t device);               // compute capability 8.0 or newer

// ---------------------------------------------------------------- ops
// (y, h, stats) of a LayerNorm / RMSNorm forward on x [M, N] (norm.cpp); h undefined without
// a residual, stats undefined when not training (the inference graph writes none)
std::tuple<Tensor, Tensor, Tensor> norm_forward(const Tensor& x, const OptTensor& residual, const OptTensor& weight,
                                                const OptTensor& bias, double eps, bool training, bool rms,
                                                double offset);
// (y, stats) of cudnorm's own kernel on x [M, N] (kernel.cpp): stats as norm_forward's
std::tuple<Tensor, Tensor> kernel_forward(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps,
                                          bool training, bool rms);
// (dx, dweight, dbias) of it: dweight in weight's dtype, dbias in `bias_dtype` (none: no bias);
// undefined where absent
std::tuple<Tensor, Tensor, Tensor> kernel_backward(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                                   const Tensor& stats, bool rms,
                                                   std::optional<at::ScalarType> bias_dtype);
// A norm modulated per token or per sample (kernel.cpp): x [M, N] packed; scale and shift (or
// none) rows with unit column stride, any row stride: [M, N] per token, [B, N] per sample.
// The call's recipe (mode Aten: the formula's ops serve it, not the kernels), looked up once
// by the caller; then (y, stats) forward on it, row r reading modulation row r / seq, stats as
// kernel_forward's.
RecipeRef modulated_recipe(const Tensor& x, const Tensor& scale, const OptTensor& shift, bool one_plus_scale, bool rms,
                           bool training);
std::tuple<Tensor, Tensor> modulated_forward(const Tensor& x, const Tensor& scale, const OptTensor& shift, double eps,
                                             bool one_plus_scale, bool rms, bool training, int64_t seq,
                                             const Recipe& recipe);
// per token: (dx, dscale), dscale in scale's dtype (dshift is dy itself)
std::tuple<Tensor, Tensor> token_backward(const Tensor& dy, const Tensor& x, const Tensor& scale,
                                          const Tensor& stats, bool one_plus_scale, bool rms);
// the adaptive RMSNorm's (per sample, [B, N] scale): (dx, dscale, dshift) with the per-sample
// sums in scale's and shift's dtypes (dshift undefined without a shift)
std::tuple<Tensor, Tensor, Tensor> ada_rms_backward(const Tensor& dy, const Tensor& x, const Tensor& scale,
                                                    const Tensor& rstd, bool one_plus_scale,
                                                    std::optional<at::ScalarType> shift_dtype);
// The gated residual's backward (gated.cpp): h [B, S, D] packed (h = residual + gate * branch),
// dy and branch of its shape, dh too or absent; gate and scale [B, D] with unit column stride;
// stats the AdaLN forward's. (dresidual [B*S, D], dbranch [B*S, D], sums [3, B, D] fp32:
// dscale, dshift, dgate).
std::tuple<Tensor, Tensor, Tensor> gated_backward(const Tensor& dy, const OptTensor& dh, const Tensor& h,
                                                  const Tensor& branch, const Tensor& gate, const Tensor& scale,
                                                  const Tensor& stats, bool one_plus_scale);
// (y, stats) of an AdaLN forward on x [B, S, D] (ada.cpp); stats undefined when not training
std::tuple<Tensor, Tensor> ada_forward(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                                       bool one_plus_scale, bool training);

// The CUDA kernels of cudnorm's custom ops (norm.cpp, ada.cpp): same schemas as cudnorm._norm,
// cudnorm._fused_add and cudnorm.ada_layer_norm define.
std::tuple<Tensor, Tensor> layer_norm_fwd(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                          double eps, bool training);
std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                                  const Tensor& stats);
std::tuple<Tensor, Tensor> rms_norm_fwd(const Tensor& x, const OptTensor& weight, double eps, bool training,
                                        double offset);
std::tuple<Tensor, Tensor> rms_norm_bwd(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                        const Tensor& rstd, double offset);
std::tuple<Tensor, Tensor, Tensor> add_norm_fwd(const Tensor& x, const Tensor& residual, const OptTensor& weight,
                                                const OptTensor& bias, double eps, bool training, bool rms,
                                                double offset);
std::tuple<Tensor, Tensor, Tensor> add_norm_bwd(const OptTensor& dy, const OptTensor& dh, const Tensor& h,
                                                const OptTensor& weight, const Tensor& stats, bool rms,
                                                double offset);
std::tuple<Tensor, Tensor> ada_layer_norm_fwd(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                                              bool one_plus_scale, bool training);
std::tuple<Tensor, Tensor, Tensor> ada_layer_norm_bwd(const Tensor& dy, const Tensor& x, const Tensor& scale,
                                                      const Tensor& stats, bool one_plus_scale,
                                                      at::ScalarType shift_dtype);

// The autograd kernels of the forward ops (autograd.cpp). `redispatch`: the keys below
// autograd to send the forward to (a traced call: fake tensors); nullopt runs the CUDA kernel
// above directly (plain tensors, the entry points' hot path).
std::tuple<Tensor, Tensor> layer_norm_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x, const OptTensor& weight,
                                                   const OptTensor& bias, double eps, bool training);
std::tuple<Tensor, Tensor> rms_norm_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x, const OptTensor& weight,
                                                 double eps, bool training, double offset);
std::tuple<Tensor, Tensor, Tensor> add_norm_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x,
                                                         const Tensor& residual, const OptTensor& weight,
                                                         const OptTensor& bias, double eps, bool training, bool rms,
                                                         double offset);
std::tuple<Tensor, Tensor> ada_layer_norm_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x, const Tensor& scale,
                                                       const Tensor& shift, double eps, bool one_plus_scale,
                                                       bool training);
// the same with the CUDA kernel called directly (plain tensors); `kernel`: cudnorm's own kernel
// (kernel.cpp) serves forward and backward instead of cuDNN's plans
Tensor layer_norm_train(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps, bool training,
                        bool kernel = false);
Tensor rms_norm_train(const Tensor& x, const OptTensor& weight, double eps, bool training, double offset,
                      bool kernel = false);
std::tuple<Tensor, Tensor> add_norm_train(const Tensor& x, const Tensor& residual, const OptTensor& weight,
                                          const OptTensor& bias, double eps, bool training, bool rms, double offset);
Tensor ada_layer_norm_train(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                            bool one_plus_scale, bool training);
// (y, h) of the gated residual into an adaptive LayerNorm with its node: residual and branch
// [B, S, D], gate, scale and shift [B, D], all of one dtype
std::tuple<Tensor, Tensor> gated_train(const Tensor& residual, const Tensor& branch, const Tensor& gate,
                                       const Tensor& scale, const Tensor& shift, double eps, bool one_plus_scale);
// the modulated norm's forward with its node (a gradient is needed) on modulated_forward's
// rows: per token (batch 0) or per sample (batch B, the adaptive RMSNorm)
Tensor modulated_norm_train(const Tensor& x, const Tensor& scale, const OptTensor& shift, double eps,
                            bool one_plus_scale, bool rms, int64_t batch, const Recipe& recipe);

// The public entry points (entry.cpp): cudnorm.layer_norm & co. with the native path.
Tensor layer_norm_entry(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                        const OptTensor& bias, double eps);
Tensor rms_norm_entry(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                      std::optional<double> eps, double weight_offset);
std::tuple<Tensor, Tensor> add_layer_norm_entry(const Tensor& input, const Tensor& residual,
                                                c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                                const OptTensor& bias, double eps);
std::tuple<Tensor, Tensor> add_rms_norm_entry(const Tensor& input, const Tensor& residual,
                                              c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                              std::optional<double> eps, double weight_offset);
Tensor ada_layer_norm_entry(const Tensor& input, const Tensor& scale, const Tensor& shift, double eps,
                            bool one_plus_scale);
// cudnorm.ada_layer_norm / ada_rms_norm with a modulation per token (scale and shift of input's
// shape): the measured decision between the formula and the kernels. The kernel alone (what the
// dispatcher times as "kernel"): nullopt where the native path does not serve these arguments.
Tensor token_ada_norm_entry(const Tensor& input, const Tensor& scale, const OptTensor& shift, double eps,
                            bool one_plus_scale, bool rms);
std::optional<Tensor> token_ada_kernel_entry(const Tensor& input, const Tensor& scale, const OptTensor& shift,
                                             double eps, bool one_plus_scale, bool rms);
// cudnorm._ada_rms.kernel (adaptive RMSNorm, [B, D] or [B, 1.., D] modulation) through the
// kernels: nullopt where the native path does not serve these arguments or the kernels do not
// compute them (Python's implementation then)
std::optional<Tensor> ada_rms_kernel_entry(const Tensor& input, const Tensor& scale, const OptTensor& shift,
                                           double eps, bool one_plus_scale);
// cudnorm._gated.fused (the gated residual's fused op, a training call): (y, h), or nullopt
// where the native path does not serve these arguments (Python's implementation then)
std::optional<std::tuple<Tensor, Tensor>> gated_kernel_entry(const Tensor& residual, const Tensor& branch,
                                                             const Tensor& gate, const Tensor& scale,
                                                             const Tensor& shift, double eps, bool one_plus_scale);
// cudnorm._diffusers_forwards._modulated_layer_norm's per-sample call of an affine LayerNorm
// (x [B, S, D], scale and shift [B, 1, D], weight and bias [D], one dtype): the formula or the
// fold and the adaptive LayerNorm, as measured; nullopt for any other call (Python's then)
std::optional<Tensor> modulated_layer_norm_entry(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                                                 const OptTensor& weight, const OptTensor& bias);
// cudnorm.gated_ada_layer_norm: (y, h) by its rules (the formula, the adaptive LayerNorm's entry
// without grad, the measured decision, the fused op), or nullopt where Python takes the call
// (arguments it does not serve, whose error Python raises; no kernel launched from here)
std::optional<std::tuple<Tensor, Tensor>> gated_entry(const Tensor& residual, const Tensor& branch,
                                                      const Tensor& gate, const Tensor& scale, const Tensor& shift,
                                                      double eps, bool one_plus_scale);
// The gain and shift of an affine LayerNorm folded into its per-sample modulation, in `dtype`
// (fold.cpp): (w * g, b * g + shift) with g = 1 + scale (or scale); one autograd node.
std::tuple<Tensor, Tensor> affine_fold(const Tensor& scale, const Tensor& shift, const OptTensor& weight,
                                       const OptTensor& bias, bool one_plus_scale, at::ScalarType dtype);

}  // namespace cudnorm
