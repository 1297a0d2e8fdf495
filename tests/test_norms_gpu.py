"""LayerNorm/RMSNorm on cuDNN (GPU): accuracy under the 2x-PyTorch rule across dtypes,
weights, sizes and layouts; phases; opcheck; torch.compile; CUDA-graph replay; fallback."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _cache
from cudnorm import reference as ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SIZES = [256, 768, 1000, 1024, 4096, 5120, 12345, 16384, 65536]


@pytest.fixture(autouse=True)
def _no_autotune():
    # accuracy does not depend on the plan; autotuning every shape would only cost build time
    cudnorm.config(autotune="off")


def _rows(n):
    return max(8, min(512, (1 << 22) // n))


def _weights(n, kind, dtype):
    if kind == "none":
        return None, None
    wdtype = torch.float32 if kind == "fp32" else dtype
    return ((1 + 0.1 * torch.randn(n, device="cuda")).to(wdtype), (0.1 * torch.randn(n, device="cuda")).to(wdtype))


def _check_ln(x, w, b):
    n = x.shape[-1]
    before = cudnorm.cache_info().declined
    rows = ref.accuracy_report(
        lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, (n,), None if w is None else w.to(x.dtype), None if b is None else b.to(x.dtype), 1e-5),
        lambda x, w, b: ref.layer_norm(x, w, b, 1e-5), (x, w, b), torch.randn_like(x), ("y", "dx", "dw", "db"), x.dtype)
    assert cudnorm.cache_info().declined == before, "cuDNN declined a configuration"
    assert all(r["ok"] for r in rows), rows


def _check_rms(x, w):
    n = x.shape[-1]
    before = cudnorm.cache_info().declined
    rows = ref.accuracy_report(
        lambda x, w: cudnorm.rms_norm(x, (n,), w, 1e-6),
        lambda x, w: F.rms_norm(x, (n,), None if w is None else w.to(x.dtype), 1e-6),
        lambda x, w: ref.rms_norm(x, w, 1e-6), (x, w), torch.randn_like(x), ("y", "dx", "dw"), x.dtype)
    assert cudnorm.cache_info().declined == before, "cuDNN declined a configuration"
    assert all(r["ok"] for r in rows), rows


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_fp32_weights_2d(n, dtype):
    x = torch.randn(_rows(n), n, device="cuda").to(dtype)
    w, b = _weights(n, "fp32", dtype)
    assert cudnorm.serving_path("layer_norm", x) == "cudnn"
    _check_ln(x, w, b)
    _check_rms(x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_rows_forward_on_pytorchs_kernel_backward_on_cudnn(dtype, fresh_cache):
    """N >= NATIVE_FORWARD_MIN_COLS: the forward runs PyTorch's fused kernel (measured faster),
    the backward cuDNN's graph on that kernel's statistics; both within the 2x rule."""
    n = cudnorm._dispatch.NATIVE_FORWARD_MIN_COLS
    x = torch.randn(8, n, device="cuda").to(dtype)
    w, b = _weights(n, "fp32", dtype)
    _check_ln(x, w, b)
    _check_rms(x, w)
    built = {(s.op, s.phase) for s in _cache.plans.specs() if s.cols == n}
    assert built == {("layer_norm", "bwd"), ("rms_norm", "bwd")}


@pytest.mark.parametrize("n", [1000, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["same", "none"])
def test_accuracy_other_weights_3d(n, dtype, kind):
    x = torch.randn(3, 37, n, device="cuda").to(dtype)
    w, b = _weights(n, kind, dtype)
    _check_ln(x, w, b)
    _check_ln(x, w, None)
    _check_rms(x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_non_contiguous_and_padded_inputs(dtype):
    base = torch.randn(64, 2048, device="cuda").to(dtype)
    w, b = _weights(1024, "fp32", dtype)
    _check_ln(base[:, :1024], w, b)  # padded rows: served without a copy
    _check_rms(base[:, 1024:], w)
    _check_ln(torch.randn(1024, 96, device="cuda").to(dtype).t(), w, b)  # transposed: copied


def _check_rms_offset(x, w, offset=1.0):
    n = x.shape[-1]
    before = cudnorm.cache_info().declined
    rows = ref.accuracy_report(
        lambda x, w: cudnorm.rms_norm(x, (n,), w, 1e-6, weight_offset=offset),
        lambda x, w: (F.rms_norm(x.float(), (n,), None, 1e-6) * (w.float() + offset)).to(x.dtype),  # Gemma's formula
        lambda x, w: ref.rms_norm(x, w + offset, 1e-6), (x, w), torch.randn_like(x), ("y", "dx", "dw"), x.dtype)
    assert cudnorm.cache_info().declined == before, "cuDNN declined a configuration"
    assert all(r["ok"] for r in rows), rows


@pytest.mark.parametrize("n", [1024, 4096, 5120])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wkind", ["same", "fp32"])
def test_weight_offset_on_cudnn(n, dtype, wkind, fresh_cache):
    """Gemma's ``(1 + weight)`` added inside the graph: forward and backward within the 2x
    rule against Gemma's own formula, exact and row-chunked graphs, inference graph too."""
    wdtype = torch.float32 if wkind == "fp32" else dtype
    w = (0.3 * torch.randn(n, device="cuda")).to(wdtype)  # stored around zero, as Gemma's
    _check_rms_offset(torch.randn(_rows(n), n, device="cuda").to(dtype), w)
    with cudnorm.config(exact_rows=1, exact_after=1):  # the second row count runs shared chunk graphs
        _check_rms_offset(torch.randn(300, n, device="cuda").to(dtype), w)
        _check_rms_offset(torch.randn(5000, n, device="cuda").to(dtype), w)
    assert cudnorm.cache_info().chunked_calls > 0
    built = {(s.phase, s.offset, s.dynamic) for s in _cache.plans.specs()}
    assert {("train", True, False), ("bwd", True, False), ("train", True, True)} <= built, built
    plans = cudnorm.cache_info().size
    _check_rms_offset(torch.randn(_rows(n), n, device="cuda").to(dtype), w, 0.5)  # cuDNN takes only 1.0
    assert cudnorm.cache_info().size == plans, "an offset other than 1.0 built a cuDNN graph"
    x = torch.randn(64, n, device="cuda").to(dtype)
    with torch.no_grad():
        infer = cudnorm.rms_norm(x, (n,), w, 1e-6, weight_offset=1.0)
    torch.testing.assert_close(infer, cudnorm.rms_norm(x, (n,), w.requires_grad_(), 1e-6, weight_offset=1.0).detach())


def _check_fused_add(x, r, params, rms):
    n = x.shape[-1]
    if rms:
        fn = lambda x, r, w: torch.cat(cudnorm.rms_norm(x, (n,), w, 1e-6, residual=r), -1)  # noqa: E731
        base = lambda x, r, w: torch.cat((F.rms_norm(x + r, (n,), w.to(x.dtype), 1e-6), x + r), -1)  # noqa: E731
        want = lambda x, r, w: torch.cat((ref.rms_norm(x + r, w, 1e-6), x + r), -1)  # noqa: E731
        names = ("out", "dx", "dresidual", "dw")
    else:
        fn = lambda x, r, w, b: torch.cat(cudnorm.layer_norm(x, (n,), w, b, 1e-5, residual=r), -1)  # noqa: E731
        base = lambda x, r, w, b: torch.cat(  # noqa: E731
            (F.layer_norm(x + r, (n,), w.to(x.dtype), b.to(x.dtype), 1e-5), x + r), -1)
        want = lambda x, r, w, b: torch.cat((ref.layer_norm(x + r, w, b, 1e-5), x + r), -1)  # noqa: E731
        names = ("out", "dx", "dresidual", "dw", "db")
    before = cudnorm.cache_info().declined
    rows = ref.accuracy_report(fn, base, want, (x, r, *params), torch.randn(x.shape[0], 2 * n, device="cuda").to(x.dtype),
                               names, x.dtype)
    assert cudnorm.cache_info().declined == before, "cuDNN declined a configuration"
    assert all(row["ok"] for row in rows), rows


@pytest.mark.parametrize("n", [1024, 4096, 16384])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_fused_residual_add_on_cudnn(rms, dtype, n, fresh_cache):
    """``residual=``: forward (fused graph up to FUSED_FORWARD_MAX_COLS columns, PyTorch's add and
    the plain graph above) and backward within the 2x rule, on exact and row-chunked graphs."""
    from cudnorm import _cache, _fused_add
    fn_name = "rms_norm" if rms else "layer_norm"
    params = [(1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)]
    if not rms:
        params.append((0.1 * torch.randn(n, device="cuda")).to(dtype))
    m = _rows(n)
    _check_fused_add(torch.randn(m, n, device="cuda").to(dtype), torch.randn(m, n, device="cuda").to(dtype), params, rms)
    with cudnorm.config(exact_rows=1, exact_after=1):
        _check_fused_add(torch.randn(300, n, device="cuda").to(dtype), torch.randn(300, n, device="cuda").to(dtype),
                         params, rms)
    fused = {s.phase for s in _cache.plans.specs() if s.residual}
    assert fused == ({"train"} if n <= _fused_add.FUSED_FORWARD_MAX_COLS[fn_name] else set()), fused
    x, r = torch.randn(64, n, device="cuda").to(dtype), torch.randn(64, n, device="cuda").to(dtype)
    fn = getattr(cudnorm, fn_name)
    with torch.no_grad():
        y, h = fn(x, n, *params, residual=r)
    torch.testing.assert_close(h, x + r)
    x.requires_grad_()
    y_train, _ = fn(x, n, *params, residual=r)
    # the two phases may run different kernels at 64 rows (a row count first seen runs PyTorch's
    # fp32 fallback until the row policy gives it a graph): they agree to one rounding step
    step = torch.finfo(dtype).eps * y_train.detach().abs().amax().float()
    rtol = 1.3e-6 if dtype is torch.float32 else 0.0  # fp32: assert_close's default
    torch.testing.assert_close(y, y_train.detach(), rtol=rtol, atol=max(step.item(), 1e-5))


def test_no_grad_runs_inference_graph(fresh_cache):
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", requires_grad=True)
    with torch.no_grad():
        cudnorm.layer_norm(x, (1024,), w)
    with torch.inference_mode():
        cudnorm.rms_norm(x, (1024,), w)
    assert {(s.op, s.phase) for s in _cache.plans.specs()} == {("layer_norm", "infer"), ("rms_norm", "infer")}
    cudnorm.layer_norm(x, (1024,), w)
    assert ("layer_norm", "train") in {(s.op, s.phase) for s in _cache.plans.specs()}


def test_fp32_weight_forward_is_rounded_weight_forward():
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.01 * torch.randn(4096, device="cuda")
    b = 0.01 * torch.randn(4096, device="cuda")
    assert torch.equal(cudnorm.layer_norm(x, (4096,), w, b), cudnorm.layer_norm(x, (4096,), w.bfloat16(), b.bfloat16()))


@pytest.mark.parametrize("op, args", [
    ("layer_norm_fwd", lambda: (torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                                torch.randn(1024, device="cuda", requires_grad=True),
                                torch.randn(1024, device="cuda", requires_grad=True), 1e-5, True)),
    ("layer_norm_fwd", lambda: (torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16), None, None, 1e-5, False)),
    ("rms_norm_fwd", lambda: (torch.randn(64, 1024, device="cuda", dtype=torch.float16, requires_grad=True),
                              torch.randn(1024, device="cuda", dtype=torch.float16, requires_grad=True), 1e-6, True)),
])
def test_opcheck_cuda(op, args):
    torch.library.opcheck(getattr(torch.ops.cudnorm, op).default, args())


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(cudnorm.LayerNorm(1024), torch.nn.Linear(1024, 1024), cudnorm.RMSNorm(1024)).cuda()


def test_compile_fullgraph_matches_eager():
    model = _model()
    x = torch.randn(4, 64, 1024, device="cuda", requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want)


def test_compile_reduce_overhead_trains_with_cudnn_norms():
    """mode="reduce-overhead" replays CUDA graphs from one memory pool and refuses to record
    while a pool tensor that is no graph output lives; the warm-up allocates from that pool, so
    cudnorm's kept buffers (workspaces, stand-in weights) must come from outside it (a DiT
    step failed so on an H100). An unusual width makes every kept buffer new here. After an
    eager backward (a session that ran eagerly before it compiled) the AdaLN backward's plan,
    built inside the compiled backward, meets a heuristic mode with no engine; the frontend's
    reference cycle then kept the backward's outputs alive on the Python launch path (H100),
    until planning moved to cudnorm's worker thread."""
    from cudnorm import _runtime

    cudnorm.layer_norm(torch.randn(8, 64, device="cuda", requires_grad=True), (64,)).sum().backward()
    torch._dynamo.reset()
    _runtime.release_workspaces()
    d = 392
    norm, linear = cudnorm.LayerNorm(d, elementwise_affine=False).cuda(), torch.nn.Linear(d, d).cuda()

    def block(x, scale, shift):
        return linear(cudnorm.ada_layer_norm(norm(x), scale, shift, one_plus_scale=True))

    step = torch.compile(block, mode="reduce-overhead")
    with cudnorm.config(policy="cudnn"):
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            linear.zero_grad(set_to_none=True)  # a replay overwrites the last step's gradients
            x = torch.randn(4, 96, d, device="cuda", requires_grad=True)
            scale, shift = torch.randn(2, 4, d, device="cuda").unbind(0)
            out = step(x, scale, shift)
            out.square().mean().backward()
        torch.testing.assert_close(out, block(x, scale, shift))
    torch._dynamo.reset()


def test_cuda_graph_training_step_replays():
    model = _model()
    static_x = torch.randn(64, 1024, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: replays must reproduce eager exactly

    def step():
        opt.zero_grad(set_to_none=False)
        loss = model(static_x).square().mean()
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up: graphs are built and cached outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    for _ in range(3):
        new_x = torch.randn(64, 1024, device="cuda")
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        replay_loss = static_loss.item()
        replay_grads = [p.grad.clone() for p in model.parameters()]
        eager_loss = step().item()
        assert replay_loss == pytest.approx(eager_loss, rel=1e-6)
        for a, b in zip(replay_grads, (p.grad for p in model.parameters())):
            torch.testing.assert_close(a, b)


def test_cpu_tensors_fall_back_on_a_gpu_machine():
    x = torch.randn(8, 256)
    assert cudnorm.serving_path("layer_norm", x) == "torch (cpu tensor)"
    torch.testing.assert_close(cudnorm.layer_norm(x, (256,)), F.layer_norm(x, (256,)))


def test_autotune_picks_a_timed_plan(fresh_cache):
    cudnorm.config(autotune="on")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = cudnorm.layer_norm(x, (4096,), w)
    (spec,) = _cache.plans.specs()
    plan = _cache.plans.lookup(spec)
    assert spec.autotune and plan.candidates_timed >= 1
    torch.testing.assert_close(y.float(), ref.layer_norm(x, w, None).float(), atol=2e-2, rtol=2e-2)


def test_autotuning_times_alone_on_its_gpu(fresh_cache, monkeypatch):
    """While another process holds the GPU's timing lock, autotuning builds its candidates but
    times them only once that process let go (cudnorm._gpu_lock: plans tuned beside other
    processes' work were picked 1.3-2.1x slower)."""
    import subprocess
    import sys
    import time

    from cudnorm import _gpu_lock

    if _gpu_lock.fcntl is None:
        pytest.skip("no flock on this platform")
    code = ("import importlib.util, time\n"
            f"spec = importlib.util.spec_from_file_location('gpu_lock', {_gpu_lock.__file__!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"with m.held({_gpu_lock.device_key(0)!r}) as ok:\n"
            "    print('held' if ok else 'not held', flush=True); time.sleep(3.0)\n"
            "    print(time.time(), flush=True)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    taken = []
    held = _gpu_lock.held

    def recording(key, **kwargs):
        cm = held(key, **kwargs)

        class Recorded:
            def __enter__(self):
                ok = cm.__enter__()
                taken.append((key, ok, time.time()))
                return ok

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return Recorded()

    monkeypatch.setattr(_gpu_lock, "held", recording)
    cudnorm.config(autotune="on")
    x = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        cudnorm.layer_norm(x, (3072,))
    released = float(holder.stdout.readline())
    holder.wait(timeout=30)
    (spec,) = _cache.plans.specs()
    assert spec.autotune and _cache.plans.lookup(spec).candidates_timed >= 1
    assert [(key, ok) for key, ok, _ in taken] == [(_gpu_lock.device_key(0), True)]
    assert taken[0][2] >= released - 0.05, "timed while the other process held the GPU's lock"


def test_threads_get_their_own_handles():
    import threading

    from cudnorm import _runtime

    handles = {}

    def grab(name):
        handles[name] = _runtime.handle(0)

    threads = [threading.Thread(target=grab, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grab("main")
    assert len({id(h) for h in handles.values()}) == 3


def test_rounding_rows_are_reused_safely_across_calls_streams_and_threads():
    """fp32 weights are rounded into per-(thread, stream) rows that every forward rewrites:
    many calls with different weights queued back to back, on two streams and from two
    threads, must each see their own weights (compared with the bf16-weight call)."""
    import threading

    n = 4096
    x = torch.randn(256, n, device="cuda", dtype=torch.bfloat16)
    weights = [(1 + 0.1 * torch.randn(n, device="cuda"), 0.1 * torch.randn(n, device="cuda")) for _ in range(6)]
    expected = [cudnorm.layer_norm(x, (n,), w.bfloat16(), b.bfloat16()) for w, b in weights]
    expected_rms = [cudnorm.rms_norm(x, (n,), w.bfloat16()) for w, _ in weights]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    results = {}

    def run(tag, stream):
        with torch.cuda.stream(stream):
            results[tag] = [(cudnorm.layer_norm(x, (n,), w, b), cudnorm.rms_norm(x, (n,), w)) for w, b in weights]

    threads = [threading.Thread(target=run, args=(f"thread{i}", torch.cuda.current_stream())) for i in range(2)]
    for t in threads:
        t.start()
    run("main", torch.cuda.current_stream())
    run("side", side)
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for tag, outs in results.items():
        for (y, y_rms), want, want_rms in zip(outs, expected, expected_rms):
            assert torch.equal(y, want) and torch.equal(y_rms, want_rms), tag


def test_misaligned_contiguous_view_is_served_correctly():
    base = torch.randn(64 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(64, 1024)  # contiguous, address 2 bytes past a 16-byte boundary
    w, b = _weights(1024, "fp32", torch.bfloat16)
    want = cudnorm.layer_norm(x.clone(), (1024,), w, b)
    assert torch.equal(cudnorm.layer_norm(x, (1024,), w, b), want)
    _check_ln(x, w, b)


_OUTPUT_ROLES = {"y", "dx", "dscale", "dbias"}


@pytest.mark.parametrize("case", ["ln_train_autotuned", "ln_infer", "ln_bwd", "ln_bwd_bf16_weight", "rms_train",
                                  "rms_bwd", "rms_bwd_bf16_weight", "ada_train", "ada_bwd", "ln_train_dynamic",
                                  "ln_bwd_deserialized"])
def test_raw_execute_matches_public_execute(case):
    """The raw-pointer launcher (RawExecute) writes exactly what the public execute writes."""
    from cudnorm import _graphs
    from cudnorm._spec import NormSpec

    bf16, f32 = torch.bfloat16, torch.float32
    specs = {
        "ln_train_autotuned": NormSpec("layer_norm", "train", 2048, 1024, bf16, bf16, 0, autotune=True),
        "ln_infer": NormSpec("layer_norm", "infer", 1000, 768, torch.float16, f32, 0),
        "ln_bwd": NormSpec("layer_norm", "bwd", 2048, 1024, bf16, f32, 0),
        "ln_bwd_bf16_weight": NormSpec("layer_norm", "bwd", 2048, 1024, bf16, bf16, 0),
        "rms_bwd_bf16_weight": NormSpec("rms_norm", "bwd", 4096, 4096, bf16, bf16, 0),
        "ada_bwd": NormSpec("ada_layer_norm", "bwd", 2 * 256, 1152, bf16, bf16, 0, batch=2),
        "rms_train": NormSpec("rms_norm", "train", 4096, 4096, bf16, bf16, 0),
        "rms_bwd": NormSpec("rms_norm", "bwd", 4096, 4096, bf16, f32, 0),
        "ada_train": NormSpec("ada_layer_norm", "train", 4 * 256, 1152, bf16, bf16, 0, batch=4),
        "ln_train_dynamic": NormSpec("layer_norm", "train", 4096, 2048, bf16, bf16, 0, dynamic=True),
        "ln_bwd_deserialized": NormSpec("layer_norm", "bwd", 1024, 4096, bf16, f32, 0),
    }
    spec = specs[case]
    plan = _graphs.build_plan(spec)
    if case.endswith("deserialized"):
        plan = _graphs.deserialize_plan(spec, _graphs.serialize_plan(plan))
    assert plan.raw is not None, "frontend 1.32 should take the raw path for every norm graph"
    buffers = _graphs.dummy_buffers(spec)
    roles = _graphs.roles(spec)
    outputs = [i for i, r in enumerate(roles) if r in _OUTPUT_ROLES or (spec.phase == "train" and r in ("mean", "rstd"))]
    results = []
    public_only = dataclasses.replace(plan, raw=None)  # raw_execute=False: addresses in the public form
    for run in (lambda *b: plan.launch([t.data_ptr() for t in b]), plan.run, public_only.run,
                lambda *b: public_only.launch([t.data_ptr() for t in b])):
        for i in outputs:
            buffers[i].fill_(float("nan"))
        run(*buffers)
        torch.cuda.synchronize()
        results.append([buffers[i].clone() for i in outputs])
    for i, launched, raw, public, public_launched in zip(outputs, *results):
        assert not raw.isnan().any(), roles[i]
        assert torch.equal(launched, raw), f"{case}: {roles[i]} differs between launch by address and run"
        assert torch.equal(raw, public), f"{case}: {roles[i]} differs between raw and public execute"
        assert torch.equal(public_launched, public), f"{case}: {roles[i]}: public execute, addresses vs tensors"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "rms_norm_fp32_weight", "rms_norm_residual", "ada_layer_norm"])
def test_leaf_gradients_are_kept_not_copied(case, dtype):
    """AccumulateGrad keeps the gradient tensors cudnorm's backward returns as ``.grad`` (a
    hook sees the same storage) instead of copying them: a copy would be one more kernel and
    allocation per leaf and step. It copies when the backward holds another reference to a
    gradient or returns one tensor for two inputs."""
    n = 1024
    x = torch.randn(4, 256, n, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.float32 if case.endswith("fp32_weight") else dtype)
    b = 0.1 * torch.randn(n, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    scale, shift = 0.5 * torch.randn(4, n, device="cuda", dtype=dtype), 0.5 * torch.randn(4, n, device="cuda", dtype=dtype)
    calls = {"layer_norm": (lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b, 1e-5), [x, w, b]),
             "rms_norm": (lambda x, w: cudnorm.rms_norm(x, (n,), w, 1e-5), [x, w]),
             "rms_norm_fp32_weight": (lambda x, w: cudnorm.rms_norm(x, (n,), w, 1e-5), [x, w]),
             "rms_norm_residual": (lambda x, r, w: cudnorm.rms_norm(x, (n,), w, 1e-5, residual=r)[0], [x, r, w]),
             "ada_layer_norm": (lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=True),
                                [x, scale, shift])}
    fn, leaves = calls[case]
    leaves = [t.detach().requires_grad_() for t in leaves]
    seen = {}
    for i, t in enumerate(leaves):
        t.register_hook(lambda g, i=i: seen.__setitem__(i, g.data_ptr()))
    with cudnorm.config(policy="cudnn"):
        fn(*leaves).float().pow(2).sum().backward()
    assert [t.grad.data_ptr() for t in leaves] == [seen[i] for i in range(len(leaves))]
