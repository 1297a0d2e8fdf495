"""``diffusers-all``: every transformer class diffusers exports, from its default config.

Where :mod:`.diffusers_models` writes four models out by hand, this table derives a
:class:`RealModel` for each class of ``diffusers.models.transformers`` (and the
``*Transformer*Model`` classes of diffusers' top level) generically:

* config: the class's ``__init__`` defaults (mostly the published widths; see :data:`NOT_PUBLISHED`),
  with the published checkpoint's values where a default is None or not its width
  (:data:`.diffusers_inputs.CONFIGS`),
  with every depth field (:func:`_is_depth`) cut to 1 and layer-index lists cut to match; the
  quick (CPU) mode also cuts every head count to 2 (head sizes kept, so rotary axes still sum
  to them) and a ``hidden_size``-like width with it;
* inputs: from ``inspect.signature(cls.forward)``: each required argument, and the optional
  ones a pipeline passes (pooled projections, ids, guidance, masks), by name (:data:`_KNOWN`),
  with shapes from the config, and a class's own arguments (:data:`.diffusers_inputs.INPUTS`); the
  latent is ``[B, C, H, W]``, ``[B, C, F, H, W]`` for the ``3D`` classes, or packed ``[B, H * W, C]``
  for the classes taking ``img_ids``/``img_shapes`` (exceptions: :data:`.diffusers_inputs.LAYOUT`);
* sizes: 512 px images (64 x 64 latents) and 4-frame 32 x 32 video latents, 128 text tokens,
  B 2 images or B 1 video (sampling at twice that, CFG); quick: 8 x 8 latents, 8 text tokens.

A class is a case when :func:`probe` builds it (on the ``meta`` device at the run's widths:
no memory) and ``cudnorm.patch`` swaps at least one norm in it; else its cases are skipped with
one line saying why (``RealCase.missing``). At run time a class whose unpatched model fails a
step (an input the generic rules cannot make) is reported as skipped, not failed
(``models.run_cases``). Every case runs ``--models diffusers-all`` only (the filter names it).

Count on diffusers 0.42.1 (torch 2.13, CPU, ``--quick``): see :data:`COUNTS`.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from typing import Any

import torch

from . import diffusers_inputs
from .diffusers_models import FLUX_SDPA
from .spec import RealModel

PREFIX = "diffusers-all:"

# On diffusers 0.42.1: 76 classes found; 73 built (at the run's widths and at toy widths) with norms
# cudnorm.patch swaps, 9 of them from the published configs of diffusers_inputs.CONFIGS; 3 skipped:
# DualTransformer2DModel cannot be built (a pair of Transformer2DModels, no widths of its own), Krea2
# and StableAudio3DiT have no norm the patch swaps. Of the 73, the generic inputs with the per-class
# tables (diffusers_inputs, diffusers_inputs_av) run 61 on the CPU at toy widths (forward and backward).
# The other 12: AnyFlow-FAR's inputs are made but FlexAttention has no CPU backward; Cosmos needs
# torchvision; Ideogram4, Kandinsky6 (and SR), LongCatAudioDiT, MiniMaxH3, MiniMaxMusic3 (and its RVQ
# decoder), RFD4Proteina, SanaWM and its LTX-2 refiner need an argument or shape no rule makes yet
# (mRoPE and segment ids, channel layouts, masks and camera inputs) and are reported skipped.

#: the classes ``--quick`` runs, one per family (DiT, Wan, CogView, QwenImage; Flux.1's is
#: diffusers-flux.1-dev's): about 10-20 s each on 2 CPU cores, both modes, four providers; the
#: others are built and patched on the meta device only
QUICK = ("DiTTransformer2DModel", "ChronoEditTransformer3DModel", "CogView4Transformer2DModel",
         "QwenImageTransformer2DModel")

#: classes whose ``__init__`` defaults are not a published model's widths (what they are instead);
#: checked for these only, the others' defaults are taken as their model card's
NOT_PUBLISHED = {
    "SD3Transformer2DModel": "18 heads x 64 (1152 wide), no published SD3 (SD3-medium: 24 x 64; "
                             "diffusers-sd3.5-medium runs SD3.5-medium's)",
}

_DEPTH = re.compile(r"^(num_.*layers|n_.*layers|nlayers|num_.*blocks|depth|dit_depth|mmdit_layers|llama_layers|"
                    r".*_depth)$")
_HEADS = re.compile(r"^(num_.*heads|n_.*heads|nheads|num_heads|dit_heads|.*_num_heads|num_kv_heads|n_kv_heads|"
                    r"num_key_value.*heads)$")
# the text encoder width a model's encoder_hidden_states have, by config field, first found wins
_TEXT_DIM = ("joint_attention_dim", "caption_channels", "cross_attention_dim", "text_embed_dim", "text_dim",
             "caption_dim", "context_dim", "text_hidden_dim", "encoder_hidden_size", "text_in_dim", "cap_feat_dim",
             "in_text_dim", "context_in_dim", "dit_text_dim")
_IN_CHANNELS = ("in_channels", "in_dim", "latent_channels", "in_channel", "input_dim")


def _is_depth(name: str, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1 and bool(_DEPTH.match(name))


def classes() -> list[type]:
    """Every transformer model class diffusers exports, by name."""
    import diffusers  # noqa: PLC0415
    import diffusers.models.transformers as transformers  # noqa: PLC0415

    found = {}
    for module, pattern in ((transformers, ""), (diffusers, "Transformer")):
        found.update(exported_modules(module, pattern))
    return [found[name] for name in sorted(found)]


def exported_modules(module, pattern: str) -> dict[str, type]:
    """``{name: class}`` of the ``torch.nn.Module`` classes ``module`` exports whose name holds
    ``pattern`` and ends like a model's. Names are filtered before they are resolved: diffusers
    resolves its exports lazily, and some fail to import where an optional dependency is
    half there (its ONNX pipelines, with ``onnx`` installed but not ``onnxruntime``'s providers);
    such a name is passed over."""
    found = {}
    for name in dir(module):
        if pattern not in name or not name.endswith(("Model", "Transformer", "Decoder")):
            continue
        try:
            obj = getattr(module, name)
        except (AttributeError, ImportError, RuntimeError):
            continue
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            found[name] = obj
    return found


def defaults(cls: type) -> dict:
    """The keyword arguments of ``cls.__init__`` that have defaults."""
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if k != "self" and p.default is not inspect.Parameter.empty
            and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}


def shrink(cls: type, toy: bool) -> dict:
    """``cls``'s default config (with the published values of :data:`.diffusers_inputs.CONFIGS`)
    with one layer of each kind (toy: also 2 heads of each kind)."""
    config = diffusers_inputs.configure(cls.__name__, defaults(cls))
    changed = {}
    for name, value in config.items():
        if _is_depth(name, value):
            changed[name] = 1
        elif toy and isinstance(value, int) and not isinstance(value, bool) and value > 2 and _HEADS.match(name):
            changed[name] = 2
    for name, value in config.items():  # layer indices of layers that are gone
        if isinstance(value, (list, tuple)) and "layer" in name and all(isinstance(v, int) for v in value):
            changed[name] = type(value)(v for v in value if v < 1)
    if toy:
        heads = next((k for k in ("num_attention_heads", "n_heads", "num_heads", "nheads", "dit_heads")
                      if k in changed), None)
        for width in ("hidden_size", "dim", "hidden_dim", "model_dim", "dit_dim", "inner_dim"):
            value = config.get(width)
            if heads and isinstance(value, int) and value % config[heads] == 0:
                changed[width] = value // config[heads] * 2
        # a text width that is the inner width (PixArt-style caption projections into it, SD3's and AuraFlow's
        # caption_projection_dim, which their joint attention concatenates with the image tokens) shrinks with it
        head_dim = config.get("attention_head_dim")
        for inner in ("cross_attention_dim", "caption_projection_dim"):
            if heads and isinstance(head_dim, int) and config.get(inner) == config[heads] * head_dim:
                changed[inner] = 2 * head_dim
        if isinstance(config.get("sample_size"), int):
            changed["sample_size"] = 8
    return diffusers_inputs.after_shrink(cls.__name__, {**config, **changed})


# ------------------------------------------------------------------------------ inputs

def _field(config: dict, names, default=None):
    return next((config[n] for n in names if isinstance(config.get(n), int) and config[n] > 0), default)


def _patch(config: dict) -> tuple[int, int]:
    """(temporal, spatial) patch size."""
    p = config.get("patch_size", 1)
    if isinstance(p, (list, tuple)):
        return (p[0], p[-1]) if len(p) == 3 else (1, p[-1])
    return config.get("patch_size_t") or 1, p or 1


def _layout(cls: type) -> str:
    if cls.__name__ in diffusers_inputs.LAYOUT:
        return diffusers_inputs.LAYOUT[cls.__name__]
    params = inspect.signature(cls.forward).parameters
    if "img_ids" in params or "img_shapes" in params:
        return "packed"
    return "video" if "3D" in cls.__name__ else "image"


def _video(layout: str) -> bool:
    return layout in ("video", "frames-first")


def _sizes(config: dict, cls: type, toy: bool) -> dict:
    """Latent side, frames and text tokens of a step (module docstring)."""
    t, p = _patch(config)
    layout = _layout(cls)
    side = 8 if toy else 32 if _video(layout) else 64
    if layout == "packed":
        side //= 2  # 2 x 2 latents already packed into the channels
    side = max(side, 2 * p)
    # a model whose positional table spans a fixed caption length (CogVideoX's max_text_seq_length) takes that many
    text = config.get("max_text_seq_length") or (8 if toy else 128)
    # and one whose temporal table spans a fixed frame count (Latte's video_length) that many frames
    frames = config.get("video_length") or (2 * t if toy else 4 * t)
    return {"side": side - side % p, "frames": frames, "text": text, "layout": layout}


def _ids(side: int, text: int, axes: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    img = torch.zeros(side, side, axes, device=device, dtype=dtype)
    img[..., 1] = torch.arange(side, device=device)[:, None]
    img[..., 2] = torch.arange(side, device=device)[None, :]
    return img.flatten(0, 1), torch.zeros(text, axes, device=device, dtype=dtype)


def make_inputs(cls: type, config: dict, batch: int, device, dtype, gen, toy: bool) -> dict:
    """The forward's keyword arguments (module docstring); raises ``ValueError`` naming an
    argument it cannot make."""
    params = inspect.signature(cls.forward).parameters
    s = _sizes(config, cls, toy)
    side, frames, text = s["side"], s["frames"], s["text"]
    channels = _field(config, _IN_CHANNELS, 4)
    text_dim = _field(config, _TEXT_DIM, 64)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    if s["layout"] == "packed":
        latent = randn(batch, side * side, channels)
    elif s["layout"] == "video":
        latent = randn(batch, channels, frames, side, side)
    elif s["layout"] == "frames-first":
        latent = randn(batch, frames, channels, side, side)
    else:
        latent = randn(batch, channels, side, side)
    axes = len(config.get("axes_dims_rope") or (0, 0, 0))
    img_ids, txt_ids = _ids(side, text, max(axes, 3), device, dtype)
    made = {
        "timestep": lambda: torch.rand(batch, generator=gen, device=device, dtype=dtype) * 999,
        "encoder_hidden_states": lambda: randn(batch, text, text_dim),
        "pooled_projections": lambda: randn(batch, _field(config, ("pooled_projection_dim", "in_text_dim2"), 64)),
        "img_ids": lambda: img_ids,
        "txt_ids": lambda: txt_ids,
        "guidance": lambda: torch.full((batch,), 3.5, device=device, dtype=dtype),
        "encoder_attention_mask": lambda: torch.ones(batch, text, device=device,
                                                     dtype=diffusers_inputs.MASK_DTYPES.get(cls.__name__, dtype)),
        "class_labels": lambda: torch.randint(0, _field(config, ("num_embeds_ada_norm", "num_classes"), 10),
                                              (batch,), generator=gen, device=device),
        # PixArt's micro-conditions (read where use_additional_conditions: the 1024 px default)
        "added_cond_kwargs": lambda: {"resolution": torch.full((batch, 2), side * 8.0, device=device, dtype=dtype),
                                      "aspect_ratio": torch.ones(batch, 1, device=device, dtype=dtype)},
        "img_shapes": lambda: [[(1, side, side)]] * batch,
        # SDXL-style micro-conditioning (CogView): image sizes in pixels, the crop's corner
        "original_size": lambda: torch.full((batch, 2), side * 8, device=device, dtype=dtype),
        "crop_coords": lambda: torch.zeros(batch, 2, device=device, dtype=dtype),
    }
    # the class's own arguments (diffusers_inputs.INPUTS) replace or add to the generic ones
    maker = diffusers_inputs.INPUTS.get(cls.__name__)
    own = maker(diffusers_inputs.Inputs(config, batch, side, frames, text, toy, device, dtype, gen, latent)) \
        if maker else {}
    made["target_size"] = made["original_size"]
    made["timesteps"] = made["t"] = made["timestep"]
    # arguments a pipeline passes where the model has their part (optional in the signature)
    wanted = {"pooled_projections": "pooled_projection_dim", "guidance": "guidance_embeds",
              "class_labels": "num_embeds_ada_norm", "img_ids": None, "txt_ids": None, "img_shapes": None,
              "encoder_hidden_states": None, "timestep": None, "added_cond_kwargs": "use_additional_conditions"}
    kwargs = {}
    first = True
    for name, param in params.items():
        if name in ("self", "return_dict") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        required = param.default is inspect.Parameter.empty
        if name in own:
            kwargs[name], first = own[name], False
            continue
        if first:
            kwargs[name], first = latent, False
            continue
        if name in wanted and not required:
            field = wanted[name]
            if field is not None and not config.get(field) and name != "added_cond_kwargs":
                continue
            if name == "added_cond_kwargs" and "norm_type" not in config:
                continue
        elif not required:
            continue
        if name not in made:
            raise ValueError(f"no rule makes its forward's argument {name!r}")
        kwargs[name] = made[name]()
    latent_arg = diffusers_inputs.LATENT_ARG.get(cls.__name__)
    return {latent_arg: kwargs.pop(latent_arg), **kwargs} if latent_arg else kwargs


def output(result) -> torch.Tensor:
    """The tensor of a forward's result (``.sample``, a tuple's or another output's first item (the
    prior's ``predicted_image_embedding``), or itself)."""
    if hasattr(result, "sample"):
        return result.sample
    return result[0] if isinstance(result, (tuple, list)) or hasattr(result, "to_tuple") else result


def _width(config: dict) -> int:
    heads = _field(config, ("num_attention_heads", "n_heads", "num_heads", "nheads", "dit_heads"), 0)
    head_dim = _field(config, ("attention_head_dim", "head_dim", "dim_head"), 0)
    return heads * head_dim or _field(config, ("hidden_size", "dim", "hidden_dim", "model_dim", "inner_dim"), 0)


def _tokens(cls: type, config: dict, toy: bool) -> int:
    s, (t, p) = _sizes(config, cls, toy), _patch(config)
    if s["layout"] == "packed":
        return s["side"] ** 2 + s["text"]
    frames = s["frames"] // t if _video(s["layout"]) else 1
    return frames * (s["side"] // p) ** 2


# every class's training step runs with cuDNN's SDPA backend off: one bad step ends the process
SDPA_OFF = (FLUX_SDPA + "; in diffusers-all the same failure (then an illegal memory access) ended the runs in the "
            "unpatched training steps of Flux.1, Bria and Chroma, one layer each, on H200s")

# ------------------------------------------------------------------------------ the table

@functools.cache
def probe(name: str, toy: bool) -> tuple[int, str] | str:
    """``(norms cudnorm.patch swaps, what it leaves)`` of class ``name`` built from its
    config (``toy``: the quick mode's) on the meta device, or why it cannot be a case."""
    import cudnorm  # noqa: PLC0415

    cls = _by_name()[name]
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cls(**shrink(cls, toy))
            report = cudnorm.patch(model)
    except Exception as exc:  # noqa: BLE001 - any failure is the reason this class is skipped
        return f"cannot be built from its default config: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if not report.swapped:
        return "no norm that cudnorm.patch swaps"
    left = sorted({cls.rpartition(".")[2] for _, cls, _ in report.left})
    return len(report.swapped), ", ".join(left)


@functools.cache
def _by_name() -> dict[str, type]:
    return {cls.__name__: cls for cls in classes()}


def names() -> list[str]:
    """The model names (``diffusers-all:<ClassName>``) of every class diffusers exports."""
    return [PREFIX + name for name in _by_name()]


@functools.cache
def spec(model: str) -> RealModel:
    """The :class:`RealModel` of ``diffusers-all:<ClassName>``."""
    cls = _by_name()[model.removeprefix(PREFIX)]
    video = _video(_layout(cls))

    def build(config: dict) -> torch.nn.Module:
        return diffusers_inputs.build(cls, config)

    def inputs(config, batch, device, dtype, gen):
        return make_inputs(cls, config, batch, device, dtype, gen, toy=config is toy)

    toy = shrink(cls, toy=True)
    return RealModel(
        name=model, library="diffusers", title=f"diffusers {cls.__name__} (default config, 1 layer per kind)",
        build=build, config=shrink(cls, toy=False), toy=toy, full={}, inputs=inputs, output=output,
        batch=1 if video else 2, toy_batch=1,
        tokens=lambda config: _tokens(cls, config, toy=config is toy), width=_width,
        timed_s=0.5, cudnn_sdpa_off=SDPA_OFF)


def patch_note(model: str, toy: bool) -> str:
    """What ``cudnorm.patch`` does to ``model`` (a line of the run): norms swapped and the
    classes it leaves as PyTorch's."""
    probed = probe(model.removeprefix(PREFIX), toy)
    if isinstance(probed, str):
        return probed
    swapped, left = probed
    return f"cudnorm.patch swaps {swapped} norm(s), leaves " + (left or "none")


def census(toy: bool) -> tuple[int, int, list[str]]:
    """(classes found, classes built with norms the patch swaps, the other classes' names)."""
    found = list(_by_name())
    skipped = [name for name in found if isinstance(probe(name, toy), str)]
    return len(found), len(found) - len(skipped), skipped


def not_quick(model: str) -> str | None:
    """Why ``--quick`` does not run ``model`` (it is not in :data:`QUICK`), or None."""
    if model.removeprefix(PREFIX) in QUICK:
        return None
    return f"--quick runs only {', '.join(QUICK)} (the others built and patched on the meta device)"
