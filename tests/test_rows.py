"""Variable row counts (cudnorm._rows): decomposition, policy, and chunked execution.

On the CPU, chunk plans are replaced by fake plans that compute the real LayerNorm/RMSNorm
math (fp64) on the buffers they are handed and check the pointer alignment cuDNN needs, so
offsets, the overlapping remainder, its zeroed dy and the dW/dB sums are checked against
the same math on the whole tensor. GPU tests run the public API with chunking forced.
"""

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _cache, _graphs, _rows, _runtime
from cudnorm import reference as ref
from cudnorm._spec import NormSpec

SMALL_CHUNKS = {"train": (32, 8, 4), "infer": (32, 8, 4), "bwd": (32, 8)}


class FakePlan:
    """Stands in for a cuDNN plan of ``spec``: same buffer contract, reference math."""

    def __init__(self, spec):
        self.spec = spec
        self.launches = []  # the dy each backward launch saw (cloned)

    def run(self, *buffers):
        spec = self.spec
        named = dict(zip(_graphs.roles(spec), buffers, strict=True))
        for role, buf in named.items():
            if role != "eps":  # cuDNN assumes 16-byte aligned pointers
                assert buf.data_ptr() % 16 == 0, (role, buf.data_ptr())
        x = named["x"]
        assert x.shape == (spec.rows, spec.cols) and x.stride() == (spec.x_row_stride, 1)
        for role in ("y", "dy", "dx"):
            if role in named:
                assert named[role].shape == (spec.rows, spec.cols) and named[role].is_contiguous()
        xf = x.double()
        w = named["scale"].double()
        if spec.phase == "bwd":
            self.launches.append(named["dy"].clone())
            self._backward(named, xf, w)
        else:
            self._forward(named, xf, w, named["eps"].item())

    def _forward(self, named, xf, w, eps):
        if self.spec.op == "layer_norm":
            mean = xf.mean(1)
            rstd = ((xf - mean[:, None]).square().mean(1) + eps).rsqrt()
            y = (xf - mean[:, None]) * rstd[:, None] * w + named["bias"].double()
        else:
            mean, rstd = None, (xf.square().mean(1) + eps).rsqrt()
            y = xf * rstd[:, None] * w
        named["y"].copy_(y)
        if self.spec.phase == "train":
            named["rstd"].copy_(rstd)
            if mean is not None:
                named["mean"].copy_(mean)

    def _backward(self, named, xf, w):
        dy, rstd = named["dy"].double(), named["rstd"].double()[:, None]
        layer = self.spec.op == "layer_norm"
        xhat = (xf - named["mean"].double()[:, None]) * rstd if layer else xf * rstd
        g = dy * w
        inner = g - xhat * (g * xhat).mean(1, keepdim=True)
        named["dx"].copy_(rstd * (inner - g.mean(1, keepdim=True) if layer else inner))
        named["dscale"].copy_((dy * xhat).sum(0))
        if layer:
            named["dbias"].copy_(dy.sum(0))


class FakeAddressPlan(FakePlan):
    """A :class:`FakePlan` launched by address (the path ``ChunkedPlan`` takes when every
    chunk plan has a raw launcher): rebuilds CPU tensors at the addresses it is handed, so
    the offset arithmetic, alignment and temporaries are checked by the same math."""

    raw = True

    def launch(self, pointers):
        spec = self.spec
        tensors = []
        for (role, (shape, dtype)), address in zip(_graphs.buffer_shapes(spec).items(), pointers, strict=True):
            stride = spec.x_row_stride if role == "x" else None
            tensors.append(_tensor_at(address, shape, dtype, stride))
        self.run(*tensors)


def _tensor_at(address, shape, dtype, row_stride=None):
    """A CPU tensor over the memory at ``address`` (``row_stride`` for padded 2-D rows)."""
    import ctypes
    import math

    numel = math.prod(shape) if row_stride is None else (shape[0] - 1) * row_stride + shape[1]
    memory = (ctypes.c_char * (numel * dtype.itemsize)).from_address(address)
    flat = torch.frombuffer(memory, dtype=dtype, count=numel)
    return flat.view(shape) if row_stride is None else flat.as_strided(shape, (row_stride, 1))


def _buffers(spec, seed=0):
    """Random inputs and empty outputs for ``spec`` (CPU), in role order."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for role, (shape, dtype) in _graphs.buffer_shapes(spec).items():
        if role == "eps":
            out.append(_graphs.host_scalar(1e-5, spec))
        elif role == "rstd":
            out.append(torch.rand(shape, generator=gen).add_(0.5))
        elif role in ("y", "dx", "dscale", "dbias") or (role == "mean" and spec.phase != "bwd"):
            out.append(torch.full(shape, float("nan"), dtype=dtype))
        else:
            out.append(torch.randn(shape, generator=gen).to(dtype))
    if spec.phase != "bwd" and "rstd" in _graphs.roles(spec):  # forward writes rstd
        out[_graphs.roles(spec).index("rstd")].fill_(float("nan"))
    return out


def _spec(op, phase, rows, cols=16, dtype=torch.float32):
    return NormSpec(op, phase, rows, cols, dtype, torch.float32 if phase == "bwd" else dtype, 0)


@pytest.mark.parametrize("any_size_overlap", [False, True])
@pytest.mark.parametrize("rows", [4, 5, 7, 8, 11, 17, 20, 31, 32, 33, 45, 64, 71, 100])
def test_decompose_covers_rows_once_except_documented_overlap(rows, any_size_overlap):
    sizes = (32, 8, 4)
    chunks, overlap = _rows.decompose(rows, sizes, any_size_overlap=any_size_overlap)
    covered = torch.zeros(rows, dtype=torch.int64)
    for start, size in chunks:
        # no chunk may start before row 0 or end past the last row: its launch would touch
        # memory outside the caller's buffers (17 and 20 rows once got a 32-row chunk at -15/-12)
        assert size in sizes and 0 <= start and start + size <= rows, (start, size)
        covered[start:start + size] += 1
    if overlap:
        start, size = chunks[0]  # the remainder comes first and ends at the last row
        assert start + size == rows and (any_size_overlap or size == min(sizes))
        assert covered[start:start + overlap].eq(2).all()
        covered[start:start + overlap] -= 1
    assert covered.eq(1).all()
    assert all(start % 4 == 0 for start, _ in chunks[1 if overlap else 0:])  # fp32 stats stay 16-byte aligned


def test_decompose_rejects_rows_below_smallest_chunk():
    assert _rows.decompose(3, (32, 8, 4)) is None
    assert _rows.decompose(4, (32, 8, 4)) == ([(0, 4)], 0)
    assert _rows.decompose(70, (32, 8)) == ([(62, 8), (0, 32), (32, 32)], 2)


def _run_chunked(spec, buffers, sizes, fake=FakePlan, any_size_overlap=False):
    chunks, overlap = _rows.decompose(spec.rows, sizes, any_size_overlap=any_size_overlap)
    plans = {size: fake(spec._replace(rows=size)) for _, size in chunks}
    _rows.ChunkedPlan(spec, chunks, overlap, plans).run(*buffers)
    return chunks, overlap, plans


@pytest.mark.parametrize("fake", [FakePlan, FakeAddressPlan], ids=["views", "addresses"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("phase", ["train", "infer", "bwd"])
@pytest.mark.parametrize("rows", [4, 9, 37, 70, 100])
def test_chunked_matches_whole_tensor(op, phase, rows, fake):
    sizes = SMALL_CHUNKS[phase]
    spec = _spec(op, phase, rows)
    if rows < min(sizes):
        pytest.skip("served by PyTorch")
    expected = _buffers(spec)
    FakePlan(spec).run(*expected)
    got = _buffers(spec)
    _run_chunked(spec, got, sizes, fake)
    for role, want, have in zip(_graphs.roles(spec), expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-6, msg=f"{op} {phase} rows={rows}: {role}")


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_backward_remainder_sees_zero_dy_on_overlapped_rows(op):
    spec = _spec(op, "bwd", 70)
    buffers = _buffers(spec)
    chunks, overlap, plans = _run_chunked(spec, buffers, (32, 8))
    assert overlap == 2 and chunks[0] == (62, 8)
    dy = dict(zip(_graphs.roles(spec), buffers))["dy"]
    remainder_dy = plans[8].launches[0]
    assert remainder_dy[:overlap].eq(0).all()
    torch.testing.assert_close(remainder_dy[overlap:], dy[64:], rtol=0, atol=0)


@pytest.mark.parametrize("fake", [FakePlan, FakeAddressPlan], ids=["views", "addresses"])
@pytest.mark.parametrize("phase", ["train", "bwd"])
def test_bf16_padded_rows_and_misaligned_remainder_stats(phase, fake):
    # x rows padded to 24 elements (48 bytes); remainder starts at row 33 (stats offset 132 bytes)
    base = torch.randn(37, 24).to(torch.bfloat16)
    scale_dtype = torch.float32 if phase == "bwd" else torch.bfloat16
    spec = NormSpec("layer_norm", phase, 37, 16, torch.bfloat16, scale_dtype, 0, x_row_stride=24)
    expected, got = _buffers(spec), _buffers(spec)
    expected[0] = got[0] = base[:, :16]
    FakePlan(spec).run(*expected)
    _run_chunked(spec, got, (32, 8, 4) if phase == "train" else (32, 4), fake)
    for role, want, have in zip(_graphs.roles(spec), expected, got, strict=True):
        exact = phase == "train"  # forward: bit-identical; backward dW/dB: fp32 sums of partials
        torch.testing.assert_close(have, want, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6, msg=role)


# -- policy --------------------------------------------------------------------------------

@pytest.fixture
def fake_builds(monkeypatch, fresh_cache):
    """``_cache.get_plan`` replaced by fake plans; records the specs asked for."""
    asked, declined = [], set()

    def get_plan(spec):
        asked.append(spec)
        return None if spec in declined else FakePlan(spec)

    monkeypatch.setattr(_cache, "get_plan", get_plan)
    monkeypatch.setattr(_rows, "CHUNK_ROWS", SMALL_CHUNKS)
    _rows.reset()
    yield asked, declined
    _rows.reset()


def test_first_exact_rows_get_exact_graphs_then_chunks(fake_builds):
    asked, _ = fake_builds
    cudnorm.config(exact_rows=2)
    first, second, third = (_spec("layer_norm", "train", m) for m in (40, 50, 70))
    assert _rows.plan_or_chunks(first).spec == first
    assert _rows.plan_or_chunks(second).spec == second
    assert _rows.plan_or_chunks(first).spec == first  # an admitted count stays exact
    chunked = _rows.plan_or_chunks(third)
    assert isinstance(chunked, _rows.ChunkedPlan)
    # forward: the 6 rows left after 64 fill an 8-row chunk at least half, so one overlapping 8
    assert chunked.chunks == [(62, 8), (0, 32), (32, 32)] and chunked.overlap == 2
    assert asked[-2:] in ([_rows.chunk_spec(third, 32), _rows.chunk_spec(third, 8)],
                          [_rows.chunk_spec(third, 8), _rows.chunk_spec(third, 32)])
    assert all(s.dynamic and s.rows in (8, 32) for s in asked[-2:])
    # another phase is another family: its first count is exact again, and bwd chunks are static
    bwd = _spec("layer_norm", "bwd", 70)
    assert _rows.plan_or_chunks(bwd).spec == bwd
    _rows.plan_or_chunks(bwd._replace(rows=50))
    _rows.plan_or_chunks(bwd._replace(rows=90))
    assert not asked[-1].dynamic and asked[-1].rows in (8, 32) and asked[-1].phase == "bwd"


def test_count_gets_exact_graphs_after_exact_after_calls(fake_builds):
    asked, _ = fake_builds
    cudnorm.config(exact_rows=1, exact_after=3)
    spec, other = _spec("layer_norm", "bwd", 70), _spec("layer_norm", "bwd", 50)
    chunked = _rows.plan_or_chunks(spec)
    assert isinstance(chunked, _rows.ChunkedPlan) and _rows.plan_or_chunks(spec) is chunked
    assert _rows.plan_or_chunks(spec).spec == spec and asked[-1] == spec  # third call: promoted
    _cache.plans.put(spec, FakePlan(spec))  # (the fake get_plan does not cache)
    assert _rows.plan_or_chunks(spec).spec == spec
    for _ in range(5):  # the family has its one exact count: another count stays chunked
        assert isinstance(_rows.plan_or_chunks(other), _rows.ChunkedPlan)
    assert other not in asked


def test_decompose_overlaps_with_any_size_only_when_asked():
    assert _rows.decompose(70, (32, 8, 4)) == ([(66, 4), (0, 32), (32, 32), (64, 4)], 2)
    assert _rows.decompose(70, (32, 8, 4), any_size_overlap=True) == ([(62, 8), (0, 32), (32, 32)], 2)
    # 20 rows left after 32 fill a 32-row chunk more than half: one overlapping 32 instead of 8+8+4
    assert _rows.decompose(52, (32, 8, 4), any_size_overlap=True) == ([(20, 32), (0, 32)], 12)
    assert _rows.decompose(48, (32, 8, 4), any_size_overlap=True) == ([(16, 32), (0, 32)], 16)  # exactly half
    assert _rows.decompose(44, (32, 8, 4), any_size_overlap=True) == ([(36, 8), (0, 32), (32, 8)], 4)


def test_zero_exact_rows_chunks_at_once_and_small_rows_fall_back(fake_builds):
    cudnorm.config(exact_rows=0)
    assert isinstance(_rows.plan_or_chunks(_spec("rms_norm", "infer", 4)), _rows.ChunkedPlan)
    before = cudnorm.cache_info().small_rows_fallbacks
    assert _rows.plan_or_chunks(_spec("rms_norm", "bwd", 7)) is None  # below the 8-row chunk
    assert cudnorm.cache_info().small_rows_fallbacks == before + 1


def test_unchunkable_and_declined_chunks_use_the_exact_graph(fake_builds):
    asked, declined = fake_builds
    cudnorm.config(exact_rows=0)
    odd = _spec("layer_norm", "train", 40, cols=12, dtype=torch.bfloat16)  # 24-byte rows
    assert not _rows.chunkable(odd) and _rows.plan_or_chunks(odd).spec == odd
    spec = _spec("layer_norm", "train", 40)
    declined.add(_rows.chunk_spec(spec, 8))
    assert _rows.plan_or_chunks(spec).spec == spec
    assert asked[-1] == spec


def test_cached_exact_plan_is_returned_without_policy(fake_builds):
    asked, _ = fake_builds
    cudnorm.config(exact_rows=0)
    spec = _spec("layer_norm", "bwd", 40)
    plan = FakePlan(spec)
    _cache.plans.put(spec, plan)
    assert _rows.plan_or_chunks(spec) is plan and asked == []
    _cache.plans.put(spec, _cache.DECLINED)
    assert _rows.plan_or_chunks(spec) is None and asked == []


# -- through the public API, with fake chunk plans on the CPU ------------------------------

@pytest.fixture
def cpu_as_cudnn(monkeypatch, fake_builds):
    """Route CPU tensors to the cuDNN code path, every row count chunked."""
    monkeypatch.setattr(_runtime, "route", lambda x: None)
    cudnorm.config(exact_rows=0)


@pytest.mark.parametrize("rows", [9, 37, 70])
def test_public_api_training_step_chunked(cpu_as_cudnn, rows):
    n = 16
    x, dy = torch.randn(rows, n, dtype=torch.float64), torch.randn(rows, n, dtype=torch.float64)
    w, b = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    cases = (((x, w, b), lambda x, w, b: cudnorm.layer_norm(x.float(), (n,), w.float(), b.float()),
              lambda x, w, b: F.layer_norm(x, (n,), w, b)),
             ((x, w), lambda x, w: cudnorm.rms_norm(x.float(), (n,), w.float(), 1e-5),
              lambda x, w: F.rms_norm(x, (n,), w, 1e-5)))
    before = cudnorm.cache_info().chunked_calls
    for tensors, ours, theirs in cases:
        inputs = [t.clone().requires_grad_() for t in tensors]
        ref_inputs = [t.clone().requires_grad_() for t in tensors]
        ours(*inputs).backward(dy.float())
        theirs(*ref_inputs).backward(dy)
        for a, r in zip(inputs, ref_inputs, strict=True):
            torch.testing.assert_close(a.grad.double(), r.grad, rtol=2e-5, atol=2e-5)
    assert cudnorm.cache_info().chunked_calls == before + 4  # fwd + bwd, two ops


# -- GPU -----------------------------------------------------------------------------------

GPU_ROWS = [1, 700, 1024, 1025, 4097, 5000, 17000, 40000]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_random_row_counts_chunked_within_2x_rule(fresh_cache, dtype):
    _rows.reset()
    cudnorm.config(exact_rows=0, autotune="off")  # accuracy does not depend on the plan
    n = 4096
    w = (1 + 0.1 * torch.randn(n, device="cuda"))
    b = 0.1 * torch.randn(n, device="cuda")
    for rows in GPU_ROWS:
        x = torch.randn(rows, n, device="cuda").to(dtype)
        dy = torch.randn_like(x)
        report = ref.accuracy_report(
            lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b, 1e-5),
            lambda x, w, b: F.layer_norm(x, (n,), w.to(x.dtype), b.to(x.dtype), 1e-5),
            lambda x, w, b: ref.layer_norm(x, w, b, 1e-5), (x, w, b), dy, ("y", "dx", "dw", "db"), dtype)
        assert all(r["ok"] for r in report), (rows, report)
        report = ref.accuracy_report(
            lambda x, w: cudnorm.rms_norm(x, (n,), w, 1e-6),
            lambda x, w: F.rms_norm(x, (n,), w.to(x.dtype), 1e-6),
            lambda x, w: ref.rms_norm(x, w, 1e-6), (x, w), dy, ("y", "dx", "dw"), dtype)
        assert all(r["ok"] for r in report), (rows, report)
    info = cudnorm.cache_info()
    assert info.declined == 0
    assert info.chunked_calls > 0 and info.small_rows_fallbacks > 0  # rows=1 and 700 < 1024/4096 chunks
    built_rows = {spec.rows for spec in _cache.plans.specs()}
    assert built_rows <= {size for sizes in _rows.CHUNK_ROWS.values() for size in sizes}


def test_chunked_plan_is_memoised_until_settings_change(fake_builds):
    asked, _ = fake_builds
    cudnorm.config(exact_rows=0)
    spec = _spec("layer_norm", "train", 70)
    first = _rows.plan_or_chunks(spec)
    count = len(asked)
    before = cudnorm.cache_info().chunked_calls
    assert _rows.plan_or_chunks(spec) is first and len(asked) == count  # no policy, no plan lookups
    assert cudnorm.cache_info().chunked_calls == before + 1
    cudnorm.config(exact_rows=1)  # new settings: the policy runs again (70 is admitted)
    assert _rows.plan_or_chunks(spec).spec == spec


@pytest.mark.parametrize("fake", [FakePlan, FakeAddressPlan], ids=["views", "addresses"])
@pytest.mark.parametrize("phase", ["train", "bwd"])
def test_aligned_remainder_writes_stats_in_place(phase, fake):
    # 44 rows with chunks (32, 8): remainder chunk starts at row 36, a 16-byte aligned stats offset
    spec = _spec("layer_norm", phase, 44)
    expected, got = _buffers(spec), _buffers(spec)
    FakePlan(spec).run(*expected)
    chunks, overlap, _ = _run_chunked(spec, got, (32, 8), fake)
    assert chunks[0] == (36, 8) and overlap == 4
    for role, want, have in zip(_graphs.roles(spec), expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-6, msg=role)


@pytest.mark.parametrize("fake", [FakePlan, FakeAddressPlan], ids=["views", "addresses"])
@pytest.mark.parametrize("phase", ["train", "infer"])
@pytest.mark.parametrize("rows", [52, 53])
def test_forward_overlapping_chunk_of_a_larger_size(rows, phase, fake):
    # 20 or 21 rows left after 32: one overlapping 32-row chunk (stats aligned at 52, not at 53)
    spec = _spec("rms_norm", phase, rows)
    expected, got = _buffers(spec), _buffers(spec)
    FakePlan(spec).run(*expected)
    chunks, _, _ = _run_chunked(spec, got, (32, 8, 4), fake, any_size_overlap=True)
    assert chunks == [(rows - 32, 32), (0, 32)]
    for role, want, have in zip(_graphs.roles(spec), expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0, msg=role)


def test_count_in_the_plan_store_gets_its_exact_plan_at_once(fake_builds, monkeypatch):
    asked, _ = fake_builds
    cudnorm.config(exact_rows=0)  # the policy alone would chunk every count
    stored = _spec("layer_norm", "bwd", 70)
    monkeypatch.setattr(_cache, "stored", lambda spec: spec == stored)
    assert _rows.plan_or_chunks(stored).spec == stored and asked[-1] == stored
    assert isinstance(_rows.plan_or_chunks(stored._replace(rows=50)), _rows.ChunkedPlan)
