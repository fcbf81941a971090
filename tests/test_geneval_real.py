"""Tests of GenEval's real-image backend (Mask2Former + CLIP colours) on tiny random models built offline.

Random weights detect nothing meaningful, so the segmenter is run end to end only for well-formed
records; the records -> rules -> score path is checked with injected segmenter outputs and stubbed colour
logits, and the colour classifier against its formula.
"""

import pytest
import torch
from tiny_pipelines.clip import cut_clip_tokenizer, save_random_clip

from flowrl.rewards.base import build_reward
from flowrl.rewards.geneval import geneval
from flowrl.rewards.geneval.real import (
    CLASSES,
    COLOR_TEMPLATES,
    COLORS,
    CROP_BACKGROUND,
    Segment,
    box_iou,
    crop_object,
    geneval_name,
    mask_boxes,
    select_detections,
)

COCO_LABELS = (  # COCO's thing classes as checkpoints' id2label spell them (detectron2 / transformers)
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "mouse",
    "remote",
    "keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)
DOG, CAT = COCO_LABELS.index("dog"), COCO_LABELS.index("cat")
QUERIES = 6


@pytest.fixture(scope="module")
def segmenter_dir(tmp_path_factory):
    """A seeded random Mask2Former (tiny Swin backbone, COCO's 80 labels) with its image processor."""
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    backbone = SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=8,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    id2label = dict(enumerate(COCO_LABELS))
    config = Mask2FormerConfig(
        backbone_config=backbone,
        feature_size=32,
        mask_feature_size=32,
        hidden_dim=32,
        encoder_feedforward_dim=32,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        dim_feedforward=32,
        num_queries=QUERIES,
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_mask2former")
    Mask2FormerForUniversalSegmentation(config).save_pretrained(folder)
    Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 128}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A seeded random CLIP (1 + 1 layers, 32 positions, seed 1) with a cut CLIP tokenizer and a 32-pixel image
    processor."""
    sizes = dict(text_layers=1, vision_layers=1, positions=32, seed=1)
    return save_random_clip(tmp_path_factory.mktemp("tiny_clip"), cut_clip_tokenizer(300), **sizes)


@pytest.fixture(scope="module")
def reward(segmenter_dir, clip_dir):
    return geneval(strict=True, segmenter_path=str(segmenter_dir), clip_path=str(clip_dir))


def _outputs(objects, size=384):
    """Synthetic Mask2Former outputs for one image: ``objects`` = [(label, class logit, (x0, y0, x1, y1))];
    other queries predict no object with empty masks. Masks come at 384 x 384, the post-processor's grid."""
    from transformers.models.mask2former.modeling_mask2former import Mask2FormerForUniversalSegmentationOutput

    classes = torch.zeros(1, QUERIES, len(COCO_LABELS) + 1)
    classes[0, :, -1] = 20.0  # no object
    masks = torch.full((1, QUERIES, size, size), -10.0)
    for q, (label, logit, (x0, y0, x1, y1)) in enumerate(objects):
        classes[0, q, -1] = 0.0
        classes[0, q, label] = logit
        masks[0, q, y0:y1, x0:x1] = 10.0
    return Mask2FormerForUniversalSegmentationOutput(class_queries_logits=classes, masks_queries_logits=masks)


def _inject(monkeypatch, reward, objects, color=None):
    """Make the reward's segmenter return ``objects`` and its colour classifier say ``color``; returns the
    list the stub appends ``(crop shapes, object names)`` to."""
    monkeypatch.setattr(reward.detector.segmenter, "forward", lambda images: _outputs(objects))
    calls = []

    def logits(crops, names):
        calls.append(([tuple(c.shape) for c in crops], list(names)))
        out = torch.zeros(len(crops), len(COLORS))
        out[:, COLORS.index(color)] = 1.0
        return out

    monkeypatch.setattr(reward.detector.colors, "logits", logits)
    return calls


def _score(reward, meta, size=384):
    images = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    correct, dense = reward.judge(images, [meta["prompt"]], [meta])
    return correct.item(), dense.item()


# --- names, boxes, selection ---------------------------------------------------------------------


def test_coco_labels_map_to_geneval_names():
    assert tuple(geneval_name(label) for label in COCO_LABELS) == CLASSES
    assert geneval_name("Dining-Table") == "dining table" and geneval_name("tvmonitor") == "tv"
    assert geneval_name("sky-other-merged") is None and geneval_name("wall") is None
    assert len(set(CLASSES)) == 80 and len(COLORS) == 10


def test_mask_boxes_are_mask2bbox():
    from torchvision.ops import masks_to_boxes

    masks = torch.rand(5, 20, 30, generator=torch.Generator().manual_seed(0)) > 0.97
    masks[0] = False
    masks[0, 3, 7] = True  # a single pixel: box (7, 3, 8, 4)
    expected = masks_to_boxes(masks) + torch.tensor([0.0, 0.0, 1.0, 1.0])  # torchvision's ends are inclusive
    torch.testing.assert_close(mask_boxes(masks), expected)
    assert mask_boxes(masks)[0].tolist() == [7.0, 3.0, 8.0, 4.0]


def test_select_detections_thresholds_cap_and_nms():
    def seg(score, box=(0, 0, 10, 10), cls="dog"):
        return Segment(cls, None, box, score)

    dets = [seg(0.95), seg(0.3), seg(0.31), seg(0.5, cls="cat"), seg(0.9)]
    assert [d.score for d in select_detections(dets, {"tag": "two_object"})] == [0.95, 0.9, 0.31, 0.5]
    assert [d.score for d in select_detections(dets, {"tag": "counting"})] == [0.95]  # strictly above 0.9
    many = [seg(0.5 + i / 100) for i in range(20)]
    assert len(select_detections(many, {}, max_objects=16)) == 16
    assert select_detections(many, {}, max_objects=3)[0].score == 0.69
    # the reference's IoU counts x1 - x0 + 1 pixels a side: (0..10) vs (2..12) -> 81 / (121 + 121 - 81)
    assert box_iou((0, 0, 10, 10), (2, 2, 12, 12)) == pytest.approx(81 / 161)
    overlapping = [seg(0.9, (0, 0, 10, 10)), seg(0.8, (2, 2, 12, 12)), seg(0.7, (30, 30, 40, 40))]
    assert len(select_detections(overlapping, {})) == 3  # 1.0: GenEval's default keeps all
    assert [d.score for d in select_detections(overlapping, {}, nms_threshold=0.5)] == [0.9, 0.7]
    assert len(select_detections(overlapping, {}, nms_threshold=0.6)) == 3


def test_crop_object_paints_grey_outside_the_mask_and_cuts_the_box():
    image = torch.rand(3, 12, 16, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(12, 16, dtype=torch.bool)
    mask[2:6, 3:9] = True
    mask[2, 3] = False
    crop = crop_object(image, Segment("dog", None, (3.0, 2.0, 9.0, 6.0), 0.9, mask))
    assert crop.shape == (3, 4, 6)
    torch.testing.assert_close(crop[:, 1:, :], image[:, 3:6, 3:9])
    assert CROP_BACKGROUND == 0x99 / 255 and torch.all(crop[:, 0, 0] == CROP_BACKGROUND)  # the reference's "#999"
    unmasked = crop_object(image, Segment("dog", None, (3.0, 2.0, 9.0, 6.0), 0.9))
    torch.testing.assert_close(unmasked, image[:, 2:6, 3:9])


# --- end to end with the random models ----------------------------------------------------------


def test_real_segmenter_end_to_end_gives_well_formed_records(reward, segmenter_dir, clip_dir):
    segmenter = reward.detector.segmenter
    assert segmenter.classes == tuple(sorted(CLASSES))
    images = torch.rand(2, 3, 40, 56, generator=torch.Generator().manual_seed(0))
    outputs = segmenter.forward(images)
    assert outputs.class_queries_logits.shape == (2, QUERIES, 81) and outputs.masks_queries_logits.ndim == 4
    segmenter.threshold = 0.0  # random weights are never confident: keep every non-empty mask
    try:
        records = segmenter(images)
    finally:
        segmenter.threshold = 0.3
    assert len(records) == 2 and sum(map(len, records)) > 0
    probs = outputs.class_queries_logits.softmax(-1)[..., :-1]  # (2, Q, 80)
    for b, segments in enumerate(records):
        for s in segments:
            assert s.cls in CLASSES and s.color is None
            assert s.mask.shape == (40, 56) and s.mask.dtype == torch.bool and s.mask.any()
            assert list(s.box) == mask_boxes(s.mask[None])[0].tolist()
            x0, y0, x1, y1 = map(int, s.box)
            assert 0 <= x0 < x1 <= 56 and 0 <= y0 < y1 <= 40
            label = COCO_LABELS.index(next(k for k in COCO_LABELS if geneval_name(k) == s.cls))
            assert 0 <= s.score <= probs[b, :, label].max().item() + 1e-6  # class prob x mean mask prob

    metas = [
        {"tag": "single_object", "include": [{"class": "computer mouse", "count": 1}], "prompt": "a mouse"},
        {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "pink"}], "prompt": "a pink dog"},
    ]
    strict = reward(images, [m["prompt"] for m in metas], metas)
    assert strict.shape == (2,) and strict.dtype == torch.float32 and set(strict.tolist()) <= {0.0, 1.0}
    dense = build_reward("geneval", segmenter_path=str(segmenter_dir), clip_path=str(clip_dir), segmenter_size=64)(
        images, [m["prompt"] for m in metas], metas
    )
    assert dense.shape == (2,) and bool(((dense >= 0) & (dense <= 1)).all())


def test_color_classifier_matches_the_zero_shot_formula(reward, clip_dir):
    from transformers import CLIPImageProcessor

    colors = reward.detector.colors
    model, tokenizer = colors.model, colors.tokenizer
    weights = colors.text_weights("tv remote")
    assert weights.shape == (10, 16)
    expected = []
    with torch.no_grad():
        for color in COLORS:
            rows = []
            for template in COLOR_TEMPLATES:
                tokens = tokenizer([template.format(color=color, object="tv remote")], return_tensors="pt")
                out = model.get_text_features(tokens["input_ids"], tokens["attention_mask"])
                out = out if isinstance(out, torch.Tensor) else out.pooler_output
                rows.append(out[0] / out[0].norm())
            mean = torch.stack(rows).mean(0)
            expected.append(mean / mean.norm())
        torch.testing.assert_close(weights, torch.stack(expected), atol=1e-5, rtol=1e-5)
        assert "a photo of a purple-colored tv remote" == COLOR_TEMPLATES[1].format(color="purple", object="tv remote")

        crops = [torch.rand(3, 20, 12, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        logits = colors.logits(crops, ["tv remote", "dog", "tv remote"])
        processor = CLIPImageProcessor.from_pretrained(clip_dir)
        pixels = processor(images=crops, do_rescale=False, return_tensors="pt", input_data_format="channels_first")[
            "pixel_values"
        ]
        image = model.get_image_features(pixel_values=pixels)
        image = image if isinstance(image, torch.Tensor) else image.pooler_output
        image = image / image.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(logits[0], 100 * image[0] @ weights.T, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[1], 100 * image[1] @ colors.text_weights("dog").T, atol=1e-4, rtol=1e-4)
    assert colors.classify(crops, ["tv remote", "dog", "tv remote"]) == [COLORS[i] for i in logits.argmax(1)]


# --- records -> rules -> score, with injected segmenter outputs ---------------------------------


def test_injected_outputs_become_exact_records(monkeypatch, reward):
    mouse = COCO_LABELS.index("mouse")
    _inject(monkeypatch, reward, [(DOG, 10.0, (40, 50, 120, 200)), (mouse, 10.0, (200, 10, 260, 90))])
    images = torch.rand(1, 3, 384, 384)
    (records,) = reward.detector.segmenter(images)
    records = sorted(records, key=lambda r: r.cls)  # the post-processor's top-k comes unsorted
    assert [(r.cls, r.box) for r in records] == [
        ("computer mouse", (200.0, 10.0, 260.0, 90.0)),
        ("dog", (40.0, 50.0, 120.0, 200.0)),
    ]
    score = torch.tensor(10.0).exp() / (torch.tensor(10.0).exp() + 80) * torch.tensor(10.0).sigmoid()
    assert [r.score for r in records] == pytest.approx([score.item()] * 2, abs=1e-5)  # class x mean mask prob
    assert records[1].mask.sum() == 80 * 150 and records[1].mask[50:200, 40:120].all()


def test_counting_needs_two_confident_detections(monkeypatch, reward):
    meta = {
        "tag": "counting",
        "include": [{"class": "dog", "count": 2}],
        "exclude": [{"class": "dog", "count": 3}],
        "prompt": "a photo of two dogs",
    }
    _inject(monkeypatch, reward, [(DOG, 10.0, (10, 10, 100, 100)), (DOG, 10.0, (200, 200, 300, 300))])
    assert _score(reward, meta) == (1.0, 1.0)
    # a second dog at class prob 0.5 (logit ln 80) passes 0.3 but not the counting threshold 0.9
    _inject(monkeypatch, reward, [(DOG, 10.0, (10, 10, 100, 100)), (DOG, 4.382, (200, 200, 300, 300))])
    assert _score(reward, meta) == (0.0, 0.5)
    three = [(DOG, 10.0, (10, 10, 100, 100)), (DOG, 10.0, (200, 200, 300, 300)), (DOG, 10.0, (10, 250, 90, 380))]
    _inject(monkeypatch, reward, three)
    assert _score(reward, meta) == (0.0, 0.5)  # the exclude clause: three dogs are too many


def test_color_passes_only_when_clip_says_the_colour(monkeypatch, reward):
    meta = {
        "tag": "colors",
        "include": [{"class": "dog", "count": 1, "color": "red"}],
        "prompt": "a photo of a red dog",
    }
    objects = [(DOG, 10.0, (40, 50, 120, 200)), (DOG, 8.0, (200, 200, 300, 300)), (CAT, 10.0, (0, 0, 30, 30))]
    calls = _inject(monkeypatch, reward, objects, color="red")
    assert _score(reward, meta) == (1.0, 1.0)
    assert calls == [([(3, 150, 80)], ["dog"])]  # only the most confident dog, cut to its box
    _inject(monkeypatch, reward, objects, color="blue")
    assert _score(reward, meta) == (0.0, 0.0)


def test_position_rules_read_the_boxes(monkeypatch, reward):
    def meta(relation):
        return {
            "tag": "position",
            "prompt": f"a photo of a dog {relation} a cat",
            "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": [relation, 0]}],
        }

    _inject(monkeypatch, reward, [(DOG, 10.0, (10, 150, 100, 250)), (CAT, 10.0, (250, 150, 350, 250))])
    assert _score(reward, meta("left of"))[0] == 1.0
    assert _score(reward, meta("right of"))[0] == 0.0
    assert _score(reward, meta("above"))[0] == 0.0
    _inject(monkeypatch, reward, [(DOG, 10.0, (150, 10, 250, 100)), (CAT, 10.0, (150, 250, 250, 350))])
    assert _score(reward, meta("above"))[0] == 1.0 and _score(reward, meta("left of"))[0] == 0.0


# --- errors --------------------------------------------------------------------------------------


def _one_line(err):
    return "\n" not in str(err.value)


def test_missing_or_wrong_folders_name_the_option(tmp_path, segmenter_dir, clip_dir):
    with pytest.raises(FileNotFoundError, match="segmenter_path") as err:
        geneval(segmenter_path=str(tmp_path / "nope"), clip_path=str(clip_dir))
    assert _one_line(err)
    with pytest.raises(ValueError, match="segmenter_path .* 'clip' model, expected a 'mask2former'") as err:
        geneval(segmenter_path=str(clip_dir), clip_path=str(clip_dir))
    assert _one_line(err)
    with pytest.raises(ValueError, match="clip_path .* 'mask2former' model, expected a 'clip'") as err:
        geneval(segmenter_path=str(segmenter_dir), clip_path=str(segmenter_dir))
    assert _one_line(err)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="clip_path .* no readable config.json") as err:
        geneval(segmenter_path=str(segmenter_dir), clip_path=str(tmp_path / "empty"))
    assert _one_line(err)
    with pytest.raises(ValueError, match="needs clip_path"):
        geneval(segmenter_path=str(segmenter_dir))


def test_option_errors(reward, segmenter_dir, clip_dir):
    paths = dict(segmenter_path=str(segmenter_dir), clip_path=str(clip_dir))
    with pytest.raises(ValueError, match="lenient is for the tiny world"):
        geneval(lenient=True, **paths)
    with pytest.raises(ValueError, match="options device are for backend 'real'"):
        geneval(device="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        geneval(backend="detectron")
    with pytest.raises(ValueError, match="nms_threshold"):
        geneval(nms_threshold=0.0, **paths)
    with pytest.raises(ValueError, match="max_objects"):
        geneval(max_objects=0, **paths)
    with pytest.raises(ValueError, match="segmenter_size"):
        geneval(segmenter_size=8, **paths)
    images = torch.rand(1, 3, 32, 32)
    for clause in ({"class": "circle", "count": 1}, {"class": "dog", "count": 1, "color": "magenta"}):
        meta = {"tag": "colors", "include": [clause], "prompt": "p"}
        with pytest.raises(ValueError, match="'p' asks for .* Mask2Former segmenter knows"):
            reward(images, ["p"], [meta])


def test_the_trainers_evaluation_judges_with_the_configured_real_backend(monkeypatch):
    """A run whose geneval reward reads real images evaluates with that reward, not the tiny world's detector."""
    from flowrl.evaluator import geneval_reader
    from flowrl.rewards import WeightedSum
    from flowrl.rewards.geneval import GenEval

    real = GenEval(detector=object())  # any real-backend reader
    assert geneval_reader(WeightedSum({"geneval": (real, 1.0)})) is real
    assert geneval_reader(WeightedSum({"geneval": (GenEval(), 1.0)})) is None
