"""``cudnorm bench --models``: the quick run end to end, the case filter, and the models
themselves (rotary embeddings, provider equivalence, the fp32-master-weights autocast mode)
on the CPU."""

from __future__ import annotations

import csv

import pytest
import torch

from cudnorm import _settings, cli
from cudnorm._bench import model_cases, model_norms, model_zoo, models, real_models

# cudnorm-python runs under cudnorm.config(native="off"), an option of the native launch path
needs_native_option = pytest.mark.skipif("native" not in _settings.OPTIONS,
                                         reason="this cudnorm.config has no 'native' option")
# the providers whose models of the zoo run on the CPU (Liger needs triton and a GPU)
CPU_PROVIDERS = [pytest.param(p, marks=needs_native_option) if p == "cudnorm-python" else p
                 for p in models.MODEL_PROVIDERS["sd3"] if p not in ("torch", "liger")]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # every model case (test_filter_selects_cases runs a few in the quick tier)
def test_quick_run_writes_every_case(tmp_path, capsys):
    assert cli.main(["bench", "--models", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "models.csv", newline="") as f:
        assert tuple(next(csv.reader(f))) == models.COLUMNS
    rows = _rows(tmp_path / "models.csv")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # fp32 on the CPU, bf16 models on a GPU and in train-autocast everywhere (cudnorm's own
    # path rounds a bf16 result once where PyTorch's formula rounds after each op)
    bounds = {True: 5e-2, False: 1e-3 if device == "cpu" else 5e-2}
    every = model_cases.all_cases(quick=True) + real_models.cases(quick=True)
    expected = {c.id for c in model_cases.select(every, None, device, quick=True)}
    assert {r["case"] for r in rows} == expected
    assert not any(r["mode"] == "train-compile" for r in rows)  # only when asked for, in quick mode
    for case in expected:
        got = {r["provider"]: r for r in rows if r["case"] == case}
        assert {"torch", "cudnorm"} <= set(got), case
        assert set(got) <= set(models.PROVIDERS)
        for r in got.values():
            assert r["status"] == "ok" or r["status"].startswith("ok ("), r  # "ok (patch left ...)"
            assert float(r["step_ms"]) > 0 and float(r["host_ms"]) > 0
        assert float(got["torch"]["speedup"]) == 1.0
        assert float(got["torch"]["rel_diff"]) == 0.0
        bound = bounds[case.endswith("autocast")]
        for peer in set(got) - {"torch", "limit"}:  # the limit's norms compute nothing
            assert float(got[peer]["rel_diff"]) < bound, got[peer]
            if got[peer]["mode"].startswith("train"):
                assert float(got[peer]["grad_rel_diff"]) < bound, got[peer]
    md = (tmp_path / "models.md").read_text()
    assert f"`cudnorm bench --models --quick --out {tmp_path}`" in md
    out = capsys.readouterr().out  # the tables come last
    assert out.rstrip().splitlines()[-1].startswith("transformers-qwen3-8b:sample")


def test_filter_selects_cases(tmp_path):
    # "dit-64" (the quick DiT): "dit" also names diffusers' DiT-XL/2 (tests/test_bench_real_models.py)
    assert cli.main(["bench", "--models", "dit-64", "--quick", "--out", str(tmp_path),
                     "--providers", "torch,cudnorm"]) == 0
    rows = _rows(tmp_path / "models.csv")
    assert rows and all(r["model"] == "dit" for r in rows)
    assert {r["mode"] for r in rows} == {"train", "infer", "train-autocast"}
    assert "--models dit-64" in (tmp_path / "models.md").read_text()
    every = model_cases.all_cases(quick=True) + real_models.cases(quick=True)
    assert {c.model for c in model_cases.select(every, "dit", "cpu", quick=True)} == {"dit", "diffusers-dit-xl-2"}


def test_resume_keeps_finished_cases_and_names_the_one_the_process_died_in(tmp_path, capsys):
    args = ["bench", "--models", "dit-64", "--quick", "--out", str(tmp_path), "--providers", "torch,cudnorm"]
    assert cli.main(args) == 0
    first = _rows(tmp_path / "models.csv")
    assert not (tmp_path / models.RUNNING).exists()  # a run that ends leaves no marker
    # as if the process had died: the last case's rows gone, the marker naming its cudnorm provider
    died = first[-1]["case"]
    kept = [r for r in first if r["case"] != died]
    with open(tmp_path / "models.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, models.COLUMNS)
        writer.writeheader()
        writer.writerows(kept)
    (tmp_path / models.RUNNING).write_text(f"{died}\tcudnorm\ttimed steps\n")
    capsys.readouterr()
    assert cli.main([*args, "--resume"]) == 1  # the crash is cudnorm's: a failed row
    again = _rows(tmp_path / "models.csv")
    assert [r for r in again if r["case"] != died] == kept  # finished cases are not run again
    [crash] = [r for r in again if r["case"] == died]
    assert crash["provider"] == "cudnorm" and crash["status"].startswith("failed: the process died in provider cudnorm")
    assert "cudnorm bench --models dit-64 --quick --providers torch,cudnorm" in (tmp_path / "models.md").read_text()
    # a marker naming a case that has rows is stale: the rows stand
    (tmp_path / models.RUNNING).write_text(f"{died}\ttorch\tbuild and first steps\n")
    assert [r["status"].split(":")[0] for r in models.resumed(tmp_path) if r["case"] == died] == ["failed"]
    # the unpatched model dying is the model's trouble, not cudnorm's: skipped
    with open(tmp_path / "models.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, models.COLUMNS)
        writer.writeheader()
        writer.writerows(kept)
    (tmp_path / models.RUNNING).write_text(f"{died}\ttorch\tbuild and first steps\n")
    [crash] = [r for r in models.resumed(tmp_path) if r["case"] == died]
    assert crash["status"].startswith("skipped: the process died in provider torch's build and first steps")
    (tmp_path / "models.csv").unlink()
    assert models.resumed(tmp_path) == []


def test_resume_goes_with_models(capsys):
    assert cli.main(["bench", "--quick", "--resume"]) == 2
    assert "--resume: goes with --models" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--profile-host"]) == 2
    assert "--profile-host: goes with --models" in capsys.readouterr().err


def test_profile_host_writes_one_profile_per_case_and_provider(tmp_path):
    assert cli.main(["bench", "--models", "dit-64-b2-s16:train", "--quick", "--out", str(tmp_path),
                     "--providers", "torch,cudnorm", "--profile-host"]) == 0
    profiles = sorted((tmp_path / "profiles").glob("*.txt"))
    names = {p.name.split("__")[1] for p in profiles}
    assert {"torch.txt", "cudnorm.txt"} <= names, profiles
    text = next(p for p in profiles if p.name.endswith("__cudnorm.txt")).read_text()
    assert "native table counters over the step" in text and "tottime" in text
    ops = next(p for p in profiles if p.name.endswith("__ops.txt")).read_text()  # the op table against torch's
    assert "cudnorm against torch" in ops and "aten::" in ops
    assert "--profile-host" in (tmp_path / "models.md").read_text()


def test_op_table_difference_orders_the_changes():
    """``<case>__ops.txt``: each provider's own host time per op against PyTorch's step, the total
    first, then the largest increases and the largest decreases."""
    from cudnorm._bench import host_profile

    tables = {"torch": {"aten::mm": (100.0, 4.0), "NativeLayerNormBackward0": (30.0, 2.0)},
              "cudnorm": {"aten::mm": (100.0, 4.0), "CudnormLayerNormBackward": (120.0, 2.0), "aten::copy_": (5.0, 1.0)}}
    lines = host_profile.difference("case", tables, rows=3).splitlines()
    assert lines[0].startswith("case: cudnorm against torch") and lines[0].endswith("+0.10 ms")
    body = [line.split() for line in lines[2:] if line]
    assert body[0] == ["+120.0", "+2.0", "CudnormLayerNormBackward"] and body[1][2] == "aten::copy_"
    assert body[-1] == ["-30.0", "-2.0", "NativeLayerNormBackward0"]


@needs_native_option
def test_cudnorm_python_provider_runs(tmp_path):
    assert cli.main(["bench", "--models", "flux-64-b1-s24:train", "--quick", "--out", str(tmp_path),
                     "--providers", "torch,cudnorm-python"]) == 0
    rows = {r["provider"]: r for r in _rows(tmp_path / "models.csv")}
    assert set(rows) == {"torch", "cudnorm-python"} and rows["cudnorm-python"]["status"] == "ok"


def test_select_and_unknown_filter():
    cases = model_cases.all_cases(quick=False)
    ids = {c.id for c in model_cases.select(cases, "llama-4096:decode,gpt2", "cuda", quick=False)}
    assert ids == {"llama-4096:decode-b1", "llama-4096:decode-b32", "gpt2-1024-b8-s1024:train",
                   "gpt2-1024-b8-s1024:train-compile"}
    assert "dit-1152-b8-s1024:train-compile" in {c.id for c in model_cases.select(cases, None, "cuda", quick=False)}
    on_cpu = model_cases.select(cases, "dit-1152-b8", "cpu", quick=False)
    assert on_cpu and not any(c.compiled for c in on_cpu)  # compile only when the filter names it
    assert {c.mode for c in model_cases.select(cases, "dit-1152-b8-s1024:train-compile", "cpu", quick=False)} == {
        "train-compile"}
    exact = model_cases.select(cases, "dit-1152-b8-s256:train,gpt2-1024-b8-s1024:train-compile", "cuda", quick=False)
    assert [c.id for c in exact] == ["dit-1152-b8-s256:train", "gpt2-1024-b8-s1024:train-compile"]
    # the cases of issue 32's table of model steps
    table = "sd3,flux,dit-1152-b8,dit-1152-b32-s1024:train,llama-4096:decode-b1"
    assert {c.id for c in model_cases.select(cases, table, "cuda", quick=False)} == {
        *(f"{name}:{mode}" for name in ("sd3-1536-b2-s4096-t154", "flux-3072-b1-s4608")
          for mode in ("train", "train-autocast", "infer")),
        *(f"dit-1152-b8-s{s}:{mode}" for s in (256, 1024) for mode in ("train", "train-compile", "infer",
                                                                         "train-autocast")),
        *(f"dit-1152-b8-s256:{mode}" for mode in model_cases.EXTRA_COMPILE_MODES),
        "dit-1152-b32-s1024:train", "llama-4096:decode-b1"}
    # torch.compile's modes: the default, and the two named ones on a host-bound and a GPU-bound step
    modes = {c.id.partition(":")[2]: c.compile_mode for c in model_cases.select(cases, "dit-1152-b32-s1024", "cuda", False)}
    assert modes == {"train": None, "infer": None, "train-compile": None,
                     "train-compile-max-autotune": "max-autotune", "train-compile-reduce-overhead": "reduce-overhead"}
    sd3 = next(c for c in cases if c.model == "sd3")
    assert (sd3.batch, sd3.seq, sd3.text, sd3.width, sd3.width // sd3.heads) == (2, 4096, 154, 1536, 64)
    flux = next(c for c in cases if c.model == "flux")
    assert (flux.batch, flux.seq, flux.width, flux.width // flux.heads) == (1, 4096 + 512, 3072, 128)
    assert cli.main(["bench", "--models", "no-such-model", "--quick"]) == 2
    assert cli.main(["bench", "--models", "--quick", "--providers", "torch,nope"]) == 2


def test_rotary_is_a_relative_rotation():
    rope = model_zoo.Rotary(head_dim=16, max_pos=64).double()
    q, k = torch.randn(2, 1, 1, 16, dtype=torch.float64).unbind(0)
    q, k = q[None], k[None]
    # a rotation: norms are kept
    torch.testing.assert_close(rope(q, 5).norm(), q.norm())
    # scores depend only on the distance between the positions
    score = [(rope(q, m) * rope(k, m - 3)).sum() for m in (3, 10, 40)]
    torch.testing.assert_close(score[1], score[0])
    torch.testing.assert_close(score[2], score[0])
    # position 0 is the identity; channel i rotates with channel i + 8 by angle pos * base^(-i/8)
    torch.testing.assert_close(rope(q, 0), q)
    x = torch.zeros(1, 1, 1, 16, dtype=torch.float64)
    x[..., 1] = 1.0
    angle = torch.tensor(7 * 10000.0 ** (-2 / 16), dtype=torch.float64)
    got = rope(x, 7)[0, 0, 0]
    torch.testing.assert_close(got[[1, 9]], torch.stack([angle.cos(), angle.sin()]))
    assert got[[0, 2, 8, 10]].abs().max() == 0


def test_decode_matches_full_forward():
    """Token-by-token decode through the KV cache gives the causal full forward's outputs."""
    model = model_zoo.build_llama(32, 4, 64, 2, "torch", max_pos=16).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    full = model(x)
    model.make_cache(2, context=16, prefill=0)
    steps = torch.cat([model.decode_step(x[:, i:i + 1]) for i in range(6)], dim=1)
    torch.testing.assert_close(steps, full)


@pytest.mark.parametrize("train", [False, True])
def test_dit_providers_agree(train):
    """The cudnorm-provider DiT and the torch-provider DiT have the same weights and give the
    same output (and gradients) in fp32 on the CPU."""
    ref, mine = (model_zoo.build_dit(32, 4, 2, p) for p in ("torch", "cudnorm"))
    for a, b in zip(ref.state_dict().values(), mine.state_dict().values()):
        assert torch.equal(a, b)
    x, c = torch.randn(2, 8, 32), torch.randn(2, 32)
    outs = []
    for model in (ref, mine):
        with torch.set_grad_enabled(train):
            out = model(x, c)
        if train:
            out.float().square().mean().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    if train:
        for a, b in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4)


def test_llama_and_gpt_providers_share_weights():
    for build in (lambda p: model_zoo.build_llama(32, 4, 64, 2, p, max_pos=16),
                  lambda p: model_zoo.build_gpt(32, 4, 2, p)):
        ref, mine = build("torch"), build("cudnorm")
        assert list(ref.state_dict()) == list(mine.state_dict())
        for a, b in zip(ref.state_dict().values(), mine.state_dict().values()):
            assert torch.equal(a, b)
        norm = ref.layers[0].modules()
        weights = [m.weight for m in norm if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))]
        assert weights and not torch.equal(weights[0], torch.ones_like(weights[0]))  # randomised


def _tiny(model: str, mode: str) -> model_cases.Case:
    return next(c for c in model_cases.all_cases(quick=True) if c.model == model and c.mode == mode)


def _run(case, provider, dtype=torch.float32):
    """``(model, output, {parameter name: grad})`` of one seeded step of ``case``."""
    with model_norms.provider_settings(provider):
        w = models.build(case, provider, "cpu", dtype)
        out = w.step(torch.Generator().manual_seed(1)).detach()
    return w.model, out, {n: p.grad for n, p in w.model.named_parameters()}


@pytest.mark.parametrize("model", ["sd3", "flux"])
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_sd3_and_flux_providers_agree(model, provider, mode):
    """Every provider's SD3/Flux model has torch's weights and, in fp32 on the CPU (where
    cudnorm's norms run PyTorch's kernels), its outputs and gradients."""
    case = _tiny(model, mode)
    ref, want, want_grads = _run(case, "torch")
    mine, got, grads = _run(case, provider)
    assert list(ref.state_dict()) == list(mine.state_dict())
    for a, b in zip(ref.state_dict().values(), mine.state_dict().values()):
        assert torch.equal(a, b)
    norm_q = mine.blocks[0].attn.norm_q if model == "flux" else mine.blocks[0].image.attn.norm_q
    assert norm_q.weight.shape == (case.width // case.heads,)  # a per-head norm, randomised
    assert not torch.equal(norm_q.weight, torch.ones_like(norm_q.weight))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        if case.train:
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
        else:
            assert grad is None and grads[name] is None


@pytest.mark.parametrize("model", ["dit", "sd3", "flux"])
@pytest.mark.parametrize("provider", ["torch", *CPU_PROVIDERS])
def test_autocast_mode_keeps_fp32_master_weights(model, provider):
    """``train-autocast``: parameters (norm weights included) and their gradients stay fp32,
    the norms see bf16 activations under autocast, and the output is as close to the fp64
    model's as PyTorch's own norms get (at most 2x torch's error)."""
    case = _tiny(model, "train-autocast")
    with model_norms.provider_settings(provider):
        w = models.build(case, provider, "cpu", torch.float32)
    assert {p.dtype for p in w.model.parameters()} == {torch.float32}
    seen = set()  # (norm, autocast on, activation dtype, weight dtype) of every norm call

    def record_ada(norm_mod):
        def recorded(x, shift, scale):
            seen.add(("ada", torch.is_autocast_enabled("cpu"), x.dtype, None))
            return norm_mod(x, shift, scale)
        return recorded

    def record_rms(module, args):
        seen.add(("rms", torch.is_autocast_enabled("cpu"), args[0].dtype, module.weight.dtype))

    for m in w.model.modules():
        if hasattr(m, "norm_mod"):
            m.norm_mod = record_ada(m.norm_mod)
        if isinstance(m, model_zoo.QKV):
            m.norm_q.register_forward_pre_hook(record_rms)
            m.norm_k.register_forward_pre_hook(record_rms)
    gen = torch.Generator().manual_seed(1)
    inputs = w.inputs(gen)
    assert {x.dtype for x in inputs} == {torch.bfloat16}
    with model_norms.provider_settings(provider):
        out = w.forward(*inputs)
    out.float().square().mean().backward()
    assert seen == {("ada", True, torch.bfloat16, None)} | (
        set() if model == "dit" else {("rms", True, torch.bfloat16, torch.float32)})
    assert {p.grad.dtype for p in w.model.parameters()} == {torch.float32}

    # the same model in fp64 without autocast: the reference both providers are held to
    builder = {"dit": lambda: model_zoo.build_dit(case.width, case.heads, case.depth, "torch"),
               "sd3": lambda: model_zoo.build_sd3(case.width, case.heads, case.depth, "torch"),
               "flux": lambda: model_zoo.build_flux(case.width, case.heads, case.depth, "torch", case.seq)}[model]
    with torch.no_grad():
        ref = builder().double()(*(x.double() for x in inputs))

    def err(y):
        return float((y.detach().double() - ref).norm() / ref.norm())

    assert err(out) <= 2 * err(_run(case, "torch")[1])


def _row(call, case, mode, provider, speedup):
    return {**models.blank_row(model_cases.Case("dit", case, mode, 2, 8, 64, 4, 1), provider), "call": call,
            "case": f"{case}:{mode}", "speedup": speedup, "step_ms": 1.0, "host_ms": 1.0, "host_ratio": 1.0}


RESULTS = [  # two device calls of one results file, as benchmarks/results/<gpu>/models.csv keeps them
    _row("A", "dit-old", "train", "cudnorm", 1.50), _row("A", "dit-old", "train", "torch-again", 1.20),
    _row("B", "dit-x", "train", "cudnorm", 0.97), _row("B", "dit-y", "train", "cudnorm", 1.06),
    _row("B", "dit-x", "train", "torch-again", 1.02), _row("B", "dit-y", "infer", "cudnorm", 1.01),
    _row("B", "dit-y", "infer", "torch-again", 0.99),
]


def test_plot_draws_the_latest_call_sorted_with_its_noise_band():
    """models.png shows one run (the last call of a results file), cases sorted by cudnorm's
    speed-up, one panel per mode, the run's torch-again ratios as its band (not as bars)."""
    from cudnorm._bench import plots  # noqa: PLC0415

    call, latest = plots.latest_run(RESULTS)
    assert call == "B" and {r["call"] for r in latest} == {"B"}
    panels = plots.model_panels(latest, {"train": "train", "infer": "infer / decode"})
    assert [title for title, _, _ in panels] == ["train", "infer / decode"]
    (_, train, train_aa), (_, infer, infer_aa) = panels
    assert plots.sorted_cases(train) == ["dit-y", "dit-x"]  # 1.06 before 0.97
    assert train_aa == [1.02] and infer_aa == [0.99]
    assert all(provider != "torch-again" for _, provider, _ in train + infer)


def test_from_csv_redraws_the_plot_of_a_results_file(tmp_path, capsys):
    """``cudnorm bench --from-csv models.csv`` redraws models.png from a file holding several
    calls (the latest by default, ``--call`` another) and prints that call's tables."""
    import importlib.util  # noqa: PLC0415

    from cudnorm._bench import report  # noqa: PLC0415

    path = tmp_path / "models.csv"
    report.write_csv(RESULTS, path, columns=("call", *models.COLUMNS))
    assert cli.main(["bench", "--from-csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DiT (AdaLN) (call B)" in out and "dit-old" not in out
    assert cli.main(["bench", "--from-csv", str(path), "--call", "A"]) == 0
    assert "dit-old" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "models.png").stat().st_size > 0
