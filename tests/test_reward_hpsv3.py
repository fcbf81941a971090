"""The HPSv3 reward (`rewards.hpsv3`) on a tiny random Qwen2-VL saved as the released checkpoint is laid out
(transformers 4.45 key names, `<|Reward|>` row added to the embeddings, a three-Linear `rm_head`), offline."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flowrl.rewards import REWARDS, build_reward
from flowrl.rewards.hpsv3 import REWARD_TOKEN, hpsv3

TEMPLATE = "Rate this image for: {text_prompt}\nScore: <|Reward|>\nEND\n"
PIXELS = 56 * 56  # min_pixels = max_pixels: 56 x 56 (4 visual tokens) for a square image


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder as the `hpsv3` factory expects it (base config without `<|Reward|>`, processor, `HPSv3.safetensors`
    in transformers 4.45's key layout, `hpsv3_prompt.txt`), and the same weights in memory."""
    from safetensors.torch import save_file
    from tiny_qwen2vl import tiny_qwen2vl

    model, processor = tiny_qwen2vl()
    folder = tmp_path_factory.mktemp("tiny_hpsv3")
    model.config.save_pretrained(folder)
    processor.save_pretrained(folder)
    processor.tokenizer.add_tokens([REWARD_TOKEN], special_tokens=True)  # as hpsv3's create_model_and_processor
    model.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
    with torch.no_grad():  # sharper attention, so that the position ids change the scores visibly
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    torch.manual_seed(1)
    head = torch.nn.Sequential(
        torch.nn.Linear(32, 16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.05),
        torch.nn.Linear(16, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 2),
    ).eval()
    old_names = {"model.visual.": "visual.", "model.language_model.": "model."}
    state = {}
    for key, value in model.state_dict().items():
        for new, old in old_names.items():
            key = old + key.removeprefix(new) if key.startswith(new) else key
        state[key] = value.clone().contiguous()
    state.update({f"rm_head.{k}": v.clone() for k, v in head.state_dict().items()})  # rm_head.0, .3, .5
    assert any(k.startswith("visual.blocks.") for k in state) and "model.embed_tokens.weight" in state
    save_file(state, folder / "HPSv3.safetensors")
    (folder / "hpsv3_prompt.txt").write_text(TEMPLATE)
    return SimpleNamespace(folder=folder, model=model.eval(), head=head, processor=processor, state=state)


def _by_hand(tiny, images, prompts, positions="sequential"):
    """HPSv3's forward written out, one image at a time (no padding): resize to `smart_resize`'s size, the
    Qwen-style chat text, visual features scattered into the token embeddings, the language model with no position
    ids (0..L-1 on all three axes, as the reference passes none; `positions="mrope"` runs Qwen2-VL's own 3-D
    positions instead), the head at `<|Reward|>`. Returns `(B, 2)`: mu, log sigma."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    reward_id = tiny.processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    image_id = tiny.model.config.image_token_id
    out = []
    for image, prompt in zip(images, prompts):
        size = smart_resize(*image.shape[-2:], 28, PIXELS, PIXELS)
        pixels = F.interpolate(image[None], size=size, mode="bicubic", antialias=True).clamp(0, 1)[0]
        text = (
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
            f"{TEMPLATE.format(text_prompt=prompt)}<|im_end|>\n<|im_start|>assistant\n"
        )
        batch = tiny.processor(
            text=[text], images=[pixels], return_tensors="pt", images_kwargs={"do_resize": False, "do_rescale": False}
        )
        ids = batch["input_ids"]  # (1, L)
        with torch.no_grad():
            if positions == "mrope":
                hidden = tiny.model.model(**batch).last_hidden_state  # (1, L, D)
            else:
                embeds = tiny.model.model.get_input_embeddings()(ids)  # (1, L, D)
                visual = tiny.model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
                embeds[ids == image_id] = visual.pooler_output  # (tokens, D) after the 2x2 merge
                hidden = tiny.model.model.language_model(inputs_embeds=embeds).last_hidden_state  # (1, L, D)
            out.append(tiny.head(hidden[0, ids[0].tolist().index(reward_id)]))  # (2,)
    return torch.stack(out)


def test_hpsv3_equals_the_head_at_the_reward_token_by_hand(tiny):
    images = torch.rand(3, 3, 40, 70, generator=torch.Generator().manual_seed(0))  # resized to 56 x 84
    prompts = ["a cat", "two dogs run on a beach at dawn", "x"]  # different lengths: right padding
    expected = _by_hand(tiny, images, prompts)

    reward = build_reward("hpsv3", model_path=str(tiny.folder), min_pixels=PIXELS, max_pixels=PIXELS)
    scores = reward(images, prompts, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(scores, expected[:, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward.last_sigma, expected[:, 1].exp(), rtol=1e-4, atol=1e-5)
    mrope = _by_hand(tiny, images[:1], prompts[:1], positions="mrope")[0, 0]
    assert abs(scores[0] - mrope) > 1e-3  # Qwen2-VL's own 3-D positions give another score

    chunked = hpsv3(tiny.folder, min_pixels=PIXELS, max_pixels=PIXELS, batch_size=2)  # chunks of 2 and 1
    torch.testing.assert_close(chunked(images, prompts, [{}] * 3), scores, rtol=1e-5, atol=1e-5)
    alone = reward(images[1:2], prompts[1:2], [{}])
    torch.testing.assert_close(alone, scores[1:2], rtol=1e-5, atol=1e-5)
    assert reward(images[:0], [], []).shape == (0,)


def test_hpsv3_resizes_to_the_pixel_budget(tiny):
    reward = hpsv3(tiny.folder, min_pixels=PIXELS, max_pixels=PIXELS)
    for (height, width), grid in [((56, 56), (4, 4)), ((40, 70), (4, 6)), ((200, 100), (4, 2))]:
        batch = reward.inputs(torch.rand(1, 3, height, width), ["a"])
        assert batch["image_grid_thw"].tolist() == [[1, *grid]]  # 14-pixel patches: 56x56, 56x84, 56x28
    default = hpsv3(tiny.folder)  # HPSv3's 256 * 28 * 28 pixels: 448 x 448 for a square image
    assert default.resize(torch.rand(1, 3, 512, 512)).shape[-2:] == (448, 448)


def test_hpsv3_is_registered():
    assert REWARDS["hpsv3"].modality == "image"
    assert "MizzenAI/HPSv3" in REWARDS["hpsv3"].weights


def _partial_folder(tiny, path, files=("config.json",), state=None, prompt=TEMPLATE):
    """A copy of the tiny folder's processor files plus `files`, with `state` as `HPSv3.safetensors`."""
    import shutil

    from safetensors.torch import save_file

    path.mkdir()
    for file in tiny.folder.iterdir():
        if file.name in files or file.name not in ("config.json", "HPSv3.safetensors", "hpsv3_prompt.txt"):
            shutil.copy(file, path / file.name)
    if state is not None:
        save_file(state, path / "HPSv3.safetensors")
    if prompt is not None:
        (path / "hpsv3_prompt.txt").write_text(prompt)
    return path


def test_hpsv3_refuses_missing_files_and_bad_checkpoints(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"hpsv3: model_path '.*nowhere' is not a local folder"):
        hpsv3(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"hpsv3: model_path '.*no_config' has no config.json; put Qwen"):
        hpsv3(_partial_folder(tiny, tmp_path / "no_config", files=()))
    with pytest.raises(FileNotFoundError, match=r"hpsv3: checkpoint '.*HPSv3.safetensors' not found; download it"):
        hpsv3(_partial_folder(tiny, tmp_path / "no_ckpt"))
    with pytest.raises(FileNotFoundError, match="hpsv3: no prompt_template given and no hpsv3_prompt.txt"):
        hpsv3(_partial_folder(tiny, tmp_path / "no_prompt", files=("config.json", "HPSv3.safetensors"), prompt=None))

    no_head = {k: v for k, v in tiny.state.items() if not k.startswith("rm_head.")}
    with pytest.raises(ValueError, match=r"hpsv3: '.*' has no reward head \(rm_head.<i>.weight\)"):
        hpsv3(_partial_folder(tiny, tmp_path / "no_head", state=no_head))
    renamed = {k.replace("visual.", "vision."): v for k, v in tiny.state.items()}
    with pytest.raises(ValueError, match=r"hpsv3: '.*' has key 'vision\.[a-z0-9_.]+', not of an HPSv3"):
        hpsv3(_partial_folder(tiny, tmp_path / "renamed", state=renamed))
    missing = {k: v for k, v in tiny.state.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"does not fit the Qwen2-VL config .*1 missing keys .*language_model.norm"):
        hpsv3(_partial_folder(tiny, tmp_path / "missing", state=missing))
    short = {**tiny.state, "model.embed_tokens.weight": tiny.state["model.embed_tokens.weight"][:-1]}
    rows = len(short["model.embed_tokens.weight"])  # the <|Reward|> token's id, the last of the tokenizer
    with pytest.raises(
        ValueError, match=rf"gives <\|Reward\|> id {rows}, beyond the checkpoint's {rows} embedding rows"
    ):
        hpsv3(_partial_folder(tiny, tmp_path / "short", state=short))


def test_hpsv3_refuses_bad_options(tiny):
    with pytest.raises(ValueError, match=r"hpsv3: prompt_template must contain <\|Reward\|> once"):
        hpsv3(tiny.folder, prompt_template="rate {text_prompt}")
    with pytest.raises(ValueError, match="hpsv3: prompt_template must contain '{text_prompt}'"):
        hpsv3(tiny.folder, prompt_template="rate it <|Reward|>")
    with pytest.raises(ValueError, match=r"hpsv3: min_pixels \(4000\) must not exceed max_pixels \(3136\)"):
        hpsv3(tiny.folder, min_pixels=4000, max_pixels=PIXELS)
    with pytest.raises(ValueError, match="hpsv3: max_pixels must be an integer >= 1"):
        hpsv3(tiny.folder, max_pixels=0)
    with pytest.raises(ValueError, match="hpsv3: batch_size must be an integer >= 1"):
        hpsv3(tiny.folder, batch_size=0)
    reward = hpsv3(tiny.folder, min_pixels=PIXELS, max_pixels=PIXELS)
    with pytest.raises(ValueError, match=r"hpsv3: a prompt contains <\|Reward\|>"):
        reward(torch.rand(1, 3, 56, 56), ["a <|Reward|>"], [{}])
    with pytest.raises(ValueError, match="images must have shape"):
        reward(torch.rand(1, 56, 56), ["a"], [{}])
