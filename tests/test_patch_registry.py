"""The classes ``cudnorm.patch`` swaps, one by one (CPU).

* Every registered transformers/diffusers class that the installed versions define has, body
  for body (docstrings and annotations aside), the forward and helpers of one of its formula's
  anchors (``cudnorm._patch_table.ANCHORS``);
* every anchor, patched, against itself unpatched: for every pair of fp32/bf16/fp16 weight and
  input dtypes the same output dtype, within twice the original's error against the original
  in fp64 (the same numbers in fp32), and an empty input passes through;
* every diffusers AdaLN class (the cases of ``tests/test_diffusers_compat.py``, and
  CogVideoX's, HunyuanDiT's and Sana's), patched in place, against itself: fp32 outputs and
  gradients, bf16 within the 2x rule;
* identity, not names: a same-named class from elsewhere, a subclass redefining the forward,
  a forward replaced after the class was defined are left with the reason; subclasses
  keeping the forward are swapped; :func:`cudnorm.patching.register`;
* ``docs/patching.md`` lists every registered class and every class the table leaves.
"""

import ast
import copy
import importlib
import importlib.util
import pathlib
import types

import pytest
import torch

import cudnorm
from cudnorm import _patch_table, patching
from cudnorm import reference as ref

ROOT = pathlib.Path(__file__).resolve().parent.parent
HALF_AND_FP32 = (torch.float32, torch.bfloat16, torch.float16)
F32_TOL = 1e-5


def _class(qualified: str):
    """The class of a module-qualified name, or a skip when the installed packages lack it."""
    module, _, name = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{qualified} is not installed")


# ---------------------------------------------------------------- the table against the sources

def _class_node(qualified: str) -> ast.ClassDef | None:
    """The class statement of ``qualified`` in its module's source, without importing the
    module (about 200 of them); None when the installed packages lack it."""
    module, _, name = qualified.rpartition(".")
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or spec.origin is None:
        return None
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    return next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None)


def _bodies(node: ast.ClassDef, methods) -> dict:
    """``{method: (argument names, body)}`` of ``node``'s ``methods``, the body without its
    docstring, as an AST dump (no line numbers, no annotations)."""
    out = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name in methods:
            body = [s for s in item.body if not (
                isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))]
            out[item.name] = ([a.arg for a in item.args.args], [ast.dump(s) for s in body])
    return out


MANY = [name for name, classes in _patch_table.CLASSES.items() if len(classes) > 1]


@pytest.mark.parametrize("formula", MANY)
def test_registered_classes_have_an_anchors_forward(formula):
    methods = patching.FORMULAS[formula].methods
    anchors = [_class_node(name) for name in _patch_table.ANCHORS[formula]]
    if not all(anchors):
        pytest.skip(f"the installed packages lack an anchor of {formula}")
    known = [_bodies(node, methods) for node in anchors]
    assert all("forward" in k for k in known)
    checked, differ = 0, []
    for name in _patch_table.CLASSES[formula]:
        node = _class_node(name)
        if node is None:
            continue  # not in the installed version: its entry is inert
        checked += 1
        if _bodies(node, methods) not in known:
            differ.append(name)
    assert not differ, f"registered for {formula} but computing something else: {differ}"
    assert checked >= len(anchors)


def test_every_registered_name_names_a_formula_and_anchors_are_registered():
    assert set(_patch_table.CLASSES) == set(patching.FORMULAS) - {"layer_norm", "rms_norm"}
    for formula, anchors in _patch_table.ANCHORS.items():
        assert set(anchors) <= set(_patch_table.CLASSES[formula]), formula
    assert not set(_patch_table.LEFT) & {n for names in _patch_table.CLASSES.values() for n in names}


# ---------------------------------------------------------------- the anchors against cudnorm

TF = "transformers.models.{0}.modeling_{0}.{1}".format
NORMALIZATION = "diffusers.models.normalization"
# id -> (class, its constructor call, input trailing shape, the weight's centre)
ANCHOR_CASES = {
    "llama": (TF("llama", "LlamaRMSNorm"), lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "gemma": (TF("gemma", "GemmaRMSNorm"), lambda cls: cls(64, eps=1e-5), (64,), 0.0),
    "qwen-image21-zero-center": ("diffusers.models.transformers.transformer_qwenimage21.QwenImage21ZeroCenterRMSNorm",
                                 lambda cls: cls(64, eps=1e-5), (64,), 0.0),
    "krea2": ("diffusers.models.transformers.transformer_krea2.Krea2RMSNorm", lambda cls: cls(64, eps=1e-5), (64,), 0.0),
    "stable-audio3": ("diffusers.models.transformers.transformer_stable_audio3.StableAudio3RMSNorm",
                      lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "stable-audio3-input-dtype": ("diffusers.models.transformers.transformer_stable_audio3.StableAudio3RMSNorm",
                                  lambda cls: cls(64, eps=1e-5, force_fp32=False), (64,), 1.0),
    "olmo2": (TF("olmo2", "Olmo2RMSNorm"), lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "helium": (TF("helium", "HeliumRMSNorm"), lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "chatglm": ("diffusers.pipelines.kolors.text_encoder.RMSNorm", lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "mochi": (f"{NORMALIZATION}.MochiRMSNorm", lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "mochi-no-weight": (f"{NORMALIZATION}.MochiRMSNorm", lambda cls: cls(64, 1e-5, False), (64,), 1.0),
    "t5": (TF("t5", "T5LayerNorm"), lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "diffusers-rms": (f"{NORMALIZATION}.RMSNorm", lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "diffusers-rms-no-weight": (f"{NORMALIZATION}.RMSNorm", lambda cls: cls(64, 1e-5, False), (64,), 1.0),
    "cohere": (TF("cohere", "CohereLayerNorm"), lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "cohere-qk": (TF("cohere", "CohereLayerNorm"), lambda cls: cls((4, 16), eps=1e-5), (4, 16), 1.0),
    "fp32-layer-norm": (f"{NORMALIZATION}.FP32LayerNorm", lambda cls: cls(64, eps=1e-5), (64,), 1.0),
    "fp32-layer-norm-plain": (f"{NORMALIZATION}.FP32LayerNorm",
                              lambda cls: cls(64, eps=1e-5, elementwise_affine=False, bias=False), (64,), 1.0),
}


def _anchor(case: str, dtype: torch.dtype):
    """(the original module in ``dtype`` with parameters off their init, the same in fp64)."""
    qualified, make, _, centre = ANCHOR_CASES[case]
    cls = _class(qualified)
    torch.manual_seed(0)
    theirs = make(cls)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) + (centre if name in ("weight", "gamma") else 0.0))
    exact = copy.deepcopy(theirs).double()
    return theirs.to(dtype), exact


@pytest.mark.parametrize("case", ANCHOR_CASES)
def test_each_anchor_computes_its_formula(case):
    """For every pair of weight and input dtypes: the patched module returns the original's
    dtype, within twice the original's error against the original in fp64 (for fp32 results:
    the same numbers); pairs the original refuses, the patched module refuses too."""
    shape = ANCHOR_CASES[case][2]
    x = 3 + 2 * torch.randn(32, *shape)
    for weight_dtype in HALF_AND_FP32:
        theirs, exact = _anchor(case, weight_dtype)
        ours = copy.deepcopy(theirs)
        report = cudnorm.patch(ours)
        assert [(name, cls) for name, cls, _ in report.swapped] == [("", ANCHOR_CASES[case][0])], report
        for x_dtype in HALF_AND_FP32:
            xin = x.to(x_dtype)
            try:
                base = theirs(xin)
            except RuntimeError:
                with pytest.raises((RuntimeError, TypeError, ValueError)):
                    ours(xin)
                continue
            want, got = exact(xin.double()), ours(xin)
            assert got.dtype == base.dtype, (weight_dtype, x_dtype)
            out_dtype = base.dtype if base.dtype in (torch.bfloat16, torch.float16) else torch.float32
            bound = ref.error_bound(ref.rel_error(base, want), out_dtype)
            assert ref.rel_error(got, want) <= bound, (weight_dtype, x_dtype, ref.rel_error(got, want), bound)
            empty = xin[:0]
            assert ours(empty).shape == empty.shape and ours(empty).dtype == theirs(empty).dtype


def test_diffusers_rms_norm_with_a_bias_is_left():
    """Sana's caption norm is diffusers' RMSNorm with a bias: left, with that reason."""
    normalization = pytest.importorskip("diffusers.models.normalization")
    biased = normalization.RMSNorm(64, 1e-5, bias=True)
    report = cudnorm.patch(biased)
    assert not report.swapped and type(biased) is normalization.RMSNorm
    assert [(name, why) for name, _, why in report.left] == [
        ("", "a bias after the norm, which cudnorm's RMSNorm does not take")]


# ---------------------------------------------------------------- diffusers' AdaLN classes

def _adaln_cases():
    """The cases of tests/test_diffusers_compat.py, and CogVideoX's, HunyuanDiT's and Sana's
    modules: id -> (make the diffusers module, make (args, kwargs) for a dtype)."""
    compat = importlib.import_module("test_diffusers_compat")
    normalization = importlib.import_module(NORMALIZATION)
    hunyuan = importlib.import_module("diffusers.models.transformers.hunyuan_transformer_2d")
    sana = importlib.import_module("diffusers.models.transformers.sana_transformer")
    d, c = compat.D, compat.C

    def x(*shape):
        return lambda dtype: (3 + 2 * torch.randn(*shape)).to(dtype)

    cases = {case: (lambda name=name, a=a, k=k: getattr(normalization, name)(*a, **k),
                    lambda dtype, inputs=inputs: ((compat._x(dtype),), {n: f(dtype) for n, f in inputs.items()}))
             for case, (name, a, k, inputs) in compat.CASES.items()}
    cases["cogvideox"] = (lambda: normalization.CogVideoXLayerNormZero(c, d),
                          lambda dtype: ((x(2, 5, d)(dtype), x(2, 3, d)(dtype), x(2, c)(dtype)), {}))
    easyanimate = importlib.import_module("diffusers.models.transformers.transformer_easyanimate")
    cases["easyanimate"] = (lambda: easyanimate.EasyAnimateLayerNormZero(c, d),
                            lambda dtype: ((x(2, 5, d)(dtype), x(2, 3, d)(dtype), x(2, c)(dtype)), {}))
    cases["easyanimate-layer-norm"] = (lambda: easyanimate.EasyAnimateLayerNormZero(c, d, norm_type="layer_norm"),
                                       lambda dtype: ((x(2, 5, d)(dtype), x(2, 3, d)(dtype), x(2, c)(dtype)), {}))
    cases["hunyuan-shift"] = (lambda: hunyuan.AdaLayerNormShift(d),
                              lambda dtype: ((x(2, 5, d)(dtype), x(2, d)(dtype)), {}))
    cases["sana"] = (lambda: sana.SanaModulatedNorm(d),
                     lambda dtype: ((x(2, 5, d)(dtype), x(2, d)(dtype), x(2, d)(dtype)), {}))
    # the modulated RMSNorms (cudnorm.ada_rms_norm)
    mochi = importlib.import_module("diffusers.models.transformers.transformer_mochi")
    cases["lumina-zero"] = (lambda: normalization.LuminaRMSNormZero(d, 1e-5, True),
                            lambda dtype: ((x(2, 5, d)(dtype), x(2, d)(dtype)), {}))
    cases["lumina-continuous"] = (lambda: normalization.LuminaLayerNormContinuous(d, c, out_dim=8),
                                  lambda dtype: ((x(2, 5, d)(dtype), x(2, c)(dtype)), {}))
    cases["lumina-continuous-rms"] = (lambda: normalization.LuminaLayerNormContinuous(d, c, False, 1e-6,
                                                                                      norm_type="rms_norm"),
                                      lambda dtype: ((x(2, 5, d)(dtype), x(2, c)(dtype)), {}))
    chroma = importlib.import_module("diffusers.models.transformers.transformer_chroma")
    cogview4 = importlib.import_module("diffusers.models.transformers.transformer_cogview4")
    cases["chroma-zero"] = (lambda: chroma.ChromaAdaLayerNormZeroPruned(d),
                            lambda dtype: ((x(2, 5, d)(dtype),), {"emb": (0.2 * torch.randn(2, 6, d)).to(dtype)}))
    cases["chroma-zero-single"] = (lambda: chroma.ChromaAdaLayerNormZeroSinglePruned(d),
                                   lambda dtype: ((x(2, 5, d)(dtype), (0.2 * torch.randn(2, 3, d)).to(dtype)), {}))
    cases["chroma-continuous"] = (lambda: chroma.ChromaAdaLayerNormContinuousPruned(d, c, False, 1e-6),
                                  lambda dtype: ((x(2, 5, d)(dtype), (0.2 * torch.randn(2, 2, d)).to(dtype)), {}))
    cases["chroma-continuous-rms"] = (lambda: chroma.ChromaAdaLayerNormContinuousPruned(d, c, True, 1e-6,
                                                                                        norm_type="rms_norm"),
                                      lambda dtype: ((x(2, 5, d)(dtype), (0.2 * torch.randn(2, 2, d)).to(dtype)), {}))
    cases["cogview4-zero"] = (lambda: cogview4.CogView4AdaLayerNormZero(c, d),
                              lambda dtype: ((x(2, 5, d)(dtype), x(2, 3, d)(dtype), x(2, c)(dtype)), {}))
    cases["cogview4-continuous"] = (lambda: cogview4.CogView4AdaLayerNormContinuous(d, c, False, 1e-6),
                                    lambda dtype: ((x(2, 5, d)(dtype), x(2, c)(dtype)), {}))
    glm = importlib.import_module("diffusers.models.transformers.transformer_glm_image")
    cases["glm-image-zero"] = (lambda: glm.GlmImageAdaLayerNormZero(c, d),
                               lambda dtype: ((x(2, 5, d)(dtype), x(2, 3, d)(dtype), x(2, c)(dtype)), {}))
    cases["glm-image-continuous"] = (lambda: glm.GlmImageAdaLayerNormContinuous(d, c, False, 1e-6),
                                     lambda dtype: ((x(2, 5, d)(dtype), x(2, c)(dtype)), {}))
    qwen21 = importlib.import_module("diffusers.models.transformers.transformer_qwenimage21")
    cases["qwen-image21-continuous"] = (lambda: qwen21.QwenImage21AdaLayerNormContinuous(d, c),
                                        lambda dtype: ((x(2, 5, d)(dtype), x(2, c)(dtype)), {}))
    cases["qwen-image21-continuous-mask"] = (
        lambda: qwen21.QwenImage21AdaLayerNormContinuous(d, c),
        lambda dtype: ((x(2, 5, d)(dtype), x(3, c)(dtype)),
                       {"target_token_mask": torch.tensor([True, True, False, True, False])}))
    audio = importlib.import_module("diffusers.models.transformers.transformer_longcat_audio_dit")
    cases["audio-dit-final"] = (lambda: audio.AudioDiTAdaLayerNormZeroFinal(d),
                                lambda dtype: ((x(2, 5, d)(dtype), x(2, d)(dtype)), {}))
    cases["audio-dit-final-per-token"] = (lambda: audio.AudioDiTAdaLayerNormZeroFinal(d),
                                          lambda dtype: ((x(2, 5, d)(dtype), x(2, 5, d)(dtype)), {}))
    # modulated per token (cudnorm.ada_layer_norm's per-token path)
    sana_video = importlib.import_module("diffusers.models.transformers.transformer_sana_video")
    cases["sana-video-per-token"] = (lambda: sana_video.SanaModulatedNorm(d),
                                     lambda dtype: ((x(2, 5, d)(dtype), x(2, 5, d)(dtype), x(2, d)(dtype)), {}))
    cases["sana-video-per-sample"] = (lambda: sana_video.SanaModulatedNorm(d),
                                      lambda dtype: ((x(2, 5, d)(dtype), x(2, 1, d)(dtype), x(2, d)(dtype)), {}))
    flux3 = importlib.import_module("diffusers.models.transformers.transformer_flux3")
    cases["flux3-output"] = (lambda: flux3.Flux3AdaLayerNorm(d),
                             lambda dtype: ((x(2, 5, d)(dtype), x(2, 5, d)(dtype)), {}))
    helios = importlib.import_module("diffusers.models.transformers.transformer_helios")
    cases["helios-output"] = (lambda: helios.HeliosOutputNorm(d),
                              lambda dtype: ((x(2, 7, d)(dtype), x(2, 7, d)(dtype), 5), {}))
    cases["cogview3plus-zero"] = (lambda: normalization.CogView3PlusAdaLayerNormZeroTextImage(c, d),
                                  lambda dtype: ((x(2, 5, d)(dtype), x(2, 3, d)(dtype), x(2, c)(dtype)), {}))
    cosmos = importlib.import_module("diffusers.models.transformers.transformer_cosmos")
    cases["cosmos"] = (lambda: cosmos.CosmosAdaLayerNorm(d, 16),
                       lambda dtype: ((x(2, 5, d)(dtype), x(2, d)(dtype)), {"temb": x(2, 3 * d)(dtype)}))
    cases["cosmos-per-token"] = (lambda: cosmos.CosmosAdaLayerNorm(d, 16),
                                 lambda dtype: ((x(2, 5, d)(dtype), x(2, 5, d)(dtype)), {}))
    cases["cosmos-zero"] = (lambda: cosmos.CosmosAdaLayerNormZero(d, 16),
                            lambda dtype: ((x(2, 5, d)(dtype), x(2, d)(dtype)), {"temb": x(2, 3 * d)(dtype)}))
    cases["mochi-zero"] = (lambda: mochi.MochiRMSNormZero(c, 4 * d),
                           lambda dtype: ((x(2, 5, d)(dtype), x(2, c)(dtype)), {}))
    cases["mochi-modulated"] = (lambda: mochi.MochiModulatedRMSNorm(1e-5),
                                lambda dtype: ((x(2, 5, d)(dtype), (0.2 * torch.randn(2, 1, d)).tanh().to(dtype)), {}))
    cases["mochi-modulated-plain"] = (lambda: mochi.MochiModulatedRMSNorm(1e-5),
                                      lambda dtype: ((x(2, 5, d)(dtype),), {}))
    return cases


def _adaln_pair(case):
    pytest.importorskip("diffusers")
    make, inputs = _adaln_cases()[case]
    torch.manual_seed(0)
    theirs = make().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) + (1.0 if name == "norm.weight" else 0.0))
    ours = copy.deepcopy(theirs)
    report = cudnorm.patch(ours)
    assert report.swapped[0][0] == "" and report.swapped[0][2] != "layer_norm", report
    return theirs, ours, inputs


def _outputs(module, args, kwargs):
    out = module(*args, **kwargs)
    return out if isinstance(out, tuple) else (out,)


ADALN_CASES = ["zero", "zero-dit", "zero-fp32-ln-no-bias", "zero-single", "sd35-x", "continuous-defaults",
               "continuous-models", "continuous-affine-no-bias", "continuous-rms", "continuous-rms-plain",
               "adaln-timestep", "adaln-shared-affine", "adaln-chunk1", "adaln-chunk1-affine", "cogvideox",
               "easyanimate", "easyanimate-layer-norm",
               "hunyuan-shift", "sana", "lumina-zero", "lumina-continuous", "lumina-continuous-rms", "mochi-zero", "mochi-modulated", "mochi-modulated-plain",
               "chroma-zero", "chroma-zero-single", "chroma-continuous", "chroma-continuous-rms", "cogview4-zero",
               "cogview4-continuous", "cosmos", "cosmos-per-token", "cosmos-zero",
               "cogview3plus-zero", "glm-image-zero", "glm-image-continuous",
               "qwen-image21-continuous", "qwen-image21-continuous-mask",
               "audio-dit-final", "audio-dit-final-per-token", "sana-video-per-token", "sana-video-per-sample",
               "flux3-output", "helios-output"]


@pytest.mark.parametrize("case", ADALN_CASES)
def test_diffusers_adaln_patched_in_place_matches(case):
    """fp32 outputs and parameter gradients to 1e-5 relative; bf16 (module and input) within
    twice the module's own bf16 error against fp64."""
    theirs, ours, inputs = _adaln_pair(case)
    args, kwargs = inputs(torch.float32)
    want, got = _outputs(theirs, args, kwargs), _outputs(ours, args, kwargs)
    assert [w.dtype for w in want] == [g.dtype for g in got]
    for g, w in zip(got, want):
        assert ref.rel_error(g, w) <= F32_TOL
    if list(theirs.parameters()):  # Sana's output norm has none
        grads = [torch.autograd.grad(sum(o.square().sum() for o in out), list(m.parameters()), allow_unused=True)
                 for out, m in ((want, theirs), (got, ours))]
        for w, g in zip(*grads):
            assert (w is None) == (g is None) and (w is None or ref.rel_error(g, w) <= F32_TOL)
    exact = copy.deepcopy(theirs).double()
    theirs.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    args, kwargs = inputs(torch.bfloat16)
    def widened(v):  # DiT's hidden_dtype too
        if isinstance(v, torch.dtype):
            return torch.float64
        return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    wide = [widened(a) for a in args], {k: widened(v) for k, v in kwargs.items()}
    with torch.no_grad():
        for w, t, o in zip(_outputs(exact, *wide), _outputs(theirs, args, kwargs), _outputs(ours, args, kwargs)):
            assert o.dtype == t.dtype
            assert ref.rel_error(o, w) <= ref.error_bound(ref.rel_error(t, w), torch.bfloat16)


# ---------------------------------------------------------------- identity, not names

@pytest.fixture
def registry(monkeypatch):
    """The registry, restored after the test (``register`` changes it for the process)."""
    monkeypatch.setattr(patching, "_BY_CLASS", dict(patching._BY_CLASS))
    monkeypatch.setattr(patching, "_BY_NAME", dict(patching._BY_NAME))
    return patching


ZERO_CENTRED = """
import torch


class {name}(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(0.2 * torch.randn(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x):  # Gemma's formula: x_hat * (1 + weight)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * (1 + self.weight.float())).to(x.dtype)
"""


def _remote_class(module_name: str, name: str):
    """Class ``name`` computing Gemma's formula, defined by running its source in a new
    module ``module_name``, as ``trust_remote_code`` loads model code
    (``transformers_modules.<repo>.modeling_x``)."""
    module = types.ModuleType(module_name)
    exec(compile(ZERO_CENTRED.format(name=name), f"<{module_name}>", "exec"), module.__dict__)
    return module.__dict__[name]


def _zero_centred(self, x):
    """Gemma's formula as a forward for classes defined here (reading ``variance_epsilon``)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.variance_epsilon)
    return (xf * (1 + self.weight.float())).to(x.dtype)


def test_a_same_named_class_from_elsewhere_is_left():
    """Remote code reusing ``LlamaRMSNorm`` for a zero-centred norm: never swapped (a swap by
    name would change its outputs by the weight's offset), reported with the reason."""
    cls = _remote_class("transformers_modules.acme.modeling_acme", "LlamaRMSNorm")
    model = torch.nn.Sequential(cls(64), torch.nn.LayerNorm(64))
    x = torch.randn(4, 64)
    want = model(x)
    report = cudnorm.patch(model)
    assert type(model[0]) is cls and report.swapped == [("1", "torch.nn.LayerNorm", "layer_norm")]
    assert report.left == [("0", "transformers_modules.acme.modeling_acme.LlamaRMSNorm",
                            "not the registered class of that name (transformers_modules.acme.modeling_acme."
                            "LlamaRMSNorm is another class, e.g. remote code): cudnorm matches classes, not names")]
    assert torch.equal(model(x), want)


def test_subclasses_are_swapped_only_when_they_keep_the_forward():
    llama = _class(TF("llama", "LlamaRMSNorm"))
    gemma = _class(TF("gemma", "GemmaRMSNorm"))
    same = type("LlamaRMSNorm", (llama,), {"__module__": "acme", "describe": lambda self: "mine"})
    other = type("LlamaRMSNorm", (llama,), {"__module__": "acme", "forward": _zero_centred})
    helper = type("MyGemmaNorm", (gemma,), {"__module__": "acme", "_norm": lambda self, x: x})
    scaled = type("ScaledLN", (torch.nn.LayerNorm,), {"__module__": "acme", "forward": lambda self, x: 2 * x})
    model = torch.nn.ModuleList([same(64), other(64), helper(64), scaled(64)])
    for m in model[:3]:
        with torch.no_grad():
            m.weight.normal_()
    x = torch.randn(4, 64)
    want = [m(x) for m in model]
    report = cudnorm.patch(model)
    assert report.swapped == [("0", "acme.LlamaRMSNorm", "llama_rms_norm")]
    assert [(name, why.split(":")[0]) for name, _, why in report.left] == [
        ("1", f"a subclass of {TF('llama', 'LlamaRMSNorm')} that redefines forward"),
        ("2", f"a subclass of {TF('gemma', 'GemmaRMSNorm')} that redefines _norm"),
        ("3", "a subclass of torch.nn.LayerNorm that redefines forward")]  # no "Norm" in its name, still reported
    assert all(ref.rel_error(m(x), w) <= F32_TOL for m, w in zip(model, want))


def test_a_forward_replaced_after_the_class_was_defined_is_left(registry):
    """The registry's facts about a class registered by name are about the forward its class
    body defines: one replaced at class level since (by another patcher) is left."""

    class AcmeRMSNorm(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.zeros(dim)), 1e-6

        def forward(self, x):
            return _zero_centred(self, x)

    AcmeRMSNorm.variance_epsilon = 1e-6
    registry.register(patching.qualified_name(AcmeRMSNorm), "gemma_rms_norm")
    assert cudnorm.patch(torch.nn.Sequential(AcmeRMSNorm(8))).swapped
    cls = AcmeRMSNorm
    cls.forward = lambda self, x: x  # another patcher, at class level
    report = cudnorm.patch(torch.nn.Sequential(cls(8)))
    assert not report.swapped and report.left[0][2].startswith("its forward was replaced after its class was defined")


def test_register(registry):
    """A user's norm, registered by class or by module-qualified name (remote code not yet
    imported), is swapped, and computes what it did; a later registration replaces one."""
    by_class = _remote_class("acme.layers", "ZeroCentredRMSNorm")
    by_name = _remote_class("transformers_modules.acme.modeling_acme", "ZeroCentredRMSNorm")
    registry.register(by_class, "llama_rms_norm")
    registry.register(by_class, "gemma_rms_norm")  # replaces: its forward is Gemma's formula
    registry.register("transformers_modules.acme.modeling_acme.ZeroCentredRMSNorm", "gemma_rms_norm")
    model = torch.nn.Sequential(by_class(64), by_name(64))
    x = torch.randn(4, 64)
    want = model(x)
    report = cudnorm.patch(model)
    assert [formula for _, _, formula in report.swapped] == ["gemma_rms_norm"] * 2
    assert ref.rel_error(model(x), want) <= F32_TOL
    with pytest.raises(TypeError, match="register: argument 'cls'"):
        registry.register(by_class(8), "gemma_rms_norm")
    with pytest.raises(ValueError, match="register: argument 'how' must be one of layer_norm, "):
        registry.register(by_class, "gemma")


def test_a_norm_without_its_gamma_is_left_saying_so():
    """Stable Audio 3's formula reads a 1-D ``gamma``: an instance whose gamma is not one is left,
    the report naming it."""
    sa3 = pytest.importorskip("diffusers.models.transformers.transformer_stable_audio3")
    norm = sa3.StableAudio3RMSNorm(8)
    norm.gamma = torch.nn.Parameter(torch.ones(2, 4))
    with pytest.warns(RuntimeWarning):
        report = cudnorm.patch(norm)
    assert not report.swapped and "a gamma of shape (2, 4)" in report.left[0][2], report.left


def test_left_classes_say_why():
    """The reasons of the table's left classes reach the report (Qwen3-Next's gated norm is
    in the tiny model of tests/test_patching.py; the reason is checked here)."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    gated = qwen3_next.Qwen3NextRMSNormGated(16)
    report = cudnorm.patch(gated)
    assert report.left == [("", TF("qwen3_next", "Qwen3NextRMSNormGated"),
                            _patch_table.LEFT[TF("qwen3_next", "Qwen3NextRMSNormGated")])]
    assert "gate" in report.left[0][2]


# ---------------------------------------------------------------- the docs' table

def test_docs_patch_table_lists_every_class():
    """docs/patching.md names every registered class under its formula's heading and every
    class the table leaves, with its reason."""
    page = (ROOT / "docs" / "patching.md").read_text()
    sections = {}
    for block in page.split("\n### ")[1:]:
        title, _, body = block.partition("\n")
        sections[title.strip().strip("`")] = body
    for formula, classes in _patch_table.CLASSES.items():
        assert formula in sections, formula
        missing = [name for name in classes if f"`{name}`" not in sections[formula]]
        assert not missing, (formula, missing)
    for name, why in _patch_table.LEFT.items():
        assert f"`{name}`" in page and why in page, name
