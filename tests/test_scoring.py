"""Reward scoring (flowrl.scoring): the rewards built or given, the smoke call, scoring, the gather over processes,
judge-call counting and the reward metrics, on fake rollouts and processes (no model)."""

from types import SimpleNamespace

import pytest
import torch

from flowrl.config import ConfigError, RewardConfig
from flowrl.rewards import WeightedSum
from flowrl.scoring import Scorer, build_rewards, given_rewards

CPU = torch.device("cpu")


def brightness(images, prompts, metadata):
    return images.flatten(1).mean(1)


def _sampling(**over) -> SimpleNamespace:
    return SimpleNamespace(
        **{"overlap_rewards": False, "batch_size": 2, "group_size": 2, "prompts_per_iteration": 2, **over}
    )


def _processes(index: int = 0, count: int = 1) -> SimpleNamespace:
    """Process `index` of `count`: its gather joins `count` copies of the tensor (every process's rows alike)."""
    return SimpleNamespace(
        device=CPU, process_index=index, num_processes=count, gather=lambda t: torch.cat([t] * count)
    )


class _Judge:
    """A pairwise-style reward that counts its judgements (two per image) as ``judge_calls``."""

    def __init__(self):
        self.judge_calls = 0

    def __call__(self, images, prompts, metadata):
        self.judge_calls += 2 * len(prompts)
        return torch.zeros(len(prompts))


def test_given_rewards_take_dicts_pairs_and_lists_and_name_a_bad_entry():
    assert given_rewards(None) == {} and given_rewards([]) == {}
    assert given_rewards({"b": brightness}) == {"b": (brightness, 1.0)}
    assert given_rewards({"b": (brightness, 0.5)}) == {"b": (brightness, 0.5)}
    assert given_rewards([brightness]) == {"brightness": (brightness, 1.0)}
    with pytest.raises(TypeError, match="reward 'b' is a str, not a callable"):
        given_rewards({"b": "brightness"})
    with pytest.raises(ValueError, match="names two rewards alike"):
        given_rewards([brightness, brightness])


def test_build_rewards_names_the_config_key_of_a_bad_reward():
    with pytest.raises(ConfigError, match=r"^config key 'rewards.no_such_reward': "):
        build_rewards({"no_such_reward": RewardConfig()})
    with pytest.raises(ConfigError, match=r"^config key 'rewards.jpeg_compressibility': "):
        build_rewards({"jpeg_compressibility": RewardConfig(options={"no_such_option": 1})})
    built = build_rewards({"jpeg_compressibility": RewardConfig(weight=0.5)})
    assert list(built.rewards) == ["jpeg_compressibility"] and built.rewards["jpeg_compressibility"][1] == 0.5
    given = build_rewards({"jpeg_compressibility": RewardConfig()}, {"b": (brightness, 2.0)})
    assert given.rewards == {"b": (brightness, 2.0)}  # given rewards replace the config's


def test_the_smoke_call_scores_grey_images_of_the_rollouts_size_in_one_group():
    seen = []

    def recording(images, prompts, metadata):
        seen.append((images.shape, [m["group"] for m in metadata], images.unique().tolist()))
        return torch.zeros(len(prompts))

    recording.accepts_video = True
    scorer = Scorer(WeightedSum({"r": (recording, 1.0)}), _sampling(), _processes())
    metas = [{"prompt": p} for p in "abc"]
    scorer.smoke(SimpleNamespace(resolution=16, VIDEO=False), metas)
    scorer.smoke(SimpleNamespace(resolution=16, VIDEO=True, decoded_shape=(5, 3, 16, 16)), metas)
    assert seen == [((2, 3, 16, 16), [0, 0], [0.5]), ((2, 5, 3, 16, 16), [0, 0], [0.5])]
    nan = WeightedSum({"nan": (lambda images, p, m: torch.full((len(p),), float("nan")), 1.0)})
    with pytest.raises(ValueError, match="nan"):
        Scorer(nan, _sampling(), _processes()).smoke(SimpleNamespace(resolution=8, VIDEO=False), metas)


def test_score_gives_each_image_its_prompt_and_group():
    seen = {}

    def recording(images, prompts, metadata):
        seen.update(prompts=list(prompts), groups=[m["group"] for m in metadata])
        return brightness(images, prompts, metadata)

    scorer = Scorer(WeightedSum({"r": (recording, 2.0)}), _sampling(), _processes())
    images = torch.linspace(0, 1, 4).view(4, 1, 1, 1).expand(4, 3, 2, 2)
    scores = scorer.score(images, torch.tensor([1, 1, 0, 0]), [{"prompt": "a"}, {"prompt": "b"}])
    assert seen == {"prompts": ["b", "b", "a", "a"], "groups": [1, 1, 0, 0]}
    assert torch.allclose(scores.total, 2 * torch.linspace(0, 1, 4)) and set(scores.per_reward) == {"r"}


def test_gather_makes_groups_unique_over_processes_and_marks_this_process_rows():
    scorer = Scorer(WeightedSum({"b": (brightness, 1.0)}), _sampling(), _processes(index=1, count=2))
    images = torch.rand(4, 3, 2, 2)
    image_prompt = torch.tensor([0, 0, 1, 1])
    scores = scorer.score(images, image_prompt, [{"prompt": "a"}, {"prompt": "b"}])
    rewards = scorer.gather(scores, image_prompt, prompts=2)
    assert rewards.local is scores and rewards.mine == slice(4, 8)
    assert rewards.total.shape == (8,) and torch.equal(rewards.total[rewards.mine], scores.total)
    assert rewards.group[rewards.mine].tolist() == [2, 2, 3, 3]  # process 1's prompts follow process 0's two
    assert torch.equal(rewards.per_reward["b"][rewards.mine], scores.per_reward["b"])


def test_a_rollout_is_scored_and_its_judgements_counted_in_the_metrics():
    judge = _Judge()
    scorer = Scorer(WeightedSum({"b": (brightness, 1.0), "judge": (judge, 0.0)}), _sampling(), _processes())
    images = torch.tensor([0.0, 1.0, 0.5, 0.5]).view(4, 1, 1, 1).expand(4, 3, 2, 2)
    samples = SimpleNamespace(images=images, image_prompt=torch.tensor([0, 0, 1, 1]))
    method = SimpleNamespace(rollout=lambda metas, generator: samples)
    metas = [{"prompt": "a", "tag": "colors"}, {"prompt": "b", "tag": "counting"}]
    judge.judge_calls = 10  # earlier iterations' judgements are not this rollout's
    scored = scorer.rollout(method, metas, torch.Generator())
    assert scored.samples is samples and scored.worker_s is None and scored.judge_calls == 8
    metrics = scorer.metrics(scorer.gather(scored.scores, samples.image_prompt, 2), scored, metas)
    assert list(metrics) == [
        "reward/total/mean",
        "reward/total/std",
        "reward/b/mean",
        "reward/judge/mean",
        "reward/tag/colors/mean",
        "reward/tag/counting/mean",
        "cost/reward_calls",
        "cost/judge_calls",
    ]
    assert metrics["reward/total/mean"] == pytest.approx(0.5) and metrics["reward/tag/colors/mean"] == pytest.approx(
        0.5
    )
    assert metrics["cost/reward_calls"] == 4 and metrics["cost/judge_calls"] == 8
    plain = Scorer(WeightedSum({"b": (brightness, 1.0)}), _sampling(), _processes())
    scored = plain.rollout(method, metas, torch.Generator())
    assert "cost/judge_calls" not in plain.metrics(plain.gather(scored.scores, samples.image_prompt, 2), scored, metas)


def test_overlap_that_cannot_overlap_is_warned_about():
    rewards = WeightedSum({"b": (brightness, 1.0)})
    with pytest.warns(UserWarning, match=r"a rollout of 4 images is one chunk of .* = 4, so nothing overlaps"):
        Scorer(rewards, _sampling(overlap_rewards=True, batch_size=4), _processes())
    Scorer(rewards, _sampling(overlap_rewards=True, prompts_per_iteration=4), _processes())  # 4 chunks: no warning
