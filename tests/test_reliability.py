"""Wrong arguments get a TypeError/ValueError naming the function and the argument; the plan
store and ``cudnorm cache`` report malformed entries, special files and bad settings in a
line instead of a traceback (each of these cases failed before its fix: a wrong exception
type, a traceback, a hang); extreme values give PyTorch's result or better; results repeat
bit for bit."""

import os

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _plan_store, cli
from cudnorm import reference as ref
from cudnorm._plan_store import PlanStore, encode_entry

from test_plan_store import fake_fingerprint, plan_, spec_  # noqa: F401 - the store test helpers

X = torch.randn(4, 8)


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


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf"])
def test_bad_store_size_is_named(monkeypatch, value):
    monkeypatch.setenv("CUDNORM_PLAN_STORE_MAX_MB", value)
    with pytest.raises(ValueError, match="CUDNORM_PLAN_STORE_MAX_MB"):
        _plan_store.max_bytes_from_env()


def _raw_entry(path, meta):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_entry(meta, b"blob"))


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    from cudnorm import _dispatch

    before = _dispatch._plan_store
    monkeypatch.setenv("CUDNORM_PLAN_STORE_DIR", str(tmp_path / "plans"))
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"cache": cli.SUBCOMMANDS["cache"]})
    yield tmp_path / "plans"
    _dispatch.set_plan_store(before)


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


@pytest.mark.parametrize("build", [lambda: cudnorm.AdaLayerNormZero(64, 1000),  # diffusers: num_embeddings
                                   lambda: cudnorm.AdaLayerNormContinuous(64, 32, False, 1e-6),  # diffusers' order
                                   lambda: cudnorm.AdaLayerNorm(64, 10)])
def test_ada_modules_refuse_positional_options(build):
    """diffusers' classes of these names order their arguments differently: a positional
    call must fail instead of building another module."""
    with pytest.raises(TypeError, match="positional"):
        build()


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
