"""``cudnorm bench --models diffusers-all``: every transformer class diffusers exports, built from
its default config (``_bench/real_models/diffusers_all``): the census the run prints, one quick
case per family on the CPU, and the one line a class that cannot be built or run gets."""

from __future__ import annotations

import csv

import pytest
import torch

from cudnorm import cli
from cudnorm._bench import models, real_models
from cudnorm._bench.real_models import diffusers_all

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
    """Latte's default config has no sample_size: it cannot be built, and the run says so once
    (both modes on one line) and goes on."""
    lines, rows = _run(tmp_path, capsys, "diffusers-all:LatteTransformer3DModel")
    skipped = [line for line in lines if line.startswith("skipped") and "Latte" in line]
    assert len(skipped) == 1 and "cannot be built from its default config" in skipped[0]
    assert not rows


def test_a_class_the_generic_inputs_cannot_run_is_skipped(tmp_path, capsys, monkeypatch):
    """ACE-Step's forward takes a ``timestep_r`` no rule makes: its case is one skipped row
    (the torch provider's), not a cudnorm failure, and the run exits 0."""
    monkeypatch.setattr(diffusers_all, "QUICK", ("AceStepTransformer1DModel",))
    lines, rows = _run(tmp_path, capsys, "diffusers-all:AceStepTransformer1DModel:sample")
    assert [r["provider"] for r in rows] == ["torch"] and rows[0]["status"].startswith("skipped: ")
    assert any(line.startswith("skipped diffusers-all:AceStepTransformer1DModel:sample: ") and "timestep_r" in line
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
