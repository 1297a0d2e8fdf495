"""Wrong arguments get a TypeError/ValueError naming the function and the argument; the plan
store and ``cudnorm cache`` report malformed entries, special files and bad settings in a
line instead of a traceback (each of these cases failed before its fix: a wrong exception
type, a traceback, a hang); extreme values give PyTorch's result or better; results repeat
bit for bit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _plan_store, cli
from cudnorm import reference as ref
from cudnorm._plan_store import PlanStore, encode_entry

from test_plan_store import fake_fingerprint, plan_, spec_  # noqa: F401 - the store test helpers

X = torch.randn(4, 8)
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("call, error, words", [
    (lambda: cudnorm.layer_norm(X, (8,), [1.0] * 8), TypeError, ("cudnorm.layer_norm", "'weight'")),
    (lambda: cudnorm.layer_norm(X, (8,), None, 1.0), TypeError, ("cudnorm.layer_norm", "'bias'")),
    (lambda: cudnorm.layer_norm(X, (8.0,)), TypeError, ("cudnorm.layer_norm", "'normalized_shape'")),
    (lambda: cudnorm.rms_norm(X, (8,), [1.0] * 8), TypeError, ("cudnorm.rms_norm", "'weight'")),
    (lambda: cudnorm.rms_norm(X, "8"), TypeError, ("cudnorm.rms_norm", "'normalized_shape'")),
    (lambda: cudnorm.serving_path("layer_norm", [1, 2]), TypeError, ("cudnorm.serving_path", "'input'")),
    (lambda: cudnorm.warmup(None), TypeError, ("cudnorm.warmup", "'source'")),
    (lambda: cudnorm.warmup(42), TypeError, ("cudnorm.warmup", "'source'")),
    (lambda: cudnorm.warmup("llama-3-8b", dtype=torch.float64), ValueError, ("cudnorm.warmup", "'dtype'")),
    (lambda: cudnorm.warmup("llama-3-8b", dtype=[1]), TypeError, ("cudnorm.warmup", "'dtype'")),
])
def test_wrong_arguments_name_function_and_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert all(w in str(info.value) for w in words), str(info.value)


def test_warmup_takes_a_single_spec():
    rows = cudnorm.warmup(spec_(), device=0, progress=False)
    assert len(rows) == 1  # cuDNN unavailable on a CPU machine: reported as skipped


def test_invalid_argument_under_fullgraph_compile_carries_cudnorms_message():
    """Dynamo wraps an exception raised while tracing into ``Unsupported`` under
    ``fullgraph=True`` (documented in docs/troubleshooting.md); the message keeps cudnorm's."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: cudnorm.layer_norm(x, (8,), None, None, -1.0), fullgraph=True)
    with pytest.raises(Exception, match=r"cudnorm\.layer_norm: argument 'eps'"):
        fn(X)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"cudnorm\.layer_norm: argument 'eps'"):  # without fullgraph: as eager
        torch.compile(lambda x: cudnorm.layer_norm(x, (8,), None, None, -1.0))(X)
    torch._dynamo.reset()


# issue 21's cases: (variable, value, what it must be, the default used), in four environments
BAD_ENVIRONMENTS = [
    [("CUDNORM_PLAN_STORE_MAX_MB", "abc", "a finite number >= 0", "512"),
     ("CUDNORM_CACHE_SIZE", "abc", "an integer >= 1", "512")],
    [("CUDNORM_PLAN_STORE_MAX_MB", "-1", "a finite number >= 0", "512"),
     ("CUDNORM_CACHE_SIZE", "0", "an integer >= 1", "512")],
    [("CUDNORM_PLAN_STORE_MAX_MB", "nan", "a finite number >= 0", "512"),
     ("CUDNORM_AUTOTUNE", "maybe", "auto, on (1, true, yes, always) or off (0, false, no, never)", "'auto'")],
    [("CUDNORM_PLAN_STORE_MAX_MB", "inf", "a finite number >= 0", "512"),
     ("CUDNORM_EXACT_ROWS", "-1", "an integer >= 0", "1")],
]


@pytest.mark.slow  # a matrix of subprocesses
def test_bad_environment_values_warn_and_use_the_defaults():
    """A malformed variable never breaks ``import cudnorm`` or a CLI command: one warning per
    variable names it, the value, what it must be and the default used instead. (The
    interpreters run at once: each pays torch's import.)"""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    runs = []
    for cases in BAD_ENVIRONMENTS:
        env = {**os.environ, "PYTHONPATH": path, **{variable: value for variable, value, _, _ in cases}}
        for command in (["-c", "import cudnorm"], ["-m", "cudnorm.cli", "info"]):
            runs.append((cases, command, subprocess.Popen([sys.executable, *command], env=env, text=True,
                                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    for cases, command, proc in runs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "Traceback" not in err, (command, err)
        for variable, value, allowed, default in cases:
            warning = f"cudnorm: ignoring {variable}={value!r}: it must be {allowed}; using the default, {default}"
            assert err.count(warning) == 1, (command, warning, err)


def _raw_entry(path, meta):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_entry(meta, b"blob"))


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    cudnorm.config(plan_store_dir=tmp_path / "plans")  # stays disabled (conftest): `cudnorm cache` still finds it
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"cache": cli.SUBCOMMANDS["cache"]})
    return tmp_path / "plans"


def test_cache_info_reports_malformed_and_special_entries(store_dir, capsys):
    sub = store_dir / "fp"
    good_spec = {"op": "layer_norm", "phase": "train", "rows": 8, "cols": 8, "x_dtype": "bf16", "scale_dtype": "bf16"}
    for i, meta in enumerate([{"spec": "layer_norm", "fingerprint": {}}, {"fingerprint": {}}, {"spec": None,
                              "fingerprint": {}}, {"spec": good_spec, "fingerprint": "H100"},
                              {"spec": {"op": "layer_norm"}, "fingerprint": {}}]):
        _raw_entry(sub / f"bad{i}.plan", meta)
    loop = sub / "loop.plan"
    loop.symlink_to(loop)
    os.mkfifo(sub / "fifo.plan")
    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert out.count("unreadable") == 6  # 5 malformed headers and the FIFO; the symlink loop is skipped
    assert "not a regular file" in out
    assert cli.main(["cache", "info", "--json"]) == 0


def test_load_skips_a_fifo_named_like_an_entry(tmp_path):
    store = PlanStore(tmp_path / "plans", 1 << 30, fingerprint=fake_fingerprint)
    path = store.entry_path(spec_())
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert store.load(spec_()) is None  # returns instead of blocking on the read


def test_cache_clear_that_cannot_remove_fails_loudly(store_dir, monkeypatch, capsys):
    _raw_entry(store_dir / "fp" / "a.plan", {"spec": {}, "fingerprint": {}})
    monkeypatch.setattr(_plan_store, "_unlink", lambda path: 0)  # what a read-only directory does
    assert cli.main(["cache", "clear"]) == 1
    err = capsys.readouterr().err
    assert "could not remove 1 of 1" in err and "read-only" in err


def test_meta_tensors_give_shapes_without_a_device():
    """Meta inputs (shape inference, as ``torch.device("meta")`` model construction uses) run
    PyTorch's ops and give the output's shape and dtype."""
    x = torch.empty(4, 16, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    for y in (cudnorm.layer_norm(x, (64,), w, w), cudnorm.rms_norm(x, (64,), w),
              cudnorm.ada_layer_norm(x, torch.empty(4, 64, device="meta", dtype=torch.bfloat16),
                                     torch.empty(4, 64, device="meta", dtype=torch.bfloat16))):
        assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype


def test_cli_output_into_a_closed_pipe_has_no_traceback():
    """``cudnorm info | head -1``: the reader leaves before the command has written; the
    command stops quietly with the shell's broken-pipe status instead of a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "cudnorm.cli", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "CUDNORM_PLAN_STORE": "0"})
    proc.stdout.close()  # nobody reads: the first write fails with EPIPE
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()


def _extreme_rows(dtype, device, big):
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    x[0] *= big  # sums of squares overflow the dtype
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    return x  # row 3 stays ordinary


def check_extreme_values(device):
    """PyTorch's result or better, row by row: where PyTorch's row is finite, cudnorm's is
    finite and meets the error rule against fp64; a NaN input row stays NaN."""
    for dtype, big in ((torch.float32, 1e19), (torch.float16, 3e3), (torch.bfloat16, 1e19)):
        x = _extreme_rows(dtype, device, big)
        for mine, theirs, exact in (
                (lambda x: cudnorm.layer_norm(x, (256,)), lambda x: F.layer_norm(x, (256,)),
                 lambda x: ref.layer_norm(x)),
                (lambda x: cudnorm.rms_norm(x, (256,), None, 1e-6), lambda x: F.rms_norm(x, (256,), None, 1e-6),
                 lambda x: ref.rms_norm(x, None, 1e-6))):
            got, want, true = mine(x), theirs(x), exact(x)
            assert torch.isnan(got[1]).any(), dtype  # NaN in, NaN out
            for row in (0, 2, 3):
                if torch.isfinite(want[row]).all():
                    assert torch.isfinite(got[row]).all(), (dtype, row)
                    bound = ref.error_bound(ref.rel_error(want[row], true[row]), dtype)
                    assert ref.rel_error(got[row], true[row]) <= bound, (dtype, row)


def test_extreme_values_cpu():
    check_extreme_values("cpu")


@pytest.mark.gpu
def test_extreme_values_gpu():
    check_extreme_values("cuda")


def test_run_to_run_bitwise_determinism():
    x = torch.randn(64, 512, requires_grad=True)
    w = torch.randn(512, requires_grad=True)
    results = []
    for _ in range(2):
        x.grad = w.grad = None
        y = cudnorm.layer_norm(x, (512,), w, w) + cudnorm.rms_norm(x, (512,), w, 1e-6)
        y.square().sum().backward()
        results.append((y.detach().clone(), x.grad.clone(), w.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_ada_promotes_half_modulation_of_fp32_input_and_casts_conditioning():
    """As diffusers does: an fp32 input with bf16 scale/shift computes in fp32 (gradients in
    the parameters' dtype); a bf16 module takes fp32 conditioning."""
    x = torch.randn(2, 5, 16)
    scale = torch.randn(2, 16, dtype=torch.bfloat16, requires_grad=True)
    shift = torch.randn(2, 16, dtype=torch.bfloat16)
    y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
    want = F.layer_norm(x, (16,), eps=1e-6) * (1 + scale.float()[:, None]) + shift.float()[:, None]
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want)
    y.sum().backward()
    assert scale.grad.dtype == torch.bfloat16
    module = cudnorm.AdaLayerNormZero(16, cond_dim=8).to(torch.bfloat16)
    assert module(x.to(torch.bfloat16), torch.randn(2, 8))[0].dtype == torch.bfloat16
    continuous = cudnorm.AdaLayerNormContinuous(16, cond_dim=8).to(torch.bfloat16)
    assert continuous(x.to(torch.bfloat16), torch.randn(2, 8)).dtype == torch.bfloat16


def check_float64(device):
    """float64 (references, ``gradcheck``, ``model.double()``) is served by PyTorch's own ops at
    every policy: the same values and gradients as PyTorch's, bit for bit, through the
    functions and the modules; an fp32 weight on a float64 input is refused as PyTorch does."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 32, generator=g, dtype=torch.float64).to(device).requires_grad_()
    w, b = (torch.randn(32, generator=g, dtype=torch.float64).to(device).requires_grad_() for _ in range(2))
    s, t = (torch.randn(3, 32, generator=g, dtype=torch.float64).to(device).requires_grad_() for _ in range(2))
    pairs = [(lambda: cudnorm.layer_norm(x, (32,), w, b), lambda: F.layer_norm(x, (32,), w, b)),
             (lambda: cudnorm.rms_norm(x, (32,), w, 1e-6), lambda: F.rms_norm(x, (32,), w, 1e-6)),
             (lambda: cudnorm.ada_layer_norm(x, s, t, one_plus_scale=True),
              lambda: F.layer_norm(x, (32,), eps=1e-6) * (1 + s[:, None]) + t[:, None])]
    for mine, theirs in pairs:
        got, want = mine(), theirs()
        assert got.dtype == torch.float64 and torch.equal(got, want)
        dy = torch.randn_like(got)
        for a, e in zip(torch.autograd.grad(got, (x, w, b, s, t), dy, allow_unused=True),
                        torch.autograd.grad(want, (x, w, b, s, t), dy, allow_unused=True)):
            assert (a is None and e is None) or torch.equal(a, e)
    assert cudnorm.serving_path("layer_norm", x).startswith("torch (")
    module = cudnorm.LayerNorm(32).to(device, torch.float64)
    torch.testing.assert_close(module(x), F.layer_norm(x, (32,), module.weight, module.bias), rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda x: cudnorm.rms_norm(x, (32,), w, 1e-6), (x[:1, :2],))
    with pytest.raises(TypeError, match=r"cudnorm.layer_norm: argument 'weight' has dtype torch.float32"):
        cudnorm.layer_norm(x, (32,), w.float())


def test_float64_is_served_by_pytorch_cpu():
    check_float64("cpu")


@pytest.mark.gpu
def test_float64_is_served_by_pytorch_gpu():
    check_float64("cuda")
