"""Pairwise judges and Pref-GRPO win rates, including a VLM judge against a local OpenAI-compatible server."""

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.rewards import PrefWinRate, VLMJudge, bradley_terry_judge, build_reward, win_rates
from flowrl.rewards.pairwise import parse_choice


def _images(levels):
    """Flat grey images whose brightness encodes their index."""
    return torch.stack([torch.full((3, 8, 8), float(v)) for v in levels])


def table_judge(table):
    """A judge reading P(a > b) from a hand-made table indexed by the images' brightness * 10."""

    def judge(a, b, prompts, metadata):
        return torch.tensor(
            [table[(round(x[0, 0, 0].item() * 10), round(y[0, 0, 0].item() * 10))] for x, y in zip(a, b)]
        )

    return judge


def test_win_rates_on_a_hand_made_table():
    # 0 beats 1 and 2; 1 ties 2
    table = {(0, 1): 1.0, (1, 0): 0.0, (0, 2): 0.9, (2, 0): 0.1, (1, 2): 0.5, (2, 1): 0.5}
    images = _images([0.0, 0.1, 0.2])
    rates = win_rates(table_judge(table), images, ["p"] * 3, [{}] * 3, torch.zeros(3, dtype=torch.long))
    assert rates.tolist() == [1.0, 0.25, 0.25]
    soft = win_rates(table_judge(table), images, ["p"] * 3, [{}] * 3, torch.zeros(3, dtype=torch.long), soft=True)
    torch.testing.assert_close(soft, torch.tensor([0.95, 0.25, 0.3]))


def test_both_orders_cancel_a_judge_that_always_prefers_the_first_image():
    first = lambda a, b, p, m: torch.ones(len(a))  # noqa: E731
    images, group = _images([0.0, 0.1, 0.2, 0.3]), torch.tensor([0, 0, 0, 1])
    biased = win_rates(first, images, ["p"] * 4, [{}] * 4, group, both_orders=False)
    assert biased.tolist() == [1.0, 0.5, 0.0, 0.5]  # position decides; the lone image gets 0.5
    fair = win_rates(first, images, ["p"] * 4, [{}] * 4, group)
    assert fair.tolist() == [0.5, 0.5, 0.5, 0.5]


def test_bradley_terry_judge_from_a_pointwise_reward():
    brightness = lambda images, prompts, metadata: images.mean(dim=(1, 2, 3))  # noqa: E731
    judge = bradley_terry_judge(brightness, temperature=0.1)
    p = judge(_images([0.5, 0.2]), _images([0.2, 0.5]), ["p", "p"], [{}, {}])
    torch.testing.assert_close(p, torch.sigmoid(torch.tensor([3.0, -3.0])))
    reward = build_reward("pref_winrate", reward="jpeg_compressibility")
    assert isinstance(reward, PrefWinRate)
    # a flat image compresses far better than noise, so each pair has a clear winner (two noise images
    # can tie on JPEG size, which would make the test depend on the global RNG)
    flat, noise = torch.full((3, 16, 16), 0.5), torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
    images = torch.stack([noise, flat, flat, noise])
    scores = reward(images, ["a", "a", "b", "b"], [{}] * 4)
    assert scores.tolist() == [0.0, 1.0, 1.0, 0.0]
    # one prompt drawn twice: the trainer's group ids keep the two groups apart
    same = reward(images, ["a"] * 4, [{"group": 0}, {"group": 0}, {"group": 1}, {"group": 1}])
    assert same.tolist() == [0.0, 1.0, 1.0, 0.0]
    with pytest.raises(TypeError, match="temprature"):
        build_reward("pref_winrate", judge="bt", temprature=0.05)


def test_bradley_terry_win_rates_score_each_image_once_and_match_the_pairwise_path():
    calls = []

    def brightness(images, prompts, metadata):
        calls.append(len(images))
        return images.mean(dim=(1, 2, 3))

    images = _images([0.3, 0.1, 0.2, 0.9, 0.4, 0.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    judge = bradley_terry_judge(brightness, temperature=0.1)
    for soft in (False, True):
        fast = win_rates(judge, images, ["p"] * 6, [{}] * 6, group, soft=soft)
        generic = win_rates(lambda a, b, p, m: judge(a, b, p, m), images, ["p"] * 6, [{}] * 6, group, soft=soft)
        torch.testing.assert_close(fast, generic)
    calls.clear()
    reward = PrefWinRate(judge)
    rates = reward(images, ["a"] * 3 + ["b"] * 3, [{}] * 6)
    assert rates.tolist() == [1.0, 0.0, 0.5, 1.0, 0.5, 0.0]
    assert calls == [6] and reward.judge_calls == 6  # one score per image, not two per pair and order
    with pytest.raises(ValueError, match="group must have shape"):
        win_rates(judge, images, ["p"] * 6, [{}] * 6, torch.zeros(5, dtype=torch.long))
    broken = bradley_terry_judge(lambda images, prompts, metadata: torch.full((len(prompts),), float("nan")))
    with pytest.raises(ValueError, match=r"reward 'bradley_terry\(<lambda>\)' returned 6 NaN scores"):
        win_rates(broken, images, ["p"] * 6, [{}] * 6, torch.zeros(6, dtype=torch.long))


def test_pref_winrate_counts_judge_calls_and_refuses_an_idle_temperature():
    first = lambda a, b, p, m: torch.ones(len(a))  # noqa: E731
    reward = PrefWinRate(first)
    reward(_images([0.0, 0.1, 0.2, 0.3]), ["p"] * 4, [{}] * 4)
    assert reward.judge_calls == 12  # 6 pairs, both orders
    assert reward(torch.zeros(0, 3, 8, 8), [], []).shape == (0,) and reward.judge_calls == 12  # an empty batch
    with pytest.raises(ValueError, match="temperature=0.05 has no effect with soft=false"):
        build_reward("pref_winrate", reward="jpeg_compressibility", temperature=0.05)
    soft = build_reward("pref_winrate", reward="jpeg_compressibility", temperature=0.05, soft=True)
    assert soft.judge.temperature == 0.05
    with pytest.raises(TypeError, match="temperature is an option of judge='bt'"):
        build_reward("pref_winrate", judge="vlm", temperature=0.5, base_url="http://127.0.0.1:1/v1", model="m")


def test_partial_group_metadata_and_bad_judge_output_are_named():
    first = lambda a, b, p, m: torch.ones(len(a))  # noqa: E731
    with pytest.raises(ValueError, match="pref_winrate: metadata 'group' is set in 1 of 2 records"):
        PrefWinRate(first)(_images([0.0, 0.1]), ["p", "p"], [{"group": 0}, {}])

    def overconfident(a, b, prompts, metadata):
        return torch.full((len(a),), 1.5)

    with pytest.raises(
        ValueError, match=r"pairwise judge 'overconfident' must return \(1,\) probabilities .*got values \[1.5\]"
    ):
        win_rates(overconfident, _images([0.0, 0.1]), ["p", "p"], [{}, {}], torch.zeros(2, dtype=torch.long))
    assert win_rates(first, _images([0.0]), ["p"], [{}], torch.zeros(1, dtype=torch.long)).dtype == torch.float32


def test_vlm_judge_options_are_checked_when_built():
    with pytest.raises(ValueError, match="vlm_judge: concurrency must be an integer >= 1, got 0"):
        VLMJudge("http://127.0.0.1:1/v1", "m", concurrency=0)
    with pytest.raises(ValueError, match=r"vlm_judge: question may hold only the placeholder \{prompt\}"):
        VLMJudge("http://127.0.0.1:1/v1", "m", question="Rate {prompt} as {score}")


def test_parse_choice():
    assert parse_choice("Image 2 has more detail... Final answer: Image 1") == 1.0
    assert parse_choice("I prefer image 2.") == 0.0
    assert parse_choice("Both image 1 and image 2 are fine") == 0.5
    assert parse_choice("no idea") == 0.5
    assert parse_choice("<think>Image 2 is blurry</think><answer>Image 1 is better</answer>") == 1.0
    assert parse_choice("Image 2 is better than Image 1") == 0.0
    assert parse_choice("Image 1 is blurry.") == 0.5  # naming an image outside an answer is not choosing it
    assert parse_choice("<answer>Image 2</answer>") == 0.0


class _Server:
    """A local OpenAI-compatible /v1/chat/completions endpoint with a scripted behaviour."""

    def __init__(self, behaviour):
        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append(body)
                status, text = behaviour(body, len(calls))
                if status == "sleep":
                    time.sleep(2)
                    status = 200
                payload = {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
                data = json.dumps(payload if status == 200 else {"error": {"message": text}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def _brightness(url: str) -> float:
    data = base64.b64decode(url.split(",", 1)[1])
    return float(np.asarray(Image.open(io.BytesIO(data))).mean())


def prefers_brighter(body, n):
    images = [part["image_url"]["url"] for part in body["messages"][0]["content"] if part["type"] == "image_url"]
    return 200, "Thinking... Final answer: Image 1" if _brightness(images[0]) > _brightness(
        images[1]
    ) else "Final answer: Image 2"


def test_vlm_judge_against_a_local_server():
    server = _Server(prefers_brighter)
    try:
        judge = VLMJudge(server.url, "unified-reward-think", timeout=5, max_retries=0, concurrency=4)
        rates = PrefWinRate(judge)(_images([0.1, 0.9, 0.5]), ["a red star"] * 3, [{}] * 3)
        assert rates.tolist() == [0.0, 1.0, 0.5]
        assert len(server.calls) == 6 and all(c["model"] == "unified-reward-think" for c in server.calls)
        assert "a red star" in server.calls[0]["messages"][0]["content"][0]["text"]
    finally:
        server.close()


def test_vlm_judge_position_bias_is_cancelled_and_failures_are_named():
    server = _Server(lambda body, n: (200, "Final answer: Image 1"))
    try:
        rates = PrefWinRate(VLMJudge(server.url, "m", max_retries=0))(_images([0.1, 0.9]), ["p", "p"], [{}, {}])
        assert rates.tolist() == [0.5, 0.5]
    finally:
        server.close()
    flaky = _Server(lambda body, n: (500, "overloaded") if n == 1 else (200, "Final answer: Image 2"))
    try:
        assert VLMJudge(flaky.url, "m", max_retries=2)(_images([0.1]), _images([0.9]), ["p"], [{}]).tolist() == [0.0]
        assert len(flaky.calls) == 2  # one retry
    finally:
        flaky.close()
    slow = _Server(lambda body, n: ("sleep", "Final answer: Image 1"))
    try:
        with pytest.raises(RuntimeError, match=r"request to http://127.0.0.1:\d+/v1 for prompt 'a cat' failed"):
            VLMJudge(slow.url, "m", timeout=0.3, max_retries=0)(_images([0.1]), _images([0.9]), ["a cat"], [{}])
    finally:
        slow.close()
