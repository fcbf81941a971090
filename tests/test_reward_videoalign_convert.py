"""`python -m flowrl.rewards.videoalign_convert` on a tiny fake VideoReward release, and VideoAlign's frame sampling.

The release is built as VideoAlign's `train_reward.py` builds its model: a tiny random Qwen2-VL base
(`tiny_qwen2vl`), the three reward tokens added and the embeddings resized, trained rows and vision weights, a
random LoRA on every linear layer of the language model (peft) and a reward head, saved in VideoAlign's key layout
(`visual.*`, `model.layers.*`) as the hub's `model.pth` or as `train.sh`'s adapter + non-LoRA files.
"""

import copy
import json

import pytest
import torch
from tiny_qwen2vl import tiny_qwen2vl

from flowrl.rewards.videoalign import SPECIAL_TOKENS, sampled_frame_count, videoalign
from flowrl.rewards.videoalign_convert import current_key, main, read_prompt_template

PROMPT_PY = '''
DETAILED_PROMPT = """
Rate {text_prompt}.
"""

DETAILED_PROMPT_WITH_SPECIAL_TOKEN = """
Visual: <|VQ_reward|>
Motion: <|MQ_reward|>
Prompt - {text_prompt}
Text: <|TA_reward|>
"""


def build_prompt(prompt, dimension, template_type):
    raise RuntimeError("parsed, never run")
'''
STATS = {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -1.0, "MQ_std": 0.5, "TA_mean": 0.0, "TA_std": 4.0}
RANK, ALPHA = 4, 8


def _legacy(name):
    """transformers 5's key -> VideoAlign's (the transformers it was trained with)."""
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return name.replace("model.language_model.", "model.", 1)


def _release(root, layout, rslora=False):
    """Write a fake release under `root` (base/, release/); return (base, release, the hand-merged model, processor,
    rm_head)."""
    from peft import LoraConfig, get_peft_model

    model, processor = tiny_qwen2vl(seed=1)
    base = root / "base"
    model.save_pretrained(base)
    processor.save_pretrained(base)

    processor.tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    model.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight[-3:] = torch.randn(3, 32, generator=generator)
        model.model.visual.merger.mlp[0].weight.add_(0.1 * torch.randn(128, 128, generator=generator))
    head = torch.randn(3, 32, generator=generator)
    merged = copy.deepcopy(model)
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "language_model" in n]
    torch.manual_seed(3)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False, use_rslora=rslora)
    wrapped = get_peft_model(model, config)
    scale = ALPHA / (RANK**0.5 if rslora else RANK)
    with torch.no_grad():  # the merge by hand: W + scale * B A
        for name in targets:
            layer = wrapped.base_model.model.get_submodule(name)
            delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # (out, in)
            merged.get_submodule(name).weight.add_(scale * delta)

    checkpoint = root / "release" / "checkpoint-120"
    (checkpoint / "tokenizer").mkdir(parents=True)
    (root / "release" / "checkpoint-40").mkdir()  # an older step, not read
    processor.tokenizer.save_pretrained(checkpoint / "tokenizer")
    state = {
        "base_model.model." + _legacy(k.removeprefix("base_model.model.")): v for k, v in wrapped.state_dict().items()
    }
    state["base_model.model.rm_head.weight"] = head
    if layout == "model.pth":
        torch.save(state, checkpoint / "model.pth")
    else:
        from safetensors.torch import save_file

        adapter = {k.replace(".default", ""): v for k, v in state.items() if "lora_" in k}
        trained = ("rm_head", "embed_tokens", "visual.")
        non_lora = {k: v for k, v in state.items() if any(t in k for t in trained)}
        torch.save(non_lora, checkpoint / "non_lora_state_dict.pth")
        save_file(adapter, checkpoint / "adapter_model.safetensors")
        (checkpoint / "adapter_config.json").write_text(
            json.dumps({"r": RANK, "lora_alpha": ALPHA, "use_rslora": rslora})
        )
    model_config = {
        "data_config": {
            "meta_data": "/data/train.csv",
            "fps": 2.0,
            "num_frames": None,
            "max_frame_pixels": 56 * 84,
            "prompt_template_type": "detailed_special",
            "sample_type": "uniform",
        },
        "training_args": {"output_dir": "rm_output"},
        "model_config": {"output_dim": 3, "use_special_tokens": True, "reward_token": "special"},
        "peft_lora_config": {"lora_enable": True, "lora_r": RANK, "lora_alpha": 2 * ALPHA, "use_rslora": False},
        "inference_config": STATS,
    }
    if layout == "model.pth":  # no adapter_config.json: peft_lora_config counts
        model_config["peft_lora_config"]["lora_alpha"] = ALPHA
    (root / "release" / "model_config.json").write_text(json.dumps(model_config))
    (root / "prompt_template.py").write_text(PROMPT_PY)
    return base, root / "release", merged, processor, head


def _convert(root, base, release, *options):
    code = main(
        [
            str(release),
            str(root / "out"),
            "--base",
            str(base),
            "--prompt-file",
            str(root / "prompt_template.py"),
            *options,
        ]
    )
    assert code == 0
    return root / "out"


def _assert_weights_equal(folder, merged, skip=()):
    from transformers import Qwen2VLForConditionalGeneration

    converted = Qwen2VLForConditionalGeneration.from_pretrained(folder, local_files_only=True).state_dict()
    expected = merged.state_dict()
    assert converted.keys() == expected.keys()
    for key, value in expected.items():
        if key in skip:
            continue
        torch.testing.assert_close(converted[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_convert_the_released_model_pth_scores_as_the_hand_merged_model(tmp_path):
    from safetensors.torch import save_file

    base, release, merged, processor, head = _release(tmp_path, "model.pth")
    out = _convert(tmp_path, base, release)
    _assert_weights_equal(out, merged)
    written = json.loads((out / "model_config.json").read_text())
    assert written["data_config"] == {
        "fps": 2.0,
        "num_frames": None,
        "max_frame_pixels": 56 * 84,
        "min_frame_pixels": 128 * 28 * 28,  # VideoAlign's reader's floor
        "prompt_template_type": "detailed_special",
        "sample_type": "uniform",
    }
    assert written["inference_config"] == STATS and "training_args" not in written
    assert (out / "videoalign_prompt.txt").read_text() == read_prompt_template(
        tmp_path / "prompt_template.py", "detailed_special"
    )

    reference = tmp_path / "by_hand"  # the hand-merged model, its processor and head beside the converted prompt
    merged.save_pretrained(reference)
    processor.save_pretrained(reference)
    save_file({"weight": head}, reference / "rm_head.safetensors")
    for name in ("videoalign_prompt.txt", "model_config.json"):
        (reference / name).write_text((out / name).read_text())
    videos = torch.rand(2, 9, 3, 56, 84, generator=torch.Generator().manual_seed(7))
    prompts = ["a cat", "two dogs run on a beach"]
    reward = videoalign(out, video_fps=8, min_pixels=56 * 56)
    scores = reward(videos, prompts, [{}, {}])
    expected = videoalign(reference, video_fps=8, min_pixels=56 * 56)(videos, prompts, [{}, {}])
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    assert scores.abs().min() > 1e-3  # a real score, not an empty head

    batch = videoalign(out, video_fps=8).inputs(videos, prompts)  # fps 2 of 9 frames at 8 fps: 4 frames
    assert batch["video_grid_thw"].tolist() == [[2, 20, 28]] * 2  # 56 x 84 up to 280 x 392: at least 128 * 28 * 28


def test_convert_the_adapter_layout_with_rslora(tmp_path):
    base, release, merged, _, _ = _release(tmp_path, "adapter", rslora=True)
    out = _convert(tmp_path, base, release, "--step", "120")
    # adapter_config.json's lora_alpha and use_rslora count, not model_config.json's; VideoAlign saves no lm_head
    # here (frozen), so its rows of the reward tokens are as resize_token_embeddings draws them (and never read)
    _assert_weights_equal(out, merged, skip=("lm_head.weight",))


def test_sampled_frame_count_follows_smart_nframes():
    assert sampled_frame_count(81, fps=2.0, video_fps=16) == 10  # 81 / 16 * 2 = 10.1 -> 10
    assert sampled_frame_count(9, fps=2.0, video_fps=8) == 4  # 2.25, raised to the minimum 4
    assert sampled_frame_count(3, fps=2.0, video_fps=8) == 2  # at most the frames there are, in pairs
    assert sampled_frame_count(2000, fps=24.0, video_fps=24) == 768
    assert sampled_frame_count(81, num_frames=5) == 4  # round(2.5) * 2
    assert sampled_frame_count(6, num_frames=7) == 6
    assert sampled_frame_count(7) == 7
    with pytest.raises(ValueError, match="needs video_fps > 0"):
        sampled_frame_count(9, fps=2.0)


def test_convert_and_load_refuse_bad_input(tmp_path, capsys):
    assert current_key("base_model.model.visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    assert (
        current_key("base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight")
        == "model.language_model.layers.1.mlp.up_proj.lora_B.weight"
    )
    assert current_key("base_model.model.lm_head.weight") == "lm_head.weight"
    (tmp_path / "release").mkdir()
    assert main([str(tmp_path / "release"), str(tmp_path / "out"), "--base", str(tmp_path)]) == 2
    assert "videoalign_convert: '" in capsys.readouterr().err
    (tmp_path / "prompt.py").write_text("DETAILED_PROMPT = 'no placeholder'\n")
    with pytest.raises(ValueError, match="has no string constant DETAILED_PROMPT_WITH_SPECIAL_TOKEN"):
        read_prompt_template(tmp_path / "prompt.py", "detailed_special")
    with pytest.raises(ValueError, match="has no {text_prompt}"):
        read_prompt_template(tmp_path / "prompt.py", "detailed")
    with pytest.raises(ValueError, match="'simple' has no single template"):
        read_prompt_template(tmp_path / "prompt.py", "simple")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    (tmp_path / "folder" / "rm_head.safetensors").write_text("")
    (tmp_path / "folder" / "videoalign_prompt.txt").write_text("{text_prompt}")
    (tmp_path / "folder" / "model_config.json").write_text(json.dumps({"data_config": {"fps": 2.0}}))
    with pytest.raises(ValueError, match=r"videoalign: frames are sampled at fps=2.0; give video_fps"):
        videoalign(tmp_path / "folder")  # before any model loads
    with pytest.raises(ValueError, match="give num_frames or fps, not both"):
        videoalign(tmp_path / "folder", num_frames=4, fps=1.0)
