"""``cudnorm bench --models diffusers-all``: every transformer class diffusers exports, built from
its default config (``_bench/real_models/diffusers_all``): the census the run prints, one quick
case per family on the CPU, and the one line a class that cannot be built or run gets."""

from __future__ import annotations

import csv

import pytest
import torch

from cudnorm import cli
from cudnorm._bench import models, real_models
from cudnorm._bench.real_models import diffusers_all, diffusers_inputs

pytest.importorskip("diffusers")


def _rows(path):
    with open(path, newline="") as f:
        return [models.typed_row(r) for r in csv.DictReader(f)]


def _run(tmp_path, capsys, models_filter: str) -> tuple[list[str], list[dict]]:
    assert cli.main(["bench", "--models", models_filter, "--quick", "--out", str(tmp_path), "--providers",
                     "torch,cudnorm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    csv_path = tmp_path / "models.csv"
    return lines, _rows(csv_path) if csv_path.exists() else []


def test_census_is_what_the_run_reports(tmp_path, capsys):
    """The run prints how many classes it found and built; that is the count of classes the
    probe builds with a norm the patch swaps, and every exported transformer class is a model."""
    found, built, skipped = diffusers_all.census(toy=True)
    buildable = [n for n in diffusers_all.names()
                 if not isinstance(diffusers_all.probe(n.removeprefix(diffusers_all.PREFIX), True), str)]
    assert found == len(diffusers_all.names()) == built + len(skipped) and built == len(buildable) > 0
    assert {"DiTTransformer2DModel", "FluxTransformer2DModel", "WanTransformer3DModel"} <= {
        n.removeprefix(diffusers_all.PREFIX) for n in buildable}
    lines, rows = _run(tmp_path, capsys, "diffusers-all:DiTTransformer2DModel:train")
    assert f"diffusers-all: {found} classes found, {built} built with norms cudnorm.patch swaps, " \
           f"{len(skipped)} skipped" in lines
    assert {r["case"] for r in rows} == {"diffusers-all:DiTTransformer2DModel:train"}
    assert all(r["status"].startswith("ok") for r in rows)
    assert any("diffusers-all:DiTTransformer2DModel: cudnorm.patch swaps 4 norm(s)" in line for line in lines)


def test_a_class_that_cannot_be_built_gets_one_line(tmp_path, capsys):
    """DualTransformer2DModel (a pair of Transformer2DModels, no widths of its own) has no in_channels:
    it cannot be built, and the run says so once (both modes on one line) and goes on."""
    lines, rows = _run(tmp_path, capsys, "diffusers-all:DualTransformer2DModel")
    skipped = [line for line in lines if line.startswith("skipped") and "DualTransformer2D" in line]
    assert len(skipped) == 1 and "cannot be built from its default config" in skipped[0]
    assert not rows


def test_a_class_the_generic_inputs_cannot_run_is_skipped(tmp_path, capsys, monkeypatch):
    """Ideogram 4's forward takes mRoPE ``position_ids`` no rule makes: its case is one skipped row
    (the torch provider's), not a cudnorm failure, and the run exits 0."""
    monkeypatch.setattr(diffusers_all, "QUICK", ("Ideogram4Transformer2DModel",))
    lines, rows = _run(tmp_path, capsys, "diffusers-all:Ideogram4Transformer2DModel:sample")
    assert [r["provider"] for r in rows] == ["torch"] and rows[0]["status"].startswith("skipped: ")
    assert any(line.startswith("skipped diffusers-all:Ideogram4Transformer2DModel:sample: ") and "position_ids" in line
               for line in lines)


def test_quick_mode_runs_only_its_subset():
    cases = real_models.cases(quick=True, diffusers_every=True)
    runnable = {c.model.removeprefix(diffusers_all.PREFIX) for c in cases
                if c.model.startswith(diffusers_all.PREFIX) and c.missing() is None}
    assert runnable == set(diffusers_all.QUICK)
    assert not any(c.model.startswith(diffusers_all.PREFIX) for c in real_models.cases(quick=True))


@pytest.mark.slow  # one class per family, both modes (10-20 s each on a CPU)
@pytest.mark.parametrize("name", diffusers_all.QUICK)
def test_quick_case_per_family(tmp_path, capsys, name):
    lines, rows = _run(tmp_path, capsys, f"{diffusers_all.PREFIX}{name}")
    assert {r["case"] for r in rows} == {f"{diffusers_all.PREFIX}{name}:{m}" for m in ("train", "sample")}
    for r in rows:
        assert r["status"].startswith("ok"), r
        if r["provider"] in ("cudnorm", "torch-again"):
            assert r["rel_diff"] < 1e-5, r


def test_exports_that_fail_to_resolve_are_passed_over():
    import types

    class FakeTransformer2DModel(torch.nn.Module):
        pass

    class Lazy(types.ModuleType):
        def __dir__(self):
            return ["FakeTransformer2DModel", "BrokenTransformerModel", "OnnxPipelineLegacy", "HelperTransformer"]

        def __getattr__(self, name):
            if name == "FakeTransformer2DModel":
                return FakeTransformer2DModel
            if name == "HelperTransformer":
                return len  # not a module class
            raise AttributeError(f"module has no attribute {name}")  # as diffusers' lazy import does

    assert diffusers_all.exported_modules(Lazy("fake"), "Transformer") == {"FakeTransformer2DModel": FakeTransformer2DModel}


@pytest.mark.parametrize("name", ["CogVideoXTransformer3DModel", "PixArtTransformer2DModel", "Lumina2Transformer2DModel"])
def test_inputs_meet_what_the_class_reads(name):
    """The rules for classes the generic inputs once failed: CogVideoX's positional table spans
    max_text_seq_length caption tokens; PixArt at 1024 px reads resolution and aspect-ratio
    tensors; Lumina 2 counts its caption tokens from a boolean mask."""
    cls = diffusers_all._by_name()[name]
    config = diffusers_all.shrink(cls, toy=False)
    kwargs = diffusers_all.make_inputs(cls, config, 2, "meta", torch.bfloat16, None, toy=False)
    if name.startswith("CogVideoX"):
        assert kwargs["encoder_hidden_states"].shape[1] == config["max_text_seq_length"] == 226
    elif name.startswith("PixArt"):
        cond = kwargs["added_cond_kwargs"]
        assert cond["resolution"].shape == (2, 2) and cond["aspect_ratio"].shape == (2, 1)
    else:
        assert kwargs["encoder_attention_mask"].dtype is torch.bool


@pytest.mark.slow  # every class built on the meta device at its published widths (about 20 s)
def test_every_class_patches_or_says_why():
    """Issue 47's rule for ``cudnorm.patch``'s report: on every class ``diffusers-all`` builds, each
    module it leaves carries a stated reason (normalises nothing, a per-token modulation, ...),
    never the generic "no formula is registered"."""
    import warnings

    import cudnorm

    unexplained = {}
    for name, cls in diffusers_all._by_name().items():
        if isinstance(diffusers_all.probe(name, False), str):
            continue  # not a case: it cannot be built, or has no norm the patch swaps
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = cudnorm.patch(cls(**diffusers_all.shrink(cls, False)))
        generic = sorted({c.rpartition(".")[2] for _, c, why in report.left if why.startswith("no cudnorm formula")})
        if generic:
            unexplained[name] = generic
    assert not unexplained, unexplained


# the classes the per-class tables (diffusers_inputs) make run: a published config where the defaults
# cannot be built, or the forward arguments only that class reads
FIXED = ("DreamLiteTransformer2DModel", "EasyAnimateTransformer3DModel", "HiDreamImageTransformer2DModel",
         "HunyuanDiT2DModel", "LatteTransformer3DModel", "LuminaNextDiT2DModel", "OmniGenTransformer2DModel",
         "Transformer2DModel", "TransformerTemporalModel", "Kandinsky5Transformer3DModel",
         "HunyuanVideo15Transformer3DModel", "HunyuanVideoFramepackTransformer3DModel", "WanVACETransformer3DModel",
         "GlmImageTransformer2DModel", "LTXVideoTransformer3DModel", "QwenImage21Transformer2DModel",
         "ErnieImageTransformer2DModel", "ZImageTransformer2DModel", "PRXTransformer2DModel",
         # diffusers_inputs_av's: audio beside video, poses and faces, per-sample packing, reference passes
         "LTX2VideoTransformer3DModel", "WanAnimateTransformer3DModel", "WanAnimate2Transformer3DModel",
         "JoyImageEditPlusTransformer3DModel", "AnyFlowTransformer3DModel",
         "BriaFiboTransformer2DModel", "BriaFibo2Transformer2DModel", "Cosmos3OmniTransformer",
         "AceStepTransformer1DModel", "StableAudioDiTModel", "StableAudio3DiTModel", "PriorTransformer", "T5FilmDecoder",
         # their norms patched since Krea 2's and Stable Audio 3's RMSNorms took formulas
         "Krea2Transformer2DModel",
         # the toy widths once broke a projection (caption_projection_dim is the inner width)
         "AllegroTransformer3DModel", "AuraFlowTransformer2DModel", "SD3Transformer2DModel",
         "SanaTransformer2DModel", "SanaVideoTransformer3DModel")

# inputs made, but no toy backward on the CPU: AnyFlow-FAR attends through FlexAttention (no CPU backward)
INPUTS_ONLY = ("AnyFlowFARTransformer3DModel",)


def test_published_configs_are_applied_and_build():
    """Every class of diffusers_inputs.CONFIGS builds on the meta device at the run's widths with norms
    the patch swaps, and its config carries the published values (those not cut by depth shrinking)."""
    for name, published in diffusers_inputs.CONFIGS.items():
        cls = diffusers_all._by_name()[name]
        assert not isinstance(diffusers_all.probe(name, False), str), (name, diffusers_all.probe(name, False))
        assert not isinstance(diffusers_all.probe(name, True), str), (name, diffusers_all.probe(name, True))
        config = diffusers_all.shrink(cls, toy=False)
        kept = {k: v for k, v in published.items() if not diffusers_all._is_depth(k, v) and "layers" not in k}
        assert {k: config[k] for k in kept} == kept, name
    hidream = diffusers_all.shrink(diffusers_all._by_name()["HiDreamImageTransformer2DModel"], toy=False)
    # one Llama layer per block kept: the published list's first double block's and first single block's
    assert hidream["llama_layers"] == [0, 16] and hidream["num_layers"] == hidream["num_single_layers"] == 1


@pytest.mark.parametrize("name", FIXED + INPUTS_ONLY)
def test_fixed_class_inputs_at_published_widths(name):
    """At the run's widths (meta device) the inputs are made, hold the class's own arguments, and the
    latent comes first; the published text lengths HunyuanDiT's padding table spans are kept."""
    cls = diffusers_all._by_name()[name]
    config = diffusers_all.shrink(cls, toy=False)
    kwargs = diffusers_all.make_inputs(cls, config, 2, "meta", torch.bfloat16, None, toy=False)
    latent = next(iter(kwargs.values()))
    assert torch.is_tensor(latent) and latent.is_floating_point() and latent.shape[0] in (2, 2 * 4), name
    own = diffusers_inputs.INPUTS.get(name)
    if own:
        step = diffusers_inputs.Inputs(config, 2, 8, 2, 8, False, "meta", torch.bfloat16, None, latent)
        assert set(own(step)) <= set(kwargs), name
    if name == "HunyuanDiT2DModel":
        assert kwargs["encoder_hidden_states"].shape[1] == config["text_len"] == 77
        assert kwargs["encoder_hidden_states_t5"].shape[1] == config["text_len_t5"] == 256


@pytest.mark.slow  # about 20 classes' toy models, one forward and backward each on the CPU
@pytest.mark.parametrize("name", FIXED)
def test_fixed_class_toy_forward_backward(name):
    """The toy config built on the CPU in fp32 runs one forward and backward from the made inputs,
    and the latent gets a gradient (the one the bench compares)."""
    cls = diffusers_all._by_name()[name]
    config = diffusers_all.shrink(cls, toy=True)
    torch.manual_seed(0)
    model = diffusers_inputs.build(cls, config)
    kwargs = diffusers_all.make_inputs(cls, config, 1, "cpu", torch.float32, torch.Generator().manual_seed(0),
                                       toy=True)
    latent = next(iter(kwargs.values())).requires_grad_(True)
    out = diffusers_all.output(model(**kwargs))
    out.float().square().mean().backward()
    # connected, not necessarily nonzero: some classes zero-initialise their output projection (ERNIE-Image)
    assert torch.isfinite(out).all() and latent.grad is not None and torch.isfinite(latent.grad).all(), name
