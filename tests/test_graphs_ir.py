"""Graph IR of every builder, inspected without a GPU (cuDNN-frontend builds IR on CPU), and
where planning runs."""

import gc
import threading
import weakref

import pytest
import torch

import cudnorm
from cudnorm import _graphs
from cudnorm._spec import NormSpec

cudnn = pytest.importorskip("cudnn", reason="needs the cuDNN frontend: pip install -e '.[frontend]'")
pytestmark = pytest.mark.frontend

NODE = {("layer_norm", "bwd"): "LAYERNORM_BWD", ("rms_norm", "bwd"): "RMSNORM_BWD",
        ("ada_layer_norm", "bwd"): "ADALAYERNORM_BWD", "layer_norm": "LAYERNORM", "rms_norm": "RMSNORM",
        "ada_layer_norm": "ADALAYERNORM"}
CUDNN_DTYPE = {torch.float16: "HALF", torch.bfloat16: "BFLOAT16", torch.float32: "FLOAT"}


def _io(graph):
    info = graph.inspect()
    return info, {name: t for name, t in info["tensors"].items() if not t["is_virtual"]}


def _spec(op, phase, dtype=torch.bfloat16, scale_dtype=None, **kw):
    batch = 4 if op == "ada_layer_norm" else 1
    return NormSpec(op, phase, 64, 384, dtype, scale_dtype or dtype, 0, batch=batch, **kw)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "ada_layer_norm"])
@pytest.mark.parametrize("phase", ["train", "infer", "bwd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_builder_ir(op, phase, dtype):
    spec = _spec(op, phase, dtype)
    graph, uids = _graphs.build_ir(spec)
    info, io = _io(graph)
    node = NODE[(op, "bwd")] if phase == "bwd" else NODE[op]
    norm_nodes = [n for n in info["nodes"] if n["type"] != "POINTWISE"]
    assert [n["type"] for n in norm_nodes] == [node]
    if phase != "bwd":
        assert str(norm_nodes[0]["params"]["norm_forward_phase"]).endswith("TRAINING" if phase == "train" else "INFERENCE")
    by_uid = {t["uid"]: t for t in io.values()}
    assert set(by_uid) == set(uids), "every non-virtual tensor is bound by the ordered execute"
    assert uids == tuple(_graphs.UIDS[r] for r in _graphs.roles(spec))
    shapes = _graphs.buffer_shapes(spec)
    for role in _graphs.roles(spec):
        t = by_uid[_graphs.UIDS[role]]
        assert str(t["dtype"]).endswith(CUDNN_DTYPE[torch.float32 if role in ("eps", "one", "mean", "rstd") else
                                               _expected_dtype(spec, role)]), role
        numel = 1
        for d in t["dim"]:
            numel *= d
        expected = 1
        for d in shapes[role][0]:
            expected *= d
        assert numel == expected, (role, t["dim"], shapes[role][0])
    if phase != "bwd":
        assert by_uid[_graphs.UIDS["eps"]] and "eps" in _graphs.roles(spec)
    assert ("mean" in _graphs.roles(spec)) == (phase in ("train", "bwd") and op != "rms_norm")


def _expected_dtype(spec, role):
    if role in ("x", "y", "dx", "dy"):
        return spec.x_dtype
    return spec.scale_dtype  # every graph reads the scale, and a backward writes dW/dB, in its dtype


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("phase", ["train", "infer", "bwd"])
def test_weight_offset_is_added_inside_the_graph(op, phase):
    """``offset=True``: one pointwise ADD of the scale and a pass-by-value fp32 host scalar
    feeds the norm node's scale; the scalar is bound last (its uid is the largest). That it is
    passed by value is checked on the GPU, where a device pointer for it would fail."""
    spec = _spec(op, phase, offset=True)
    graph, uids = _graphs.build_ir(spec)
    info, io = _io(graph)
    assert _graphs.roles(spec)[-1] == "offset" and uids[-1] == _graphs.UIDS["offset"]
    assert {t["uid"] for t in io.values()} == set(uids)
    scalar = next(t for t in io.values() if t["uid"] == _graphs.UIDS["offset"])
    assert scalar["dim"] == [1, 1, 1, 1] and str(scalar["dtype"]).endswith("FLOAT")
    adds = [n for n in info["nodes"] if n["type"] == "POINTWISE"]
    assert len(adds) == 1 and str(adds[0]["params"]["mode"]).lower().endswith("add"), adds
    assert set(adds[0]["inputs"].values()) == {"scale", "offset"}
    norm = next(n for n in info["nodes"] if n["type"] != "POINTWISE")
    assert adds[0]["outputs"]["OUT_0"] in norm["inputs"].values(), "the norm reads scale + offset"
    plain_info, _ = _io(_graphs.build_ir(_spec(op, phase))[0])
    assert not [n for n in plain_info["nodes"] if n["type"] == "POINTWISE"]
    assert spec.slug().endswith("-offset") and NormSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="offset"):
        _spec("ada_layer_norm", phase, offset=True).validate()


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("phase", ["train", "infer"])
def test_residual_add_feeds_the_norm_and_is_written(op, phase):
    """``residual=True`` forward: one pointwise ADD of ``x`` and ``residual``; its output is
    the graph's ``h`` (packed, x's dtype) and the norm's input, so the sum is read once."""
    spec = _spec(op, phase, residual=True)
    graph, uids = _graphs.build_ir(spec)
    info, io = _io(graph)
    assert _graphs.roles(spec)[-2:] == ("residual", "h") and {t["uid"] for t in io.values()} == set(uids)
    adds = [n for n in info["nodes"] if n["type"] == "POINTWISE"]
    assert len(adds) == 1 and set(adds[0]["inputs"].values()) == {"x", "residual"}
    h = next(t for t in io.values() if t["uid"] == _graphs.UIDS["h"])
    assert h["dim"][:2] == [spec.rows, spec.cols] and str(h["dtype"]).endswith("BFLOAT16")
    norm = next(n for n in info["nodes"] if n["type"] != "POINTWISE")
    assert norm["inputs"]["input"] == adds[0]["outputs"]["OUT_0"]
    assert spec.slug().endswith("-residual") and NormSpec.from_json(spec.to_json()) == spec
    for bad in (_spec("ada_layer_norm", phase, residual=True), _spec(op, "bwd", residual=True)):
        with pytest.raises(ValueError, match="residual"):
            bad.validate()


def test_padded_rows_layout():
    spec = NormSpec("rms_norm", "train", 8, 100, torch.bfloat16, torch.bfloat16, 0, x_row_stride=128)
    _, io = _io(_graphs.build_ir(spec)[0])
    assert io["x"]["stride"][0] == 128
    y = next(t for n, t in io.items() if t["uid"] == _graphs.UIDS["y"])
    assert y["stride"][0] == 100, "outputs stay packed"


def test_spec_json_round_trip_and_slug():
    spec = NormSpec("ada_layer_norm", "bwd", 1024, 768, torch.float16, torch.float32, 1, batch=4, autotune=True)
    assert NormSpec.from_json(spec.to_json()) == spec
    assert spec.slug() == "ada_layer_norm-bwd-1024x768-float16-sfloat32-cuda1-b4-autotune"
    with pytest.raises(ValueError, match="unknown NormSpec field"):
        NormSpec.from_json({**spec.to_json(), "bogus": 1})
    with pytest.raises(ValueError, match="unknown op"):
        NormSpec("group_norm", "train", 1, 1, torch.float32, torch.float32, 0).validate()
    with pytest.raises(ValueError, match="inconsistent"):
        NormSpec("layer_norm", "train", 8, 64, torch.float32, torch.float32, 0, x_row_stride=32).validate()


def test_raw_execute_only_on_verified_frontends(monkeypatch):
    from cudnorm import _graphs, _runtime

    cudnn = _runtime.cudnn_module()
    monkeypatch.setattr(cudnn, "__version__", "9.99.0")
    assert not _graphs.RawExecute.enabled()
    assert _graphs.RawExecute.mode() == "public execute (raw-pointer launch not verified on frontend 9.99.0)"
    assert _graphs.RawExecute.for_graph(object(), (1,)) is None
    monkeypatch.setattr(cudnn, "__version__", "1.32.0")
    assert _graphs.RawExecute.enabled()
    assert _graphs.RawExecute.for_graph(object(), (1,)) is None  # private details missing: public path
    assert _graphs.RawExecute.mode() == "raw-pointer launch"
    cudnorm.config(raw_execute=False)
    assert not _graphs.RawExecute.enabled()
    assert _graphs.RawExecute.mode() == "public execute (raw_execute=False)"


class _GraphWhosePlanningKeepsACycle:
    """Stands in for a cuDNN graph whose planning behaves as cudnn-frontend 1.32's does when one
    heuristic mode has no engine and a later one has: the failed mode's exception stays in a
    local of the frame that caught it, a cycle that holds that frame and, through ``f_back``,
    every frame of the planning thread's stack until the garbage collector runs."""

    def __init__(self) -> None:
        self.planned_on = None

    def validate(self) -> None:
        pass

    def build_operation_graph(self) -> None:
        pass

    def create_execution_plans(self, modes) -> None:
        self.planned_on = threading.current_thread().name
        failure = None
        for mode in ("no engine", "an engine"):
            try:
                if mode == "no engine":
                    raise RuntimeError("no valid engine configs")
            except RuntimeError as exc:
                failure = exc  # noqa: F841 - the frontend's cycle: frame -> failure -> traceback -> frame

    def check_support(self) -> None:
        pass

    def build_plans(self) -> None:
        pass


def test_planning_keeps_no_frame_of_the_caller(monkeypatch):
    """A DiT step under mode="reduce-overhead" failed CUDA-graph trees' pool check because a plan
    built inside the compiled backward kept the backward's outputs alive through such a cycle
    (H100); planning runs on cudnorm's worker thread, so the cycle holds none of the caller's
    frames and a caller's tensors are freed when it returns, with no garbage collection."""
    graph = _GraphWhosePlanningKeepsACycle()
    monkeypatch.setattr(_graphs, "build_ir", lambda spec, handle, kernel_cache: (graph, (1, 2)))
    spec = NormSpec("layer_norm", "train", 8, 64, torch.float32, torch.float32, -1)  # no device to make current

    def caller(activation):  # a frame holding a tensor, as the backward that needed the plan held its outputs
        return _graphs._finalise(spec, None, full_heuristics=False)

    activation = torch.empty(3)
    freed = weakref.ref(activation)
    gc.disable()
    try:
        assert caller(activation)[0] is graph
        del activation
        assert freed() is None
    finally:
        gc.enable()
    assert graph.planned_on.startswith("cudnorm-worker")


def test_the_worker_thread_runs_work_it_gives_itself():
    from cudnorm import _runtime

    assert _runtime.on_worker_thread(-1, lambda: _runtime.on_worker_thread(-1, lambda: 5)) == 5
    with pytest.raises(ValueError, match="raised on the worker"):
        _runtime.on_worker_thread(-1, lambda: (_ for _ in ()).throw(ValueError("raised on the worker")))
