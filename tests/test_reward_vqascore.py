"""Tests of VQAScore (`rewards.vqascore`) and the local backend of `vlm_yes` (`rewards.vlm`), on a tiny random
Qwen2.5-VL of the real transformers class with a byte-level Qwen2 tokenizer, built offline by
`flowrl.tiny.qwen_vl.build_random_qwen_vl`."""

import pytest
import torch

from flowrl import rewards
from flowrl.rewards import REWARDS, build_reward
from flowrl.rewards.vlm import YES_QUESTION, VLMYesLocal, yes_no_token_ids
from flowrl.rewards.vqascore import VQASCORE_QUESTION, VQAScore, vqascore
from flowrl.tiny.qwen_vl import CHAT_TEMPLATE, build_random_qwen_vl

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
PROMPTS = ["a cat", "two dogs run on a beach", "a red cube"]  # different lengths: padding in a batch


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    return build_random_qwen_vl(tmp_path_factory.mktemp("tiny_qwen25_vl"))


@pytest.fixture(scope="module")
def images():
    return torch.rand(3, 3, 56, 84, generator=torch.Generator().manual_seed(0))  # 2 x 3 merged 28-px patches


@pytest.fixture(scope="module")
def reward(qwen25_dir):
    """The registered factory's reward on the tiny folder (tests building variants wrap its model and processor)."""
    return build_reward("vqascore", model_path=str(qwen25_dir))


@pytest.fixture(scope="module")
def reference(qwen25_dir):
    """The folder's model and processor, loaded apart from the reward."""
    return _load(qwen25_dir)


def _load(folder):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    return AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval(), processor


def _by_hand(model, processor, images, prompts, question, answer="Yes"):
    """VQAScore written out, one image at a time: the Qwen chat text typed out, the full model's logits, the answer
    tokens' softmax probabilities at the positions before them, their geometric mean."""
    out = []
    for image, prompt in zip(images, prompts):
        text = (
            f"{SYSTEM}<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question.format(prompt=prompt)}"
            f"<|im_end|>\n<|im_start|>assistant\n{answer}"
        )
        ids = processor.tokenizer.encode(answer, add_special_tokens=False)
        batch = processor(text=[text], images=[image], return_tensors="pt", images_kwargs={"do_rescale": False})
        assert batch["input_ids"][0, -len(ids) :].tolist() == ids
        with torch.no_grad():
            logits = model(**batch).logits[0].float()  # (L, V)
        probs = logits[-len(ids) - 1 : -1].softmax(dim=-1)  # (n, V): position j predicts answer token j
        out.append(torch.stack([probs[j, t] for j, t in enumerate(ids)]).prod() ** (1 / len(ids)))
    return torch.stack(out)


def test_vqascore_is_the_softmax_of_yes_at_the_answer_position(reward, reference, images):
    assert isinstance(reward, VQAScore) and reward.question == VQASCORE_QUESTION
    assert type(reward.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert len(reward.processor.tokenizer.encode("Yes", add_special_tokens=False)) == 1  # one token, as in Qwen's
    scores = reward(images, PROMPTS, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and ((scores > 0) & (scores < 1)).all()
    torch.testing.assert_close(scores, _by_hand(*reference, images, PROMPTS, VQASCORE_QUESTION), rtol=1e-5, atol=0)
    # batch invariance: one image at a time, in chunks of 2, and left-padded give the same scores
    alone = torch.cat([reward(images[i : i + 1], PROMPTS[i : i + 1], [{}]) for i in range(3)])
    torch.testing.assert_close(alone, scores, rtol=1e-5, atol=0)
    chunked = VQAScore(reward.model, reward.processor, batch_size=2)
    torch.testing.assert_close(chunked(images, PROMPTS, [{}] * 3), scores, rtol=1e-5, atol=0)
    assert reward(images[:0], [], []).shape == (0,)
    reward.processor.tokenizer.padding_side = "left"  # the answer positions are found on either padding side
    try:
        torch.testing.assert_close(reward(images, PROMPTS, [{}] * 3), scores, rtol=1e-5, atol=0)
    finally:
        reward.processor.tokenizer.padding_side = "right"


def test_vqascore_honours_the_question_and_answer_templates(reward, reference, images):
    question, images, prompts = "Is {prompt} in the picture? Answer Yes or No.", images[:2], PROMPTS[:2]
    asked = VQAScore(reward.model, reward.processor, question=question, answer="Yes, it does")
    assert asked.texts(["a cat"]) == [
        f"{SYSTEM}<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Is a cat in the picture? Answer Yes or "
        "No.<|im_end|>\n<|im_start|>assistant\nYes, it does"
    ]
    scores = asked(images, prompts, [{}] * 2)
    by_hand = _by_hand(*reference, images, prompts, question, "Yes, it does")  # geometric mean of 10 tokens
    torch.testing.assert_close(scores, by_hand, rtol=1e-5, atol=0)
    other = VQAScore(reward.model, reward.processor, question=question)(images, prompts, [{}] * 2)
    assert (other - reward(images, prompts, [{}] * 2)).abs().min() > 0
    # max_pixels bounds the image processor's resize: 56 x 84 (4 x 6 patches of 14 px) -> 28 x 28 (2 x 2)
    assert reward.inputs(images[:1], ["a"])["image_grid_thw"].tolist() == [[1, 4, 6]]
    small = VQAScore(reward.model, reward.processor, max_pixels=28 * 28).inputs(images[:1], ["a"])
    assert small["image_grid_thw"].tolist() == [[1, 2, 2]]


def test_local_vlm_yes_is_vqascore_yes_over_yes_plus_no(qwen25_dir, images):
    """vlm_yes with model_path reads P(yes) / (P(yes) + P(no)), every token reading yes or no summed, from the same
    forward as vqascore: with the tiny vocabulary's one-token Yes, yes, " yes" and No, it is vqascore's score of each
    answer under vlm_yes's question combined."""
    images, prompts = images[:2], PROMPTS[:2]
    reward = build_reward("vlm_yes", model_path=str(qwen25_dir))
    assert isinstance(reward, VLMYesLocal) and isinstance(reward, VQAScore) and reward.question == YES_QUESTION
    tokenizer = reward.processor.tokenizer
    yes, no = yes_no_token_ids(tokenizer)
    assert sorted(tokenizer.convert_ids_to_tokens(yes)) == ["Yes", "yes", "Ġyes"] and tokenizer.convert_ids_to_tokens(
        no
    ) == ["No"]
    p = {
        a: VQAScore(reward.model, reward.processor, question=YES_QUESTION, answer=a)(images, prompts, [{}] * 2)
        for a in ("Yes", "yes", " yes", "No")
    }
    p_yes = p["Yes"] + p["yes"] + p[" yes"]
    scores = reward(images, prompts, [{}] * 2)
    torch.testing.assert_close(scores, p_yes / (p_yes + p["No"]), rtol=1e-5, atol=0)
    assert scores.dtype == torch.float32 and ((scores > 0) & (scores < 1)).all()
    chunked = build_reward("vlm_yes", model_path=str(qwen25_dir), batch_size=1, dtype="float32", device="cpu")
    torch.testing.assert_close(chunked(images, prompts, [{}] * 2), scores, rtol=1e-5, atol=0)


def test_qwen2_vl_folder_too(tmp_path, images):
    folder = build_random_qwen_vl(tmp_path / "tiny_qwen2_vl", arch="qwen2_vl", seed=1)
    reward = vqascore(folder)
    assert type(reward.model).__name__ == "Qwen2VLForConditionalGeneration"
    torch.testing.assert_close(
        reward(images[:1], PROMPTS[:1], [{}]),
        _by_hand(*_load(folder), images[:1], PROMPTS[:1], VQASCORE_QUESTION),
        rtol=1e-5,
        atol=0,
    )


def test_registered_and_exported():
    assert REWARDS["vqascore"] is rewards.vqascore and "vqascore" in rewards.__all__ and "VQAScore" in rewards.__all__
    assert REWARDS["vqascore"].modality == "image" and "Qwen2.5-VL" in REWARDS["vqascore"].weights
    assert "local Qwen2.5-VL" in REWARDS["vlm_yes"].weights


def test_one_line_errors(qwen25_dir, reward, tmp_path):
    from transformers import BertConfig

    cases = [
        ({}, "vlm_yes: give exactly one of base_url .* and model_path .*, got neither"),
        ({"base_url": "http://127.0.0.1:9/v1", "model_path": str(qwen25_dir)}, "got both"),
        (
            {"model_path": str(qwen25_dir), "top_logprobs": 5},
            r"vlm_yes: top_logprobs applies to base_url \(the server backend\), not with model_path",
        ),
        (
            {"base_url": "http://127.0.0.1:9/v1", "device": "cpu", "batch_size": 2},
            r"vlm_yes: device, batch_size apply to model_path \(the local backend\), not with base_url",
        ),
        (
            {"model_path": str(qwen25_dir), "question": "Is {text} there?"},
            r"vlm_yes: question may hold only the placeholder \{prompt\}",
        ),
    ]
    for options, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            build_reward("vlm_yes", **options)
        assert "\n" not in str(err.value)
    for options, match in [
        ({"question": "Is {} there?"}, "vqascore: question may hold only the placeholder"),
        ({"batch_size": 0}, "vqascore: batch_size must be an integer >= 1 or null, got 0"),
        ({"max_pixels": 0}, "vqascore: max_pixels must be an integer >= 1 or null, got 0"),
        ({"dtype": "int8"}, "dtype must be a floating torch dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            vqascore(tmp_path / "not read: the options are checked first", **options)
    with pytest.raises(ValueError, match="vqascore: answer must be a non-empty text"):
        VQAScore(reward.model, reward.processor, answer="")
    with pytest.raises(FileNotFoundError, match="vqascore: model_path '.*nowhere' is not a local folder"):
        vqascore(tmp_path / "nowhere")
    BertConfig(num_hidden_layers=1).save_pretrained(tmp_path / "bert")
    with pytest.raises(
        ValueError, match="vqascore: model_path '.*bert' is a 'bert' model; supported: qwen2_5_vl, qwen2_vl"
    ):
        vqascore(tmp_path / "bert")
    with pytest.raises(ValueError, match=r"images must have shape \(B, 3, H, W\)"):
        reward(torch.rand(1, 2, 3, 56, 56), ["a"], [{}])
    # a generation prompt ending in "Y" merges with the answer "es" into the token "Yes"
    merged = VQAScore(reward.model, reward.processor, answer="es")
    merged.processor.chat_template = CHAT_TEMPLATE.replace("assistant\n{% endif %}", "assistant\nY{% endif %}")
    try:
        with pytest.raises(ValueError, match="vqascore: answer 'es' does not tokenize the same after the chat templ"):
            merged(torch.rand(1, 3, 56, 56), ["a"], [{}])
    finally:
        merged.processor.chat_template = CHAT_TEMPLATE
