"""``cudnorm bench --models`` on diffusers' and transformers' own models (``_bench/real_models``):
the quick (toy-width) cases end to end on the CPU, each provider's copy (patched, unpatched,
norms costing nothing), the ratios of the report, the case filter and the skip of a missing
library."""

from __future__ import annotations

import csv
import statistics

import pytest
import torch

import cudnorm
from cudnorm import cli
from cudnorm._bench import model_cases, models, models_report, real_models
from cudnorm._bench.real_models import limit

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

MODELS = list(real_models.MODELS)
# the providers that run on the CPU (Liger needs triton and a GPU); every real case adds the last two
CPU_PROVIDERS = {"torch", "cudnorm", "torch-again", "limit"}


def _rows(path):
    with open(path, newline="") as f:
        return [models.typed_row(r) for r in csv.DictReader(f)]


def _base(name: str, mode: str = "train") -> torch.nn.Module:
    return real_models.build_base(real_models.RealCase(name, mode, quick=True), "cpu", torch.float32)


def _check_rows(rows: list[dict], case_ids: set[str]) -> None:
    """Every case has a row per CPU provider, all timed; cudnorm's (PyTorch's kernels on the
    CPU, in fp32) and torch-again's results are torch's; the limit's are not (its norms are gone)."""
    assert {r["case"] for r in rows} == case_ids
    for case in case_ids:
        got = {r["provider"]: r for r in rows if r["case"] == case}
        assert set(got) == CPU_PROVIDERS, case
        for r in got.values():
            assert r["status"] == "ok" or r["status"].startswith("ok ("), r
            assert r["step_ms"] > 0 and r["host_ms"] > 0
        train = case.split(":")[1].startswith("train")
        for peer in ("cudnorm", "torch-again"):
            assert got[peer]["rel_diff"] < 1e-5, got[peer]
            assert (got[peer]["grad_rel_diff"] < 1e-5) if train else got[peer]["grad_rel_diff"] is None
        assert got["limit"]["rel_diff"] > 1e-2
        assert got["torch"]["again_ratio"] == pytest.approx(got["torch"]["step_ms"] / got["torch-again"]["step_ms"])


def test_one_real_case_runs_every_provider(tmp_path, capsys):
    assert cli.main(["bench", "--models", "transformers-qwen3-8b:train", "--quick", "--out", str(tmp_path),
                     "--providers", "torch,cudnorm"]) == 0
    rows = _rows(tmp_path / "models.csv")
    _check_rows(rows, {"transformers-qwen3-8b:train"})
    assert (rows[0]["batch"], rows[0]["seq"], rows[0]["width"]) == (2, 16, 32)
    out = capsys.readouterr().out
    assert "transformers Qwen3-8B widths" in out and "share of limit" in out


@pytest.mark.slow  # every real model in both eager modes at toy widths (about 20 s on a CPU)
def test_quick_run_of_every_real_case(tmp_path):
    assert cli.main(["bench", "--models", "diffusers-,transformers-", "--quick", "--out", str(tmp_path)]) == 0
    ids = {f"{name}:{mode}" for name in MODELS for mode in ("train", "sample")}
    rows = _rows(tmp_path / "models.csv")
    _check_rows(rows, ids)
    # sampling runs the classifier-free guidance batch: 2x the prompt batch (not Flux.1-dev: guidance-distilled)
    batch = {r["case"]: r["batch"] for r in rows}
    assert batch["diffusers-dit-xl-2:sample"] == 2 * batch["diffusers-dit-xl-2:train"]
    assert batch["diffusers-flux.1-dev:sample"] == batch["diffusers-flux.1-dev:train"]


@pytest.mark.slow  # torch.compile of four toy models: minutes on a CPU
def test_compiled_real_case_runs(tmp_path):
    assert cli.main(["bench", "--models", "diffusers-sd3.5-medium:train-compile", "--quick", "--out",
                     str(tmp_path), "--providers", "torch,cudnorm"]) == 0
    rows = _rows(tmp_path / "models.csv")
    _check_rows(rows, {"diffusers-sd3.5-medium:train-compile"})
    assert all(r["compile_s"] > 0 for r in rows)


@pytest.mark.parametrize("name", MODELS)
def test_provider_copies(name):
    """Each provider's model is a copy of one seeded model: the same weights, its own storage;
    cudnorm's has cudnorm's norms, torch-again's and the limit's have none."""
    base = _base(name)
    copies = {p: real_models.provider_copy(base, p)[0] for p in ("torch", "cudnorm", "torch-again", "limit")}
    want = base.state_dict()
    for provider, model in copies.items():
        got = model.state_dict()
        assert list(got) == list(want)
        assert all(torch.equal(got[k], want[k]) and got[k].data_ptr() != want[k].data_ptr() for k in want), provider
        patched = [m for m in model.modules() if hasattr(type(m), "_cudnorm_formula")]
        assert bool(patched) == (provider == "cudnorm"), provider
    assert not any(hasattr(type(m), "_cudnorm_formula") for m in base.modules())  # the patch went to the copy


@pytest.mark.parametrize("name", MODELS)
def test_limit_frees_what_the_patch_swaps(name):
    """The limit model's norms return their input and its AdaLN modules return ``x`` itself,
    one freed module for each module ``cudnorm.patch`` swaps, and nothing norm-like is left
    but PixArt's AdaLayerNormSingle (a timestep embedding: it normalises nothing)."""
    swapped = len({id(m) for m in real_models.provider_copy(_base(name), "cudnorm")[0].modules()
                   if hasattr(type(m), "_cudnorm_formula")})
    model = _base(name)
    assert limit.free_norms(model) == swapped > 0
    assert limit.free_norms(model) == 0  # freed already
    freed, calls = [m for m in model.modules() if getattr(type(m), "_bench_free", False)], []

    def record(module, args, kwargs, out):
        x = args[0] if args else next(iter(kwargs.values()))
        first = out[0] if isinstance(out, tuple) else out
        calls.append(first is x)

    for m in freed:
        m.register_forward_hook(record, with_kwargs=True)
    left = {type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__ and m not in freed}
    assert left <= {"AdaLayerNormSingle"}
    case = real_models.RealCase(name, "train", quick=True)
    with torch.no_grad():
        model(**case.spec.inputs(case.config, case.batch, "cpu", torch.float32, torch.Generator().manual_seed(0)))
    assert calls and all(calls)


@pytest.mark.parametrize("name", ["Krea2Transformer2DModel", "StableAudio3DiTModel", "MochiTransformer3DModel"])
def test_limit_frees_every_plain_norm_the_patch_swaps(name):
    """Every module the patch swaps under a formula without modulation (Krea 2's zero-centred
    RMSNorm, Stable Audio 3's, Mochi's) is one the limit frees: a limit that kept them read
    1.01-1.02x beside the patch's 1.20-1.51x on a GPU, a meaningless share of the limit."""
    import copy
    import warnings

    from cudnorm._bench.real_models import diffusers_all

    cls = diffusers_all._by_name()[name]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(**diffusers_all.shrink(cls, True))
        patched = copy.deepcopy(model)
        cudnorm.patch(patched)
    plain = {path for path, m in patched.named_modules()
             if getattr(type(m), "_cudnorm_formula", None) and type(m)._cudnorm_formula.name in limit.PLAIN_FORMULAS}
    limit.free_norms(model)
    freed = {path for path, m in model.named_modules() if getattr(type(m), "_bench_free", False)}
    assert plain and plain <= freed, sorted(plain - freed)


def test_free_adaln_keeps_its_modulation():
    """A freed AdaLayerNormZero still computes its gates (the modulation GEMM runs) and
    returns ``x`` in place of ``norm(x) * (1 + scale) + shift``."""
    from diffusers.models.normalization import AdaLayerNormZero  # noqa: PLC0415

    torch.manual_seed(0)
    ada = AdaLayerNormZero(16)
    x, emb = torch.randn(2, 5, 16), torch.randn(2, 16)
    want = ada(x, emb=emb)
    limit.free_norms(ada)
    got = ada(x, emb=emb)
    assert got[0] is x and len(got) == len(want) == 5
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b)


def test_ratios_of_a_case():
    rows = {p: {**models.blank_row(real_models.RealCase(MODELS[0], "train"), p), "step_ms": ms, "host_ms": 1.0}
            for p, ms in (("torch", 100.0), ("cudnorm", 90.0), ("torch-again", 98.0), ("limit", 80.0))}
    models._ratios(rows)
    assert rows["cudnorm"]["share_of_limit"] == pytest.approx(0.5)
    assert rows["limit"]["share_of_limit"] == pytest.approx(1.0) and rows["torch"]["share_of_limit"] == 0.0
    assert all(r["again_ratio"] == pytest.approx(100 / 98) for r in rows.values())
    assert rows["cudnorm"]["speedup"] == pytest.approx(100 / 90)
    rows["limit"]["step_ms"] = 101.0  # a limit no faster than torch leaves no gain to share
    models._ratios(rows)
    assert rows["cudnorm"]["share_of_limit"] is None


def test_round_by_round_spread_says_when_a_row_lies_beyond_the_noise():
    # ratios pair the rounds: a drift that slows every provider in one round cancels
    torch_ms = [10.0, 20.0, 10.0, 20.0, 10.0, 20.0, 10.0, 20.0]
    rows = {p: {**models.blank_row(real_models.RealCase(MODELS[0], "train"), p), "host_ms": 1.0,
                "step_ms": statistics.median(ms), "_round_ms": ms}
            for p, ms in (("torch", torch_ms), ("cudnorm", [t / 0.9 for t in torch_ms]),
                          ("torch-again", [t * f for t, f in zip(torch_ms, (0.98, 1.02) * 4)]),
                          ("limit", [t / 1.2 for t in torch_ms]))}
    models._ratios(rows)
    assert rows["cudnorm"]["speedup_q1"] == pytest.approx(0.9) and rows["cudnorm"]["speedup_q3"] == pytest.approx(0.9)
    assert models.against_noise(rows["cudnorm"], rows["torch-again"]) == "slower"
    assert models.against_noise(rows["limit"], rows["torch-again"]) == "faster"
    assert models.against_noise(rows["torch-again"], rows["torch-again"]) == ""
    line = {r[1]: r for r in models_report._real_lines(list(rows.values()))[1:]}
    assert line["cudnorm"][3] == "0.90-0.90 slower" and line["limit"][3] == "1.20-1.20 faster"
    assert line["torch"][3] == "" and "slower" not in line["torch-again"][3]
    # within the noise: no verdict; too few rounds or a row read back from a CSV: no spread
    rows["cudnorm"]["_round_ms"] = [t * f for t, f in zip(torch_ms, (1.01, 0.99) * 4)]
    models._ratios(rows)
    assert models.against_noise(rows["cudnorm"], rows["torch-again"]) == ""
    assert models.paired_quartiles([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == (None, None)
    assert models.paired_quartiles(None, [1.0] * 5) == (None, None)


def test_flux_training_turns_cudnn_sdpa_off(capsys):
    flux = "diffusers-flux.1-dev"
    assert real_models.RealCase(flux, "train").sdpa_note("cuda") == real_models.MODELS[flux].cudnn_sdpa_off
    assert real_models.RealCase(flux, "train").sdpa_note("cpu") is None
    assert real_models.RealCase(flux, "sample").sdpa_note("cuda") is None
    assert real_models.RealCase(MODELS[0], "train").sdpa_note("cuda") is None
    rows = {"torch": {"case": f"{flux}:train", "status": "ok"}}
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    with models._without_cudnn_sdpa("why", rows):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == enabled
    assert rows["torch"]["status"] == "ok (cuDNN SDPA off)"
    assert capsys.readouterr().out == f"note: cuDNN SDPA is off for {flux}:train: why\n"


def test_select_real_cases():
    cases = model_cases.all_cases(quick=False) + real_models.cases(quick=False)
    eager = {c.id for c in model_cases.select(cases, "diffusers-,transformers-", "cuda", quick=False)}
    assert eager == {f"{name}:{mode}" for name in MODELS for mode in ("train", "sample")}  # compile on request
    named = model_cases.select(cases, "diffusers-dit-xl-2:train-compile", "cuda", quick=False)
    assert [c.id for c in named] == ["diffusers-dit-xl-2:train-compile"]
    assert "dit-1152-b8-s256:train-compile" in {c.id for c in model_cases.select(cases, None, "cuda", quick=False)}
    dit = next(c for c in cases if c.id == "diffusers-dit-xl-2:sample")
    assert (dit.batch, dit.seq, dit.width) == (64, 256, 1152)  # B 32 x 2 for guidance, 256 px
    flux = next(c for c in cases if c.id == "diffusers-flux.1-dev:train")
    assert (flux.batch, flux.seq, flux.width) == (1, 4096 + 512, 3072)
    full = real_models.RealCase("diffusers-sd3.5-medium", "train", full_depth=True)
    assert full.config["num_layers"] == 24 and full.config["dual_attention_layers"] == tuple(range(13))


def test_missing_library_skips_its_cases_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(real_models.RealCase, "missing",
                        lambda case: "diffusers is not installed" if case.spec.library == "diffusers" else None)
    assert cli.main(["bench", "--models", "diffusers-dit-xl-2:train,transformers-llama-3-8b:sample", "--quick",
                     "--out", str(tmp_path), "--providers", "torch"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]
    assert lines == ["skipped 1 case(s): diffusers is not installed (diffusers-dit-xl-2:train)"]
    assert {r["case"] for r in _rows(tmp_path / "models.csv")} == {"transformers-llama-3-8b:sample"}


def test_missing_reads_the_installed_libraries(monkeypatch):
    import importlib.util  # noqa: PLC0415

    case = real_models.RealCase(MODELS[0], "train")
    assert case.missing() is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert case.missing() == "diffusers is not installed"


def test_modes_of_the_steps_and_the_check():
    """Eager training runs in train mode, compiled training and sampling in eval mode (one
    compiled graph for the steps and the eval-mode check); the check leaves the mode as it was."""
    name = "diffusers-dit-xl-2"
    training = {mode: _base(name, mode).training for mode in real_models.MODES}
    assert training == {"train": True, "sample": False, "train-compile": False, "sample-compile": False}
    w = models.real_builder(real_models.RealCase(name, "train", quick=True), "cpu", torch.float32)("torch")
    seen = []
    w.model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    out, grad = w.check(torch.Generator().manual_seed(0))
    assert seen == [False] and w.model.training
    assert grad.shape == w.inputs(None)[0]["hidden_states"].shape and grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["train", "train-compile", "sample"])
def test_training_steps_take_the_latents_gradient(mode):
    """The latent of a training step requires grad, as in the check (a compiled model then
    sees one graph), and a sampling step's does not."""
    case = real_models.RealCase("transformers-llama-3-8b", mode, quick=True)
    (kwargs,) = models.real_builder(case, "cpu", torch.float32)("torch").inputs(None)
    assert kwargs["inputs_embeds"].requires_grad == case.train
