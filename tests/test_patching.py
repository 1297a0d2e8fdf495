"""``cudnorm.patch`` on real transformers and diffusers models built from tiny configs: Llama,
Qwen2, Qwen3, Gemma, Gemma 2, GPT-2, T5, DiT, SD3, Flux and PixArt (CPU; the ``emulated``
variants run the cuDNN path's code on emulated graphs, the ``gpu`` variants on cuDNN). For each
model: what is swapped and what is left; parameters and state_dict keys untouched and a
checkpoint of the original loading strictly into the patched model; outputs and gradients equal
to the unpatched model's in fp32 (1e-5 relative); bf16 outputs within the 2x-PyTorch-error
rule; ``save_pretrained`` / ``from_pretrained`` round trips; ``torch.compile(fullgraph=True)``
of a patched block equal to eager. Then every norm class the patch tables name against its
stand-in, in every pair of weight and input dtypes, and plain PyTorch models."""

import contextlib
import importlib
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

import cudnorm
from cudnorm import reference as ref
from cudnorm.patching import GEMMA_STYLE_RMS_NORMS, LLAMA_STYLE_RMS_NORMS, T5_STYLE_RMS_NORMS

import emulated_cudnn as emu

F32_TOL = 1e-5
# "emulated": CPU tensors through the cuDNN path's own code, the graphs emulated
# (tests/emulated_cudnn.py); the GPU runs cudnorm's cuDNN path itself
DEVICES = ["cpu", "emulated", pytest.param("cuda", marks=pytest.mark.gpu)]


@contextlib.contextmanager
def _on(device: str):
    """The torch device of a ``DEVICES`` entry, with the graph emulator installed for
    ``"emulated"``."""
    if device != "emulated":
        yield device
        return
    with emu.installed():
        yield "cpu"


B, VOCAB = 2, 128
LAYER_NORMS = ("torch.nn.LayerNorm", "cudnorm.LayerNorm")


class Tiny(NamedTuple):
    """A tiny model family and what patching it must give."""

    make: Callable[[], torch.nn.Module]  # the unpatched model with fresh random weights
    inputs: dict  # forward keyword arguments (CPU tensors)
    swaps: dict  # {(old class, new class): count} the report must list
    left: list  # [(module name, class)] the report must list as left
    block: Callable  # model -> (a block, a call of it on h [B, 8, width], width)


# ---------------------------------------------------------------- transformers models

def _ids(*shape):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(1))


def _decoder(name, swaps, **extra):
    """A Llama-shaped causal LM of transformers' family ``name``; the block is its first decoder
    layer, given the rotary embedding of the model."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, name + "Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **extra)

    def block(model):
        layer, positions = model.model.layers[0], torch.arange(8, device=model.device)[None]
        return layer, lambda h: layer(h, position_embeddings=model.model.rotary_emb(h, positions),
                                      position_ids=positions), 64

    return Tiny(lambda: getattr(transformers, name + "ForCausalLM")(config), {"input_ids": _ids(B, 16)}, swaps, [],
                block)


def _llama():  # 2 a layer + the final norm
    return _decoder("Llama", {("transformers.LlamaRMSNorm", "cudnorm.LlamaStyleRMSNorm"): 5}, num_key_value_heads=2)


def _qwen2():
    return _decoder("Qwen2", {("transformers.Qwen2RMSNorm", "cudnorm.LlamaStyleRMSNorm"): 5}, num_key_value_heads=2)


def _qwen3():  # q_norm and k_norm (over head_dim) too: 4 a layer + final
    return _decoder("Qwen3", {("transformers.Qwen3RMSNorm", "cudnorm.LlamaStyleRMSNorm"): 9}, num_key_value_heads=2,
                    head_dim=16)


def _gemma():
    return _decoder("Gemma", {("transformers.GemmaRMSNorm", "cudnorm.GemmaStyleRMSNorm"): 5}, num_key_value_heads=1,
                    head_dim=16)


def _gemma2():  # pre- and post-norms around attention and MLP: 4 a layer + final
    return _decoder("Gemma2", {("transformers.Gemma2RMSNorm", "cudnorm.GemmaStyleRMSNorm"): 9},
                    num_key_value_heads=1, head_dim=16)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)

    def block(model):
        layer = model.transformer.h[0]
        return layer, layer, 64

    return Tiny(lambda: transformers.GPT2LMHeadModel(config), {"input_ids": _ids(B, 16)}, {LAYER_NORMS: 5}, [], block)


def _t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)

    def block(model):
        layer = model.encoder.block[0]  # the first holds the relative attention bias
        return layer, layer, 32

    # encoder: 2 a layer + final; decoder: 3 a layer (self-, cross-attention, MLP) + final
    return Tiny(lambda: transformers.T5ForConditionalGeneration(config),
                {"input_ids": _ids(B, 12), "decoder_input_ids": _ids(B, 8)},
                {("transformers.T5LayerNorm", "cudnorm.T5StyleRMSNorm"): 12}, [], block)


# ---------------------------------------------------------------- diffusers models

def _mirror(name, count):
    """The swap of diffusers' AdaLN class ``name`` for cudnorm.diffusers' class of that name."""
    return {(f"diffusers.{name}", f"cudnorm.diffusers.{name}"): count}


def _dit():
    diffusers = pytest.importorskip("diffusers")
    config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=8,
                  patch_size=2, num_embeds_ada_norm=10)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), timestep=torch.tensor([3, 500]),
                  class_labels=torch.tensor([1, 2]))

    def block(model):
        layer, dev = model.transformer_blocks[0], model.device
        return layer, lambda h: layer(h, timestep=torch.tensor([3, 500], device=dev),
                                      class_labels=torch.tensor([1, 2], device=dev)), 16

    # norm1 of each block: AdaLayerNormZero; norm3 of each block and norm_out: nn.LayerNorm
    return Tiny(lambda: diffusers.DiTTransformer2DModel(**config), inputs,
                {**_mirror("AdaLayerNormZero", 2), LAYER_NORMS: 3}, [], block)


def _joint_block(model):
    """The first block of SD3 or Flux: ``(hidden_states, encoder_hidden_states, temb)``."""
    layer, dev = model.transformer_blocks[0], model.device
    context, temb = torch.randn(B, 3, 16, device=dev), torch.randn(B, 16, device=dev)
    return layer, lambda h: layer(h, context, temb), 16


def _sd3():
    diffusers = pytest.importorskip("diffusers")
    config = dict(sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
                  out_channels=4, pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm")
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 3, 16),
                  pooled_projections=torch.randn(B, 8), timestep=torch.tensor([3, 500]))
    # block 0: SD35AdaLayerNormZeroX + AdaLayerNormZero (context); block 1 (the last, context
    # pre-only): AdaLayerNormZero + AdaLayerNormContinuous; the output norm: AdaLayerNormContinuous;
    # q/k norms: diffusers' RMSNorm (4 a joint attention, 2 in block 0's second attention)
    return Tiny(lambda: diffusers.SD3Transformer2DModel(**config), inputs, {
        **_mirror("SD35AdaLayerNormZeroX", 1), **_mirror("AdaLayerNormZero", 2), **_mirror("AdaLayerNormContinuous", 2),
        ("diffusers.RMSNorm", "cudnorm.T5StyleRMSNorm"): 10, LAYER_NORMS: 3}, [], _joint_block)


def _flux():
    diffusers = pytest.importorskip("diffusers")
    config = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    inputs = dict(hidden_states=torch.randn(B, 6, 4), encoder_hidden_states=torch.randn(B, 3, 16),
                  pooled_projections=torch.randn(B, 8), timestep=torch.tensor([0.3, 0.5]),
                  img_ids=torch.randn(6, 3), txt_ids=torch.zeros(3, 3))
    return Tiny(lambda: diffusers.FluxTransformer2DModel(**config), inputs, {
        **_mirror("AdaLayerNormZero", 2), **_mirror("AdaLayerNormZeroSingle", 1),
        **_mirror("AdaLayerNormContinuous", 1), ("torch.nn.RMSNorm", "cudnorm.RMSNorm"): 6, LAYER_NORMS: 2},
        [], _joint_block)


def _pixart():
    """adaLN-single: one AdaLayerNormSingle for the model (a timestep embedding and a linear, no
    norm); each block adds its ``scale_shift_table`` and modulates the output of a non-affine
    ``nn.LayerNorm`` inline, and those LayerNorms are what patch swaps."""
    diffusers = pytest.importorskip("diffusers")
    config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
                  sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=12)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 3, 12),
                  timestep=torch.tensor([3, 500]))

    def block(model):
        layer, dev = model.transformer_blocks[0], model.device
        context, timestep = torch.randn(B, 3, 16, device=dev), torch.randn(B, 6 * 16, device=dev)
        return layer, lambda h: layer(h, encoder_hidden_states=context, timestep=timestep), 16

    # norm1 and norm2 of each block, and norm_out
    return Tiny(lambda: diffusers.PixArtTransformer2DModel(**config), inputs, {LAYER_NORMS: 5},
                [("adaln_single", "diffusers.AdaLayerNormSingle")], block)


FAMILIES = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "gemma": _gemma, "gemma2": _gemma2, "gpt2": _gpt2,
            "t5": _t5, "dit": _dit, "sd3": _sd3, "flux": _flux, "pixart": _pixart}


# ---------------------------------------------------------------- helpers

def _build(tiny):
    """The unpatched model in eval mode (no dropout), every parameter moved off its init: norm
    weights off ones (Gemma's off zeros), diffusers' zero-initialised modulation off zero, so
    a wrong formula or a dropped parameter shows."""
    torch.manual_seed(0)
    model = tiny.make().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _bf16(model):
    """``model`` in bf16 as ``from_pretrained(..., dtype=torch.bfloat16)`` gives it: modules the
    class keeps in fp32 stay fp32 (T5's ``wo``, after which T5's residual stream is fp32 and
    its norms get fp32 input with bf16 weights)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    model.to(torch.bfloat16)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in keep:
            module.float()
    return model


def _output(model, inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.sample


def _output_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = _output(model, inputs)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got, want):
    """Per-tensor relative error <= F32_TOL; gradients that are zero in exact arithmetic (an
    attention key's bias: softmax ignores it) carry only rounding noise, about 1e-8 of the
    largest gradient's norm in fp32 (PixArt under compile on an H100), held to F32_TOL of 1% of it."""
    largest = max(w.norm() for w in want.values())
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] - w).norm() <= F32_TOL * max(w.norm(), 1e-2 * largest), name


# ---------------------------------------------------------------- patched models

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_models_load_strictly_and_match(family, device):
    with _on(device) as device:
        _load_strictly_and_match(FAMILIES[family](), device)


def _load_strictly_and_match(tiny, device):
    inputs = {k: v.to(device) for k, v in tiny.inputs.items()}
    base = _build(tiny).to(device)
    want, want_grads = _output_and_grads(base, inputs)
    model = tiny.make().to(device).eval()
    keys = {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}
    report = cudnorm.patch(model)
    assert Counter((old, new) for _, old, new in report.swapped) == tiny.swaps, report
    assert [(name, cls) for name, cls, _ in report.left] == tiny.left, report
    assert {k: id(v) for k, v in model.state_dict(keep_vars=True).items()} == keys  # same keys, same Parameters
    model.load_state_dict(base.state_dict(), strict=True)  # the original's checkpoint loads as before
    got, got_grads = _output_and_grads(model, inputs)
    assert got.dtype == want.dtype and ref.rel_error(got, want) <= F32_TOL
    _assert_grads_close(got_grads, want_grads)
    tiny.make().load_state_dict(model.state_dict(), strict=True)  # and the patched model's into the original
    with pytest.warns(RuntimeWarning, match="swapped no norm"):  # a second call finds nothing left to swap
        assert not cudnorm.patch(model).swapped


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_models_bf16_meet_the_error_rule(family, device):
    """bf16 outputs within twice the unpatched bf16 model's error, both against the same
    weights in fp64."""
    with _on(device) as device:
        _bf16_meets_the_rule(FAMILIES[family](), device)


def _bf16_meets_the_rule(tiny, device):
    base = _bf16(_build(tiny)).to(device)
    exact = tiny.make().eval()
    exact.load_state_dict({k: v.double() for k, v in base.state_dict().items()})
    exact.to(device, torch.float64)
    patched = _bf16(tiny.make().eval()).to(device)
    cudnorm.patch(patched)
    patched.load_state_dict(base.state_dict(), strict=True)
    inputs = {k: v.to(device) for k, v in tiny.inputs.items()}
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() and not k.endswith("_ids") else v  # Flux's ids stay fp32
            for k, v in inputs.items()}
    with torch.no_grad():
        want, theirs, ours = _output(exact, wide), _output(base, half), _output(patched, half)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    bound = ref.error_bound(ref.rel_error(theirs, want), torch.bfloat16)
    assert ref.rel_error(ours, want) <= bound, (ref.rel_error(ours, want), bound)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_models_round_trip_through_save_pretrained(family, tmp_path):
    """The checkpoint of a patched model is the original class's: it loads unpatched."""
    tiny = FAMILIES[family]()
    model = _build(tiny)
    cudnorm.patch(model)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert list(loaded.state_dict()) == list(model.state_dict())
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert ref.rel_error(_output(model, tiny.inputs), _output(loaded, tiny.inputs)) <= F32_TOL


# Inductor on the GPU; on the CPU aot_eager, which traces what Inductor would (Dynamo's full
# graph, the custom ops' fake and autograd registrations) without 2-9 s of C++ codegen per
# block, and cudnorm's ops on the CPU are PyTorch's kernels either way
COMPILE_BACKEND = {"cpu": "aot_eager", "cuda": "inductor"}


@pytest.mark.slow  # torch.compile of every model family on the CPU
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_patched_block_matches_eager(family, device):
    with _on(device) as device:
        _compiled_matches_eager(FAMILIES[family](), device)


def _compiled_matches_eager(tiny, device):
    model = _build(tiny).to(device)
    cudnorm.patch(model)
    layer, call, width = tiny.block(model)
    h = torch.randn(B, 8, width, device=device, requires_grad=True)
    params = dict(layer.named_parameters())

    def loss(h):
        out = call(h)
        return sum(o.float().square().mean() for o in (out if isinstance(out, tuple) else (out,)) if o is not None)

    traced = []

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return torch._dynamo.lookup_backend(COMPILE_BACKEND[device])(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(loss, fullgraph=True, backend=backend)(h)
    got_grads = torch.autograd.grad(got, [h, *params.values()], allow_unused=True)
    torch._dynamo.reset()
    assert any("cudnorm" in t for t in traced)  # the patched norms' ops are in the graph
    want = loss(h)
    want_grads = torch.autograd.grad(want, [h, *params.values()], allow_unused=True)
    assert ref.rel_error(got, want) <= F32_TOL
    names = ["input", *params]
    assert [n for n, g in zip(names, got_grads) if g is None] == [n for n, g in zip(names, want_grads) if g is None]
    _assert_grads_close({n: g for n, g in zip(names, got_grads) if g is not None},
                        {n: g for n, g in zip(names, want_grads) if g is not None})


# ---------------------------------------------------------------- every class the tables name

def _norm_class(name):
    """The class ``name`` (``Qwen2MoeRMSNorm``; ``diffusers.RMSNorm``), or a skip."""
    if name == "diffusers.RMSNorm":
        return pytest.importorskip("diffusers.models.normalization").RMSNorm
    transformers = pytest.importorskip("transformers")
    family = name.removesuffix("RMSNorm").removesuffix("LayerNorm")
    folder = {"Qwen2Moe": "qwen2_moe", "Qwen3Moe": "qwen3_moe", "SwitchTransformers": "switch_transformers"}.get(
        family, family.lower())
    try:
        return getattr(importlib.import_module(f"transformers.models.{folder}.modeling_{folder}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")


def _stand_in(name):
    """The class label patch swaps ``name`` for."""
    if name in LLAMA_STYLE_RMS_NORMS:
        return "cudnorm.LlamaStyleRMSNorm"
    return "cudnorm.GemmaStyleRMSNorm" if name in GEMMA_STYLE_RMS_NORMS else "cudnorm.T5StyleRMSNorm"


HALF_AND_FP32 = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("name", [*sorted(LLAMA_STYLE_RMS_NORMS | GEMMA_STYLE_RMS_NORMS | T5_STYLE_RMS_NORMS),
                                  "diffusers.RMSNorm"])
def test_every_named_class_is_swapped_for_its_formula(name):
    """For every pair of weight and input dtypes: the patched module returns the original's
    dtype, within twice the original's error against the original in fp64 (for fp32 results:
    the same numbers). T5's family and diffusers' RMSNorm return the weight's dtype for half
    weights (bf16 from fp32 input too) and fp32 for fp32 weights on half input; Llama's the
    promotion of the two; Gemma's the input's."""
    cls = _norm_class(name)
    label = name if name.startswith("diffusers.") else f"transformers.{name}"
    weight = torch.randn(64) * 0.2 + (0.0 if name in GEMMA_STYLE_RMS_NORMS else 1.0)
    x = 3 + 2 * torch.randn(32, 64)
    for weight_dtype in HALF_AND_FP32:
        theirs = cls(64, eps=1e-5).to(weight_dtype)
        with torch.no_grad():
            theirs.weight.copy_(weight)
        exact = cls(64, eps=1e-5).double()
        exact.load_state_dict(theirs.state_dict())
        ours = torch.nn.Sequential(theirs)
        report = cudnorm.patch(ours)
        assert report.swapped == [("0", label, _stand_in(name))] and ours[0].weight is theirs.weight
        assert ours[0].eps == 1e-5 and getattr(ours[0], "variance_epsilon", 1e-5) == 1e-5
        for x_dtype in HALF_AND_FP32:
            xin = x.to(x_dtype)
            want, base, got = exact(xin.double()), theirs(xin), ours(xin)
            assert got.dtype == base.dtype, (weight_dtype, x_dtype)
            out_dtype = base.dtype if base.dtype in (torch.bfloat16, torch.float16) else torch.float32
            bound = ref.error_bound(ref.rel_error(base, want), out_dtype)
            assert ref.rel_error(got, want) <= bound, (weight_dtype, x_dtype, ref.rel_error(got, want), bound)


def test_diffusers_rms_norm_without_weight_or_with_bias():
    """Without a weight diffusers' RMSNorm is cudnorm's (the input's dtype); with a bias it is left."""
    dn = pytest.importorskip("diffusers.models.normalization")
    model = torch.nn.Sequential(dn.RMSNorm(64, eps=1e-6, elementwise_affine=False), dn.RMSNorm(64, 1e-5, bias=True))
    plain, biased = model
    report = cudnorm.patch(model)
    assert type(model[0]) is cudnorm.RMSNorm and model[0].weight is None and model[1] is biased
    assert [(name, cls) for name, cls, _ in report.left] == [("1", "diffusers.RMSNorm")] and "bias" in report.left[0][2]
    for dtype in HALF_AND_FP32:
        x = (3 + 2 * torch.randn(8, 64)).to(dtype)
        want, got = plain(x), model[0](x)
        assert got.dtype == want.dtype == dtype
        assert ref.rel_error(got, want) <= ref.ERROR_FLOOR[dtype]


# ---------------------------------------------------------------- plain models, arguments

def test_plain_models():
    shared = torch.nn.LayerNorm(8)
    plain = torch.nn.Sequential(shared, torch.nn.Linear(8, 8), shared, torch.nn.RMSNorm(8, elementwise_affine=False))
    report = cudnorm.patch(plain)
    assert type(plain[0]) is cudnorm.LayerNorm and plain[0] is plain[2]  # one module for a shared norm
    assert type(plain[3]) is cudnorm.RMSNorm and plain[3].weight is None
    assert len(report.swapped) == 3 and not report.left


def test_patch_arguments():
    with pytest.raises(TypeError, match=r"cudnorm\.patch: argument 'model'"):
        cudnorm.patch("llama")
    with pytest.raises(ValueError, match="itself a norm"):
        cudnorm.patch(torch.nn.LayerNorm(8))
