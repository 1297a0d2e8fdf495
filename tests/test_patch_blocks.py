"""``cudnorm.patch(model, blocks=True)`` (cudnorm._diffusers_blocks): diffusers' DiT, PixArt, SD3,
Flux and Sana blocks with each plain LayerNorm and the modulation after it fused into one op. The
tiny models of tests/test_patching.py: the blocks swapped on request only, the fused op taking
every modulated norm, outputs and gradients equal to the unpatched model's in fp32 (CPU, and
the cuDNN path's code on emulated graphs), bf16 within the 2x-PyTorch-error rule, the block's
own forward where a call is not covered (hooks on a norm it reads, a feed-forward chunk size),
copies and checkpoints as before."""

import copy
from collections import Counter

import pytest
import torch

import cudnorm
from cudnorm import _diffusers_block_ops as block_ops
from cudnorm import _diffusers_blocks as blocks_mod
from cudnorm import reference as ref
from test_patching import (DEVICES, F32_TOL, _assert_grads_close, _bf16, _build, _compiled_matches_eager, _dit,
                           _flux, _on, _output, _output_and_grads, _pixart, _sana, _sd3)

ATTENTION = "diffusers.models.attention"
FLUX = "diffusers.models.transformers.transformer_flux"
# family -> (its tiny model, the block class and count swapped, modulated norms fused per forward)
BLOCK_FAMILIES = {
    "dit": (_dit, (f"{ATTENTION}.BasicTransformerBlock", 2), 2),  # norm3 of each block
    "pixart": (_pixart, (f"{ATTENTION}.BasicTransformerBlock", 2), 4),  # norm1 and norm2 of each block
    "sd3": (_sd3, (f"{ATTENTION}.JointTransformerBlock", 2), 3),  # norm2 twice, norm2_context once (the last block has none)
    "flux": (_flux, (f"{FLUX}.FluxTransformerBlock", 1), 2),  # norm2 and norm2_context
    "sana": (_sana, ("diffusers.models.transformers.sana_transformer.SanaTransformerBlock", 2), 4),  # norm1, norm2
}


def _counting(monkeypatch) -> list:
    """Count the fused modulated norms the block forwards run (LayerNorms and RMSNorms)."""
    calls = []
    for name in ("modulated", "rms_modulated", "gated_modulated"):
        def counted(*args, fused=getattr(block_ops, name)):
            calls.append(1)
            return fused(*args)

        monkeypatch.setattr(block_ops, name, counted)
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_fused_blocks_match_the_unpatched_model(family, device, monkeypatch):
    make, (block_class, block_count), fused_per_forward = BLOCK_FAMILIES[family]
    tiny = make()
    with _on(device) as device:
        inputs = {k: v.to(device) for k, v in tiny.inputs.items()}
        base = _build(tiny).to(device)
        want, want_grads = _output_and_grads(base, inputs)
        model = copy.deepcopy(base)
        report = cudnorm.patch(model, blocks=True)
        swapped = Counter((cls, formula) for _, cls, formula in report.swapped)
        assert swapped[(block_class, f"{block_class.rpartition('.')[2]}_fused")] == block_count, report
        assert swapped - Counter({(block_class, f"{block_class.rpartition('.')[2]}_fused"): block_count}) == Counter(
            tiny.swaps)  # the norms as without blocks
        calls = _counting(monkeypatch)
        got, got_grads = _output_and_grads(model, inputs)
        assert len(calls) == fused_per_forward
        assert got.dtype == want.dtype and ref.rel_error(got, want) <= F32_TOL
        _assert_grads_close(got_grads, want_grads)
        tiny.make().load_state_dict(model.state_dict(), strict=True)  # the checkpoint is the original class's
        with torch.no_grad():  # a copy (what the bench makes of each provider) runs the same
            assert ref.rel_error(_output(copy.deepcopy(model), inputs), got) <= F32_TOL


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_fused_blocks_bf16_meet_the_error_rule(family):
    make = BLOCK_FAMILIES[family][0]
    tiny = make()
    base = _bf16(_build(tiny))
    exact = copy.deepcopy(base).to(torch.float64)
    patched = copy.deepcopy(base)
    cudnorm.patch(patched, blocks=True)
    wide = {k: v.double() if v.is_floating_point() else v for k, v in tiny.inputs.items()}
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() and not k.endswith("_ids") else v
            for k, v in tiny.inputs.items()}
    with torch.no_grad():
        want, theirs, ours = _output(exact, wide), _output(base, half), _output(patched, half)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert ref.rel_error(ours, want) <= ref.error_bound(ref.rel_error(theirs, want), torch.bfloat16)


def test_blocks_are_swapped_on_request_only():
    model = _build(_dit())
    cudnorm.patch(model)
    assert not any(hasattr(type(block), "_cudnorm_formula") for block in model.transformer_blocks)
    report = cudnorm.patch(model, blocks=True)  # later, on request: the blocks only
    assert [formula for _, _, formula in report.swapped] == ["BasicTransformerBlock_fused"] * 2


@pytest.mark.parametrize("family", ["dit", "sd3"])
def test_calls_the_fused_forward_does_not_cover_run_the_blocks_own(family, monkeypatch):
    """A hook on a norm the fused forward reads, and a feed-forward chunk size: the block's own
    forward runs (the hook fires), with the same result."""
    tiny = BLOCK_FAMILIES[family][0]()
    base = _build(tiny)
    with torch.no_grad():
        want = _output(base, tiny.inputs)
    model = copy.deepcopy(base)
    cudnorm.patch(model, blocks=True)
    calls = _counting(monkeypatch)
    first = model.transformer_blocks[0]
    seen = []
    handle = first.norm2.register_forward_hook(lambda *a: seen.append(1)) if family == "sd3" else (
        first.norm3.register_forward_hook(lambda *a: seen.append(1)))
    with torch.no_grad():
        assert ref.rel_error(_output(model, tiny.inputs), want) <= F32_TOL
    assert seen == [1] and len(calls) == BLOCK_FAMILIES[family][2] - (2 if family == "sd3" else 1)
    handle.remove()
    for block in model.transformer_blocks:
        block.set_chunk_feed_forward(1, dim=1)
    calls.clear()
    with torch.no_grad():
        assert ref.rel_error(_output(model, tiny.inputs), want) <= F32_TOL
    assert calls == []


def test_observed_reads_hooks_and_instance_forwards():
    norm = torch.nn.LayerNorm(8)
    assert not block_ops.observed(norm)
    handle = norm.register_forward_pre_hook(lambda *a: None)
    assert block_ops.observed(norm)
    handle.remove()
    norm.forward = norm.forward  # an instance forward, as accelerate's hook sets one
    assert block_ops.observed(norm)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert block_ops.observed(torch.nn.LayerNorm(8))
    finally:
        handle.remove()


@pytest.mark.slow  # torch.compile on the CPU
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_compiled_fused_block_matches_eager(family):
    """``torch.compile(fullgraph=True)`` traces the fused block forward (aot_eager on the CPU)
    and computes what it does eagerly: tests/test_patching.py's check, blocks patched."""
    _compiled_matches_eager(BLOCK_FAMILIES[family][0](), "cpu", blocks=True)


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_fused_block_runs_no_more_python_than_the_patched_one(family):
    """Python calls of one block call (tests/test_patch_host_cost.py's count): the fused forward
    replaces each norm's module call and the two ops after it, and adds no calls of its own
    beyond those (host-bound steps pay each one in every block)."""
    from test_patch_host_cost import _python_calls

    tiny = BLOCK_FAMILIES[family][0]()
    base = _build(tiny)
    counts = []
    for blocks in (False, True):
        model = copy.deepcopy(base)
        cudnorm.patch(model, blocks=blocks)
        _, call, width = tiny.block(model)
        h = torch.randn(2, 8, width)
        with torch.no_grad():
            call(h)
            counts.append(_python_calls(lambda: call(h)))
    assert counts[1] <= counts[0], counts


@pytest.mark.parametrize("name", ["SanaTransformer2DModel", "BriaFiboTransformer2DModel",
                                  "LongCatImageTransformer2DModel", "OvisImageTransformer2DModel",
                                  "QwenImageTransformer2DModel", "Flux2Transformer2DModel",
                                  "ChromaTransformer2DModel", "LTXVideoTransformer3DModel",
                                  "AuraFlowTransformer2DModel", "AllegroTransformer3DModel",
                                  "HiDreamImageTransformer2DModel", "WanTransformer3DModel",
                                  "ChronoEditTransformer3DModel", "HunyuanVideoTransformer3DModel",
                                  "HunyuanVideo15Transformer3DModel", "HunyuanVideoFramepackTransformer3DModel",
                                  "CogView4Transformer2DModel", "SkyReelsV2Transformer3DModel",
                                  "HunyuanImageTransformer2DModel", "Flux3Transformer2DModel"])
def test_fused_blocks_of_diffusers_all_toy_models_match(name, monkeypatch):
    """The block classes added after the four families, on ``diffusers-all``'s toy models (fp32,
    CPU): each model's block is swapped for its fused forward, which fuses its modulated norms,
    and the output and the latent's gradient equal the unpatched model's."""
    from cudnorm._bench.real_models import diffusers_all, diffusers_inputs

    cls = diffusers_all._by_name()[name]
    config = diffusers_all.shrink(cls, toy=True)
    torch.manual_seed(0)
    base = diffusers_inputs.build(cls, config).float().eval()
    model = copy.deepcopy(base)
    report = cudnorm.patch(model, blocks=True)
    assert any(formula.endswith("_fused") for _, _, formula in report.swapped), report
    results, calls = [], _counting(monkeypatch)
    for m in (base, model):
        kwargs = diffusers_all.make_inputs(cls, config, 1, "cpu", torch.float32, torch.Generator().manual_seed(0),
                                           toy=True)
        latent = next(iter(kwargs.values())).requires_grad_(True)
        out = diffusers_all.output(m(**kwargs))
        out.square().mean().backward()
        results.append((out.detach(), latent.grad))
    (want, want_grad), (got, got_grad) = results
    assert calls, "the fused forward fused no modulated norm"
    assert ref.rel_error(got, want) <= F32_TOL and ref.rel_error(got_grad, want_grad) <= F32_TOL


@pytest.mark.parametrize("decided", ["torch", "kernel"])
def test_ltx_blocks_take_the_fused_rms_norm_where_it_is_decided(decided, monkeypatch):
    """LTX-Video's fused block asks the measured decision of op ``modulated_rms_norm`` for each
    per-sample modulated RMSNorm: ``torch`` runs the block's own formula (the plain patch's
    work), anything else the fused :func:`cudnorm.ada_rms_norm`; both compute the unpatched
    model's output (fp32, CPU, ``diffusers-all``'s toy model)."""
    from cudnorm import _candidates, _decisions
    from cudnorm._bench.real_models import diffusers_all, diffusers_inputs

    cls = diffusers_all._by_name()["LTXVideoTransformer3DModel"]
    config = diffusers_all.shrink(cls, toy=True)
    torch.manual_seed(0)
    base = diffusers_inputs.build(cls, config).float().eval()
    model = copy.deepcopy(base)
    cudnorm.patch(model, blocks=True)
    asked, fused, serves = [], [], _decisions.serves

    def decision(op, *args):  # the other ops' calls keep their own answer
        if op != _candidates.MODULATED_RMS:
            return serves(op, *args)
        asked.append(op)
        return decided
    monkeypatch.setattr(_decisions, "serves", decision)
    monkeypatch.setattr(block_ops, "ada_rms_norm", lambda *a, **k: fused.append(1) or cudnorm.ada_rms_norm(*a, **k))
    outputs = []
    for m in (base, model):
        kwargs = diffusers_all.make_inputs(cls, config, 1, "cpu", torch.float32, torch.Generator().manual_seed(0),
                                           toy=True)
        with torch.no_grad():
            outputs.append(diffusers_all.output(m(**kwargs)))
    assert asked, "the fused block asked no decision"
    assert len(fused) == (0 if decided == "torch" else len(asked)), (decided, len(fused), len(asked))
    assert ref.rel_error(outputs[1], outputs[0]) <= F32_TOL


@pytest.mark.parametrize("bodies, forward", [("WAN_BODIES", "_wan_block"),
                                             ("HUNYUAN_VIDEO_BODIES", "_hunyuan_video_block")])
def test_blocks_sharing_a_forward_have_its_body(bodies, forward):
    """The classes one fused forward runs (Wan's ``WAN_BODIES``, HunyuanVideo's
    ``HUNYUAN_VIDEO_BODIES``) have, source for source, one forward: a diffusers release that
    changes one fails here."""
    import importlib
    import inspect

    sources = set()
    for name in getattr(blocks_mod, bodies):
        module, _, cls = name.rpartition(".")
        sources.add(inspect.getsource(getattr(importlib.import_module(module), cls).forward))
        assert blocks_mod.BLOCKS[name].forward is getattr(blocks_mod, forward)
    assert len(sources) == 1


def test_blocks_sharing_fluxs_forward_have_its_body():
    """The classes run by Flux's fused forward (``FLUX_BODIES``) have, source for source, the
    forward of ``FluxTransformerBlock``: a diffusers release that changes one fails here."""
    import importlib
    import inspect

    flux = inspect.getsource(importlib.import_module(FLUX).FluxTransformerBlock.forward)
    for name in blocks_mod.FLUX_BODIES:
        module, _, cls = name.rpartition(".")
        assert inspect.getsource(getattr(importlib.import_module(module), cls).forward) == flux, name
        assert blocks_mod.BLOCKS[name].forward is blocks_mod._flux_block
