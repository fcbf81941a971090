"""HPSv3: a Qwen2-VL human-preference score of an image for its prompt.

HPSv3 (Ma et al., arXiv 2508.03789; reference implementation github.com/MizzenAI/HPSv3, pip package `hpsv3` 1.0.0:
`hpsv3/model/qwen2vl_trainer.py` `Qwen2VLRewardModelBT`, `hpsv3/train.py` `create_model_and_processor`,
`hpsv3/inference.py` `HPSv3RewardInferencer`, `hpsv3/config/HPSv3_7B.yaml`) is Qwen2-VL-7B-Instruct fine-tuned in
full on HPDv3 pairs. What the reference does, and this module with it:

- The tokenizer gets one added special token, `<|Reward|>`, and the token embeddings are resized to the new
  tokenizer length (151658 rows for Qwen2-VL-7B-Instruct's 151657 tokens).
- The user turn of the chat template is the image followed by a text: an instruction holding the prompt, then a line
  ending in `<|Reward|>` (the package's `INSTRUCTION + prompt_with_special_token`, read here from
  `hpsv3_prompt.txt`). Sequences are padded on the right.
- The image is resized (bicubic) to `smart_resize(H, W, factor=28, min_pixels=max_pixels=256*28*28)`: sides that
  are multiples of 28 with about 200704 pixels (448 x 448 for a square image), then normalised with OpenAI CLIP's
  mean and std by the Qwen2-VL image processor, which does not resize again.
- The language model runs with position ids `0 .. L-1` on all three M-RoPE axes: the reference forward passes no
  position ids and never calls `get_rope_index`, so image tokens get sequential positions, not the 3-D ones of
  Qwen2-VL's own forward.
- A float32 head, `rm_head` = Linear(D, 1024), ReLU, Dropout(0.05), Linear(1024, 16), ReLU, Linear(16, 2) (keys
  `rm_head.0`, `rm_head.3`, `rm_head.5`), maps the final-norm hidden state at the `<|Reward|>` token to
  `(mu, log sigma)`. Training fits the uncertainty-aware ranking loss `-log sigmoid(z)`, with
  `z ~ N(mu_A - mu_B, sigma_A^2 + sigma_B^2)`, and the score is `mu`.

The released weights (`MizzenAI/HPSv3`, `HPSv3.safetensors`) are the whole model's state dict in the key layout of
transformers 4.45 (`visual.*`, `model.*`, `lm_head.weight`, `rm_head.*`). They are mapped here onto transformers'
`Qwen2VLModel` (`visual.*`, `language_model.*`). The language-model head is not needed and is dropped. Runs
in-process and offline.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .base import check_batch_size, check_inputs, chunk_slices, is_integer, quiet_loading, register_reward
from .frozen import as_dtype, frozen
from .video import _check_folder
from .vqascore import chat_texts

__all__ = ["HPSv3", "hpsv3", "hpsv3_state_dict"]

REWARD_TOKEN = "<|Reward|>"
CHECKPOINT_FILE = "HPSv3.safetensors"
PROMPT_FILE = "hpsv3_prompt.txt"
PIXELS = 256 * 28 * 28
"""HPSv3's `min_pixels` and `max_pixels` (`HPSv3_7B.yaml`): 200704 pixels, 256 visual tokens after the 2x2 merge."""


class HPSv3:
    """Score images against their prompts with an HPSv3 model.

    Use the `hpsv3` factory to load one from a folder; build this class directly to wrap a model already in memory.

    Args:
        model (`transformers.Qwen2VLModel`): vision tower and language model (no language-model head), with the
            token embeddings covering `<|Reward|>`. It is put in eval mode, frozen, and moved to `device` and `dtype`.
        head (`torch.nn.Module`): `(..., hidden_size)` -> `(..., K)` with `K >= 1`: output 0 is `mu` and output 1
            (when present) is `log sigma`. It runs in float32 on `device`.
        processor (`transformers.Qwen2VLProcessor`): tokenizer holding `<|Reward|>`, image processor and chat
            template of Qwen2-VL-7B-Instruct. Its tokenizer is set to pad on the right.
        prompt_template (`str`): the text after the image, with `{text_prompt}` where the prompt goes and
            `<|Reward|>` once (`hpsv3_prompt.txt`).
        min_pixels, max_pixels (`int >= 1`, default 200704 each): the image area bounds of `smart_resize`.
        device (`str` or `torch.device`), dtype (`torch.dtype` or `str`): where and in what the model runs
            (the release is bfloat16).
        batch_size (`int >= 1`, *optional*): images per forward; default all at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, CPU: `mu`, unbounded (about -5 to 15 for the released model).
        `last_sigma` keeps the `(B,)` `sigma = exp(log sigma)` of the last call (`(0,)` when the head has one
        output).

    Raises:
        ValueError: a template without `{text_prompt}` or without exactly one `<|Reward|>`, a tokenizer without
            `<|Reward|>`, bad `min_pixels` / `max_pixels` / `batch_size` or `dtype`; when called, malformed images
            (`rewards.base.check_inputs`), or a prompt that holds `<|Reward|>` itself.
    """

    name = "hpsv3"

    def __init__(
        self,
        model: torch.nn.Module,
        head: torch.nn.Module,
        processor: Any,
        prompt_template: str,
        min_pixels: int = PIXELS,
        max_pixels: int = PIXELS,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        if "{text_prompt}" not in prompt_template:
            raise ValueError("hpsv3: prompt_template must contain '{text_prompt}' where the prompt goes")
        if prompt_template.count(REWARD_TOKEN) != 1:
            raise ValueError(
                f"hpsv3: prompt_template must contain {REWARD_TOKEN} once (the head reads its hidden state), "
                f"found {prompt_template.count(REWARD_TOKEN)}"
            )
        for option, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if not is_integer(value) or value < 1:
                raise ValueError(f"hpsv3: {option} must be an integer >= 1, got {value!r}")
        if min_pixels > max_pixels:
            raise ValueError(f"hpsv3: min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")
        self.batch_size = check_batch_size(batch_size, self.name)
        self.reward_id = processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        if self.reward_id is None or self.reward_id == processor.tokenizer.unk_token_id:
            raise ValueError(f"hpsv3: the tokenizer lacks {REWARD_TOKEN}; add it (the hpsv3 factory does)")
        processor.tokenizer.padding_side = "right"  # positions are 0..L-1: left padding would shift them
        self.processor, self.prompt_template = processor, prompt_template
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        image_processor = processor.image_processor
        self.factor = image_processor.patch_size * image_processor.merge_size  # 28
        self.device, self.dtype = torch.device(device), as_dtype(dtype)
        self.model = frozen(model, self.device, self.dtype)
        self.head = frozen(head, self.device, torch.float32)
        self.last_sigma = torch.zeros(0)

    def resize(self, images: torch.Tensor) -> torch.Tensor:
        """`(B, 3, H, W)` in `[0, 1]` -> `(B, 3, h, w)` float32 in `[0, 1]` on `device`, `(h, w)` = transformers'
        Qwen2-VL `smart_resize(H, W, 28, min_pixels, max_pixels)`: bicubic, antialiased, clipped to `[0, 1]` as the
        reference's PIL resize clips (unchanged when `(h, w) == (H, W)`)."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        pixels = images.to(device=self.device, dtype=torch.float32)  # (B, 3, H, W)
        size = smart_resize(*pixels.shape[-2:], self.factor, self.min_pixels, self.max_pixels)
        if tuple(size) == tuple(pixels.shape[-2:]):
            return pixels
        return F.interpolate(pixels, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)

    def inputs(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The processor's batch for `(b, 3, H, W)` images in `[0, 1]` and `b` prompts (chat template with the image
        then `prompt_template`, right padding, `resize`d pixels normalised by the image processor), on `device`."""
        if any(REWARD_TOKEN in prompt for prompt in prompts):
            raise ValueError(f"hpsv3: a prompt contains {REWARD_TOKEN}, which only the template may hold")
        texts = chat_texts(self.processor, "image", [self.prompt_template.format(text_prompt=p) for p in prompts])
        pixels = list(self.resize(images).cpu())  # b x (3, h, w), sides multiples of 28
        batch = self.processor(
            text=texts,
            images=pixels,
            padding=True,
            return_tensors="pt",
            images_kwargs={"do_resize": False, "do_rescale": False},
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def outputs(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """`(B, K)` float32 CPU: the head's outputs (`mu`, `log sigma`) at `<|Reward|>`, one forward per chunk."""
        out = []
        for part in chunk_slices(len(prompts), self.batch_size):
            batch = self.inputs(images[part], prompts[part])
            ids = batch["input_ids"]  # (b, L)
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # (b, L): 0..L-1 on 3 axes
            hidden = self.model(**batch, position_ids=positions, use_cache=False).last_hidden_state  # (b, L, D)
            at = (ids == self.reward_id).int().argmax(dim=1)  # (b,): the one <|Reward|> of each row
            rows = torch.arange(ids.shape[0], device=ids.device)
            out.append(self.head(hidden[rows, at].float()).cpu())  # (b, K)
        return torch.cat(out)

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(images, prompts, metadata)
        if len(prompts) == 0:
            return torch.zeros(0)
        outputs = self.outputs(images, list(prompts))  # (B, K)
        self.last_sigma = outputs[:, 1].exp() if outputs.shape[1] > 1 else torch.zeros(0)
        return outputs[:, 0]  # (B,): mu


def hpsv3_state_dict(
    state: Mapping[str, torch.Tensor], source: str | os.PathLike = "checkpoint"
) -> tuple[dict[str, torch.Tensor], torch.nn.Sequential]:
    """Split an HPSv3 state dict into `Qwen2VLModel` weights and the reward head.

    Keys in transformers 4.45's layout (`visual.*`, `model.*`) or in the current one (`model.visual.*`,
    `model.language_model.*`) become `visual.*` and `language_model.*`; `lm_head.weight` is dropped. The head's
    `rm_head.<i>.weight` / `.bias` (Linear layers, `i` in increasing order, e.g. 0, 3, 5) become an
    `nn.Sequential` of those Linear layers with a ReLU between consecutive ones (the reference's Dropout is the
    identity at inference).

    Args:
        state (`Mapping[str, torch.Tensor]`): the checkpoint, e.g. `HPSv3.safetensors` read whole.
        source (`str` or path): named in error messages.

    Returns:
        `(backbone, head)`: a dict for `Qwen2VLModel.load_state_dict` (tensors as stored) and a float32 head
        `(..., hidden_size)` -> `(..., K)`.

    Raises:
        ValueError: keys of neither layout, no `rm_head.<i>.weight`, or head layers whose shapes do not chain.
    """
    backbone, layers = {}, {}
    for key, value in state.items():
        if key == "lm_head.weight":
            continue
        if match := re.fullmatch(r"rm_head\.(\d+)\.(weight|bias)", key):
            layers.setdefault(int(match[1]), {})[match[2]] = value
        elif key.startswith(("visual.", "model.visual.")):
            backbone[key.removeprefix("model.")] = value
        elif key.startswith("model.language_model."):
            backbone[key.removeprefix("model.")] = value
        elif key.startswith("model."):
            backbone["language_model." + key.removeprefix("model.")] = value
        else:
            raise ValueError(
                f"hpsv3: '{source}' has key {key!r}, not of an HPSv3 checkpoint (visual.*, model.*, lm_head.weight, "
                "rm_head.<i>.*)"
            )
    if not layers or not all("weight" in layer for layer in layers.values()):
        raise ValueError(f"hpsv3: '{source}' has no reward head (rm_head.<i>.weight); is it an HPSv3 checkpoint?")
    modules: list[torch.nn.Module] = []
    for index in sorted(layers):
        weight, bias = layers[index]["weight"], layers[index].get("bias")
        if modules:
            if weight.shape[1] != modules[-1].out_features:
                raise ValueError(
                    f"hpsv3: '{source}' rm_head.{index}.weight has shape {tuple(weight.shape)}, which does not "
                    f"follow the previous layer's {modules[-1].out_features} outputs"
                )
            modules.append(torch.nn.ReLU())
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        linear.weight.data.copy_(weight)
        if bias is not None:
            linear.bias.data.copy_(bias)
        modules.append(linear)
    return backbone, torch.nn.Sequential(*modules).float()


@register_reward(
    "hpsv3",
    modality="image",
    weights="MizzenAI/HPSv3 HPSv3.safetensors + Qwen/Qwen2-VL-7B-Instruct config, tokenizer and processor files",
)
def hpsv3(
    model_path: str | os.PathLike,
    checkpoint: str | os.PathLike = CHECKPOINT_FILE,
    prompt_template: str | None = None,
    min_pixels: int = PIXELS,
    max_pixels: int = PIXELS,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> HPSv3:
    """Load the `HPSv3` reward from a local folder (nothing is downloaded).

    The folder holds Qwen2-VL-7B-Instruct's `config.json`, tokenizer, `preprocessor_config.json` and chat template
    (no base weights are needed), the released `HPSv3.safetensors`, and `hpsv3_prompt.txt` (the package's
    `INSTRUCTION + prompt_with_special_token`, see docs/rewards.md). `<|Reward|>` is added to the tokenizer when
    missing, the text model's `vocab_size` is set to the checkpoint's embedding rows, and the whole state dict is
    loaded strictly. A weights-only `.pt` / `.pth` checkpoint is read too (`rewards.convert.load_state_dict`, never
    unpickled).

    Args:
        model_path (`str` or path): the folder above.
        checkpoint (`str` or path, default `"HPSv3.safetensors"`): the checkpoint, relative to `model_path`
            (or absolute).
        prompt_template (`str`, *optional*): see `HPSv3`; default the folder's `hpsv3_prompt.txt`.
        min_pixels, max_pixels, device, dtype, batch_size: see `HPSv3` (use `dtype: bfloat16` on GPU; the 7B model
            needs about 17 GB in bfloat16).

    Returns:
        An `HPSv3`: `(B, 3, H, W)` images in `[0, 1]` -> `(B,)` float32 CPU `mu`.

    Raises:
        FileNotFoundError: `model_path` is not a folder with `config.json`, the checkpoint is missing, or there is
            neither `prompt_template` nor `hpsv3_prompt.txt`.
        ValueError: a checkpoint that is not an HPSv3 state dict or does not fit the folder's config (missing,
            unexpected or misshapen keys), a tokenizer whose `<|Reward|>` id is outside the checkpoint's
            embeddings, or the checks of `HPSv3`.
    """
    from transformers import AutoConfig, AutoProcessor, Qwen2VLModel

    from .convert import load_state_dict

    folder = _check_folder("hpsv3", model_path, "model_path", need_config=False)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"hpsv3: model_path '{model_path}' has no config.json; put Qwen/Qwen2-VL-7B-Instruct's config, "
            "tokenizer and processor files there"
        )
    path = folder / checkpoint
    if not path.is_file():
        raise FileNotFoundError(
            f"hpsv3: checkpoint '{path}' not found; download it (hf download MizzenAI/HPSv3 {CHECKPOINT_FILE} "
            f"--local-dir {folder})"
        )
    if prompt_template is None:
        if not (folder / PROMPT_FILE).is_file():
            raise FileNotFoundError(
                f"hpsv3: no prompt_template given and no {PROMPT_FILE} in '{model_path}'; write the hpsv3 package's "
                "INSTRUCTION + prompt_with_special_token there (docs/rewards.md)"
            )
        prompt_template = (folder / PROMPT_FILE).read_text(encoding="utf-8")
    as_dtype(dtype)
    backbone, head = hpsv3_state_dict(load_state_dict(path, "hpsv3"), path)
    embeddings = backbone.get("language_model.embed_tokens.weight")
    if embeddings is None:
        raise ValueError(f"hpsv3: '{path}' has no model.embed_tokens.weight; is it an HPSv3 checkpoint?")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    config.get_text_config().vocab_size = embeddings.shape[0]
    try:
        with quiet_loading():
            model, info = Qwen2VLModel.from_pretrained(
                None, config=config, state_dict=backbone, dtype=as_dtype(dtype), output_loading_info=True
            )
    except RuntimeError as err:  # shape mismatches
        detail = str(err).strip().splitlines()[-1]
        raise ValueError(f"hpsv3: '{path}' does not fit the Qwen2-VL config in '{folder}' ({detail})") from None
    bad = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        summary = "; ".join(f"{len(v)} {k.replace('_', ' ')} (e.g. {v[:2]})" for k, v in bad.items())
        raise ValueError(f"hpsv3: '{path}' does not fit the Qwen2-VL config in '{folder}': {summary}")
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    processor.tokenizer.add_tokens([REWARD_TOKEN], special_tokens=True)  # no-op when present
    reward_id = processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    if reward_id >= embeddings.shape[0]:
        raise ValueError(
            f"hpsv3: the tokenizer in '{folder}' gives {REWARD_TOKEN} id {reward_id}, beyond the checkpoint's "
            f"{embeddings.shape[0]} embedding rows; use Qwen2-VL-7B-Instruct's tokenizer files"
        )
    return HPSv3(model, head, processor, prompt_template, min_pixels, max_pixels, device, dtype, batch_size)
