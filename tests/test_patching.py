"""``cudnorm.patch``: real transformers models built from tiny configs (CPU), and plain
PyTorch models: what is swapped, that parameters and state_dict keys are untouched, that
outputs and gradients match the original model, and what is left with its reason."""

import pytest
import torch

import cudnorm
from cudnorm import reference as ref
from cudnorm.patching import GEMMA_STYLE_RMS_NORMS, GemmaStyleRMSNorm, LlamaStyleRMSNorm

transformers = pytest.importorskip("transformers")


def _randomize_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return _randomize_norms(transformers.LlamaForCausalLM(cfg)).to(dtype)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_llama_swaps_every_rms_norm_and_matches(device):
    model, ids = _llama().to(device), torch.randint(0, 128, (2, 16), device=device)
    want, want_grads = _loss_and_grads(model, ids)
    keys, params = list(model.state_dict()), {n: id(p) for n, p in model.named_parameters()}
    report = cudnorm.patch(model)
    assert len(report.swapped) == 5 and not report.left  # 2 per layer + the final norm
    assert {(old, new) for _, old, new in report.swapped} == {("transformers.LlamaRMSNorm",
                                                                "cudnorm.LlamaStyleRMSNorm")}
    assert "5 x transformers.LlamaRMSNorm -> cudnorm.LlamaStyleRMSNorm" in str(report)
    assert list(model.state_dict()) == keys
    assert {n: id(p) for n, p in model.named_parameters()} == params  # the same Parameter objects
    got, got_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(got, want)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)


def test_patched_llama_round_trips_through_save_pretrained(tmp_path):
    model = _llama()
    cudnorm.patch(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_llama_style_output_dtype_follows_the_reference():
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(64, eps=1e-6)  # fp32 weight
    mine = LlamaStyleRMSNorm(64, eps=1e-6)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert norm(x).dtype == mine(x).dtype == torch.float32  # fp32 weight on bf16 input: promoted
    torch.testing.assert_close(mine(x), norm(x), atol=1e-2, rtol=1e-2)
    assert mine.variance_epsilon == 1e-6
    half = _llama(torch.bfloat16)
    cudnorm.patch(half)
    assert half(torch.randint(0, 128, (1, 8))).logits.dtype == torch.bfloat16


def _gemma(cls_name="Gemma", dtype=torch.float32):
    torch.manual_seed(0)
    config_cls, model_cls = getattr(transformers, cls_name + "Config"), getattr(transformers, cls_name + "ForCausalLM")
    cfg = config_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # Gemma stores weights around zero (the scale is 1 + weight)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model.to(dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", ["Gemma", "Gemma2"])
def test_gemma_swaps_to_the_offset_norm_and_matches(family, device):
    """Gemma's ``x_hat * (1 + weight)``: swapped naively for a plain RMSNorm the logits were
    off by 3.8; with ``weight_offset=1.0`` they match in fp32, and gradients too."""
    model, ids = _gemma(family).to(device), torch.randint(0, 128, (2, 16), device=device)
    want, want_grads = _loss_and_grads(model, ids)
    keys = list(model.state_dict())
    gemma_norms = sum(type(m).__name__ in GEMMA_STYLE_RMS_NORMS for m in model.modules())
    report = cudnorm.patch(model)
    assert gemma_norms >= 5 and len(report.swapped) == gemma_norms, report  # 2-4 per layer + the final norm
    assert {new for _, _, new in report.swapped} == {"cudnorm.GemmaStyleRMSNorm"} and not report.left
    assert list(model.state_dict()) == keys
    got, got_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_gemma_style_bf16_meets_the_error_rule():
    norm = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(64))
    mine = GemmaStyleRMSNorm(64, eps=1e-6)
    mine.weight = norm.weight
    x = torch.randn(32, 64)
    exact = norm.double()(x.double())
    for dtype in (torch.bfloat16, torch.float16):
        half = x.to(dtype)
        norm_half = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(64, eps=1e-6)
        norm_half.weight = torch.nn.Parameter(norm.weight.detach().float())
        theirs, ours = norm_half(half), mine.float()(half)
        assert ours.dtype == theirs.dtype == dtype
        assert ref.rel_error(ours, exact) <= ref.error_bound(ref.rel_error(theirs, exact), dtype)


def test_gpt2_layer_norms_and_plain_models():
    torch.manual_seed(0)
    model = _randomize_norms(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))).eval()  # no dropout
    ids = torch.randint(0, 128, (2, 16))
    want, _ = _loss_and_grads(model, ids)
    report = cudnorm.patch(model)
    assert len(report.swapped) == 5 and all(new == "cudnorm.LayerNorm" for _, _, new in report.swapped)
    torch.testing.assert_close(_loss_and_grads(model, ids)[0], want)
    shared = torch.nn.LayerNorm(8)
    plain = torch.nn.Sequential(shared, torch.nn.Linear(8, 8), shared, torch.nn.RMSNorm(8, elementwise_affine=False))
    report = cudnorm.patch(plain)
    assert type(plain[0]) is cudnorm.LayerNorm and plain[0] is plain[2]  # one module for a shared norm
    assert type(plain[3]) is cudnorm.RMSNorm and plain[3].weight is None


def test_patch_arguments():
    with pytest.raises(TypeError, match=r"cudnorm\.patch: argument 'model'"):
        cudnorm.patch("llama")
    with pytest.raises(ValueError, match="itself a norm"):
        cudnorm.patch(torch.nn.LayerNorm(8))
