"""``cudnorm bench``: the quick run end to end, the correctness gate, the arithmetic."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cudnorm import cli
from cudnorm._bench import accuracy, cuda_graph, host_overhead, providers, report, runner

ROOT = Path(__file__).resolve().parent.parent
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_quick_run_writes_checked_rows(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "bench.csv", newline="") as f:
        assert tuple(csv.reader(f).__next__()) == report.COLUMNS
    rows = _read_csv(tmp_path / "bench.csv")
    ops = {r["op"] for r in rows}
    assert {"ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd"} <= ops
    for op in ops:
        family = op.split("_")[0]
        shapes = {r["shape"] for r in rows if r["op"] == op}
        assert shapes == {"x".join(map(str, s)) for s in runner.default_shapes(family, quick=True)}
    for r in rows:
        if r["provider"] in ("cudnorm", "torch"):
            assert r["status"] == "ok", r
            assert float(r["ms"]) > 0 and float(r["gbps"]) > 0
            assert float(r["error"]) <= float(r["bound"])
        if r["provider"] == "cudnorm":
            assert r["path"] and r["speedup"] and r["best_peer"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench.png").stat().st_size > 0
    assert "cudnorm bench --quick --out" in (tmp_path / "summary.md").read_text()
    out = capsys.readouterr().out  # the legend, then the tables, come last
    assert out.rindex("Legend:") < out.rindex("\nshape ")
    last_shape = "x".join(map(str, runner.default_shapes(rows[-1]["op"].split("_")[0], quick=True)[-1]))
    assert out.rstrip().splitlines()[-1].startswith(last_shape)

    (tmp_path / "bench.png").unlink(missing_ok=True)
    assert cli.main(["bench", "--from-csv", str(tmp_path / "bench.csv")]) == 0
    replot = capsys.readouterr().out
    assert replot[replot.index("Legend:"):] == out[out.index("Legend:"):]  # same tables from the CSV
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench.png").stat().st_size > 0


def _scaled_torch(op, inp):
    """A deliberately wrong provider: eager PyTorch with every output 5% too large."""
    fn, outputs = providers.torch_setup(op, inp)
    return fn, tuple(o * 1.05 for o in outputs)


def _raising(op, inp):
    raise RuntimeError("kernel exploded")


def test_wrong_and_raising_providers_are_reported_not_timed(tmp_path, monkeypatch):
    registry = dict(providers.REGISTRY)
    registry["wrong"] = providers.Provider("wrong", _scaled_torch, providers.OPS)
    registry["broken"] = providers.Provider("broken", _raising, providers.OPS)
    monkeypatch.setattr(providers, "REGISTRY", registry)
    argv = ["bench", "--quick", "--ops", "rms_fwd,rms_bwd", "--providers", "torch,wrong,broken", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    rows = _read_csv(tmp_path / "bench.csv")
    by_provider = {p: [r for r in rows if r["provider"] == p] for p in ("torch", "wrong", "broken")}
    assert len(by_provider["wrong"]) == 4  # 2 ops x 2 quick shapes
    for r in by_provider["wrong"]:
        assert r["status"].startswith("wrong: "), r
        assert r["ms"] == "" and float(r["error"]) > float(r["bound"])
    for r in by_provider["broken"]:
        assert r["status"] == "error: RuntimeError: kernel exploded" and r["ms"] == ""
    assert all(r["status"] == "ok" and r["ms"] for r in by_provider["torch"])


def _row(op, provider, ms, status="ok"):
    row = runner.blank_row(op, (32768, 4096), provider)
    row.update(status=status, ms=ms, N=4096)
    return row


def test_speedup_is_best_other_provider_over_cudnorm():
    rows = [_row("ln_bwd", "cudnorm", 1.0), _row("ln_bwd", "torch", 2.0), _row("ln_bwd", "quack", 1.5),
            _row("ln_bwd", "liger", None, status="wrong: dx 1e-1 > 8e-3"),
            _row("rms_bwd", "cudnorm", 2.0), _row("rms_bwd", "torch", 1.0),
            _row("rms_fwd", "cudnorm", 1.0)]
    report.add_speedups(rows)
    assert (rows[0]["speedup"], rows[0]["best_peer"]) == (1.5, "quack")
    assert (rows[4]["speedup"], rows[4]["best_peer"]) == (0.5, "torch")
    assert rows[6]["speedup"] is None  # no peer timed: nothing to compare
    assert all(r["speedup"] is None for r in rows if r["provider"] != "cudnorm")
    rows[4]["pct_copy"] = 80.0
    assert report.goal(rows[4]) == "slower than torch; <90% copy"
    rows[0]["pct_copy"] = 95.0
    assert report.goal(rows[0]) == "ok"


def test_traffic_bytes_match_the_seed_formulas():
    m, n = 64, 256
    ln = providers.make_inputs("ln", (m, n), torch.bfloat16, "cpu")
    rms = providers.make_inputs("rms", (m, n), torch.bfloat16, "cpu")
    assert providers.traffic_bytes("ln_fwd", ln) == 2 * m * n * 2 + 2 * n * 4 + 2 * m * 4
    assert providers.traffic_bytes("ln_bwd", ln) == 3 * m * n * 2 + 3 * n * 4 + 2 * m * 4
    assert providers.traffic_bytes("rms_fwd", rms) == 2 * m * n * 2 + n * 4 + m * 4
    assert providers.traffic_bytes("rms_bwd", rms) == 3 * m * n * 2 + 2 * n * 4 + m * 4
    b, s, d = 2, 8, 32
    ada = providers.make_inputs("ada", (b, s, d), torch.bfloat16, "cpu")
    assert providers.traffic_bytes("ada_bwd", ada) == 3 * b * s * d * 2 + 3 * b * d * 2 + 2 * b * s * 4


@pytest.mark.parametrize("family,shape", [("ln", (12, 40)), ("rms", (12, 40)), ("ada", (5, 3, 16))])
def test_chunked_reference_equals_one_pass(family, shape, monkeypatch):
    inp = providers.make_inputs(family, shape, torch.float32, "cpu")
    whole = accuracy.reference(inp, with_grads=True)
    monkeypatch.setattr(accuracy, "CHUNK_ELEMENTS", 50)  # several row chunks
    chunked = accuracy.reference(inp, with_grads=True)
    assert whole.keys() == chunked.keys() == {"y", "dx", *providers.quantities(family + "_bwd")[1:]}
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], rtol=1e-6, atol=1e-6)
    assert accuracy.rel_error(chunked["dx"] * 1.01, whole["dx"]) == pytest.approx(0.01, rel=1e-4)


def test_parse_shapes():
    assert runner.parse_shapes("32768x4096, 4x1024x768") == [(32768, 4096), (4, 1024, 768)]
    with pytest.raises(ValueError, match="'32768' is not MxN or BxSxD"):
        runner.parse_shapes("32768")


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_replay_matches_eager():
    (result,) = cuda_graph.bench(rows=(64,), iters=10)
    assert result["match"] <= cuda_graph.MATCH_TOLERANCE
    assert result["replay_us"] > 0 and result["eager_us"] > 0


@pytest.mark.gpu
@requires_cuda
def test_host_overhead_times_every_op_direction_and_provider(monkeypatch):
    monkeypatch.setattr(host_overhead, "CALLS", 4)
    monkeypatch.setattr(host_overhead, "ROUNDS", 1)
    monkeypatch.setattr(host_overhead, "POOL", 4)
    monkeypatch.setattr(host_overhead, "PASSES", 2)
    results, how = host_overhead.bench(rows=64, cols=1024, ada_shape=(2, 64, 256))
    cases = {(r["op"], r["direction"], r["provider"]) for r in results}
    assert cases == {(op, d, p) for op in ("layer_norm", "rms_norm", "ada_layer_norm")
                     for d in ("fwd-infer", "fwd-train", "bwd") for p in host_overhead.PROVIDERS}
    assert set(host_overhead.PROVIDERS) == {"cudnorm", "cudnorm-cudnn", "cudnorm-python", "torch", "torch-again"}
    assert all(r["same_us"] > 0 and r["fresh_us"] > 0 for r in results) and "fresh" in how
    assert all(r["vs_torch"] == 1.0 for r in results if r["provider"] == "torch")
    stages = host_overhead.breakdown(rows=64, cols=1024, ada_shape=(2, 64, 256))
    assert {r["call"] for r in stages} == {"layer_norm fwd-train", "layer_norm bwd", "rms_norm bwd",
                                           "ada_layer_norm fwd-train", "ada_layer_norm bwd"}
    assert all(r["us"] > 0 for r in stages)



@pytest.mark.slow  # two processes under torchrun
def test_distributed_steps_quick_run_times_every_provider(tmp_path):
    """``benchmarks/distributed_steps.py --quick`` under torchrun with 2 gloo processes: FSDP2
    and TP + SP each give a row per provider with a positive step time (the script's
    mechanics; its speed figures come from GPU runs)."""
    out = tmp_path / "steps.csv"
    for setup in ("fsdp2", "tp"):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(ROOT / "benchmarks" / "distributed_steps.py"), "--quick", "--setup", setup,
                               "--out", str(out)],
                              capture_output=True, text=True, timeout=240, cwd=tmp_path,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = _read_csv(out)
    assert [(r["setup"], r["provider"]) for r in rows] == [
        (s, p) for s in ("fsdp2", "tp") for p in ("torch", "cudnorm", "cudnorm-cudnn", "torch-again")]
    assert all(r["status"] == "ok" and float(r["ms_per_step"]) > 0 for r in rows), rows


@pytest.mark.slow  # two processes under torchrun
def test_distributed_steps_quick_run_times_the_dit_under_fsdp2(tmp_path):
    """``distributed_steps.py --model dit --quick``: diffusers' DiT at toy widths under FSDP2
    over 2 gloo processes, a row per provider with a positive step time, the cudnorm providers
    patched; ``--setup tp`` with it is refused naming both arguments."""
    pytest.importorskip("diffusers")
    from cudnorm._bench.real_models.diffusers_models import DIT  # noqa: PLC0415

    script = str(ROOT / "benchmarks" / "distributed_steps.py")
    out = tmp_path / "steps.csv"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script, "--model", "dit", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = _read_csv(out)
    assert [(r["model"], r["setup"], r["provider"]) for r in rows] == [
        ("dit", "fsdp2", p) for p in ("torch", "cudnorm", "cudnorm-cudnn", "torch-again")]
    assert all(r["status"] == "ok" and float(r["ms_per_step"]) > 0 for r in rows), rows
    toy = DIT.toy
    assert {(r["dim"], r["depth"], r["batch"], r["seq"]) for r in rows} == {
        (str(DIT.width(toy)), str(toy["num_layers"]), str(DIT.toy_batch), str(DIT.tokens(toy)))}
    swapped = [line for line in done.stdout.splitlines() if "cudnorm.patch: swapped" in line]
    assert [line.split(":")[0] for line in swapped] == ["cudnorm", "cudnorm-cudnn"], done.stdout
    assert all("swapped 0 " not in line for line in swapped), swapped
    refused = subprocess.run([sys.executable, script, "--model", "dit", "--setup", "tp"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "--setup tp: --model dit runs under fsdp2 only" in refused.stderr


def test_speedup_panels_of_the_op_and_host_tables():
    """``bench_speedup.png``: cudnorm's kernel time against eager PyTorch's per shape, one
    panel per op, ``torch-again`` as the band; ``host_overhead.png`` likewise per direction."""
    from cudnorm._bench import plots  # noqa: PLC0415

    def op_row(op, shape, provider, ms):
        return {"op": op, "shape": shape, "provider": provider, "ms": ms}

    rows = [op_row("ln_fwd", "8x64", "torch", 2.0), op_row("ln_fwd", "8x64", "cudnorm", 1.0),
            op_row("ln_fwd", "8x64", "torch-again", 2.1), op_row("ln_fwd", "8x64", "liger", 1.5),
            op_row("ln_fwd", "8x128", "torch", 3.0), op_row("ln_fwd", "8x128", "cudnorm", 1.0),
            op_row("ln_bwd", "8x64", "torch", 1.0), op_row("ln_bwd", "8x64", "cudnorm", 2.0)]
    (fwd_title, fwd, fwd_aa), (bwd_title, bwd, bwd_aa) = plots.op_panels(rows)
    assert (fwd_title, bwd_title) == ("LayerNorm forward (training)", "LayerNorm backward")
    assert fwd == [("8x64", "cudnorm", 2.0), ("8x128", "cudnorm", 3.0)] and plots.sorted_cases(fwd) == ["8x128", "8x64"]
    assert fwd_aa == [pytest.approx(2.0 / 2.1)] and bwd == [("8x64", "cudnorm", 0.5)] and bwd_aa == []
    host = [{"op": "rms_norm", "direction": "bwd", "provider": p, "fresh_us": us}
            for p, us in (("torch", 100.0), ("cudnorm", 80.0), ("torch-again", 104.0))]
    assert plots.host_panels(host) == [("bwd", [("rms_norm", "cudnorm", 1.25)], [pytest.approx(100 / 104)])]


def test_policy_threshold_script_times_each_threshold_beside_pytorch(tmp_path):
    """``benchmarks/policy_threshold.py --quick`` (the evidence script of
    ``_policy.NATIVE_CUDNN_MIN_ELEMENTS``): a row per threshold beside PyTorch and PyTorch
    again, and an unknown case named in the error (its speed figures come from GPU runs)."""
    out = tmp_path / "thresholds.csv"
    script = str(ROOT / "benchmarks" / "policy_threshold.py")
    done = subprocess.run([sys.executable, script, "--quick", "--cases", "llama-64:decode-b1",
                           "--thresholds", "0,65536", "--csv", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open()))
    assert [r["variant"] for r in rows] == ["torch", "torch-again", "cudnorm@0", "cudnorm@65536"]
    assert all(float(r["step_ms"]) > 0 for r in rows) and float(rows[0]["vs_torch"]) == 1.0
    bad = subprocess.run([sys.executable, script, "--quick", "--cases", "llama-9:decode-b1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "unknown --cases ['llama-9:decode-b1']" in bad.stderr


def test_step_kernels_script_compares_each_kernel_of_a_step(tmp_path):
    """``benchmarks/step_kernels.py --quick`` (the per-kernel account of a model step): on the
    CPU its "kernels" are operators, a row per name with both providers' times and counts, the
    largest difference first, and the step times beside (its GPU figures come from device runs)."""
    out = tmp_path / "kernels.csv"
    script = str(ROOT / "benchmarks" / "step_kernels.py")
    done = subprocess.run([sys.executable, script, "--quick", "--csv", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open()))
    names = [r["kernel"] for r in rows]
    assert len(names) == len(set(names)) and "aten::mm" in names
    differences = [abs(float(r["difference_ms"])) for r in rows]
    assert differences == sorted(differences, reverse=True)
    mm = rows[names.index("aten::mm")]
    assert float(mm["torch_ms"]) > 0 and int(mm["torch_launches"]) == int(mm["cudnorm_launches"]) > 0
    assert all(float(r["torch_step_ms"]) > 0 and float(r["cudnorm_step_ms"]) > 0 for r in rows)
    assert "dit-64-b2-s16:train: step ms torch" in done.stdout


def test_patched_host_script_times_every_class_beside_the_unpatched_module(tmp_path):
    """``benchmarks/patched_host.py`` (the patched norms' host time, issue 42): on the CPU a row
    per norm class, direction and provider, then the DiT step's, the unpatched module's the
    reference (its GPU figures come from device runs)."""
    out = tmp_path / "patched_host.csv"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "patched_host.py"), "--passes", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open()))
    steps = [r for r in rows if r["section"] == "step"]
    assert [r["provider"] for r in steps] == ["unpatched", "patched", "unpatched-again"]
    assert all(float(r["value"]) > 0 and r["unit"] == "ms" for r in steps)
    rows = [r for r in rows if r["section"] == "per_call"]
    cases = {r["case"] for r in rows}
    assert {"AdaLayerNormZero (DiT, with emb)", "SD35AdaLayerNormZeroX", "diffusers RMSNorm"} <= cases
    assert len(rows) == len(cases) * 3 * 3  # directions x providers
    assert all(float(r["value"]) > 0 and r["unit"] == "us" for r in rows)
    assert all(float(r["vs_unpatched"]) == 1.0 for r in rows if r["provider"] == "unpatched")
