"""sampling.overlap_rewards: chunked rollouts equal the one-batch rollout, the worker overlaps, errors and Ctrl-C."""

from __future__ import annotations

import dataclasses
import re
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_overrides

from flowrl.config import ConfigError, load_config
from flowrl.overlap import ChunkWorker
from flowrl.rewards import CombinedScores, RewardError, WeightedSum, build_reward
from flowrl.samplers import StepPlan, flow_sigmas, mix_plan, sample, sample_in_chunks
from flowrl.scoring import Scorer
from flowrl.trainer import Trainer


def _velocity(x, t, cond):
    """A per-row velocity with a transcendental term (vectorised and scalar tails must agree)."""
    return 0.7 * torch.tanh(x) - 0.3 * t.view(-1, 1, 1, 1) + 0.1 * cond.view(-1, 1, 1, 1).float()


@pytest.mark.parametrize("kernel", ["flow_sde", "dance_sde", "cps", "ddim", "mix"])
def test_a_rollout_sampled_in_chunks_equals_the_one_batch_rollout(kernel):
    sigmas = flow_sigmas(6, 1.0)
    if kernel == "mix":  # MixGRPO: an SDE window, ODE before it and a DPM-Solver++ tail after
        sigmas, plan = mix_plan(sigmas, [1, 2], "flow_sde", 0.7, 0.5, 1.0)
    else:
        plan = StepPlan.sde(6, kernel=kernel, noise_level=0.7)
    noise, cond = torch.randn(7, 2, 4, 4), torch.arange(7) // 2
    one, chunked = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    whole = sample(_velocity, noise, cond, cond.clone(), sigmas, plan, one)
    handed = []
    parts = sample_in_chunks(
        _velocity, noise, cond, cond.clone(), sigmas, plan, 3, lambda r, f: handed.append((r, f)), chunked
    )
    for f in dataclasses.fields(whole):
        a, b = getattr(whole, f.name), getattr(parts, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    assert torch.equal(one.get_state(), chunked.get_state())  # the generator is left where sample() leaves it
    assert [(r.start, r.stop) for r, _ in handed] == [(0, 3), (3, 6), (6, 7)]
    assert torch.equal(torch.cat([f for _, f in handed]), whole.final)


# ------------------------------------------------------------------------------ the worker, on known sleeps
class _SlowMethod:
    """A method whose rollout samples 3 chunks of 2 images, each taking `sample_s`; decode is free."""

    def __init__(self, sample_s: float):
        self.sample_s, self.chunks = sample_s, 0

    def rollout_in_chunks(self, metas, generator, size, on_chunk):
        for c in range(3):
            time.sleep(self.sample_s)
            self.chunks += 1
            on_chunk(torch.full((size, 1), float(c)), torch.tensor([c, c]))
        return SimpleNamespace(images=torch.empty(0), image_prompt=torch.arange(3).repeat_interleave(2))

    def decode(self, latents):
        return latents.view(-1, 1, 1, 1).expand(-1, 3, 2, 2)


def _scorer(score) -> Scorer:
    """A scorer of chunks of 2 images on the CPU whose ``score`` is `score`."""
    sampling = SimpleNamespace(batch_size=2, group_size=2, overlap_rewards=True, prompts_per_iteration=3)
    scorer = Scorer(
        WeightedSum({"unused": (lambda *a: None, 1.0)}), sampling, SimpleNamespace(device=torch.device("cpu"))
    )
    scorer.score = score
    return scorer


def test_the_worker_scores_a_chunk_while_the_next_one_samples():
    def slow_score(images, image_prompt, metas):  # a reward taking 0.2 s per chunk, as long as a chunk's sampling
        time.sleep(0.2)
        return CombinedScores(images.mean((1, 2, 3)), {"slow": images.mean((1, 2, 3))})

    start = time.perf_counter()
    samples, scores, _, worker_s = _scorer(slow_score).overlapped_rollout(_SlowMethod(0.2), [], None)
    wall = time.perf_counter() - start
    assert wall < 1.0  # in turn: 3 x 0.2 s sampling + 3 x 0.2 s scoring = 1.2 s; overlapped about 0.8 s
    assert worker_s >= 0.6
    assert scores.total.tolist() == [0, 0, 1, 1, 2, 2] and scores.per_reward["slow"].tolist() == [0, 0, 1, 1, 2, 2]
    assert samples.images.shape == (6, 3, 2, 2)


def test_a_failing_reward_stops_the_rollout_with_its_own_error():
    error = RewardError("reward bad raised RuntimeError: down")

    def failing(images, image_prompt, metas):
        raise error

    method = _SlowMethod(0.1)
    with pytest.raises(RewardError) as raised:
        _scorer(failing).overlapped_rollout(method, [], None)
    assert raised.value is error and method.chunks < 3  # surfaced at the next chunk, not after the rollout


def test_ctrl_c_while_waiting_for_the_worker_stops_at_once():
    # Python's own Ctrl-C handler, whatever a library imported by earlier tests installed in its place
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_while_waiting()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_while_waiting() -> None:
    main = threading.get_ident()
    worker = ChunkWorker(lambda: time.sleep(10))
    worker.submit()
    threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt), worker:
        worker.results()
    assert time.perf_counter() - start < 5 and worker._thread.daemon  # the sleeping worker never holds the process


# ------------------------------------------------------------------------------ a tiny model, both ways
def _trainer(tmp_path, random_pipeline, prompt_files, seen: list, overlap: bool = True, method: str = "grpo"):
    def brightness(images, prompts, metadata):  # records every image it scores
        seen.append(images.clone())
        return images.flatten(1).mean(1)

    train, test = prompt_files
    extra = {"sampling.overlap_rewards": overlap, "sampling.batch_size": 2, "sampling.num_steps": 2}
    extra["train.method"] = method  # 2 prompts of 2 images: 2 chunks of one group per iteration
    cfg = load_config(None, tiny_overrides(random_pipeline, train, test, tmp_path / f"run-{overlap}", **extra))
    return Trainer(cfg, rewards={"brightness": brightness, "jpeg": build_reward("jpeg_compressibility")})


def _one_line(error: BaseException) -> str:
    return re.sub(r"\d+(, \d+)*", "N", str(error))  # a NaN count is of the batch scored: the chunk's, with overlap


def test_an_overlapped_rollout_equals_the_rollout_then_its_scores(tmp_path, random_pipeline, prompt_files):
    seen = []
    trainer = _trainer(tmp_path, random_pipeline, prompt_files, seen)
    metas = trainer.sample_prompts(0)
    seen.clear()
    samples = trainer.method.rollout(metas, trainer._generator(0))
    scores = trainer.scorer.score(samples.images, samples.image_prompt, metas)
    overlapped, overlapped_scores, _, _ = trainer.scorer.overlapped_rollout(
        trainer.method, metas, trainer._generator(0)
    )
    assert len(seen) == 3  # one batch, then one call per chunk
    assert torch.equal(samples.images, overlapped.images) and torch.equal(seen[0], torch.cat(seen[1:]))
    assert torch.equal(scores.total, overlapped_scores.total)
    assert all(torch.equal(v, overlapped_scores.per_reward[k]) for k, v in scores.per_reward.items())
    ro, other = samples.rollout, overlapped.rollout  # every transition alike: the same advantages and update
    for f in dataclasses.fields(ro):
        a, b = getattr(ro, f.name), getattr(other, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name

    def nan(images, prompts, metadata):
        return torch.full((len(prompts),), float("nan"))

    def down(images, prompts, metadata):
        raise ConnectionError("reward server at http://x:1 refused the connection")

    for bad, kind in ((nan, ValueError), (down, RewardError)):  # the same one-line error either way
        trainer.scorer.rewards = WeightedSum({"bad": (bad, 1.0)})
        with pytest.raises(kind) as sequential:
            trainer.scorer.score(samples.images, samples.image_prompt, metas)
        with pytest.raises(kind) as overlapping:
            trainer.scorer.overlapped_rollout(trainer.method, metas, trainer._generator(0))
        assert _one_line(sequential.value) == _one_line(overlapping.value) and "bad" in str(sequential.value)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "nft"])
def test_overlapped_training_equals_sequential_training(tmp_path, random_pipeline, prompt_files, method):
    seen, trainers, metrics = {}, {}, {}
    for overlap in (False, True):
        seen[overlap] = []
        trainers[overlap] = _trainer(tmp_path, random_pipeline, prompt_files, seen[overlap], overlap, method)
        metrics[overlap] = [trainers[overlap].step(it) for it in range(2)]
    for a, b in zip(metrics[False], metrics[True]):
        assert {k: v for k, v in a.items() if not k.startswith(("time/", "memory/"))} == {
            k: v for k, v in b.items() if not k.startswith(("time/", "memory/"))
        }
        assert "time/score_worker_s" in b and "time/score_worker_s" not in a
    assert len(seen[True]) == 1 + 2 * len(seen[False][1:])  # the smoke call, then one call per chunk
    assert torch.equal(torch.cat(seen[False][1:]), torch.cat(seen[True][1:]))  # the same images
    params = trainers[False].policy.params
    assert all(torch.equal(p, trainers[True].policy.params[n]) for n, p in params.items())  # the same weights


def test_overlap_is_refused_where_the_rollout_is_not_chunked():
    with pytest.raises(ConfigError, match="sampling.overlap_rewards.*shared_noise"):
        load_config(None, ["sampling.overlap_rewards=true", "sampling.shared_noise=true"])
    with pytest.raises(ConfigError, match="'sampling.overlap_rewards' must be false with train.method 'refl'"):
        load_config(None, ["sampling.overlap_rewards=true", "train.method=refl"])
    assert load_config(None, ["sampling.overlap_rewards=true", "train.method=nft"]).sampling.overlap_rewards
