"""MPS: Multi-dimensional Preference Score, a CLIP ViT-H/14 with a condition branch (Zhang et al., arXiv 2405.14705).

The score follows the reference `infer_one_sample` of `eval_overall_mps_on_hpdv2.py` and the modules
`trainer/models/clip_model.py` and `trainer/models/cross_modeling.py` (github.com/Kwai-Kolors/MPS):

1. The prompt and the condition text (for the released overall model, the 22 words of `MPS_CONDITION`) are
   tokenised to the tokenizer's 77 tokens (padded with `padding="max_length"`) and run through CLIP's text
   tower with no attention mask. Every token's final hidden state goes through `text_projection`: `T` `(b, L, D)`
   for the prompt, `C` `(L, D)` for the condition; the prompt's EOS token gives the text embedding `t` `(b, D)`.
2. The image's ViT tokens (all of them, before `post_layernorm`) go through `visual_projection`: `I` `(b, N, D)`.
3. Condition mask: `s_l = max_m <T_l, C_m>` for each prompt token `l`, divided by its maximum over `l`; prompt
   tokens with `s_l / max(s) > 0.3` are kept.
4. A 4-layer cross model (`MPSCrossModel`, 16 heads of 64): each layer is a multi-query cross-attention from the
   image tokens to the kept prompt tokens with a parallel SwiGLU feed-forward, then a PaLM-style parallel
   self-attention block with rotary positions, both residual. Its output at the CLS token is the image embedding.
5. `score = logit_scale.exp() * cos(t, image embedding)`.

Departures from the reference: step 3's maximum is taken per prompt (the reference divides by the maximum over the
batch; its scripts score one prompt at a time, where the two agree, so scores here do not depend on the batch);
the similarities of step 3, the rotary angles and the final cosine are computed in float32 whatever the weight
dtype (the reference runs all in float16). Images are preprocessed in torch as `CLIPImageProcessor` does (resize
the shorter side to 224 bicubic, centre crop, OpenAI mean/std; `clipscore.clip_preprocess`).

Weights. The released `MPS_overall_checkpoint.pth` (Google Drive, linked from the reference README) is a whole
pickled `trainer.models.clip_model.CLIPModel` (the README loads it with a bare `torch.load`), which a weights-only
load refuses. Its `state_dict()` is the layout read here: `model.*` (a transformers `CLIPModel`, the CLIP-ViT-H-14
laion2B architecture; `*.position_ids` keys from old transformers are ignored) and `cross_model.layers.<i>.0.fn.*`
/ `cross_model.layers.<i>.1.fn.*` (cross-attention and self-attention block of layer `i`). Convert it once, in
your own environment and only for a file you trust (unpickling runs code), from a checkout of the reference
repository (its `trainer` package must be importable), in a fresh venv with the reference's transformers pin::

    git clone https://github.com/Kwai-Kolors/MPS && cd MPS
    python -m venv /tmp/mpsenv && /tmp/mpsenv/bin/pip install torch safetensors einops transformers==4.27.3
    /tmp/mpsenv/bin/python -c "import torch; from safetensors.torch import save_file; \
    m = torch.load('MPS_overall_checkpoint.pth', map_location='cpu', weights_only=False); \
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, 'MPS_overall_checkpoint.safetensors')"

The CLIP config, tokenizer and image processor come from `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`, where the
reference loads its processor from (its projection width, 1024, is the reference cross model's); the CLIP is built
from that `config.json` with no weights and the MPS file is loaded over it, so no LAION weights are read. A file that
does not fit that config is refused with the count of missing and unexpected keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import check_batch_size, register_reward
from .clipscore import clip_preprocess, load_clip_processor
from .frozen import FrozenNetworkReward, as_dtype, channel_stats, frozen
from .options import check_folder

__all__ = [
    "MPS",
    "MPS_CONDITION",
    "MPS_MASK_THRESHOLD",
    "MPS_PROCESSOR",
    "MPSCrossModel",
    "MPSModel",
    "condition_mask",
    "mps",
]

MPS_CONDITION = (
    "light, color, clarity, tone, style, ambiance, artistry, shape, face, hair, hands, limbs, structure, instance, "
    "texture, quantity, attributes, position, number, location, word, things."
)
"""The condition text of the overall preference, as the reference eval scripts write it."""

MPS_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
"""Hub id of the CLIP config, tokenizer and image processor the reference loads with MPS."""

MPS_MASK_THRESHOLD = 0.3
"""Prompt tokens whose condition similarity, over its maximum, exceeds this are attended (the eval scripts' 0.3)."""


# --- the condition branch: names and shapes follow the checkpoint's `cross_model.*` keys -------------------------


class _GainLayerNorm(nn.Module):
    """LayerNorm over the last axis with a learned gain and a zero bias kept as a buffer (stored in the checkpoint)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("bias", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class _SwiGLU(nn.Module):
    """`(..., 2F)` -> `(..., F)`: first half times SiLU of the second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class _Residual(nn.Module):
    """`x + fn(x, *args)`; the wrapped module is `fn`, as in the checkpoint's key names."""

    def __init__(self, fn: nn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return x + self.fn(x, *args)


class _Rotary(nn.Module):
    """Rotary position angles (arXiv 2104.09864) from `inv_freq` `(d/2,)`, a buffer of the checkpoint."""

    def __init__(self, dim_head: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim_head, 2).float() / dim_head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(b, h, n, d)` or `(b, n, d)` rotated by position along axis -2 (angles in float32)."""
        positions = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq.float())  # (n, d/2)
        angles = torch.cat([angles, angles], dim=-1)  # (n, d)
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)  # the "rotate half" of the two halves
        return x * angles.cos().to(x.dtype) + rotated * angles.sin().to(x.dtype)


def _multi_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention of `h` query heads `q` `(b, h, n, d)` over one key/value head `k`, `v` `(b, m, d)`.

    `keep` `(b, m)` bool masks keys out where False. Returns `(b, n, h * d)`.
    """
    logits = torch.einsum("bhnd,bmd->bhnm", q * q.shape[-1] ** -0.5, k)  # (b, h, n, m)
    if keep is not None:
        logits = logits.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = torch.einsum("bhnm,bmd->bhnd", logits.softmax(dim=-1), v)  # (b, h, n, d)
    return out.transpose(1, 2).flatten(2)  # (b, n, h * d)


class _CrossAttention(nn.Module):
    """Image tokens attend to the kept prompt tokens (multi-query), plus a parallel SwiGLU feed-forward."""

    def __init__(self, dim: int, heads: int, dim_head: int, ff_inner: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.norm = _GainLayerNorm(dim)
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.ff = nn.Sequential(
            nn.Linear(dim, 2 * ff_inner, bias=False), _SwiGLU(), nn.Linear(ff_inner, dim, bias=False)
        )

    def forward(self, x: torch.Tensor, context: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """`x` `(b, n, D)`, `context` `(b, m, D)` (not normalised), `keep` `(b, m)` bool -> `(b, n, D)`."""
        x = self.norm(x)
        q = self.to_q(x).unflatten(-1, (self.heads, self.dim_head)).transpose(1, 2)  # (b, h, n, d)
        k, v = self.to_kv(context).chunk(2, dim=-1)  # (b, m, d) each
        return self.to_out(_multi_query_attention(q, k, v, keep)) + self.ff(x)


class _ParallelBlock(nn.Module):
    """Self-attention with rotary positions (multi-query) and a SwiGLU feed-forward from one fused projection."""

    def __init__(self, dim: int, heads: int, dim_head: int, ff_inner: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.splits = (heads * dim_head, dim_head, dim_head, 2 * ff_inner)
        self.norm = _GainLayerNorm(dim)
        self.rotary_emb = _Rotary(dim_head)
        self.fused_attn_ff_proj = nn.Linear(dim, sum(self.splits), bias=False)
        self.attn_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.ff_out = nn.Sequential(_SwiGLU(), nn.Linear(ff_inner, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(b, n, D)` -> `(b, n, D)`."""
        x = self.norm(x)
        q, k, v, ff = self.fused_attn_ff_proj(x).split(self.splits, dim=-1)
        q = q.unflatten(-1, (self.heads, self.dim_head)).transpose(1, 2)  # (b, h, n, d)
        q, k = self.rotary_emb(q), self.rotary_emb(k)
        return self.attn_out(_multi_query_attention(q, k, v)) + self.ff_out(ff)


class MPSCrossModel(nn.Module):
    """MPS's condition-masked cross model: `depth` layers of (cross-attention to the prompt, self-attention block).

    Args:
        dim (`int`): token width `D` (CLIP's projection dim, 1024 for ViT-H-14).
        depth (`int`): number of layers (4 in MPS).
        heads (`int`), dim_head (`int`): query heads and their width (16 and 64 in MPS).
        ff_inner (`int`): hidden width of the SwiGLU feed-forwards (`4 * dim` in MPS).

    Called with image tokens `(b, n, D)`, prompt tokens `(b, m, D)` and `keep` `(b, m)` bool (at least one True per
    row); returns `(b, n, D)` in the input dtype.
    """

    def __init__(self, dim: int, depth: int, heads: int, dim_head: int, ff_inner: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [
                    _Residual(_CrossAttention(dim, heads, dim_head, ff_inner)),
                    _Residual(_ParallelBlock(dim, heads, dim_head, ff_inner)),
                ]
            )
            for _ in range(depth)
        )

    def forward(self, image_tokens: torch.Tensor, text_tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = image_tokens
        for cross_attention, block in self.layers:
            x = block(cross_attention(x, text_tokens, keep))
        return x

    @staticmethod
    def sizes_from_state_dict(state: Mapping[str, torch.Tensor], prefix: str = "cross_model.") -> dict[str, int]:
        """`dim`, `depth`, `heads`, `dim_head`, `ff_inner` read from the shapes of a checkpoint's cross-model keys.

        Raises:
            KeyError: the keys of layer 0's cross-attention (`to_q`, `to_kv`, `ff.2`) are missing.
        """
        layer = f"{prefix}layers.0.0.fn."
        to_q, to_kv, ff_out = (state[layer + name] for name in ("to_q.weight", "to_kv.weight", "ff.2.weight"))
        depth = 1 + max(
            int(key[len(prefix) + 7 :].split(".")[0]) for key in state if key.startswith(prefix + "layers.")
        )
        dim_head = to_kv.shape[0] // 2
        return dict(
            dim=to_q.shape[1],
            depth=depth,
            heads=to_q.shape[0] // dim_head,
            dim_head=dim_head,
            ff_inner=ff_out.shape[1],
        )


class MPSModel(nn.Module):
    """The MPS network: a transformers `CLIPModel` as `model` and an `MPSCrossModel` as `cross_model`.

    The attribute names make `state_dict()` keys equal to the reference wrapper's (`model.*`, `cross_model.*`).
    """

    def __init__(self, model: nn.Module, cross_model: MPSCrossModel):
        super().__init__()
        self.model = model
        self.cross_model = cross_model

    def encode_text(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(b, L)` token ids -> projected hidden states of every token `(b, L, D)` and of the EOS token `(b, D)`.

        No attention mask, as in the reference: padding tokens are context for the cross model too.
        """
        out = self.model.text_model(input_ids=input_ids)
        projection = self.model.text_projection
        return projection(out.last_hidden_state), projection(out.pooler_output)

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`(b, 3, S, S)` -> every ViT token (CLS first, before `post_layernorm`) projected: `(b, N, D)`."""
        return self.model.visual_projection(self.model.vision_model(pixel_values=pixel_values).last_hidden_state)


def condition_mask(
    text_tokens: torch.Tensor, condition_tokens: torch.Tensor, threshold: float = MPS_MASK_THRESHOLD
) -> torch.Tensor:
    """Which prompt tokens the cross model attends to: `s / max(s) > threshold`, `s_l = max_m <text_l, cond_m>`.

    Args:
        text_tokens (`torch.Tensor` of shape `(b, L, D)`): projected prompt tokens (not normalised).
        condition_tokens (`torch.Tensor` of shape `(M, D)`): projected condition tokens.
        threshold (`float`): the cut on the ratio.

    Returns:
        `torch.Tensor` of shape `(b, L)`, bool; each row keeps at least its best-matching token.
    """
    similarity = torch.einsum("bld,md->blm", text_tokens.float(), condition_tokens.float()).amax(dim=-1)  # (b, L)
    return similarity / similarity.amax(dim=-1, keepdim=True) > threshold


class MPS(FrozenNetworkReward):
    """Score images against their prompts with MPS, under a condition text.

    Use the `mps` factory to load one from a checkpoint; build this class directly to wrap an `MPSModel` in memory.

    Args:
        model (`MPSModel`): the network; put in eval mode, frozen, and moved to `device` and `dtype`.
        tokenizer (`transformers.PreTrainedTokenizerBase`): the CLIP tokenizer; prompts and the condition are padded
            (or cut) to `min(tokenizer.model_max_length, max_position_embeddings)` tokens (77).
        image_mean, image_std (`Sequence[float]` of length 3): per-channel normalisation (OpenAI CLIP's).
        condition (`str`, default `MPS_CONDITION`): the condition text; the released model was trained on the
            overall condition only.
        device (`str` or `torch.device`): where the model runs.
        dtype (`torch.dtype` or `str`): the weight dtype (e.g. `"bfloat16"` or `"float16"` on GPU).
        batch_size (`int >= 1`, *optional*): images per forward; default the whole batch at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, on CPU (`(0,)` for an empty batch):
        `logit_scale.exp() * cos(text, image)` in `[-s, s]`, `s = logit_scale.exp()` (100 for CLIP-H). Only
        differences between images of one prompt are meaningful (the reference turns them into a softmax).

    Raises:
        ValueError: `condition` not a non-empty string, image mean/std not 3 values, bad `dtype` or `batch_size`.
            When called, TypeError / ValueError on malformed inputs (see `rewards.base.check_inputs`).
    """

    name = "mps"

    def __init__(
        self,
        model: MPSModel,
        tokenizer: Any,
        image_mean: Sequence[float],
        image_std: Sequence[float],
        condition: str = MPS_CONDITION,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        _check_condition(condition)
        self.place(device, dtype, batch_size)
        self.image_mean, self.image_std = channel_stats(image_mean, image_std, self.device, self.name)
        self.model = frozen(model, self.device, self.dtype)
        for module in self.model.modules():
            if isinstance(module, _Rotary):  # keep the rotary frequencies in float32 under a bf16/fp16 model
                module.inv_freq = module.inv_freq.float()
        self.tokenizer = tokenizer
        config = model.model.config
        self.image_size = int(config.vision_config.image_size)
        self.max_length = min(tokenizer.model_max_length, config.text_config.max_position_embeddings)
        self.condition = condition
        with torch.no_grad():
            self.condition_tokens = self.model.encode_text(self.tokenize([condition]))[0][0]  # (L, D)

    def tokenize(self, texts: Sequence[str]) -> torch.Tensor:
        """`b` strings -> `(b, L)` long token ids on `self.device`, padded to `L = self.max_length` as the reference."""
        return self.tokenizer(
            list(texts), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        ).input_ids.to(self.device)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """`(B, 3, H, W)` in `[0, 1]` -> `(B, 3, S, S)` model input in `self.dtype` (`clipscore.clip_preprocess`)."""
        return clip_preprocess(images, self.image_size, self.image_mean, self.image_std).to(self.dtype)

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """One chunk: `(b, 3, H, W)` images and `b` prompts -> `(b,)` CPU scores (float32; float64 for float64)."""
        text_tokens, text = self.model.encode_text(self.tokenize(prompts))  # (b, L, D), (b, D)
        image_tokens = self.model.encode_image(self.preprocess(images))  # (b, N, D)
        keep = condition_mask(text_tokens, self.condition_tokens)  # (b, L)
        image = self.model.cross_model(image_tokens, text_tokens, keep)[:, 0]  # (b, D): the CLS token
        dt = torch.promote_types(self.dtype, torch.float32)
        cosine = (F.normalize(image.to(dt), dim=-1) * F.normalize(text.to(dt), dim=-1)).sum(-1)  # (b,)
        return (self.model.model.logit_scale.to(dt).exp() * cosine).cpu()


def _check_condition(condition: Any) -> str:
    """`condition` unchanged; ValueError naming it unless a non-empty string."""
    if not isinstance(condition, str) or not condition.strip():
        raise ValueError(f"mps: condition must be a non-empty string, got {condition!r}")
    return condition


_CONVERT_HINT = (
    "the released MPS_overall_checkpoint.pth is a whole pickled model, which is not unpickled here: convert it once "
    "to safetensors in a trusted environment (recipe in rewards/mps.py and docs/rewards.md, section MPS)"
)


def _load_mps_model(path: Path, config: Any) -> MPSModel:
    """Build an `MPSModel` of `config` (a `CLIPConfig`) without initialising weights and load the file over it.

    Raises:
        ValueError: the file is not a weights-only state dict, has no `cross_model.*` keys, or does not fit.
    """
    from accelerate import init_empty_weights
    from transformers import CLIPModel

    from .convert import load_state_dict  # not at the top: `python -m rewards.convert` runs without a double import

    try:
        state = load_state_dict(path, "mps")
    except ValueError as err:
        if "not a weights-only checkpoint" in str(err):
            raise ValueError(f"mps: '{path}' is not a weights-only checkpoint; {_CONVERT_HINT}") from None
        raise
    state = {key: value for key, value in state.items() if not key.endswith("embeddings.position_ids")}
    try:
        sizes = MPSCrossModel.sizes_from_state_dict(state)
    except (KeyError, ValueError):
        raise ValueError(
            f"mps: '{path}' has no MPS condition branch (cross_model.layers.0.0.fn.to_q.weight, ...); "
            "expected the state dict of the reference CLIPModel wrapper (keys model.* and cross_model.*)"
        ) from None
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, replaced by the file's
        model = MPSModel(CLIPModel(config), MPSCrossModel(**sizes))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as err:  # shape mismatches
        detail = str(err).strip().splitlines()[-1].strip()
        raise ValueError(f"mps: '{path}' does not fit the CLIP config of processor_path ({detail})") from None
    buffers = {name for name, _ in model.named_buffers()}  # zero LayerNorm biases, rotary frequencies: defaults ok
    missing = [key for key in missing if key not in buffers]
    if missing or unexpected:
        raise ValueError(
            f"mps: '{path}' does not fit the CLIP config of processor_path: {len(missing)} missing keys "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected keys (e.g. {unexpected[:3]})"
        )
    return model


@register_reward(
    "mps",
    modality="image",
    weights="MPS_overall_checkpoint.pth (Kwai-Kolors/MPS) converted to safetensors + laion/CLIP-ViT-H-14 processor",
    differentiable=True,
)
def mps(
    model_path: str | os.PathLike,
    processor_path: str | os.PathLike = MPS_PROCESSOR,
    condition: str = MPS_CONDITION,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> MPS:
    """Load the MPS reward from a converted checkpoint and the CLIP-H processor folder (nothing is downloaded).

    Args:
        model_path (`str` or path): the MPS weights: a `.safetensors` file (or a weights-only `.pt` / `.pth`) holding
            the reference wrapper's state dict (`model.*`, `cross_model.*`); see this module's docstring for the
            one-time conversion of the released pickled `MPS_overall_checkpoint.pth`.
        processor_path (`str` or path, default `"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"`): folder or cached hub id
            with the CLIP `config.json`, tokenizer and `preprocessor_config.json`
            (`hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K config.json preprocessor_config.json
            tokenizer.json tokenizer_config.json special_tokens_map.json vocab.json merges.txt`).
        condition (`str`, default `MPS_CONDITION`): the condition text (the overall preference's 22 words).
        device (`str` or `torch.device`, default `"cpu"`): where the model runs.
        dtype (`torch.dtype` or `str`, default float32): weight dtype, e.g. `"bfloat16"` on GPU (the reference
            scripts run it in float16).
        batch_size (`int >= 1`, *optional*): images per forward (bounds ViT-H memory); default the whole batch.

    Returns:
        An `MPS`, scoring `(B, 3, H, W)` images in `[0, 1]` to `(B,)` float32 CPU tensors in `[-100, 100]`.

    Raises:
        FileNotFoundError: `model_path` is not a file, or `processor_path` is neither a folder nor a cached hub id,
            or has no `config.json` (messages start with `mps:` and name the path).
        OSError: no CLIP tokenizer and image processor in `processor_path`.
        ValueError: bad `condition`, `dtype` or `batch_size` (before anything loads); a pickled-model checkpoint
            (with the conversion hint), a file without MPS's keys, or one that does not fit the CLIP config.
    """
    _check_condition(condition)
    check_batch_size(batch_size, "mps")
    as_dtype(dtype)
    path = Path(model_path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise FileNotFoundError(
            f"mps: model_path '{path}' {what}; pass the MPS weights file (MPS_overall_checkpoint.pth converted to "
            ".safetensors, see docs/rewards.md)"
        )
    from transformers import CLIPConfig

    folder = check_folder(processor_path, "processor_path", need_config=False, reward="mps")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"mps: processor_path '{processor_path}' has no config.json (the CLIP config MPS is built from, "
            f"e.g. {MPS_PROCESSOR}'s)"
        )
    tokenizer, image_processor = load_clip_processor(folder, processor_path, "mps")
    model = _load_mps_model(path, CLIPConfig.from_pretrained(folder, local_files_only=True))
    return MPS(
        model,
        tokenizer,
        image_processor.image_mean,
        image_processor.image_std,
        condition,
        device,
        dtype,
        batch_size,
    )
