"""Recording specs, spec files, presets, ``cudnorm.warmup`` and ``cudnorm warmup`` on the CPU.

On a CPU the ops never ask for a graph, so the recorder is exercised by letting CPU tensors
through the routing check (``_runtime.route``) and declining every build: the ops then
request exactly the specs they would on a GPU and fall back to PyTorch's kernels.
"""

import importlib
import json
import types

import pytest
import torch

import cudnorm
from cudnorm import _cache, _graphs, _plan_store, _recording, _runtime
from cudnorm._plan_store import PlanStore
from cudnorm._spec import NormSpec
from test_plan_store import cli_main, fake_deserialize, fake_fingerprint, fake_serialize, plan_  # noqa: F401 - shared fakes and fixture

warmup_mod = importlib.import_module("cudnorm.warmup")  # the package attribute is the function
from cudnorm import _ada_strategies as strategies  # noqa: E402

ada = importlib.import_module("cudnorm.ada_layer_norm")


@pytest.fixture
def cpu_as_cudnn(monkeypatch, fresh_cache):
    """CPU tensors take the cuDNN branch of the ops; every build is declined."""
    monkeypatch.setattr(_runtime, "route", lambda x: None)
    monkeypatch.setattr(_cache, "_build", lambda spec: _cache.DECLINED)


def _training_step(weight_dtype, with_weight=True):
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, dtype=weight_dtype, requires_grad=True) if with_weight else None
    b = torch.zeros(256, dtype=weight_dtype, requires_grad=True) if with_weight else None
    cudnorm.layer_norm(x, (256,), w, b).sum().backward()
    with torch.no_grad():
        cudnorm.rms_norm(x.reshape(6, 256), (256,), w)
        cudnorm.rms_norm(x.reshape(6, 256), (256,), w)  # a repeat is recorded once


@pytest.mark.parametrize("policy", [{}, {"fp32_weight_fwd": "native"}, {"autotune": "on"}])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, None])
def test_recorded_specs_equal_the_derived_ones(cpu_as_cudnn, tmp_path, policy, weight_dtype):
    cudnorm.config(**policy)
    path = tmp_path / "step.json"
    with cudnorm.record_specs(path) as rec:
        _training_step(weight_dtype or torch.float32, with_weight=weight_dtype is not None)
    kw = dict(x_dtype=torch.bfloat16, weight_dtype=weight_dtype, device_index=None)
    expected = (warmup_mod.norm_specs("layer_norm", 6, 256, phases=("train", "bwd"), **kw)
                + warmup_mod.norm_specs("rms_norm", 6, 256, phases=("infer",), **kw))
    assert rec.specs == warmup_mod._sorted(expected)
    assert len(rec.specs) == 3
    assert warmup_mod.read_spec_file(path) == rec.specs
    assert _recording.blocks == []


@pytest.mark.parametrize("fwd, bwd", [("auto", "auto"), ("cudnn", "cudnn"), ("per_sample", "per_sample"),
                                      ("per_sample", "cudnn"), ("cudnn", "per_sample"),
                                      ("torch", "cudnn"), ("cudnn", "torch")])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_recorded_ada_specs_equal_the_derived_ones(monkeypatch, fresh_cache, fused_kernel, fwd, bwd, scale_dtype):
    # plans that run nothing: each op takes its first strategy, as it would on a GPU
    monkeypatch.setattr(_runtime, "route", lambda x: None)
    monkeypatch.setattr(_cache, "_build", lambda spec: types.SimpleNamespace(
        spec=spec, run=lambda *a: None, launch=lambda pointers: None, raw=None, workspace_size=0))
    cudnorm.config(ada_forward=fwd, ada_backward=bwd)
    b, s, d = 2, 8, 64
    x = torch.randn(b, s, d, dtype=torch.bfloat16, requires_grad=True)
    scale, shift = (torch.randn(b, d, dtype=scale_dtype, requires_grad=True) for _ in range(2))
    with cudnorm.record_specs() as rec:
        cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True).sum().backward()
        with torch.no_grad():
            cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
    derived = warmup_mod.ada_norm_specs(b, s, d, x_dtype=torch.bfloat16, scale_dtype=scale_dtype, device_index=None)
    assert rec.specs == warmup_mod._sorted(derived)
    ops = {(spec.op, spec.phase == "bwd") for spec in rec.specs}
    fwd, bwd = strategies.forward_strategy(b, s, d, x.dtype), strategies.backward_strategy(b, s, d, x.dtype)  # resolve "auto"
    if bwd == "fused" and fused_kernel is None:  # no Triton: the per-sample launches
        bwd = strategies.BACKWARD_ORDER["fused"][1]
    assert fused_kernel in (None, [b] if bwd == "fused" else [])  # the fused kernel needs no warmup spec
    assert (("layer_norm", False) in ops) == fwd.startswith("per_sample")
    assert (("layer_norm", True) in ops) == bwd.startswith("per_sample")
    assert len(rec.specs) == (fwd != "torch") * 2 + (bwd not in ("torch", "fused"))


def test_spec_file_format(cpu_as_cudnn, tmp_path):
    path = tmp_path / "step.json"
    with cudnorm.record_specs(path):
        _training_step(torch.float32)
    data = json.loads(path.read_text())
    assert data["format"] == "cudnorm-specs" and data["version"] == 1
    assert [NormSpec.from_json(d).slug() for d in data["specs"]] == [
        "layer_norm-bwd-6x256-bfloat16-sfloat32-cudaNone",
        "layer_norm-train-6x256-bfloat16-sbfloat16-cudaNone",
        "rms_norm-infer-6x256-bfloat16-sbfloat16-cudaNone",
    ]


def test_nested_recorders_and_failure(cpu_as_cudnn, tmp_path):
    with cudnorm.record_specs() as outer:
        with cudnorm.record_specs() as inner:
            cudnorm.rms_norm(torch.randn(4, 64), (64,))
        cudnorm.layer_norm(torch.randn(4, 64), (64,))
    assert [s.op for s in inner.specs] == ["rms_norm"]
    assert [s.op for s in outer.specs] == ["layer_norm", "rms_norm"]
    path = tmp_path / "never.json"
    with pytest.raises(KeyError), cudnorm.record_specs(path):
        cudnorm.rms_norm(torch.randn(4, 64), (64,))
        raise KeyError("the step failed")
    assert not path.exists() and _recording.blocks == []


def test_recording_nothing_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match="no cuDNN graph was requested"):
        with cudnorm.record_specs(tmp_path / "empty.json"):
            cudnorm.rms_norm(torch.randn(4, 64), (64,))  # a plain CPU call asks for no graph
    assert warmup_mod.read_spec_file(tmp_path / "empty.json") == []


@pytest.mark.parametrize("text, message", [
    ("not json", "not JSON"), ('{"specs": []}', "not a cudnorm spec file"),
    ('{"format": "cudnorm-specs", "version": 7, "specs": []}', "version 7"),
    ('{"format": "cudnorm-specs", "version": 1, "specs": [{"op": "layer_norm"}]}', "invalid spec"),
    ('{"format": "cudnorm-specs", "version": 1, "specs": [{"colour": 1}]}', "invalid spec"),
])
def test_bad_spec_files(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        warmup_mod.read_spec_file(path)


def test_llm_preset():
    specs = warmup_mod.preset_specs("llama-3-8b", batch=2, seq=512, dtype="bf16", device_index=1)
    assert {(s.op, s.phase, s.rows, s.cols) for s in specs} == {
        ("rms_norm", "train", 1024, 4096), ("rms_norm", "bwd", 1024, 4096),
        ("rms_norm", "infer", 1024, 4096), ("rms_norm", "infer", 2, 4096)}
    assert all(s.x_dtype == torch.bfloat16 and s.device_index == 1 for s in specs)
    assert {s.scale_dtype for s in specs if s.phase == "bwd"} == {torch.float32}
    assert {s.cols for s in warmup_mod.preset_specs("llama-3-70b")} == {8192}


def test_dit_preset(fused_kernel):
    specs = warmup_mod.preset_specs("dit-xl-2", batch=4, dtype=torch.float16)
    # the fused backward is a Triton kernel, not a cuDNN graph: nothing to warm up
    assert sorted(s.phase for s in specs) == (["infer", "train"] if fused_kernel is not None else ["bwd", "infer", "train"])
    assert all(s.x_dtype == torch.float16 and s.cols == 1152 for s in specs)
    assert all(s.op == "ada_layer_norm" and s.rows == 4 * 256 and s.batch == 4 and s.scale_dtype == torch.float16
               for s in specs if s.phase != "bwd" or strategies.choose_backward(4, 256, 1152, torch.float16) == "cudnn")
    # MMDiT: 4096 image tokens and 333 text tokens per sample, each stream its own graphs
    cudnorm.config(ada_forward="cudnn", ada_backward="per_sample")
    sd3 = warmup_mod.preset_specs("sd3-medium", batch=2)
    assert {(s.op, s.phase, s.rows) for s in sd3 if s.phase == "bwd"} == {
        ("layer_norm", "bwd", 4096), ("layer_norm", "bwd", 333)}
    assert {(s.op, s.rows, s.batch) for s in sd3 if s.phase != "bwd"} == {
        ("ada_layer_norm", 2 * 4096, 2), ("ada_layer_norm", 2 * 333, 2)}
    cudnorm.config(ada_forward="per_sample", ada_backward="cudnn")
    sd3 = warmup_mod.preset_specs("sd3-medium", batch=2)
    # 333 text tokens: a sample's statistics would start misaligned, so cuDNN's AdaLN forward serves them
    assert {(s.op, s.phase, s.rows) for s in sd3} == {
        ("layer_norm", "train", 4096), ("layer_norm", "infer", 4096), ("ada_layer_norm", "train", 2 * 333),
        ("ada_layer_norm", "infer", 2 * 333), ("ada_layer_norm", "bwd", 2 * 4096), ("ada_layer_norm", "bwd", 2 * 333)}


def test_warmup_measures_the_decision_of_every_forward_spec():
    """The call ``cudnorm warmup`` measures a decision on for each spec (on the CPU here): a
    LayerNorm/RMSNorm forward's ``[rows, cols]`` with weights of the backward's dtype, an
    adaptive LayerNorm's ``[B, S, D]`` with ``[B, D]`` scale and shift of x's dtype (op
    ``ada_layer_norm``); backward specs and a modulation of another dtype have none."""
    from cudnorm import _candidates

    cpu = torch.device("cpu")
    ada_spec = NormSpec("ada_layer_norm", "train", 4 * 256, 1152, torch.bfloat16, torch.bfloat16, 0, batch=4)
    op, x, cols, scale, shift, training = warmup_mod._decision_call(ada_spec, [ada_spec], cpu)
    assert (op, tuple(x.shape), cols, tuple(scale.shape), tuple(shift.shape), training) == (
        _candidates.ADA_LAYER_NORM, (4, 256, 1152), 1152, (4, 1152), (4, 1152), True)
    assert scale.dtype is shift.dtype is x.dtype is torch.bfloat16
    assert warmup_mod._decision_call(ada_spec._replace(scale_dtype=torch.float32), [], cpu) is None
    assert warmup_mod._decision_call(ada_spec._replace(phase="bwd"), [], cpu) is None
    forward = NormSpec("layer_norm", "infer", 64, 4096, torch.bfloat16, torch.bfloat16, 0)
    backward = NormSpec("layer_norm", "bwd", 64, 4096, torch.bfloat16, torch.float32, 0)
    op, x, cols, weight, bias, training = warmup_mod._decision_call(forward, [forward, backward], cpu)
    assert (op, tuple(x.shape), weight.dtype, bias.dtype, training) == (
        "layer_norm", (64, 4096), torch.float32, torch.float32, False)
    rms = NormSpec("rms_norm", "train", 64, 4096, torch.bfloat16, torch.bfloat16, 0)
    assert warmup_mod._decision_call(rms, [rms], cpu)[4] is None


def test_warmups_inputs_leave_the_callers_random_numbers_alone():
    """``cudnorm.warmup`` after ``torch.manual_seed`` must not move the seeded streams (a job
    would draw other random numbers with warmup than without): its inputs come from
    cudnorm's own generator."""
    cpu = torch.device("cpu")
    torch.manual_seed(7)
    state = torch.get_rng_state()
    for spec in (NormSpec("ada_layer_norm", "train", 4 * 256, 1152, torch.bfloat16, torch.bfloat16, 0, batch=4),
                 NormSpec("layer_norm", "infer", 64, 4096, torch.bfloat16, torch.bfloat16, 0)):
        assert warmup_mod._decision_call(spec, [spec], cpu) is not None
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", sorted(warmup_mod.PRESETS))
def test_every_preset_builds_valid_specs(fused_kernel, name):
    specs = warmup_mod.preset_specs(name, batch=3)
    assert specs and len(set(specs)) == len(specs)
    ada_fused = fused_kernel is not None and not name.startswith("llama")
    assert {s.phase for s in specs} == ({"train", "infer"} if ada_fused else {"train", "bwd", "infer"})
    assert [NormSpec.from_json(s.to_json()) for s in specs] == specs


def test_preset_argument_errors():
    with pytest.raises(ValueError, match="unknown preset 'gpt-5'"):
        warmup_mod.preset_specs("gpt-5")
    with pytest.raises(ValueError, match="argument 'batch'"):
        warmup_mod.preset_specs("dit-xl-2", batch=0)
    with pytest.raises(ValueError, match="argument 'dtype'"):
        warmup_mod.preset_specs("dit-xl-2", dtype="int8")
    with pytest.raises(ValueError, match="neither a spec file nor a preset"):
        cudnorm.warmup("no-such-thing")
    with pytest.raises(ValueError, match="must be a CUDA device"):
        warmup_mod.resolve("dit-xl-2", device="cpu")
    with pytest.raises(TypeError, match="NormSpec"):
        warmup_mod.resolve(["layer_norm"])


def test_device_override():
    specs = warmup_mod.resolve("dit-b-2", device=1) + warmup_mod.resolve("dit-b-2", device="cuda:2")
    assert {s.device_index for s in specs} == {1, 2}


def test_warmup_without_cudnn_builds_nothing():
    if _runtime.cudnn_status().available:
        pytest.skip("cuDNN is available here")
    with pytest.warns(RuntimeWarning, match="nothing built"):
        rows = cudnorm.warmup("dit-b-2", progress=False)
    assert [r["source"] for r in rows] == ["skipped"] * 3


@pytest.fixture
def fake_gpu(monkeypatch, fresh_cache, tmp_path):
    """cuDNN 'available' with one GPU, builds and the store faked; yields the build log."""
    before = _plan_store.installed()
    monkeypatch.setattr(_runtime, "cudnn_status", lambda: _runtime.CudnnStatus(True, "ok"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _cache._warned.clear()  # each test sees its own decline warning
    monkeypatch.setattr(_graphs, "serialize_plan", fake_serialize)
    monkeypatch.setattr(_graphs, "deserialize_plan", fake_deserialize)
    builds = []

    def build(spec):
        builds.append(spec)
        if spec.phase == "infer" and spec.rows == 1:
            raise RuntimeError("no engine")
        return plan_(spec)

    monkeypatch.setattr(_graphs, "build_plan", build)
    _plan_store.install(PlanStore(tmp_path / "plans", 1 << 30, fingerprint=fake_fingerprint))
    yield builds
    _plan_store.install(before)


def test_warmup_reports_where_each_plan_came_from(fake_gpu, tmp_path):
    specs = warmup_mod.preset_specs("llama-3-8b", batch=1, seq=64, device_index=0)
    with pytest.warns(RuntimeWarning, match="declined"):
        rows = cudnorm.warmup(specs, progress=False)
    sources = {r["spec"]: r["source"] for r in rows}
    assert sorted(sources.values()) == ["built", "built", "built", "declined"]
    assert all(r["plan"] == "eng5_k3" for r in rows if r["source"] == "built")
    again = cudnorm.warmup(specs, progress=False)
    assert [r["source"] for r in again] == ["declined" if sources[r["spec"]] == "declined" else "cached" for r in again]
    _cache.plans.clear()  # a new process with a warm store
    assert sorted(r["source"] for r in cudnorm.warmup(specs, progress=False)) == ["declined", "store", "store", "store"]
    assert len(fake_gpu) == 5  # 4 first builds + the declined one retried, never a stored one


def test_cli_list_presets(cli_main, capsys):
    assert cli_main(["warmup", "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in warmup_mod.PRESETS)


def test_cli_warmup_without_cudnn_lists_specs(cli_main, capsys, tmp_path):
    if _runtime.cudnn_status().available:
        pytest.skip("cuDNN is available here")
    assert cli_main(["warmup", "--preset", "llama-3-8b", "--batch", "2", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert "nothing was built" in out and "rms_norm-train-256x4096-bfloat16" in out
    path = tmp_path / "specs.json"
    warmup_mod.write_spec_file(path, warmup_mod.preset_specs("dit-b-2"))
    assert cli_main(["warmup", str(path)]) == 0
    assert "ada_layer_norm-train-256x768" in capsys.readouterr().out


def test_cli_warmup_builds_and_summarises(fake_gpu, cli_main, capsys):
    with pytest.warns(RuntimeWarning, match="declined"):
        assert cli_main(["warmup", "--preset", "llama-3-8b", "--seq", "32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "rms_norm-bwd-32x4096" in out and "4 graph(s)" in out and "3 built" in out and "1 declined" in out


def test_cli_warmup_argument_errors(cli_main, capsys, tmp_path):
    assert cli_main(["warmup"]) == 2
    assert "give a spec file or --preset" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert cli_main(["warmup", str(tmp_path / "bad.json")]) == 2
    assert "argument spec_file: cudnorm.warmup:" in capsys.readouterr().err
