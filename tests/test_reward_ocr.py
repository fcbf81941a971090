"""The `ocr` reward: Flow-GRPO's text accuracy, its edit distance and quote rule, and RapidOCR reading
text rendered with a TrueType font (offline: RapidOCR's models ship in its wheel)."""

import functools
import itertools
import random
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowrl import rewards
from flowrl.rewards import REWARDS, build_reward
from flowrl.rewards.ocr import OcrReward, levenshtein, normalize_text, ocr_accuracy, quoted_text

FONT = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"


def render(text: str, size=(384, 128), font_size=44, colour="black", background="white") -> torch.Tensor:
    """`text` centred on a plain background, as a `(3, H, W)` float tensor in [0, 1]."""
    image = Image.new("RGB", size, background)
    font = ImageFont.truetype(str(FONT), font_size)
    ImageDraw.Draw(image).text((size[0] / 2, size[1] / 2), text, fill=colour, font=font, anchor="mm")
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


def echo_engine(image):
    """A user engine for the registry test: reads 'HELLO' whatever the image."""
    return "HELLO"


# --- edit distance, normalisation, quote rule --------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ("", "", 0),
        ("", "abc", 3),
        ("abc", "", 3),
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("intention", "execution", 5),
        ("abc", "abc", 0),
        ("abc", "acb", 2),
        ("ab", "ba", 2),
        ("a", "b", 1),
    ],
)
def test_levenshtein_known_values(a, b, expected):
    assert levenshtein(a, b) == expected == levenshtein(b, a)


@functools.lru_cache(maxsize=None)
def _reference_distance(a: str, b: str) -> int:
    """The recursive definition of the edit distance (exponential without the cache; fine for short strings)."""
    if not a or not b:
        return len(a) + len(b)
    return min(
        _reference_distance(a[1:], b) + 1,
        _reference_distance(a, b[1:]) + 1,
        _reference_distance(a[1:], b[1:]) + (a[0] != b[0]),
    )


def test_levenshtein_matches_recursive_definition_and_is_a_metric():
    rng = random.Random(0)
    words = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 6))) for _ in range(25)]
    for a, b in itertools.product(words, repeat=2):
        assert levenshtein(a, b) == _reference_distance(a, b)
    for a, b, c in itertools.islice(itertools.product(words, repeat=3), 400):
        assert levenshtein(a, c) <= levenshtein(a, b) + levenshtein(b, c)


def test_quoted_text_follows_flow_grpo_split_rule():
    assert quoted_text('a neon sign that says "Open 24 Hours" at night') == "Open 24 Hours"
    assert quoted_text('"A" then "B"') == "A"  # the first pair only
    assert quoted_text('a poster reading "Sale') == "Sale"  # one quote: the rest of the prompt
    assert quoted_text('an empty "" label') == ""
    assert quoted_text("a cat on a mat") is None
    assert quoted_text("a sign saying \u201cOpen\u201d") is None  # typographic quotes are not quotes
    for prompt in ['x "y z" w', 'just "one', '"', 'a "b" "c" d']:
        assert quoted_text(prompt) == prompt.split('"')[1]


def test_normalize_text_removes_spaces_and_lowercases_only():
    assert normalize_text("  Open 24 HOURS ") == "open24hours"
    assert normalize_text("Tab\there, comma!") == "tab\there,comma!"


def test_ocr_accuracy_formula():
    assert ocr_accuracy("OPEN 24 hours", "Open 24 Hours") == 1.0  # spaces and case ignored
    assert ocr_accuracy("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert ocr_accuracy("hxllo wxrld", "hello world") == pytest.approx(1 - 2 / 10)
    assert ocr_accuracy("", "hello") == 0.0
    assert ocr_accuracy("completely unrelated words", "cat") == 0.0  # distance clipped to len(target)
    # Flow-GRPO's image scorer: extra text around the target costs nothing; the plain distance otherwise
    assert ocr_accuracy("Big SALE today", "sale") == 1.0
    assert ocr_accuracy("Big SALE today", "sale", substring_match=False) == 0.0
    assert ocr_accuracy("sales", "sale", substring_match=False) == pytest.approx(1 - 1 / 4)
    with pytest.raises(ValueError, match="empty"):
        ocr_accuracy("anything", "   ")


# --- the reward with a stand-in engine ---------------------------------------------------------


class RecordingEngine:
    def __init__(self, texts):
        self.texts, self.seen = list(texts), []

    def __call__(self, image):
        self.seen.append(image)
        return self.texts[len(self.seen) - 1]


def test_reward_scores_and_engine_input():
    images = torch.rand(3, 3, 8, 10, generator=torch.Generator().manual_seed(0))
    engine = RecordingEngine(["Hello World", "helo", "nothing"])
    reward = OcrReward(engine)
    prompts = ['a sign "hello world"', 'a mug with "Hello" on it', 'text "xyz"']
    scores = reward(images, prompts, [{}] * 3)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.8, 0.0]))
    for image, tensor in zip(engine.seen, images):  # (H, W, 3) uint8 RGB, rounded as Flow-GRPO does
        assert image.dtype == np.uint8 and image.shape == (8, 10, 3)
        np.testing.assert_array_equal(image, (tensor * 255).round().permute(1, 2, 0).numpy().astype(np.uint8))


def test_unquoted_prompt_is_named_or_scores_zero():
    images = torch.zeros(2, 3, 8, 8)
    prompts = ['a sign "OK"', "a photo of a cat"]
    engine = RecordingEngine(["ok"])
    with pytest.raises(
        ValueError, match=r"prompts\[1\] has no text in double quotes.*'a photo of a cat'.*unquoted: zero"
    ):
        OcrReward(engine)(images, prompts, [{}, {}])
    assert engine.seen == []  # checked before any image is read
    scores = OcrReward(engine, unquoted="zero")(images, prompts, [{}, {}])
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0]))
    assert len(engine.seen) == 1  # the unquoted prompt is not read
    with pytest.raises(ValueError, match=r"prompts\[0\] quotes empty text"):
        OcrReward(engine)(images[:1], ['an empty " " sign'], [{}])


def test_bad_options_and_engine_output():
    with pytest.raises(ValueError, match="unquoted must be 'error' or 'zero'"):
        OcrReward(echo_engine, unquoted="skip")
    with pytest.raises(TypeError, match="engine must be a callable"):
        OcrReward("not callable")
    with pytest.raises(TypeError, match="must return the text read, a str"):
        OcrReward(lambda image: ["a"])(torch.zeros(1, 3, 4, 4), ['"a"'], [{}])
    with pytest.raises(ValueError, match="text_score applies to the default RapidOCR engine only"):
        build_reward("ocr", engine=echo_engine, text_score=0.9)


def test_registered_with_a_dotted_engine():
    assert REWARDS["ocr"] is rewards.ocr and "ocr" in rewards.__all__
    reward = build_reward("ocr", engine=f"{__name__}:echo_engine", substring_match=False)
    assert reward.engine is echo_engine and reward.name == "ocr"
    scores = reward(torch.zeros(2, 3, 4, 4), ['"hello"', '"help"'], [{}, {}])
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.5]))


# --- the real RapidOCR engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def rapid_reward():
    pytest.importorskip("rapidocr")
    pytest.importorskip("onnxruntime")
    return build_reward("ocr")


def test_rapidocr_reads_rendered_text(rapid_reward):
    sign, menu = render("OPEN 24 HOURS"), render("Fresh Bread", colour=(200, 30, 30), background=(250, 240, 200))
    images = torch.stack([sign, menu, sign, torch.ones_like(sign)])  # (4, 3, 128, 384)
    prompts = [
        'a shop window with a neon sign that says "Open 24 Hours"',
        'a bakery chalkboard reading "fresh bread"',
        'a shop window with a neon sign that says "Closed For Lunch"',  # wrong text in the image
        'a blank wall with "Open 24 Hours" painted on it',  # nothing written
    ]
    scores = rapid_reward(images, prompts, [{}] * 4)
    assert scores[0] >= 0.9 and scores[1] >= 0.9, scores
    assert scores[2] <= 0.4, scores
    assert scores[3] == 0.0, scores


def test_rapidocr_engine_returns_lines_in_reading_order(rapid_reward):
    image = Image.new("RGB", (384, 192), "white")
    font = ImageFont.truetype(str(FONT), 44)
    draw = ImageDraw.Draw(image)
    draw.text((192, 50), "FIRST", fill="black", font=font, anchor="mm")
    draw.text((192, 140), "SECOND", fill="black", font=font, anchor="mm")
    text = rapid_reward.engine(np.asarray(image))
    assert normalize_text(text) == "firstsecond", text
