"""Turn VideoAlign's released VideoReward checkpoint into the folder the `videoalign` reward loads.

VideoAlign (Liu et al., arXiv 2501.13918; github.com/KwaiVGI/VideoAlign) trains a LoRA on Qwen2-VL-2B-Instruct
plus a reward head. Its checkpoint folder (KwaiVGI/VideoReward on the hub) holds `model_config.json` (the
training run's `data_config`, `model_config`, `peft_lora_config` and the reward means/stds in
`inference_config`) and `checkpoint-<step>/` with either (`utils.py` `load_model_from_checkpoint`):

- `model.pth`: the whole state dict of the PEFT-wrapped model (what the hub release ships), or
- `adapter_model.safetensors` (+ `adapter_config.json`) with the LoRA and `non_lora_state_dict.pth` with the
  other trained tensors: the reward head `rm_head`, the token embeddings (rows of `<|VQ_reward|>`,
  `<|MQ_reward|>`, `<|TA_reward|>` trained), the vision tower and its merger (what `train.sh` saves),

and `tokenizer/` (Qwen2-VL's tokenizer with the three reward tokens). Keys there follow the transformers of the
time (`visual.*`, `model.layers.*`); transformers 5 nests them as `model.visual.*` and `model.language_model.*`.

`convert_videoalign` loads the Qwen2-VL-2B-Instruct base from a local folder, adds the reward tokens and resizes
the embeddings as VideoAlign's `train_reward.py` does, loads the trained tensors, merges the LoRA into the
weights with peft (`merge_and_unload`, `W + lora_alpha / r * B A`, or `/ sqrt(r)` with rsLoRA) and writes:
the merged model and the processor (`save_pretrained`, safetensors), `rm_head.safetensors`,
`videoalign_prompt.txt` (the checkpoint's prompt template) and `model_config.json` (VideoAlign's, with the frame
settings VideoAlign's inference falls back to written out: `fps`, `num_frames`, `max_frame_pixels`, and
`min_frame_pixels`, the 128 * 28 * 28 floor of its video reader). Pickled files are read with
`torch.load(weights_only=True)` only (`rewards.convert.load_state_dict`)::

    python -m flowrl.rewards.videoalign_convert /ckpt/VideoReward /ckpt/videoreward-merged \\
        --base /ckpt/Qwen2-VL-2B-Instruct --prompt-file VideoAlign/prompt_template.py
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .base import load_pretrained, read_json
from .convert import load_state_dict, run_conversion
from .videoalign import HEAD_FILE, PROMPT_FILE, SPECIAL_TOKENS

__all__ = ["convert_videoalign", "current_key", "main", "read_prompt_template"]

NAME = "videoalign_convert"
DATA_DEFAULTS = {"fps": 2.0, "num_frames": None, "max_frame_pixels": 240 * 320}
"""VideoAlign's `DataConfig` defaults for the frame settings a `model_config.json` may leave out."""
VIDEO_MIN_PIXELS = 128 * 28 * 28
"""The floor on a frame's pixels in VideoAlign's video reader (`vision_process.py` `VIDEO_MIN_PIXELS`)."""
TEMPLATE_CONSTANTS = {"detailed_special": "DETAILED_PROMPT_WITH_SPECIAL_TOKEN", "detailed": "DETAILED_PROMPT"}
"""`data_config.prompt_template_type` -> the constant of VideoAlign's `prompt_template.py` holding that template."""
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(?:\.default)?\.weight$")


def current_key(key: str) -> str | None:
    """A key of VideoAlign's state dict -> the name of the same tensor in transformers 5's
    `Qwen2VLForConditionalGeneration` (LoRA keys keep their `.lora_A.weight` / `.lora_B.weight` ending).

    Strips PEFT's `base_model.model.` prefix and `.base_layer` infix and the adapter name `default`, and moves
    `visual.*` to `model.visual.*` and `model.*` to `model.language_model.*` (keys already in the new layout are
    kept). Returns None for a `modules_to_save` wrapper's frozen `original_module` copy.
    """
    key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
    if ".original_module." in key:
        return None
    key = key.replace(".modules_to_save.default.", ".")
    key = re.sub(r"\.lora_([AB])\.default\.", r".lora_\1.", key)
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.visual.", "model.language_model.")):
        return "model.language_model." + key.removeprefix("model.")
    return key


def read_prompt_template(path: str | os.PathLike, template_type: str) -> str:
    """The prompt template, with `{text_prompt}` where the prompt goes.

    Args:
        path (`str` or path): a text file holding the template as is, or VideoAlign's `prompt_template.py`, from
            which the string constant for `template_type` (`TEMPLATE_CONSTANTS`) is read with `ast` (the file is
            parsed, not run).
        template_type (`str`): VideoAlign's `data_config.prompt_template_type`; used for a `.py` file only.

    Returns:
        `str`: the template, byte for byte.

    Raises:
        FileNotFoundError: `path` is not a file.
        ValueError: a `.py` file without that constant, a type with no single template (`simple`, `video_score`
            depend on the scored dimension: write the template to a text file), or a template without
            `{text_prompt}`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{NAME}: --prompt-file '{path}' not found")
    if path.suffix != ".py":
        template = path.read_text(encoding="utf-8")
    else:
        if template_type not in TEMPLATE_CONSTANTS:
            raise ValueError(
                f"{NAME}: prompt_template_type {template_type!r} has no single template in '{path}' (known: "
                f"{', '.join(TEMPLATE_CONSTANTS)}); write the template, with {{text_prompt}}, to a text file"
            )
        wanted, template = TEMPLATE_CONSTANTS[template_type], None
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == wanted for t in node.targets):
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    template = node.value.value
        if template is None:
            raise ValueError(f"{NAME}: '{path}' has no string constant {wanted} (VideoAlign's prompt_template.py)")
    if "{text_prompt}" not in template:
        raise ValueError(f"{NAME}: the template from '{path}' has no {{text_prompt}}")
    return template


def _checkpoint_folder(src: Path, step: int | None) -> Path:
    """`src/checkpoint-<step>`, the highest step when `step` is None."""
    steps = {int(p.name.split("-")[1]): p for p in src.glob("checkpoint-*") if p.name.split("-")[1].isdigit()}
    if not steps:
        raise FileNotFoundError(f"{NAME}: '{src}' has no checkpoint-<step> folder (VideoAlign's checkpoint layout)")
    if step is None:
        return steps[max(steps)]
    if step not in steps:
        raise FileNotFoundError(f"{NAME}: '{src}' has no checkpoint-{step} (found steps {sorted(steps)})")
    return steps[step]


def _read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's tensors under VideoAlign's keys, and its adapter_config.json (empty without one)."""
    if (folder / "model.pth").is_file():
        return load_state_dict(folder / "model.pth", NAME), {}
    adapter, rest = folder / "adapter_model.safetensors", folder / "non_lora_state_dict.pth"
    if not (adapter.is_file() and rest.is_file()):
        raise FileNotFoundError(
            f"{NAME}: '{folder}' has neither model.pth nor adapter_model.safetensors + non_lora_state_dict.pth"
        )
    config = folder / "adapter_config.json"
    return {**load_state_dict(rest, NAME), **load_state_dict(adapter, NAME)}, (
        read_json(config, NAME) if config.is_file() else {}
    )


def _split(state: dict[str, torch.Tensor]) -> tuple[dict, dict, torch.Tensor]:
    """VideoAlign's tensors -> (plain weights by current name, LoRA `{module: {"A": .., "B": ..}}`, rm_head)."""
    plain, lora, head = {}, {}, None
    for key, value in state.items():
        name = current_key(key)
        if name is None:
            continue
        if name == "rm_head.weight":
            head = value
        elif match := _LORA.match(name):
            lora.setdefault(match["module"], {})[match["part"]] = value
        elif "lora_" in name:
            raise ValueError(f"{NAME}: unsupported LoRA tensor {key!r} (only lora_A / lora_B of linear layers)")
        else:
            plain[name] = value
    if head is None:
        raise ValueError(f"{NAME}: the checkpoint has no rm_head.weight (the reward head)")
    if any(set(parts) != {"A", "B"} for parts in lora.values()):
        raise ValueError(f"{NAME}: a LoRA module lacks its lora_A or lora_B weight")
    return plain, lora, head


def _check_token_ids(folder: Path, tokenizer: Any) -> None:
    """The reward tokens' ids in the checkpoint's `tokenizer/tokenizer.json` (when present) equal ours."""
    saved = folder / "tokenizer" / "tokenizer.json"
    if not saved.is_file():
        return
    theirs = {t["content"]: t["id"] for t in read_json(saved, NAME).get("added_tokens", [])}
    ours = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    if any(theirs.get(token) != ours[token] for token in SPECIAL_TOKENS):
        raise ValueError(
            f"{NAME}: the reward tokens get ids {ours} from --base but {[theirs.get(t) for t in SPECIAL_TOKENS]} in "
            f"'{saved}'; use the base model the checkpoint was trained from (Qwen2-VL-2B-Instruct)"
        )


def _merge_lora(model: torch.nn.Module, lora: dict, peft_config: dict[str, Any]) -> torch.nn.Module:
    """`model` with the LoRA of `lora` merged in by peft; `peft_config` gives `lora_alpha` and `use_rslora`."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    ranks = {parts["A"].shape[0] for parts in lora.values()}
    if len(ranks) != 1:
        raise ValueError(f"{NAME}: LoRA ranks differ between modules ({sorted(ranks)}); expected one rank")
    rank = ranks.pop()
    if peft_config.get("r", peft_config.get("lora_r", rank)) != rank:
        raise ValueError(f"{NAME}: the LoRA tensors have rank {rank} but the config says {peft_config}")
    missing = sorted(set(lora) - {name for name, _ in model.named_modules()})
    if missing:
        raise ValueError(f"{NAME}: LoRA modules {missing[:3]} are not in the --base model")
    config = LoraConfig(
        r=rank,
        lora_alpha=peft_config.get("lora_alpha", 2 * rank),
        use_rslora=bool(peft_config.get("use_rslora", False)),
        target_modules=sorted(lora),
        lora_dropout=0.0,
        bias="none",
    )
    wrapped = get_peft_model(model, config)
    tensors = {f"base_model.model.{m}.lora_{p}.weight": t for m, parts in lora.items() for p, t in parts.items()}
    result = set_peft_model_state_dict(wrapped, tensors)
    if result.unexpected_keys or any("lora_" in key for key in result.missing_keys):
        raise ValueError(f"{NAME}: the LoRA tensors do not fit the --base model ({result})")
    return wrapped.merge_and_unload()


def convert_videoalign(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    base: str | os.PathLike,
    step: int | None = None,
    prompt_file: str | os.PathLike | None = None,
    dtype: str = "auto",
) -> Path:
    """Write the folder `rewards.videoalign.videoalign` loads from VideoAlign's checkpoint folder (module docstring).

    Args:
        src (`str` or path): VideoAlign's folder: `model_config.json` and `checkpoint-<step>/`.
        dst (`str` or path): the output folder; created, must not exist or be empty.
        base (`str` or path): a local Qwen2-VL-2B-Instruct folder (the model VideoAlign's LoRA was trained on).
        step (`int`, *optional*): which `checkpoint-<step>`; default the highest.
        prompt_file (`str` or path, *optional*): VideoAlign's `prompt_template.py` or a text file holding the
            template (`read_prompt_template`); needed unless the checkpoint's `prompt_template_type` is `none`.
        dtype (`str`): `auto` (the dtype the reward head is stored in), `float32`, `bfloat16` or `float16`: the
            dtype of the written weights. The LoRA is merged in float32.

    Returns:
        `Path`: `dst`.

    Raises:
        FileNotFoundError: a missing folder or file (`model_config.json`, a checkpoint, `--base`, `--prompt-file`).
        ValueError: `dst` not empty, an unknown `dtype`, a checkpoint VideoAlign's `videoalign` reward cannot run
            (`reward_token: mean`, `sample_type` other than `uniform`, a head not of shape `(3, hidden)`), tensors
            that do not fit the base model, or reward token ids that differ from the checkpoint's tokenizer; a JSON
            file of the checkpoint that is empty, not UTF-8 or not JSON (an HTML page), named.
    """
    from safetensors.torch import save_file
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    src, dst, base = Path(src), Path(dst), Path(base)
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"{NAME}: --dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if not (src / "model_config.json").is_file():
        raise FileNotFoundError(f"{NAME}: '{src}' has no model_config.json (VideoAlign's checkpoint folder)")
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{NAME}: --base '{base}' is not a model folder with config.json (Qwen2-VL-2B)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{NAME}: output '{dst}' exists and is not an empty folder")
    config = read_json(src / "model_config.json", NAME)
    if not isinstance(config, dict):
        raise ValueError(
            f"{NAME}: {src / 'model_config.json'} holds a {type(config).__name__}, not VideoAlign's object"
        )
    data, model_config = dict(config.get("data_config") or {}), config.get("model_config") or {}
    if model_config.get("reward_token", "last") not in ("special", "last"):
        raise ValueError(f"{NAME}: reward_token {model_config['reward_token']!r}: videoalign reads special or last")
    if data.get("sample_type", "uniform") != "uniform":
        raise ValueError(f"{NAME}: sample_type {data['sample_type']!r}: videoalign samples frames uniformly only")
    template_type = data.get("prompt_template_type", "none")
    if prompt_file is None and template_type != "none":
        raise ValueError(
            f"{NAME}: the checkpoint uses the prompt template {template_type!r}; give --prompt-file "
            "(VideoAlign's prompt_template.py, or a text file with the template)"
        )
    template = "{text_prompt}" if prompt_file is None else read_prompt_template(prompt_file, template_type)
    checkpoint = _checkpoint_folder(src, step)
    state, adapter_config = _read_weights(checkpoint)
    plain, lora, head = _split(state)

    model = load_pretrained(Qwen2VLForConditionalGeneration, base, "videoalign_convert", dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(base, local_files_only=True)
    hidden = model.config.get_text_config().hidden_size
    if tuple(head.shape) != (len(SPECIAL_TOKENS), hidden):
        raise ValueError(f"{NAME}: rm_head has shape {tuple(head.shape)}, expected (3, {hidden})")
    if model_config.get("use_special_tokens", False):
        processor.tokenizer.add_special_tokens(
            {"additional_special_tokens": list(SPECIAL_TOKENS)}, replace_extra_special_tokens=False
        )
        _check_token_ids(checkpoint, processor.tokenizer)
        model.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
        if "model.language_model.embed_tokens.weight" not in plain:
            raise ValueError(f"{NAME}: the checkpoint uses reward tokens but holds no trained token embeddings")
    try:
        result = model.load_state_dict({k: v.float() for k, v in plain.items()}, strict=False)
    except RuntimeError as err:  # a shape mismatch
        raise ValueError(f"{NAME}: the checkpoint does not fit --base '{base}': {str(err).splitlines()[-1]}") from None
    if result.unexpected_keys:
        raise ValueError(f"{NAME}: tensors not in the --base model: {result.unexpected_keys[:3]}")
    if lora:
        peft_config = adapter_config or config.get("peft_lora_config") or {}
        model = _merge_lora(
            model, {m: {p: t.float() for p, t in parts.items()} for m, parts in lora.items()}, peft_config
        )
    out_dtype = head.dtype if dtype == "auto" else getattr(torch, dtype)

    dst.mkdir(parents=True, exist_ok=True)
    model.to(out_dtype).save_pretrained(dst)
    processor.tokenizer.padding_side = "right"  # as VideoAlign's processor
    processor.save_pretrained(dst)
    save_file({"weight": head.to(out_dtype).contiguous()}, dst / HEAD_FILE)
    (dst / PROMPT_FILE).write_text(template, encoding="utf-8")
    for key, value in DATA_DEFAULTS.items():
        data.setdefault(key, value)
    data.setdefault("min_frame_pixels", VIDEO_MIN_PIXELS)
    for key in ("meta_data", "meta_data_test", "data_dir"):  # the training set's paths
        data.pop(key, None)
    written = {k: config[k] for k in ("model_config", "peft_lora_config", "inference_config") if k in config}
    (dst / "model_config.json").write_text(json.dumps({"data_config": data, **written}, indent=2))
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flowrl.rewards.videoalign_convert SRC DST --base QWEN2VL`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m flowrl.rewards.videoalign_convert",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("src", help="VideoAlign's checkpoint folder (model_config.json, checkpoint-<step>/)")
    parser.add_argument("dst", help="output folder for the videoalign reward (must not exist or be empty)")
    parser.add_argument("--base", required=True, help="local Qwen2-VL-2B-Instruct folder")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the highest)")
    parser.add_argument(
        "--prompt-file", default=None, help="VideoAlign's prompt_template.py, or a text file with the template"
    )
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    return run_conversion(
        lambda: convert_videoalign(args.src, args.dst, args.base, args.step, args.prompt_file, args.dtype)
    )


if __name__ == "__main__":
    sys.exit(main())
