"""``cudnorm.patch``: real transformers models built from tiny configs (CPU), and plain
PyTorch models: what is swapped, that parameters and state_dict keys are untouched, that
outputs and gradients match the original model, and what is left with its reason."""

import pytest
import torch

import cudnorm
from cudnorm.patching import LlamaStyleRMSNorm

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


def test_gemma_is_left_with_its_reason():
    cfg = transformers.GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    report = cudnorm.patch(transformers.GemmaForCausalLM(cfg))
    assert not report.swapped and len(report.left) == 3
    assert all("1 + weight" in why for _, _, why in report.left)


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
