"""The reward server and the ``remote`` reward on 127.0.0.1, UnifiedReward's pointwise VLM score against a local
fake OpenAI-compatible server, and rewards installed as ``flowrl.rewards`` entry points."""

import base64
import io
import json
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl import rewards
from flowrl.rewards import RemoteReward, RewardServer, WeightedSum, build_reward
from flowrl.rewards.server import decode_images, encode_images
from flowrl.rewards.vlm import UNIFIEDREWARD_QUESTION, parse_score


def _images(n=4, side=16, seed=0):
    """Half flat, half noisy images (very different JPEG sizes), float32 in [0, 1] off the uint8 grid."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(n, 3, side, side, generator=g)
    flat = torch.full((n, 3, side, side), 0.5) + 0.01 * noise
    return torch.where(torch.arange(n).view(n, 1, 1, 1) % 2 == 0, flat, noise)


def _closed_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the image encodings -------------------------------------------------------------------------------------------


def test_encodings_round_trip():
    images = _images(3, 8)
    assert torch.equal(decode_images(json.loads(json.dumps(encode_images(images, "float32")))), images)
    quantised = (images * 255).round() / 255
    for encoding in ("uint8", "png"):
        torch.testing.assert_close(decode_images(encode_images(images, encoding)), quantised, rtol=0, atol=1e-7)
    assert decode_images(encode_images(torch.zeros(0, 3, 8, 8), "png")).shape == (0, 3, 8, 8)
    with pytest.raises(ValueError, match=r"'images.data' holds 12 bytes; shape \[1, 3, 2, 2\] in float32 needs 48"):
        decode_images({"encoding": "float32", "shape": [1, 3, 2, 2], "data": base64.b64encode(bytes(12)).decode()})
    with pytest.raises(ValueError, match=r"'images.shape' must be \[B, 3, H, W\] or \[B, F, 3, H, W\]"):
        decode_images({"encoding": "uint8", "shape": [1, 4, 2, 2], "data": ""})
    with pytest.raises(ValueError, match="'images.encoding' must be one of float32, uint8, png, got 'pickle'"):
        decode_images({"encoding": "pickle", "shape": [1, 3, 2, 2], "data": ""})


# --- server and remote client --------------------------------------------------------------------------------------


@pytest.fixture
def jpeg_server():
    with RewardServer(build_reward("jpeg_compressibility"), port=0, name="jpeg_compressibility") as server:
        yield server


def test_remote_scores_equal_local_scores_exactly(jpeg_server):
    local = build_reward("jpeg_compressibility")
    images, prompts, metas = _images(6), [f"p{i}" for i in range(6)], [{"tag": "t", "i": i} for i in range(6)]
    expected = local(images, prompts, metas)
    assert expected[1] < expected[0] - 0.2  # noise compresses worse than a flat image: the scores differ
    for encoding in ("float32", "uint8", "png"):  # the JPEG reward quantises to uint8 itself: all three are exact
        remote = build_reward("remote", url=jpeg_server.url, timeout=10, retries=0, encoding=encoding)
        assert torch.equal(remote(images, prompts, metas), expected), encoding
    batched = build_reward("remote", url=jpeg_server.url + "/", batch_size=4)
    assert torch.equal(batched(images, prompts, metas), expected)  # two requests, 4 + 2 images
    assert jpeg_server.requests == 5
    health = batched.health()
    assert health["status"] == "ok" and health["reward"] == "jpeg_compressibility" and health["protocol"] == 1
    assert batched(torch.zeros(0, 3, 8, 8), [], []).shape == (0,)
    # the trainer's path: a WeightedSum holding the remote reward
    combined = WeightedSum({"remote": (batched, 2.0)})(images, prompts, metas)
    assert torch.equal(combined.total, 2 * expected)


def test_float_inputs_travel_losslessly_to_the_served_reward():
    seen = []

    def exact_mean(images, prompts, metadata):  # a reward that uses every bit of its float input
        seen.append((images.clone(), list(prompts), list(metadata)))
        return images.double().mean(dim=(1, 2, 3)).float()

    images = _images(3)
    with RewardServer(exact_mean, port=0) as server:
        scores = RemoteReward(server.url)(
            images, ["a", "b", "c"], [{"tag": "x", "include": [{"class": "cat"}]}, {}, {}]
        )
    assert torch.equal(seen[0][0], images) and seen[0][1] == ["a", "b", "c"]
    assert seen[0][2][0] == {"tag": "x", "include": [{"class": "cat"}]}
    assert torch.equal(scores, images.double().mean(dim=(1, 2, 3)).float())


class _FrameSpread:
    """A video reward: the mean absolute change between consecutive frames."""

    name, accepts_video = "frame_spread", True

    def __call__(self, videos, prompts, metadata):
        rewards.check_inputs(videos, prompts, metadata, video=True)
        return (videos[:, 1:] - videos[:, :-1]).abs().mean(dim=(1, 2, 3, 4))


def test_videos_travel_to_a_video_reward(jpeg_server):
    videos = torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(0))  # (B, F, 3, H, W)
    for encoding in ("float32", "png"):
        payload = encode_images(videos, encoding)
        assert payload["shape"] == [2, 3, 3, 8, 8]
        decoded = decode_images(payload)
        assert decoded.shape == videos.shape
        if encoding == "float32":
            assert torch.equal(decoded, videos)
    with RewardServer(_FrameSpread(), port=0) as server:
        remote = build_reward("remote", url=server.url, video=True)
        assert rewards.accepts_video(remote) and remote.health()["accepts_video"] is True
        assert torch.equal(remote(videos, ["a", "b"], [{}, {}]), _FrameSpread()(videos, ["a", "b"], [{}, {}]))
        combined = WeightedSum({"remote": (remote, 1.0)})(videos, ["a", "b"], [{}, {}])  # the trainer's path
        assert combined.total.shape == (2,)
    with pytest.raises(
        RuntimeError,
        match=r"answered status 400: bad request: reward jpeg_compressibility scores "
        r"\(B, 3, H, W\) images, not videos",
    ):
        build_reward("remote", url=jpeg_server.url, video=True)(videos, ["a", "b"], [{}, {}])


def test_server_batch_size_chunks_the_reward_calls():
    sizes = []

    def counting(images, prompts, metadata):
        sizes.append(len(prompts))
        return torch.zeros(len(prompts))

    with RewardServer(counting, port=0, batch_size=2) as server:
        RemoteReward(server.url)(_images(5), ["p"] * 5, [{}] * 5)
    assert sizes == [2, 2, 1]


def test_an_unreachable_server_is_one_line_naming_the_url():
    url = f"http://127.0.0.1:{_closed_port()}"
    reward = build_reward("remote", url=url, retries=1, timeout=2)
    start = time.perf_counter()
    with pytest.raises(ConnectionError) as info:
        reward(_images(2), ["p", "p"], [{}, {}])
    message = str(info.value)
    assert message.startswith(f"remote reward: reward server {url} is unreachable after 2 attempt(s) (")
    assert "flowrl serve-reward" in message and "\n" not in message
    assert time.perf_counter() - start < 5  # one 0.5 s backoff, not a hang
    with pytest.raises(
        rewards.RewardError, match=rf"reward remote raised ConnectionError: remote reward: reward server {url}"
    ):
        WeightedSum({"remote": (reward, 1.0)})(_images(2), ["p", "p"], [{}, {}])
    with pytest.raises(ValueError, match=r"remote reward: url must look like http://HOST:PORT .*got '127.0.0.1:8000'"):
        build_reward("remote", url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="remote reward: encoding must be one of float32, uint8, png, got 'jpeg'"):
        build_reward("remote", url=url, encoding="jpeg")


def test_a_server_that_dies_mid_run_and_a_reward_that_raises_are_named():
    calls = []

    def fragile(images, prompts, metadata):
        calls.append(1)
        if any(p == "boom" for p in prompts):
            raise ValueError("the detector ran out of memory")
        return torch.ones(len(prompts))

    server = RewardServer(fragile, port=0, name="fragile").start()
    reward = RemoteReward(server.url, retries=0, timeout=5)
    assert reward(_images(2), ["a", "b"], [{}, {}]).tolist() == [1.0, 1.0]
    with pytest.raises(
        RuntimeError,
        match=rf"remote reward: {server.url}/score answered status 500: reward fragile "
        "raised ValueError: the detector ran out of memory",
    ):
        reward(_images(1), ["boom"], [{}])
    assert reward(_images(1), ["again"], [{}]).tolist() == [1.0]  # the server survived its reward's error
    server.close()
    with pytest.raises(ConnectionError, match=rf"reward server {server.url} is unreachable after 1 attempt"):
        reward(_images(1), ["after"], [{}])


class _Scripted:
    """A loopback HTTP server answering every request with a fixed (status, body)."""

    def __init__(self, status, body: bytes, delay: float = 0.0):
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                outer.hits += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(delay)
                answer = status(outer.hits) if callable(status) else (status, body)
                self.send_response(answer[0])
                self.send_header("Content-Length", str(len(answer[1])))
                self.end_headers()
                self.wfile.write(answer[1])

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize(
    "body, message",
    [
        (b"<html>hello</html>", "not JSON"),
        (b'{"scores": [1.0]}', "expected 'scores', a list of 2 numbers"),
        (b'{"scores": ["a", "b"]}', "expected 'scores', a list of 2 numbers"),
        (b"[1, 2]", "expected a JSON object, got list"),
    ],
)
def test_a_malformed_reply_is_named(body, message):
    fake = _Scripted(200, body)
    try:
        with pytest.raises(RuntimeError, match=rf"remote reward: malformed reply from {fake.url}.*{message}"):
            RemoteReward(fake.url, retries=0)(_images(2), ["a", "b"], [{}, {}])
    finally:
        fake.close()


def test_busy_status_is_retried_and_a_timeout_names_the_url():
    flaky = _Scripted(lambda n: (503, b'{"error": "busy"}') if n == 1 else (200, b'{"scores": [3.5]}'), b"")
    try:
        assert RemoteReward(flaky.url, retries=1)(_images(1), ["a"], [{}]).tolist() == [3.5]
        assert flaky.hits == 2
    finally:
        flaky.close()
    slow = _Scripted(200, b'{"scores": [1.0]}', delay=1.0)
    try:
        with pytest.raises(
            ConnectionError, match=rf"reward server {slow.url} is unreachable after 1 attempt\(s\) \(.*timed out"
        ):
            RemoteReward(slow.url, retries=0, timeout=0.2)(_images(1), ["a"], [{}])
    finally:
        slow.close()


def test_bad_requests_get_status_400_and_the_server_stays_up(jpeg_server):
    def post(payload) -> tuple[int, dict]:
        request = urllib.request.Request(jpeg_server.url + "/score", data=payload, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, reply = post(b"not json")
    assert status == 400 and reply["error"].startswith("bad request: body is not JSON")
    images = encode_images(_images(2), "uint8")
    status, reply = post(json.dumps({"images": images, "prompts": ["a"], "metadata": [{}, {}]}).encode())
    assert status == 400 and "need one prompt and one metadata dict per image: 2 images, 1 prompts" in reply["error"]
    status, reply = post(json.dumps({"images": images, "prompts": ["a", "b"]}).encode())  # metadata may be left out
    assert status == 200 and len(reply["scores"]) == 2


def test_rewards_serve_builds_a_named_reward_and_serves_it(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(RewardServer, "serve_forever", lambda self: started.append(self))
    rewards.serve("jpeg_compressibility", port=0, quality=80)
    server = started[0]
    try:
        assert server.name == "jpeg_compressibility" and server.reward.quality == 80
        assert f"serving reward jpeg_compressibility on {server.url}" in capsys.readouterr().out
    finally:
        server.close()
    with pytest.raises(TypeError, match=r"serve: options \['quality'\] are only for a reward given by name"):
        rewards.serve(lambda i, p, m: i.mean((1, 2, 3)), port=0, quality=80)


# --- UnifiedReward pointwise score ---------------------------------------------------------------------------------


class _FakeVLM:
    """A local OpenAI-compatible /v1/chat/completions endpoint replying ``reply(body, n)``."""

    def __init__(self, reply):
        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append(body)
                status, text = reply(body, len(calls))
                top = None
                if isinstance(text, list):  # [(token, logprob), ...]: a one-token answer with its top logprobs
                    top = [{"token": t, "logprob": lp, "bytes": None} for t, lp in text]
                    text = text[0][0] if text else ""
                choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
                if top is not None:
                    first = {"token": text, "logprob": top[0]["logprob"] if top else 0.0, "bytes": None}
                    choice["logprobs"] = {"content": [{**first, "top_logprobs": top}]}
                payload = {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
                data = json.dumps(payload if status == 200 else {"error": {"message": text}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _brightness_score(body, n):
    """Scores 1 + 4 * brightness of the image, with some reasoning before the final score."""
    content = body["messages"][0]["content"]
    data = base64.b64decode(content[0]["image_url"]["url"].split(",", 1)[1])
    level = np.asarray(Image.open(io.BytesIO(data))).mean() / 255
    return 200, f"The image is fairly clear; score 3 for detail.\nFinal Score: {1 + 4 * level:.1f}"


def test_parse_score():
    assert parse_score("Looks good.\nFinal Score: 4") == 4.0
    assert parse_score("final score: **3.5**/5") == 3.5
    assert parse_score("Alignment 5, quality 2. Final Score: 2 out of 5") == 2.0
    assert parse_score("<think>score 5?</think><answer>4</answer>") == 4.0
    assert parse_score("Score: 4.5") == 4.5
    assert parse_score(" 3 ") == 3.0
    assert parse_score("Final Score: 7") is None  # outside [1, 5]
    assert parse_score("I cannot rate this image.") is None
    assert parse_score("Final Score: 7", low=0, high=10) == 7.0


def test_unifiedreward_against_a_local_server():
    server = _FakeVLM(_brightness_score)
    try:
        levels = [0.0, 0.5, 1.0, 0.25]
        images = torch.stack([torch.full((3, 8, 8), v) for v in levels])
        prompts = [f"a photo of {i} cats" for i in range(4)]
        reward = build_reward(
            "unifiedreward",
            base_url=server.url,
            model="UnifiedReward-7b-v1.5",
            max_retries=0,
            timeout=5,
            concurrency=2,
        )
        expected = torch.tensor([round(1 + 4 * v, 1) for v in levels]) / 5  # flow_grpo's score / 5
        torch.testing.assert_close(reward(images, prompts, [{}] * 4), expected)
        assert len(server.calls) == 4 and all(c["model"] == "UnifiedReward-7b-v1.5" for c in server.calls)
        assert all(c["temperature"] == 0.0 for c in server.calls)
        texts = sorted(c["messages"][0]["content"][1]["text"] for c in server.calls)
        assert texts == sorted(UNIFIEDREWARD_QUESTION.format(prompt=p) for p in prompts)
        assert server.calls[0]["messages"][0]["content"][0]["type"] == "image_url"  # the image first, as trained
        minmax = build_reward("unifiedreward", base_url=server.url, max_retries=0, normalize="minmax")
        torch.testing.assert_close(minmax(images, prompts, [{}] * 4), torch.tensor([0.0, 0.5, 1.0, 0.25]))
    finally:
        server.close()


def test_unifiedreward_unparsed_replies_and_a_dead_server_are_named():
    server = _FakeVLM(lambda body, n: (200, "I cannot judge this image."))
    try:
        images = torch.full((1, 3, 8, 8), 0.5)
        with pytest.raises(
            ValueError,
            match=r"unifiedreward: the reply of http://127.0.0.1:\d+/v1 for prompt 'a dog' "
            r"holds no score in \[1, 5\]: 'I cannot judge this image.'",
        ):
            build_reward("unifiedreward", base_url=server.url, max_retries=0)(images, ["a dog"], [{}])
        lowest = build_reward("unifiedreward", base_url=server.url, max_retries=0, unparsed="lowest")
        assert lowest(images, ["a dog"], [{}]).tolist() == [pytest.approx(0.2)] and lowest.unparsed_count == 1
    finally:
        server.close()
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    with pytest.raises(
        RuntimeError, match=rf"unifiedreward: request to {url} for prompt 'a dog' failed: APIConnectionError"
    ):
        build_reward("unifiedreward", base_url=url, max_retries=0, timeout=2)(images, ["a dog"], [{}])
    with pytest.raises(ValueError, match="vlm_score: normalize must be one of max, minmax, none, got 'z'"):
        build_reward("unifiedreward", normalize="z")


# --- entry points --------------------------------------------------------------------------------------------------


def test_rewards_installed_as_entry_points_are_found_by_name(monkeypatch):
    installed = [
        metadata.EntryPoint("sharpness", "flowrl.rewards.jpeg:jpeg_incompressibility", "flowrl.rewards"),
        metadata.EntryPoint("plain_fn", "flowrl.rewards.jpeg:jpeg_size_kb", "flowrl.rewards"),
        metadata.EntryPoint("broken", "no_such_module_xyz:reward", "flowrl.rewards"),
        metadata.EntryPoint("other_group", "flowrl.rewards.jpeg:jpeg_incompressibility", "other.group"),
    ]

    def entry_points(group=None):
        return metadata.EntryPoints(ep for ep in installed if group is None or ep.group == group)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    images = _images(2)
    reward = build_reward("sharpness", quality=90)  # a factory called with its options
    assert torch.equal(reward(images, ["a", "b"], [{}, {}]), rewards.jpeg_size_kb(images, 90))
    assert build_reward("plain_fn") is rewards.jpeg_size_kb  # no options: the callable itself, as a dotted path
    assert build_reward("jpeg_compressibility").name == "jpeg_compressibility"  # registered names come first
    with pytest.raises(
        ValueError,
        match=r"reward 'broken': entry point 'no_such_module_xyz:reward' \(flowrl.rewards\) "
        "does not load: ModuleNotFoundError",
    ):
        build_reward("broken")
    with pytest.raises(
        ValueError,
        match=r"unknown reward 'other_group'; registered rewards: .*; installed "
        r"'flowrl.rewards' entry points: broken, plain_fn, sharpness; or give",
    ):
        build_reward("other_group")
    installed.append(metadata.EntryPoint("sharpness", "other_pkg:sharp", "flowrl.rewards"))
    with pytest.raises(ValueError, match="reward 'sharpness' is declared by several 'flowrl.rewards' entry points"):
        build_reward("sharpness")


def test_vlm_yes_reads_p_yes_from_the_answers_logprobs():
    """P(yes) / (P(yes) + P(no)) of the first answer token, every case and spacing summed (Flow-Factory's
    vllm_evaluate with canonicalize); the stand-in judge says yes with probability = the image's brightness."""
    import math

    from flowrl.rewards.vlm import YES_QUESTION, yes_probability

    def judge(body, n):
        url = body["messages"][0]["content"][0]["image_url"]["url"]
        b = min(max(_png_brightness(url), 1e-3), 1 - 1e-3)
        return 200, [("Yes", math.log(b * 0.7)), (" yes", math.log(b * 0.3)), ("No", math.log(1 - b)), ("A", -9.0)]

    server = _FakeVLM(judge)
    try:
        levels = [0.1, 0.5, 0.9]
        images = torch.stack([torch.full((3, 8, 8), v) for v in levels])
        reward = build_reward("vlm_yes", base_url=server.url, max_retries=0, timeout=5)
        scores = reward(images, ["a", "b", "c"], [{}] * 3)
        torch.testing.assert_close(scores, torch.tensor([round(v * 255) / 255 for v in levels]), atol=1e-6, rtol=0)
        call = server.calls[0]
        assert call["max_tokens"] == 1 and call["logprobs"] is True and call["top_logprobs"] == 20
        assert call["messages"][0]["content"][1]["text"] in [YES_QUESTION.format(prompt=p) for p in "abc"]
    finally:
        server.close()
    assert yes_probability([("maybe", -0.1)]) is None
    silent = _FakeVLM(lambda body, n: (200, [("Maybe", -0.1)]))
    try:
        r = build_reward("vlm_yes", base_url=silent.url, max_retries=0)
        assert r(torch.full((1, 3, 4, 4), 0.5), ["x"], [{}]).tolist() == [0.0] and r.unparsed_count == 1
        with pytest.raises(ValueError, match="has neither yes nor no among its top 20 tokens"):
            build_reward("vlm_yes", base_url=silent.url, max_retries=0, unparsed="raise")(
                torch.full((1, 3, 4, 4), 0.5), ["x"], [{}]
            )
    finally:
        silent.close()
    with pytest.raises(ValueError, match="top_logprobs must be an integer in \\[1, 20\\]"):
        build_reward("vlm_yes", base_url="http://127.0.0.1:9/v1", top_logprobs=50)


def _png_brightness(url: str) -> float:
    import base64
    import io

    import numpy as np
    from PIL import Image

    return float(np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))).mean()) / 255
