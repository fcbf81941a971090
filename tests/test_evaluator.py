"""The run's evaluator (flowrl.evaluator): what an evaluation draws, which judge and weights it uses, the held-out
prompts and the before/after grid, on the tiny random pipeline."""

import contextlib

import pytest
import torch

from flowrl.config import load_config
from flowrl.evaluation import evaluate, generate
from flowrl.evaluator import GRID_IMAGES, Evaluator, eval_metrics, geneval_reader
from flowrl.models import load_model
from flowrl.rewards import WeightedSum
from flowrl.rewards.geneval import GenEval
from flowrl.tiny.prompts import split

PLAIN = [{"prompt": "a red circle"}, {"prompt": "a blue star"}, {"prompt": "two squares"}]  # no GenEval metadata


class _Policy:
    """Records each time the EMA weights and the autocast are entered."""

    def __init__(self):
        self.entered = []

    @contextlib.contextmanager
    def ema_weights(self):
        self.entered.append("ema")
        yield

    @contextlib.contextmanager
    def autocast(self):
        self.entered.append("autocast")
        yield


def brightness(images, prompts, metadata):
    return images.flatten(1).mean(1)


@pytest.fixture(scope="module")
def model(random_pipeline):
    return load_model(random_pipeline)


def _evaluator(model, metas, held_out=(), **over) -> Evaluator:
    overrides = {"eval.num_steps": 2, "eval.images_per_tag": 1, "sampling.batch_size": 4, **over}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    rewards = WeightedSum({"brightness": (brightness, 1.0)})
    return Evaluator(cfg, model, _Policy(), None, rewards, list(metas), list(held_out))


def test_the_plan_counts_the_images_of_each_prompt_set(model):
    geneval = split(0)[1]  # 90 prompts of 6 tags: one image per tag
    assert _evaluator(model, geneval).plan() == "6 images of eval.prompts, 2 Euler steps"
    both = _evaluator(model, geneval, PLAIN, **{"eval.held_out_images_per_tag": 3})
    assert both.plan() == "6 images of eval.prompts, 3 of eval.held_out, 2 Euler steps"  # plain prompts: one tag


def test_images_per_tag_counts_for_video_and_reward_only_prompt_files(model):
    """eval.images_per_tag means the same for every prompt file: the motion prompts' four directions are tags, a
    reward-only file without tags is one tag; 0 keeps each prompt once, in the file's order."""
    from flowrl.files import REPO_ROOT
    from flowrl.prompt_sets import read_prompt_set

    video = read_prompt_set(REPO_ROOT / "assets/prompts/video_test.jsonl")
    assert len(video) == 80 and not any("include" in m for m in video)
    two = Evaluator.selection(video, 2)
    assert len(two) == 8 and sorted(m["tag"] for m in two) == sorted(["left", "right", "up", "down"] * 2)
    assert _evaluator(model, video, **{"eval.images_per_tag": 2}).plan() == "8 images of eval.prompts, 2 Euler steps"
    assert Evaluator.selection(video, 0) == video  # each once, in order: the shipped tiny_video evaluation
    assert _evaluator(model, PLAIN, **{"eval.images_per_tag": 5}).plan() == "5 images of eval.prompts, 2 Euler steps"
    assert [m["prompt"] for m in Evaluator.selection(PLAIN, 4)] == [m["prompt"] for m in PLAIN + PLAIN[:1]]
    result = _evaluator(model, PLAIN, **{"eval.images_per_tag": 2}).evaluate()
    assert result["n_images"] == 2 and result["rewards"]["brightness"]["n_images"] == 2


def test_geneval_prompts_are_judged_with_the_ema_weights_under_autocast(model):
    metas = split(0)[1]
    evaluator = _evaluator(model, metas)
    result = evaluator.evaluate()
    assert evaluator.policy.entered == ["ema", "autocast"]
    assert result["n_images"] == 6 and 0 <= result["overall"] <= 1 and len(result["per_tag"]) == 6
    direct = evaluate(model, metas, 1, 2, evaluator.cfg.eval.guidance_scale, evaluator.cfg.sampling.shift, 1234, 4)
    assert result["per_tag"] == direct["per_tag"] and result["dense_per_tag"] == direct["dense_per_tag"]
    assert evaluator.evaluate(metas, 2)["n_images"] == 12  # images_per_tag given


def test_prompts_without_geneval_metadata_are_scored_by_the_runs_rewards(model):
    result = _evaluator(model, PLAIN, **{"eval.images_per_tag": 0}).evaluate()
    assert result["n_images"] == 3 and set(result["per_reward"]) == {"brightness"}
    assert 0 <= result["overall"] <= 1 and result["overall"] == pytest.approx(result["per_reward"]["brightness"])


def test_held_out_prompts_are_evaluated_beside_and_named(model):
    evaluator = _evaluator(model, PLAIN, PLAIN[:2], **{"eval.held_out_images_per_tag": 2})
    evaluator.cfg.eval.held_out = "held.jsonl"
    result = evaluator.with_held_out()
    assert result["n_images"] == 1 and result["held_out"]["n_images"] == 2  # one tag: 1 and 2 images
    assert result["held_out"]["prompts"] == "held.jsonl"
    assert "held_out" not in _evaluator(model, PLAIN).with_held_out()


def test_the_grid_is_two_prompts_per_tag_at_fixed_seeds(model):
    metas = split(0)[1]
    evaluator = _evaluator(model, metas)
    grid = evaluator.grid_metas()
    assert len(grid) == GRID_IMAGES and [m["tag"] for m in grid[:2]] == [metas[0]["tag"]] * 2
    assert len({m["tag"] for m in grid}) == GRID_IMAGES // 2  # six tags, two prompts each
    assert [m["prompt"] for m in _evaluator(model, PLAIN[:1]).grid_metas()] == [PLAIN[0]["prompt"]] * GRID_IMAGES
    images = evaluator.grid_images()
    assert images.shape == (GRID_IMAGES, 3, model.resolution, model.resolution) and evaluator.policy.entered[-2:] == [
        "ema",
        "autocast",
    ]
    e = evaluator.cfg.eval
    last = generate(
        model, [grid[-1]["prompt"]], [e.seed + GRID_IMAGES - 1], e.num_steps, e.guidance_scale, metas=grid[-1:]
    )
    assert torch.allclose(images[-1:], last, atol=1e-5)  # image i is drawn from seed eval.seed + i


def test_eval_metrics_and_the_geneval_reader():
    assert eval_metrics({"overall": 0.5, "per_tag": {"colors": 1.0, "counting": 0.0}}) == {
        "eval/overall": 0.5,
        "eval/colors": 1.0,
        "eval/counting": 0.0,
    }
    real = GenEval(detector=object())  # a real-backend reader
    assert geneval_reader(WeightedSum({"b": (brightness, 1.0), "geneval": (real, 1.0)})) is real
    assert geneval_reader(WeightedSum({"geneval": (GenEval(), 1.0)})) is None  # the tiny world's detector


def test_the_generate_bar_ticks_at_every_step_of_every_batch(model, monkeypatch):
    """A long evaluation says how far it is every Euler step, not once a batch of 64 images (minutes on a CPU); a
    grid's few images draw no bar."""
    import flowrl.evaluation

    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.n, self.postfixes = kwargs, 0, []
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix_str(self, text, refresh=True):
            self.postfixes.append((text, self.n))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(flowrl.evaluation, "tqdm", lambda **kwargs: Bar(**kwargs))
    prompts = [m["prompt"] for m in PLAIN] * 6  # 18 images in batches of 8: 3 batches of 2 steps
    images = generate(model, prompts, list(range(18)), 2, 1.0, batch_size=8)
    (bar,) = bars
    assert images.shape[0] == 18 and bar.kwargs["total"] == 6 and bar.n == 6 and not bar.kwargs["disable"]
    assert bar.postfixes == [("batch 1/3", 0), ("batch 2/3", 2), ("batch 3/3", 4)]
    assert bar.kwargs["desc"] == "generate 18 images" and bar.kwargs["unit"] == "step"
    generate(model, prompts[:12], list(range(12)), 2, 1.0, batch_size=8)  # a grid's 12 images
    assert bars[1].kwargs["disable"] and bars[1].n == 4
    assert torch.equal(generate(model, prompts[:8], list(range(8)), 2, 1.0), images[:8])  # the bar changes no image
