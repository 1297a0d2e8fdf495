"""``cudnorm.patch`` changes the computation of a module, never the module: on tiny real Llama
and Flux models, hooks of every kind (forward, forward-pre with and without kwargs, full
backward, state-dict and load hooks, global module hooks, hooks on the norm inside an AdaLN
module) fire as often as unpatched and the outputs match; accelerate-offloaded models
(``cpu_offload``, ``from_pretrained`` with a ``device_map`` offloading to disk) run and match;
``requires_grad``, dtypes, training modes and attributes model code changes stay live; a patch
that fails leaves the model bit-identical; legacy ``weight_norm`` norms are swapped and stay
removable, parametrized ones are left; patched models deep-copy and pickle. The ``emulated``
variants check that the patched norms ran cudnorm's cuDNN path (emulated graphs); the ``gpu``
variants offload to the CPU and run on a GPU."""

import contextlib
import copy
import pickle
import types
from collections import Counter

import pytest
import torch

import cudnorm
from cudnorm import reference as ref

import emulated_cudnn as emu
import test_patching as tiny_models  # the tiny model families

F32_TOL = 1e-5
DEVICES = ["cpu", "emulated", pytest.param("cuda", marks=pytest.mark.gpu)]


@contextlib.contextmanager
def _on(device: str):
    """As ``tests/test_patching.py``: the torch device, the graph emulator installed for
    ``"emulated"`` (which then requires that cudnorm's cuDNN path ran)."""
    if device != "emulated":
        yield device
        return
    with emu.installed():
        yield "cpu"


def _pair(family: str, device: str = "cpu"):
    """(unpatched model, a second copy with the same weights, forward inputs) of a tiny family."""
    tiny = tiny_models.FAMILIES[family]()
    base = tiny_models._build(tiny).to(device)
    other = copy.deepcopy(base)
    return base, other, {k: v.to(device) for k, v in tiny.inputs.items()}


def _norms(model):
    """The modules patch swaps (the decision is the patch's own: what its report lists)."""
    names = {name for name, _, _ in cudnorm.patch(copy.deepcopy(model)).swapped}
    return {name: m for name, m in model.named_modules() if name in names}


def _output(model, inputs):
    return tiny_models._output(model, inputs)


# ---------------------------------------------------------------- hooks

class _Hooks:
    """Hooks of every kind on every norm of a model, counting their calls; the forward and
    pre-hooks change what flows (a hook whose result were dropped would change the output)."""

    def __init__(self, model):
        self.calls = Counter()
        for name, module in _norms(model).items():
            module.register_forward_pre_hook(self._pre(name))
            module.register_forward_pre_hook(self._pre_kwargs(name), with_kwargs=True)
            module.register_forward_hook(self._post(name))
            module.register_full_backward_hook(self._backward(name))
            module.register_state_dict_post_hook(self._state_dict(name))
            module.register_load_state_dict_post_hook(self._loaded(name))

    def _pre(self, name):
        def hook(module, args):
            self.calls["pre", name] += 1
            return (args[0] * 1.25, *args[1:])
        return hook

    def _pre_kwargs(self, name):
        def hook(module, args, kwargs):
            self.calls["pre_kwargs", name] += 1
        return hook

    def _post(self, name):
        def hook(module, args, output):
            self.calls["post", name] += 1
            return (output[0] * 0.5, *output[1:]) if isinstance(output, tuple) else output * 0.5
        return hook

    def _backward(self, name):
        def hook(module, grad_input, grad_output):
            self.calls["backward", name] += 1
        return hook

    def _state_dict(self, name):
        def hook(module, state_dict, prefix, local_metadata):
            self.calls["state_dict", name] += 1
        return hook

    def _loaded(self, name):
        def hook(module, incompatible_keys):
            self.calls["load_state_dict", name] += 1
        return hook


def _run_with_hooks(model, inputs):
    """Output, gradients, and a state_dict round trip, with a global forward hook counting
    every module call (the norm inside an AdaLN module among them)."""
    calls = Counter()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: calls.update([type(module).__name__]))
    try:
        out = _output(model, inputs)
        out.float().square().mean().backward()
        model.load_state_dict(model.state_dict())
    finally:
        handle.remove()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "flux", "sd3"])
def test_hooks_survive_and_fire_as_often(family, device):
    """Hooks registered before patching on every norm patch swaps (for diffusers' AdaLN
    modules also on their inner norm, whose call their fused forward would replace) and a
    global module hook: the same calls, outputs and gradients as unpatched."""
    with _on(device) as device:
        base, patched, inputs = _pair(family, device)
        theirs, mine = _Hooks(base), _Hooks(patched)
        cudnorm.patch(patched)
        want, want_grads, want_calls = _run_with_hooks(base, inputs)
        got, got_grads, got_calls = _run_with_hooks(patched, inputs)
    assert mine.calls == theirs.calls and got_calls == want_calls
    assert {kind for kind, _ in mine.calls} == {"pre", "pre_kwargs", "post", "backward", "state_dict",
                                                "load_state_dict"}
    assert family == "llama" or any(name.endswith("norm1.norm") for _, name in mine.calls)
    assert ref.rel_error(got, want) <= F32_TOL
    tiny_models._assert_grads_close(got_grads, want_grads)


def test_fused_adaln_runs_unless_its_norm_is_observed():
    """On emulated graphs: Flux's four AdaLN modules run one fused AdaLN graph each; a hook
    on one's inner norm (registered after patching) sends that module through diffusers'
    forward, whose norm call runs cudnorm's LayerNorm graph and fires the hook; the outputs
    are the same."""
    base, patched, inputs = _pair("flux")
    cudnorm.patch(patched)
    with torch.no_grad():
        want = _output(base, inputs)
    with emu.installed() as launches, torch.no_grad():
        got = _output(patched, inputs)
        fused, plain = launches["ada_layer_norm", "infer"], launches["layer_norm", "infer"]
        called = Counter()
        handle = patched.transformer_blocks[0].norm1.norm.register_forward_pre_hook(lambda *a: called.update([1]))
        launches.clear()
        observed = _output(patched, inputs)
        handle.remove()
        assert (launches["ada_layer_norm", "infer"], launches["layer_norm", "infer"]) == (fused - 1, plain + 1)
    assert fused == 4 and sum(called.values()) == 1
    assert ref.rel_error(got, want) <= F32_TOL and ref.rel_error(observed, want) <= F32_TOL


# ---------------------------------------------------------------- accelerate

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["offload_then_patch", "patch_then_offload"])
@pytest.mark.parametrize("family", ["llama", "flux"])
def test_cpu_offloaded_models_match(family, order, device):
    """accelerate's ``cpu_offload``: every module with weights gets an ``AlignDevicesHook``
    that loads them from the CPU state dict before its forward (on the meta device otherwise);
    patched before or after, the model matches its unpatched copy."""
    accelerate = pytest.importorskip("accelerate")
    with _on(device) as device:
        base, patched, inputs = _pair(family, "cpu")
        with torch.no_grad():
            want = _output(base.to(device), {k: v.to(device) for k, v in inputs.items()})
        if order == "patch_then_offload":
            cudnorm.patch(patched)
        accelerate.cpu_offload(patched, execution_device=torch.device(device))
        if order == "offload_then_patch":
            norms = list(_norms(patched).values())
            hooked = [m for m in norms if list(m.parameters(recurse=False))]  # accelerate hooks these
            assert hooked and all(hasattr(m, "_hf_hook") and m.weight.is_meta for m in hooked)
            assert len(cudnorm.patch(patched).swapped) == len(norms)
        with torch.no_grad():
            got = _output(patched, {k: v.to(device) for k, v in inputs.items()})
    assert ref.rel_error(got, want) <= F32_TOL


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_from_pretrained_offloaded_to_disk_matches(device, tmp_path):
    """``from_pretrained(..., device_map=..., offload_folder=...)``: the decoder layers and the
    final norm on disk (meta tensors, loaded by their hooks at each forward), then patched."""
    pytest.importorskip("accelerate")
    with _on(device) as device:
        base, _, inputs = _pair("llama")
        base.save_pretrained(tmp_path / "model")
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
                      "model.layers": "disk", "model.norm": "disk"}
        loaded = type(base).from_pretrained(tmp_path / "model", device_map=device_map,
                                            offload_folder=tmp_path / "offload").eval()
        assert loaded.model.norm.weight.is_meta
        report = cudnorm.patch(loaded)
        assert len(report.swapped) == 5
        with torch.no_grad():
            want, got = _output(base, inputs), _output(loaded, inputs)
    assert ref.rel_error(got, want) <= F32_TOL


# ---------------------------------------------------------------- what stays live

def test_parameters_modes_and_attributes_stay_live():
    """Frozen weights stay frozen, bf16 modules stay bf16, each module keeps its training
    mode, and model code changing ``variance_epsilon`` after patching changes the output."""
    base, patched, inputs = _pair("llama")
    norm = patched.model.layers[0].input_layernorm
    norm.weight.requires_grad_(False)
    patched.model.layers[1].to(torch.bfloat16)
    patched.train()
    patched.model.layers[0].eval()
    before = {n: (p.requires_grad, p.dtype, p.device) for n, p in patched.named_parameters()}
    modes = {n: m.training for n, m in patched.named_modules()}
    cudnorm.patch(patched)
    assert {n: (p.requires_grad, p.dtype, p.device) for n, p in patched.named_parameters()} == before
    assert {n: m.training for n, m in patched.named_modules()} == modes
    x = torch.randn(2, 8, 64)
    original = type(norm).__mro__[1](64)  # the transformers class, unpatched
    original.load_state_dict(norm.state_dict())
    for eps in (0.5, 1e-6):
        norm.variance_epsilon = original.variance_epsilon = eps
        assert ref.rel_error(norm(x), original(x)) <= F32_TOL


def test_a_failing_patch_leaves_the_model_unchanged(monkeypatch):
    """Deciding a module raises (here: an attribute that raises when read, on a class
    registered for a formula that reads it): patch names the module and changes nothing, not
    even the norms decided before it."""

    class BrokenRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(64))

        @property
        def variance_epsilon(self):
            raise RuntimeError("eps is not loaded yet")

        def forward(self, x):
            raise NotImplementedError

    monkeypatch.setitem(cudnorm.patching._BY_CLASS, BrokenRMSNorm, cudnorm.patching.FORMULAS["llama_rms_norm"])
    _, model, _ = _pair("llama")
    model.model.layers[1].broken = BrokenRMSNorm()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tree = [(name, id(m), type(m)) for name, m in model.named_modules()]
    with pytest.raises(RuntimeError, match=r"cudnorm\.patch: deciding module 'model\.layers\.1\.broken' .*"
                                           r"eps is not loaded yet; the model is unchanged"):
        cudnorm.patch(model)
    assert [(name, id(m), type(m)) for name, m in model.named_modules()] == tree
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_legacy_weight_norm_is_swapped_and_stays_removable():
    """``torch.nn.utils.weight_norm`` computes the weight in a forward pre-hook: the swapped
    module keeps the hook, computes the same, and the weight norm can still be removed."""
    def make():  # deepcopy refuses weight-normed modules (pytorch#103001)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.LayerNorm(16) for _ in range(3)))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        torch.nn.utils.weight_norm(model[1], dim=0)
        return model

    model, base = make(), make()
    norms = list(model)
    x = torch.randn(4, 16)
    report = cudnorm.patch(model)
    assert [name for name, _, _ in report.swapped] == ["0", "1", "2"] and model[1] is norms[1]
    assert torch.allclose(model(x), base(x), rtol=1e-6, atol=1e-6)
    torch.nn.utils.remove_weight_norm(model[1])
    torch.nn.utils.remove_weight_norm(base[1])
    assert isinstance(model[1].weight, torch.nn.Parameter) and torch.allclose(model(x), base(x), rtol=1e-6, atol=1e-6)


def test_parametrized_and_instance_patched_norms_are_left():
    """``torch.nn.utils.parametrize`` swaps the module's class itself (its removal restores the
    class's base), and a forward set on the instance belongs to another patcher: both left."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.LayerNorm(8))
    parametrize.register_parametrization(model[0], "weight", Double())
    model[1].forward = types.MethodType(lambda self, x: x, model[1])
    report = cudnorm.patch(model)
    assert not report.swapped
    assert [(name, why.split(" ")[0]) for name, _, why in report.left] == [("0", "parametrized"), ("1", "its")]
    parametrize.remove_parametrizations(model[0], "weight")
    assert type(model[0]) is torch.nn.LayerNorm


@pytest.mark.parametrize("family", ["llama", "sd3"])
def test_patched_models_deep_copy_and_pickle(family):
    base, patched, inputs = _pair(family)
    cudnorm.patch(patched)
    with torch.no_grad():
        want = _output(base, inputs)
        for copied in (copy.deepcopy(patched), pickle.loads(pickle.dumps(patched))):
            assert [type(m) for m in copied.modules()] == [type(m) for m in patched.modules()]
            assert ref.rel_error(_output(copied, inputs), want) <= F32_TOL
            assert not cudnorm.patch(copied).swapped
