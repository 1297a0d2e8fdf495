"""cudnorm's ops on DTensors (the rules of cudnorm._sharding), in one process.

Under ``policy="cudnn"`` every public function sends a DTensor to cudnorm's own op; each rank
normalises its shard, and outputs and gradients must equal PyTorch's norms on the same
DTensors (``policy="auto"``), placements included. Four ranks are simulated in this process,
as PyTorch's own DTensor tests do: a fake process group and ``LocalTensorMode``, which runs
every op once per rank on that rank's shard and emulates the collectives, so each rank's
numbers are real. ``CommDebugMode`` counts the collectives a call needs. On a GPU the same
calls run with each rank's shard on cuDNN's graphs. The same calls run in 2 real processes
in tests/test_distributed.py. Where this torch's DTensor cannot flatten a
sequence shard into rows (torch 2.11), the LayerNorm/RMSNorm sequence-shard cases skip.
"""

import pytest
import torch

import cudnorm

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
local_tensor = pytest.importorskip("torch.distributed._local_tensor")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from test_distributed import SEQUENCE_SHARD_SKIP, flattens_sequence_shards  # noqa: E402

WORLD = 4
B, S, D = 4, 7, 32  # 7 tokens over 4 ranks: uneven sequence shards (2, 2, 2, 1)
# cudnorm's CPU path computes in fp32 in another order than PyTorch's kernels (as FP32_TOL in
# tests/test_distributed.py); weight gradients are sums over all B*S rows
TOL = dict(rtol=1e-5, atol=2e-5)


def _cases():
    """name -> (function of (x, *params) returning its outputs, params, cudnorm ops it calls)."""
    g = torch.Generator().manual_seed(7)
    w, b = 1 + 0.2 * torch.randn(D, generator=g), 0.1 * torch.randn(D, generator=g)
    w0 = 0.2 * torch.randn(D, generator=g)  # Gemma-style weight stored around zero
    scale, shift = 0.5 * torch.randn(B, D, generator=g), 0.5 * torch.randn(B, D, generator=g)
    r = torch.randn(B, S, D, generator=g)
    ln, rms, add, ada = (["layer_norm_fwd", "layer_norm_bwd"], ["rms_norm_fwd", "rms_norm_bwd"],
                         ["add_norm_fwd", "add_norm_bwd"], ["ada_layer_norm_fwd", "ada_layer_norm_bwd"])
    return {
        "layer_norm": (lambda x, w, b: (cudnorm.layer_norm(x, (D,), w, b, 1e-5),), [w, b], ln),
        "rms_norm": (lambda x, w: (cudnorm.rms_norm(x, (D,), w, 1e-5),), [w], rms),
        "rms_norm_offset": (lambda x, w: (cudnorm.rms_norm(x, (D,), w, 1e-5, weight_offset=1.0),), [w0], rms),
        "ada_layer_norm": (lambda x, sc, sh: (cudnorm.ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=True),),
                           [scale, shift], ada),
        "layer_norm_residual": (lambda x, r, w, b: cudnorm.layer_norm(x, (D,), w, b, 1e-5, residual=r), [r, w, b], add),
        "rms_norm_residual": (lambda x, r, w: cudnorm.rms_norm(x, (D,), w, 1e-5, residual=r), [r, w], add),
    }


CASES = _cases()
X = torch.randn(B, S, D, generator=torch.Generator().manual_seed(8))


class _CudnormCalls(TorchDispatchMode):
    """Records the cudnorm ops called on DTensors (not DTensor's own calls on fake tensors
    while it derives the outputs' metadata, nor the calls on each rank's shard)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "cudnorm" and any(isinstance(a, DTensor) for a in args):
            self.seen.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def meshes():
    """A 1-D mesh of 4 ranks and a 2 x 2 one (data x sequence parallel), on a fake group."""
    dist.init_process_group("fake", rank=0, world_size=WORLD)
    try:
        found = {1: init_device_mesh("cpu", (WORLD,)), 2: init_device_mesh("cpu", (2, 2))}
        if torch.cuda.is_available():  # the four simulated ranks' shards on one GPU
            found["cuda"] = init_device_mesh("cuda", (WORLD,))
        yield found
    finally:
        dist.destroy_process_group()


def _whole(t):
    """The full value of a DTensor, checked equal on every rank (a replicated DTensor made
    from a plain tensor keeps one plain local tensor for all ranks)."""
    full = t.full_tensor()
    return full.reconcile() if isinstance(full, local_tensor.LocalTensor) else full


def _loss(outs):
    """Sum of squares of the outputs; added to each other, not to Python's 0, which would
    reduce a ``Partial`` sum across the ranks in the middle of the count of collectives."""
    return sum((o.pow(2).sum() for o in outs[1:]), outs[0].pow(2).sum())


@pytest.fixture(scope="module")
def sequence_shards(meshes) -> bool:
    """Whether cudnorm.layer_norm/rms_norm can take a sequence-sharded DTensor on this torch."""
    with local_tensor.LocalTensorMode(WORLD):
        return flattens_sequence_shards(meshes[1])


def _skip_unflattenable(case, placements, sequence_shards):
    if not sequence_shards and case != "ada_layer_norm" and Shard(1) in placements:
        pytest.skip(SEQUENCE_SHARD_SKIP)  # AdaLN takes [B, S, D] as it is; the others flatten it


def _run(case, mesh, placements, policy="cudnn", **options):
    """Forward and backward of ``case`` on DTensors: ``x`` (and a residual) placed by
    ``placements``, weights and AdaLN's modulation replicated. Returns the placements and
    full values of the outputs and of every gradient, the cudnorm ops called and the number
    of collectives."""
    fn, params, _ = CASES[case]
    with cudnorm.config(policy=policy, **options), local_tensor.LocalTensorMode(WORLD):
        inputs = [distribute_tensor(t, mesh, placements if t.dim() == 3 else [Replicate()] * mesh.ndim)
                  for t in (X, *params)]
        inputs = [t.requires_grad_() for t in inputs]
        with CommDebugMode() as comm, _CudnormCalls() as calls:  # calls innermost: it sees the DTensor calls
            outs = fn(*inputs)
            # the gradients as the backward op places them: ``.backward()`` would count what
            # AccumulateGrad does with them too; on CUDA it copied AdaLN's sequence-sharded dx
            # into a Replicate() ``.grad`` (one all-gather; torch 2.11, docs/distributed.md)
            grads = torch.autograd.grad(_loss(outs), inputs)
        tensors = [*outs, *grads]
        return {"outputs": len(outs), "placements": [t.placements for t in tensors],
                "values": [_whole(t) for t in tensors],
                "calls": calls.seen, "collectives": comm.get_total_counts()}


def _reference(case):
    """Outputs and gradients of ``case`` on whole plain tensors (PyTorch's ops)."""
    fn, params, _ = CASES[case]
    inputs = [t.clone().requires_grad_() for t in (X, *params)]
    with cudnorm.config(policy="auto"):
        outs = fn(*inputs)
        _loss(outs).backward()
    return [o.detach() for o in outs] + [t.grad for t in inputs]


def _assert_values(got, want, what):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, i=i: f"{what}, tensor {i}: {m}")


PLACEMENTS = {"Shard(0)": [Shard(0)], "Shard(1)": [Shard(1)], "Replicate()": [Replicate()]}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("case", CASES)
def test_cudnn_policy_runs_cudnorms_ops_like_pytorchs_norms(meshes, sequence_shards, case, placement):
    _skip_unflattenable(case, PLACEMENTS[placement], sequence_shards)
    ours = _run(case, meshes[1], PLACEMENTS[placement])
    theirs = _run(case, meshes[1], PLACEMENTS[placement], policy="auto")
    assert ours["calls"] == CASES[case][2], ours["calls"]  # cudnorm's forward op, then its backward op
    assert theirs["calls"] == []
    assert ours["placements"] == theirs["placements"], (ours["placements"], theirs["placements"])
    assert ours["collectives"] == 0  # every rank normalised its own rows; gradients left Partial
    _assert_values(ours["values"], theirs["values"], f"{case} on {placement}")
    _assert_values(ours["values"], _reference(case), f"{case} on {placement} against one tensor")
    x_like = tuple(PLACEMENTS[placement])
    n_out = ours["outputs"]
    assert all(p == x_like for p in ours["placements"][:n_out + 1]), ours["placements"]  # outputs, dx
    grads = ours["placements"][n_out + 1:]  # of the residual (placed like x) and the parameters
    if case == "ada_layer_norm" and placement == "Shard(0)":
        assert grads == [x_like] * 2  # a batch shard shards the modulation and its gradients alike
    elif placement != "Replicate()":
        # replicated parameters: each rank's sum over its rows, reduced by full_tensor()
        assert all(p == (Partial(),) for p in grads if p != x_like), grads


@pytest.mark.parametrize("case", CASES)
def test_data_times_sequence_parallel_mesh(meshes, sequence_shards, case):
    """Batch sharded over one mesh dim and the sequence over the other: still no collective."""
    _skip_unflattenable(case, [Shard(0), Shard(1)], sequence_shards)
    ours = _run(case, meshes[2], [Shard(0), Shard(1)])
    theirs = _run(case, meshes[2], [Shard(0), Shard(1)], policy="auto")
    assert ours["calls"] == CASES[case][2]
    assert ours["placements"] == theirs["placements"], (ours["placements"], theirs["placements"])
    assert ours["placements"][0] == (Shard(0), Shard(1))
    assert ours["collectives"] == 0
    _assert_values(ours["values"], _reference(case), f"{case} on a 2 x 2 mesh")


@pytest.mark.parametrize("case", CASES)
def test_shard_of_the_normalised_dim_is_gathered_first(meshes, case):
    """No rule runs a norm on part of a row: DTensor makes the rows whole before the op (an
    all-gather, or an all-to-all to a row shard on larger tensors, as its cost model picks).
    PyTorch's own RMSNorm on such a DTensor raises in torch 2.13: values against one tensor."""
    ours = _run(case, meshes[1], [Shard(2)])
    assert ours["calls"] == CASES[case][2]
    assert ours["collectives"] > 0
    assert all(Shard(2) not in p for p in ours["placements"]), ours["placements"]
    _assert_values(ours["values"], _reference(case), f"{case} on Shard(2)")


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [*PLACEMENTS, "Shard(2)"])
@pytest.mark.parametrize("case", CASES)
def test_cuda_shards_run_cudnns_graphs(meshes, sequence_shards, case, placement):
    """The same calls with each simulated rank's shard on the GPU: the sharding rules hand
    every shard to cuDNN's graphs (AdaLN's backward of several samples: the fused kernel) (recorded specs; every row count gets its exact graph, as
    the 7-row shards would otherwise go to PyTorch's kernels), and the gathered outputs and
    gradients equal PyTorch's ops on whole CPU tensors."""
    placements = PLACEMENTS.get(placement, [Shard(2)])
    _skip_unflattenable(case, placements, sequence_shards)
    declined = cudnorm.cache_info().declined
    with cudnorm.record_specs() as recording:
        ours = _run(case, meshes["cuda"], placements, exact_rows=1_000_000, exact_after=1)
    assert ours["calls"] == CASES[case][2], ours["calls"]
    phases = {spec.phase for spec in recording.specs}
    if case == "ada_layer_norm":  # a shard of more than one sample takes the fused kernel's backward, no graph
        assert "train" in phases and phases <= {"train", "bwd"}, recording.specs
    else:
        assert phases == {"train", "bwd"}, recording.specs
    # a 7-token sequence over 4 ranks leaves the last rank one token per sample, an AdaLN shape
    # cuDNN 9.19 declines: PyTorch's kernels serve that shard (with a warning), the others cuDNN
    may_decline = 1 if case == "ada_layer_norm" and placement == "Shard(1)" else 0
    assert cudnorm.cache_info().declined - declined <= may_decline, cudnorm.cache_info()
    if placement != "Shard(2)":
        assert ours["collectives"] == 0
    # cuDNN sums in another order than PyTorch's CPU kernels (as TP_TOL["cuda"] in test_distributed)
    got = [t.cpu() for t in ours["values"]]
    for i, (g, w) in enumerate(zip(got, _reference(case), strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, i=i: f"{case} on {placement}, tensor {i}: {m}")


def _batch_of_3(param, mesh):
    """A case's parameter for the 3-sample batch: weights replicated, a residual cut and batch-sharded."""
    if param.dim() == 1:
        return distribute_tensor(param, mesh, [Replicate()])
    return distribute_tensor(param[:3], mesh, [Shard(0)])


@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "rms_norm_residual"])
def test_unflattenable_dtensor_raises_naming_the_call(meshes, case):
    """A batch of 3 over 4 ranks: DTensor cannot flatten it into rows, so the error names the
    function, the argument and the placement, and says what takes it (PyTorch's op does)."""
    fn, params, _ = CASES[case]
    op = case.removesuffix("_residual")
    batch = torch.randn(3, S, D)
    with cudnorm.config(policy="cudnn"), local_tensor.LocalTensorMode(WORLD):
        x = distribute_tensor(batch, meshes[1], [Shard(0)])
        args = [_batch_of_3(t, meshes[1]) for t in params]
        with pytest.raises(ValueError, match=rf"cudnorm\.{op}: argument 'input' is a DTensor of shape \(3, 7, 32\) "
                                             r"placed \[Shard\(dim=0\)\].*policy='auto'") as raised:
            fn(x, *args)
        assert "flatten" in str(raised.value.__cause__)
    with cudnorm.config(policy="auto"), local_tensor.LocalTensorMode(WORLD):  # PyTorch's op takes it
        x = distribute_tensor(batch, meshes[1], [Shard(0)])
        args = [_batch_of_3(t, meshes[1]) for t in params]
        got = _whole(fn(x, *args)[0])
    with cudnorm.config(policy="auto"):
        want = fn(batch, *(t if t.dim() == 1 else t[:3] for t in params))[0]
    torch.testing.assert_close(got, want, **TOL)


def test_inference_calls_replicate_their_empty_statistics(meshes):
    """Without grad the statistics are empty, so replicated; a training call after one with
    the same placements still gets its own sharded statistics (DTensor's cache is keyed on
    the ops' scalar arguments, here ``training``)."""
    rows = torch.randn(8, D)  # made outside LocalTensorMode, which gives each rank its own random numbers
    with local_tensor.LocalTensorMode(WORLD):
        x = distribute_tensor(rows, meshes[1], [Shard(0)])
        for training in (True, False, True):
            y, rstd = torch.ops.cudnorm.rms_norm_fwd.default(x, None, 1e-5, training)
            assert y.placements == (Shard(0),)
            assert rstd.placements == ((Shard(0),) if training else (Replicate(),)), training
            assert tuple(rstd.shape) == ((8,) if training else (0,)), training
            y, stats = torch.ops.cudnorm.layer_norm_fwd.default(x, None, None, 1e-5, training)
            assert stats.placements == ((Shard(1),) if training else (Replicate(),)), training
        with torch.no_grad():
            x3 = distribute_tensor(X, meshes[1], [Shard(0)])
            assert cudnorm.layer_norm(x3, (D,)).placements == (Shard(0),)


def test_fp32_weights_on_half_input_take_cudnorms_op_under_auto(meshes):
    """The default policy leaves such calls on cudnorm's path (its rounding of the weights),
    DTensors included: they used to raise for want of a sharding rule."""
    w = torch.randn(D)
    with cudnorm.config(policy="auto"), local_tensor.LocalTensorMode(WORLD):
        x = distribute_tensor(X.bfloat16(), meshes[1], [Shard(0)]).requires_grad_()
        wd = distribute_tensor(w, meshes[1], [Replicate()]).requires_grad_()
        with _CudnormCalls() as calls:
            y = cudnorm.rms_norm(x, (D,), wd, 1e-5)
            y.float().pow(2).sum().backward()
        assert calls.seen == ["rms_norm_fwd", "rms_norm_bwd"]
        assert y.placements == (Shard(0),) and y.dtype == torch.bfloat16
        assert wd.grad.placements == (Partial(),) and wd.grad.dtype == torch.float32
        got = _whole(y)
    torch.testing.assert_close(got, cudnorm.rms_norm(X.bfloat16(), (D,), w, 1e-5), rtol=0, atol=0)
