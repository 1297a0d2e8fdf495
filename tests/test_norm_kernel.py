"""cudnorm's own LayerNorm/RMSNorm kernels (cudnorm._norm_kernel): their arithmetic under
Triton's interpreter on a CPU (skipped without Triton), the launch shapes, and on a GPU the
same checks at real sizes. Every check holds the kernel to the 2x rule (its error against fp64
at most twice PyTorch's own in the same dtype; fp32 to :data:`reference.ERROR_FLOOR`) and runs
with ``torch.empty`` / ``torch.empty_like`` filled with NaN, so an element the kernel does not
write (an output, a statistic, a partial row of the weight gradient) shows."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from cudnorm import _norm_kernel as nk
from cudnorm import reference as ref
import interpreted

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-5


@contextlib.contextmanager
def _poisoned_allocations():
    """``torch.empty`` and ``torch.empty_like`` return NaN-filled floating tensors meanwhile."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def _reference(x, w, b, rms):
    """fp64 ``y`` (bias added to RMSNorm too: the kernel takes one)."""
    if not rms:
        return ref.layer_norm(x, w, b, EPS)
    y = ref.rms_norm(x, w, EPS)
    return y if b is None else y + b.double()


def _torch(x, w, b, rms):
    """PyTorch's op in x's dtype (parameters cast to it): the baseline of the 2x rule."""
    w, b = (None if t is None else t.to(x.dtype) for t in (w, b))
    if not rms:
        return F.layer_norm(x, (x.shape[1],), w, b, EPS)
    y = F.rms_norm(x, (x.shape[1],), w, EPS)
    return y if b is None else y + b


def _check(rows, cols, dtype, wdtype, bdtype, rms, device="cpu", config=None):
    """Forward statistics and values, and through :func:`nk.norm` the output and every
    gradient, against fp64 under the 2x rule; asserts, naming the case."""
    case = f"{'rms' if rms else 'ln'} {rows}x{cols} {dtype} w={wdtype} b={bdtype} {config}"
    x = (2 * torch.randn(rows, cols, device=device) + 0.5).to(dtype)
    w = None if wdtype is None else (1 + 0.5 * torch.randn(cols, device=device)).to(wdtype)
    b = None if bdtype is None else (0.3 * torch.randn(cols, device=device)).to(bdtype)
    with _poisoned_allocations():
        y, stats = nk.forward(x, w, b, EPS, rms, training=True, config=config)
        y_eval, none = nk.forward(x, w, b, EPS, rms, training=False, config=config)
    # the statistics-storing variant is compiled apart: a multiply-add may round differently
    # (seen on an H100 at 4096x2240 and 190000x88 bf16), by at most one step of the dtype
    assert none is None, case
    step = torch.finfo(dtype).eps
    assert ((y.float() - y_eval.float()).abs() <= step * y.float().abs() + step * 1e-3).all(), case
    xd = x.double()
    mean = torch.zeros_like(xd[:, 0]) if rms else xd.mean(1)
    rstd = ((xd - mean[:, None]).square().mean(1) + EPS).rsqrt()
    assert stats.dtype == F32 and stats.shape == (1 if rms else 2, rows), case
    assert ref.rel_error(stats[-1], rstd) < 1e-6, case
    if not rms:
        assert ref.rel_error(stats[0], mean) < 1e-6, case

    def candidate(x, w, b):
        if config is None:
            return nk.norm(x, w, b, EPS, rms)
        y, stats = nk.forward(x, w, b, EPS, rms, training=True, config=config)
        return _Frozen.apply(x, w, b, y, stats, rms, config)

    with _poisoned_allocations():
        report = ref.accuracy_report(candidate, lambda x, w, b: _torch(x, w, b, rms),
                                     lambda x, w, b: _reference(x, w, b, rms),
                                     (x, w, b), torch.randn_like(x), ("y", "dx", "dweight", "dbias"), dtype)
    bad = [r for r in report if not r["ok"]]
    assert not bad, f"{case}: {bad}"


class _Frozen(torch.autograd.Function):
    """:func:`nk.norm` with a launch shape: the forward's results passed in, the backward
    through :func:`nk.backward` with the same ``config``."""

    @staticmethod
    def forward(ctx, x, w, b, y, stats, rms, config):
        ctx.save_for_backward(x, w, stats)
        ctx.rms, ctx.config, ctx.bias_dtype = rms, config, None if b is None else b.dtype
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        x, w, stats = ctx.saved_tensors
        dx, dw, db = nk.backward(dy, x, w, stats, ctx.rms, ctx.bias_dtype, config=ctx.config)
        return dx, dw, db, None, None, None, None


# (rows, cols, dtype, weight dtype, bias dtype, rms, config): every width both ways, each dtype,
# weights absent / of x's dtype / fp32, bias absent / present, row counts that leave a partial tile
_SMALL = nk.Config(block_m=4, num_warps=4, programs_per_sm=3)  # 3 programs over 10 tiles, the last partial
_CASES = [
    (37, 8, F32, F32, F32, False, None),
    (37, 8, BF16, None, None, True, _SMALL),
    (37, 88, BF16, BF16, BF16, False, _SMALL),
    (37, 88, F16, F32, None, True, None),
    (21, 96, F16, F16, F32, False, None),
    (21, 96, BF16, F32, None, True, _SMALL),
    (13, 256, BF16, F32, F32, False, None),
    (13, 256, F32, None, None, True, None),
    (9, 1000, F32, None, F32, False, _SMALL),
    (9, 1000, BF16, BF16, None, True, None),
    (6, 2240, BF16, BF16, BF16, False, None),
    (6, 2240, F16, F32, BF16, True, _SMALL),
]


def _check_finish(programs, cols, has_w, has_db):
    """The parameter gradients' finishing sum over ``programs`` partial columns (more than one of
    its tiles where ``programs`` > 1024): fp32 sums, rounded once to each parameter's dtype."""
    partial = torch.randn(2, cols, programs)
    dw = torch.empty(cols, dtype=BF16) if has_w else None
    db = torch.empty(cols, dtype=F32) if has_db else None
    block_p, block_c, grid = nk._finish_shape(programs, cols)
    assert block_p <= nk._FINISH_MAX_PARTIALS and grid * block_c >= cols
    placeholder = partial[0, 0]
    nk._triton_launch.launch(nk._kernels()[2], grid, (partial[0], partial[1], placeholder if dw is None else dw,
                                                       placeholder if db is None else db, programs),
                             {"COLS": cols, "BLOCK_C": block_c, "BLOCK_P": block_p, "HAS_W": has_w,
                              "HAS_DB": has_db, "num_warps": 4})
    want = partial.double().sum(2)
    if has_w:  # one bf16 rounding (Triton's interpreter truncates where a GPU rounds to nearest)
        assert ((dw.double() - want[0]).abs() <= 2.0**-7 * want[0].abs() + 1e-6).all(), (programs, cols)
    if has_db:
        assert (db.double() - want[1]).abs().max() < 1e-4, (programs, cols)


def _check_interpreted():
    """Runs in a child process started with ``TRITON_INTERPRET=1`` (Triton reads it when
    imported, so the test process, whose Triton may already run on a GPU, cannot switch)."""
    torch.manual_seed(0)
    for case in _CASES:
        *shape, config = case
        _check(*shape, config=config)
    for programs, cols, has_w, has_db in ((1, 8, True, True), (1500, 88, True, False), (2100, 5, False, True)):
        _check_finish(programs, cols, has_w, has_db)
    print("interpreted cases ok")


def test_interpreted_kernels_meet_the_2x_rule():
    """Every case of :data:`_CASES` under Triton's interpreter (about 8 s on 2 cores, most of it
    the child's imports: one child runs them all)."""
    interpreted.run("test_norm_kernel", "_check_interpreted")


def test_supports_widths_and_dtypes():
    assert nk.supports(88, BF16, None, None) and nk.supports(nk.MAX_COLS, F16, F32, F16)
    assert nk.supports(1, F32, F32, None)
    assert not nk.supports(nk.MAX_COLS + 1, BF16, None, None) and not nk.supports(0, BF16, None, None)
    assert not nk.supports(64, torch.float64, None, None)
    assert not nk.supports(64, BF16, F16, None) and not nk.supports(64, F16, None, BF16)


def test_available_is_whether_triton_imports():
    try:
        import triton  # noqa: F401
        has = True
    except ImportError:
        has = False
    assert nk.available() is has


@pytest.mark.parametrize("cols", [1, 8, 64, 88, 96, 128, 256, 1000, 1152, 1408, 2240, 4096, 8192, nk.MAX_COLS])
@pytest.mark.parametrize("rows", [1, 37, 1 << 20])
def test_config_shapes(cols, rows):
    """Power-of-two tiles no taller than the rows need; a backward grid small enough to be
    resident at once (its programs' warps within the per-SM budget)."""
    for backward in (False, True):
        c = nk._config(cols, BF16, rows, backward)
        assert c.block_m & (c.block_m - 1) == 0 and c.block_m <= max(1, nk._pow2(rows))
        assert 1 <= c.num_warps <= 32 and c.num_warps & (c.num_warps - 1) == 0
        assert c.block_m * nk._pow2(cols) <= max(nk.MAX_COLS, 2048)
        if backward and c.stages:  # pipelined: its grid what the SMs hold of the compiled kernel
            assert c.programs_per_sm == nk.RESIDENT
        elif backward:
            assert c.programs_per_sm >= 1 and c.programs_per_sm * c.num_warps <= 32
        else:
            assert c.programs_per_sm == 0 and c.stages == 0


def test_backward_pipelines_narrow_padded_half_precision_rows():
    """The measured rule: a backward's loop, and LayerNorm's unmodulated training forward up to
    width 208, are pipelined (their grid sized by the compiled kernel) where a narrow
    half-precision row pads its tile; powers of two, fp32, wider rows and other forwards keep the
    plain shape."""
    for cols in (72, 88, 96, 136, 192, 200, 248):
        for dtype in (BF16, F16):
            c = nk._config(cols, dtype, 1 << 20, backward=True)
            assert (c.stages, c.programs_per_sm, c.num_warps) == (3, nk.RESIDENT, 4), (cols, dtype)
            assert c.block_m * nk._pow2(cols) == 2048
    assert nk._config(88, BF16, 5, backward=True).block_m == 8  # no taller than the rows need
    for cols, dtype in ((64, BF16), (128, F16), (256, BF16), (96, F32), (320, BF16), (1152, BF16)):
        assert nk._config(cols, dtype, 1 << 20, backward=True).stages == 0, (cols, dtype)
    assert nk._config(96, BF16, 1 << 20).stages == 0  # RMSNorm's or a modulated forward
    for cols in (72, 96, 136, 208):
        assert nk._config(cols, F16, 1 << 20, layer_norm_forward=True) == nk._config(cols, F16, 1 << 20, backward=True)
    for cols, dtype in ((128, BF16), (96, F32), (224, F16), (248, BF16)):
        assert nk._config(cols, dtype, 1 << 20, layer_norm_forward=True).programs_per_sm == 0, (cols, dtype)
    assert nk.tile_shape(96, 1 << 20, backward=True) == (8, 4)  # the plain tile: 1024 elements


class _Compiled:
    """What :func:`nk._resident` reads of a loaded Triton kernel."""

    def __init__(self, registers, warps, shared):
        self.n_regs = registers
        self.metadata = type("Metadata", (), {"num_warps": warps, "shared": shared})


@pytest.mark.parametrize("registers, warps, shared, want", [
    (64, 4, 0, 8),  # the plain loop: 32 warps fill the register file
    (80, 4, 16384, 6),  # the pipelined backward as an H200 compiled it (bf16, width 96-192)
    (107, 4, 16384, 4),  # registers are allocated 8 at a time: 112
    (92, 4, 16384, 5),
    (32, 4, 49152, 4),  # shared memory bounds it
    (16, 1, 0, 32),  # the block slots
    (255, 32, 0, 1),  # never fewer than one
])
def test_resident_programs_per_sm(monkeypatch, registers, warps, shared, want):
    monkeypatch.setattr(nk, "_sm_limits", lambda index: (65536, 2048, 233472))
    assert nk._resident(_Compiled(registers, warps, shared), 0) == want


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols, dtype, wdtype, bdtype, rms", [
    (190000, 88, BF16, BF16, BF16, False),  # a per-head norm: rows = batch * heads * tokens
    (190000, 88, BF16, BF16, None, True),
    (1 << 18, 128, F16, F32, F32, False),
    (50000, 96, BF16, None, None, True),
    (32768, 4096, BF16, BF16, BF16, False),
    (32768, 4096, BF16, F32, None, True),
    (4096, 2240, BF16, BF16, BF16, False),
    (8192, 1152, F32, F32, F32, True),
    (1000, nk.MAX_COLS, BF16, BF16, None, False),
    (1 << 20, 200, F16, F16, F16, False),  # the pipelined backward (a padded narrow row)
    (37, 136, BF16, BF16, BF16, False),  # ... over fewer rows than its grid
])
def test_gpu_kernels_meet_the_2x_rule(rows, cols, dtype, wdtype, bdtype, rms):
    _check(rows, cols, dtype, wdtype, bdtype, rms, device="cuda")


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    x = torch.randn(190000, 88, device="cuda", dtype=BF16)
    w = torch.randn(88, device="cuda", dtype=BF16)
    _, stats = nk.forward(x, w, None, EPS, False, training=True)
    dy = torch.randn_like(x)
    first, second = (nk.backward(dy, x, w, stats, False, BF16) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
