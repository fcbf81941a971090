"""A reward over HTTP: serve any reward from its own process (or GPU, or environment), and call it as ``remote``.

Heavy reward models (a GenEval detector, a VLM, a video reward) can live away from the trainer, as flow_grpo's
GenEval server does. The server (:func:`serve`, :class:`RewardServer`, ``flowrl serve-reward NAME``) wraps a
reward callable; the client (:class:`RemoteReward`, registered as ``remote``) is an ordinary reward that the
trainer, ``flowrl eval`` and ``flowrl score`` use like any other.

Protocol (version 1), JSON over HTTP, no pickle anywhere:

- ``GET /health`` -> ``{"status": "ok", "reward": NAME, "protocol": 1, "encodings": [...]}``.
- ``POST /score`` with ``{"images": IMAGES, "prompts": [B strings], "metadata": [B objects]}`` ->
  ``{"scores": [B numbers], "reward": NAME, "seconds": float}``; an error is ``{"error": "one line"}`` with
  status 400 (malformed request), 413 (request too large) or 500 (the reward raised).
- ``IMAGES`` is ``{"encoding": "float32" | "uint8", "shape": [B, 3, H, W], "data": base64}`` (the raw
  little-endian array, C order; ``float32`` is lossless, so remote scores equal local ones bit for bit;
  ``uint8`` is ``round(x * 255)``, 4 times smaller) or ``{"encoding": "png", "shape": [B, 3, H, W], "data":
  [B base64 PNG files]}`` (8-bit, lossless for uint8 images, smallest over a network). Videos for a reward that
  accepts them (``accepts_video``) have the shape ``[B, F, 3, H, W]`` (and ``B * F`` PNG frames, video-major).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch

from .base import accepts_video, build_reward, check_inputs, check_scores, is_integer, register_reward, reward_name

__all__ = ["ENCODINGS", "RemoteReward", "RewardServer", "decode_images", "encode_images", "remote", "serve"]

PROTOCOL = 1
ENCODINGS = ("float32", "uint8", "png")
"""Image encodings of the protocol: raw float32 (lossless), raw uint8 (``round(x * 255)``) and PNG (8-bit)."""

_RETRY_STATUS = (502, 503, 504)


def encode_images(images: torch.Tensor, encoding: str = "float32") -> dict:
    """Images as the protocol's JSON-safe ``IMAGES`` object (see the module docstring).

    Args:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, or `(B, F, 3, H, W)` videos, floating point in `[0, 1]`,
            any device).
        encoding (`str`): one of :data:`ENCODINGS`.

    Returns:
        `dict` with ``encoding``, ``shape`` and ``data`` (a base64 string, or a list of them for ``png``).

    Raises:
        ValueError: an unknown `encoding`.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"image encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    x = images.detach().to("cpu", torch.float32).contiguous()  # (B, 3, H, W)
    shape = list(x.shape)
    if encoding == "float32":
        data = base64.b64encode(x.numpy().astype("<f4", copy=False).tobytes()).decode()
    else:
        pixels = (x.clamp(0, 1) * 255).round().to(torch.uint8)  # (B, 3, H, W)
        if encoding == "uint8":
            data = base64.b64encode(pixels.numpy().tobytes()).decode()
        else:
            from PIL import Image

            data = []
            for array in pixels.reshape(-1, *shape[-3:]).permute(0, 2, 3, 1).numpy():  # (H, W, 3) each frame
                buffer = io.BytesIO()
                Image.fromarray(array).save(buffer, format="PNG")
                data.append(base64.b64encode(buffer.getvalue()).decode())
    return {"encoding": encoding, "shape": shape, "data": data}


def decode_images(payload: Any) -> torch.Tensor:
    """The inverse of :func:`encode_images`: a float32 `(B, 3, H, W)` (or `(B, F, 3, H, W)`) tensor in `[0, 1]`
    on CPU.

    Raises:
        ValueError: naming what is wrong: not an object, an unknown encoding, a shape that is not four (or five)
            non-negative integers with 3 channels, data of the wrong length, or a PNG that does not decode to
            an RGB image of the given size.
    """
    if not isinstance(payload, Mapping):
        raise ValueError(f"'images' must be an object with encoding, shape and data, got {type(payload).__name__}")
    encoding, shape, data = payload.get("encoding"), payload.get("shape"), payload.get("data")
    if encoding not in ENCODINGS:
        raise ValueError(f"'images.encoding' must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    if (
        not isinstance(shape, list)
        or len(shape) not in (4, 5)
        or not all(is_integer(s) and s >= 0 for s in shape)
        or shape[-3] != 3
    ):
        raise ValueError(
            f"'images.shape' must be [B, 3, H, W] or [B, F, 3, H, W] (non-negative integers), got {shape!r}"
        )
    count = math.prod(shape)
    if encoding == "png":
        frames = math.prod(shape[:-3])
        if not isinstance(data, list) or len(data) != frames or not all(isinstance(d, str) for d in data):
            raise ValueError(f"'images.data' must be a list of {frames} base64 PNG strings for encoding png")
        from PIL import Image

        arrays = []
        for i, item in enumerate(data):
            try:
                image = Image.open(io.BytesIO(base64.b64decode(item, validate=True)))
                image.load()
            except Exception as e:
                raise ValueError(f"'images.data[{i}]' is not a base64 PNG: {type(e).__name__}: {e}") from None
            array = np.asarray(image.convert("RGB"))  # (H, W, 3) uint8
            if array.shape != (shape[-2], shape[-1], 3):
                raise ValueError(
                    f"'images.data[{i}]' is {array.shape[1]}x{array.shape[0]} px; 'images.shape' says "
                    f"{shape[-1]}x{shape[-2]}"
                )
            arrays.append(array)
        stacked = np.stack(arrays) if arrays else np.zeros((0, shape[-2], shape[-1], 3), np.uint8)
        return (torch.from_numpy(stacked).permute(0, 3, 1, 2).float() / 255).reshape(shape)  # (B, [F,] 3, H, W)
    if not isinstance(data, str):
        raise ValueError(f"'images.data' must be one base64 string for encoding {encoding}")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:
        raise ValueError(f"'images.data' is not valid base64: {e}") from None
    itemsize = 4 if encoding == "float32" else 1
    if len(raw) != count * itemsize:
        raise ValueError(f"'images.data' holds {len(raw)} bytes; shape {shape} in {encoding} needs {count * itemsize}")
    array = np.frombuffer(raw, dtype="<f4" if encoding == "float32" else np.uint8).reshape(shape)
    tensor = torch.from_numpy(array.astype(np.float32))  # (B, 3, H, W), a writable copy
    return tensor if encoding == "float32" else tensor / 255


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class RewardServer:
    """An HTTP server scoring images with one reward (the protocol of this module's docstring).

    Requests are served on threads (``/health`` answers while a batch is scored); the reward is called by at most
    ``workers`` threads at once (1 by default: a model on a GPU need not be thread-safe), at most ``max_queue`` more
    requests wait, and one beyond that gets 503 with ``Retry-After: 1`` (the ``remote`` client retries 503). There is no authentication: keep the default
    loopback host, or bind another address only on a trusted network.

    Args:
        reward: any reward callable ``(images, prompts, metadata) -> (B,)``.
        host (`str`): the address to bind (default ``127.0.0.1``, this machine only).
        port (`int`, 0 to 65535): 0 picks a free port (read it from :attr:`url`).
        batch_size (`int` or `None`): score a request in chunks of this many images (bounds the memory of the
            reward); `None` scores each request in one call. A group-wise reward (``pref_winrate``) needs whole
            groups in one call: leave it `None` there.
        max_request_mb (`float`): refuse larger requests (status 413).
        name (`str` or `None`): the name ``/health`` reports (default: the reward's).
        workers (`int`, `>= 1`): reward calls at once (more than 1 only for a thread-safe reward).
        max_queue (`int`, `>= 0`): requests that may wait for a worker before the server answers 503.
        read_timeout (`float`, `> 0`): seconds a connection may sit idle mid-request before its thread is freed (a
            client that announces more bytes than it sends); a negative or non-numeric ``Content-Length`` is a 400,
            a missing one a 411, at once.

    Attributes:
        url (`str`): ``http://HOST:PORT``, the value of the ``remote`` reward's ``url`` option.
        requests (`int`): ``/score`` requests answered so far.

    Raises:
        ValueError: a bad `port`, `batch_size` or `read_timeout`, or a port that cannot be bound (in use), named.
    """

    def __init__(
        self,
        reward,
        host: str = "127.0.0.1",
        port: int = 8000,
        batch_size: int | None = None,
        max_request_mb: float = 2048.0,
        name: str | None = None,
        read_timeout: float = 60.0,
        workers: int = 1,
        max_queue: int = 64,
    ):
        if not is_integer(port) or not 0 <= port <= 65535:
            raise ValueError(f"reward server: port must be an integer in [0, 65535], got {port!r}")
        if batch_size is not None and (not is_integer(batch_size) or batch_size < 1):
            raise ValueError(f"reward server: batch_size must be an integer >= 1 or None, got {batch_size!r}")
        self.reward, self.batch_size, self.max_bytes = reward, batch_size, int(max_request_mb * 2**20)
        if not isinstance(read_timeout, (int, float)) or isinstance(read_timeout, bool) or not read_timeout > 0:
            raise ValueError(f"reward server: read_timeout must be seconds > 0, got {read_timeout!r}")
        self.read_timeout = float(read_timeout)
        if not is_integer(workers) or workers < 1:
            raise ValueError(f"reward server: workers must be an integer >= 1, got {workers!r}")
        if not is_integer(max_queue) or max_queue < 0:
            raise ValueError(f"reward server: max_queue must be an integer >= 0, got {max_queue!r}")
        self.workers, self.max_queue = workers, max_queue
        self._scoring = threading.BoundedSemaphore(workers)  # reward calls at once
        self._admitted = threading.BoundedSemaphore(workers + max_queue)  # requests scoring or waiting to
        self.name = name or reward_name(reward)
        self.accepts_video = accepts_video(reward)
        self.requests = 0
        self._count = threading.Lock()
        self._thread: threading.Thread | None = None
        try:
            self.httpd = ThreadingHTTPServer((host, port), self._handler())
        except OSError as e:  # the port is taken, the host is not this machine's, ...
            raise ValueError(
                f"reward server: cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host"
            ) from None
        self.httpd.daemon_threads = True
        bound_host, bound_port = self.httpd.server_address[:2]
        self.url = f"http://{bound_host if ':' not in bound_host else f'[{bound_host}]'}:{bound_port}"

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """The reward's `(B,)` float32 scores, in chunks of :attr:`batch_size`, at most :attr:`workers` calls at once."""
        step = self.batch_size or max(len(prompts), 1)
        parts = []
        with self._scoring:
            for start in range(0, len(prompts), step):
                chunk = slice(start, start + step)
                raw = self.reward(images[chunk], prompts[chunk], metadata[chunk])
                parts.append(check_scores(self.name, raw, len(prompts[chunk])))
        return torch.cat(parts) if parts else torch.zeros(0)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = server.read_timeout  # a client that stops mid-request frees its thread after this many seconds

            def log_message(self, *args):  # quiet: one line per error is printed by _reply
                pass

            def _reply(self, status: int, payload: dict, headers: dict | None = None) -> None:
                body = json.dumps(payload).encode()
                if status >= 400:
                    print(f"reward server {server.name}: {status} {payload.get('error')}", file=sys.stderr)
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.rstrip("/") != "/health":
                    return self._reply(404, {"error": f"no such endpoint {self.path!r}; use GET /health, POST /score"})
                self._reply(
                    200,
                    {
                        "status": "ok",
                        "reward": server.name,
                        "protocol": PROTOCOL,
                        "encodings": list(ENCODINGS),
                        "accepts_video": server.accepts_video,
                        "requests": server.requests,
                    },
                )

            def do_POST(self):
                if self.path.rstrip("/") != "/score":
                    return self._reply(404, {"error": f"no such endpoint {self.path!r}; use POST /score"})
                raw_length = self.headers.get("Content-Length")
                try:
                    length = int(raw_length)
                except (TypeError, ValueError):
                    length = -1
                if length < 0:
                    return self._reply(
                        411 if raw_length is None else 400,
                        {"error": f"bad request: Content-Length must be a byte count >= 0, got {raw_length!r}"},
                    )
                if length > server.max_bytes:
                    return self._reply(
                        413,
                        {
                            "error": f"request of {length / 2**20:.0f} MB is over the server's "
                            f"max_request_mb={server.max_bytes / 2**20:g}"
                        },
                    )
                try:
                    body = self.rfile.read(length)
                except (TimeoutError, OSError):  # the client sent less than it announced, then stopped
                    self.close_connection = True
                    return None
                if len(body) < length:
                    return self._reply(400, {"error": f"bad request: {len(body)} of {length} announced bytes arrived"})
                try:
                    images, prompts, metadata = _read_request(body)
                    if images.ndim == 5 and not server.accepts_video:
                        raise ValueError(f"reward {server.name} scores (B, 3, H, W) images, not videos")
                    check_inputs(images, prompts, metadata, video=images.ndim == 5)
                except (ValueError, TypeError) as e:
                    return self._reply(400, {"error": f"bad request: {_one_line(e)}"})
                if not server._admitted.acquire(blocking=False):  # the queue is full: come back later
                    return self._reply(
                        503,
                        {"error": f"busy: {server.workers + server.max_queue} requests scoring or queued"},
                        {"Retry-After": "1"},
                    )
                start = time.perf_counter()
                try:
                    scores = server.score(images, prompts, metadata)
                except Exception as e:  # the reward's failure: reported to the client, the server stays up
                    return self._reply(
                        500, {"error": f"reward {server.name} raised {type(e).__name__}: {_one_line(e)}"}
                    )
                finally:
                    server._admitted.release()
                with server._count:
                    server.requests += 1
                self._reply(
                    200, {"scores": scores.tolist(), "reward": server.name, "seconds": time.perf_counter() - start}
                )

        return Handler

    def start(self) -> RewardServer:
        """Serve on a background (daemon) thread; returns `self` (for ``server = RewardServer(...).start()``)."""
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, daemon=True, name=f"reward-server-{self.name}"
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until interrupted (Ctrl-C), then close the socket."""
        try:
            self.httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.httpd.server_close()

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _read_request(body: bytes) -> tuple[torch.Tensor, list[str], list[dict]]:
    """``(images, prompts, metadata)`` of a ``/score`` body; ValueError naming the malformed field."""
    try:
        request = json.loads(body)
    except ValueError as e:
        raise ValueError(f"body is not JSON ({e})") from None
    if not isinstance(request, dict):
        raise ValueError("body must be a JSON object with images, prompts and metadata")
    prompts, metadata = request.get("prompts"), request.get("metadata")
    if not isinstance(prompts, list):
        raise ValueError("'prompts' must be a list of strings")
    if metadata is None:
        metadata = [{} for _ in prompts]
    if not isinstance(metadata, list):
        raise ValueError("'metadata' must be a list of objects")
    return decode_images(request.get("images")), prompts, metadata


def serve(
    reward,
    host: str = "127.0.0.1",
    port: int = 8000,
    batch_size: int | None = None,
    max_request_mb: float = 2048.0,
    workers: int = 1,
    max_queue: int = 64,
    **options,
) -> None:
    """Serve a reward over HTTP until interrupted: the Python side of ``flowrl serve-reward``.

    Example::

        import rewards
        rewards.serve("clipscore", port=8001, model_path="/ckpt/PickScore_v1")   # in the reward's process
        # in the trainer's config: rewards: {remote: {options: {url: http://127.0.0.1:8001}}}

    Args:
        reward: a reward callable, or a spec for :func:`rewards.build_reward` (a registered name or
            ``'package.module:function'``) built with `options`.
        host, port, batch_size, max_request_mb, workers, max_queue: see :class:`RewardServer`.
        **options: the reward's options, when `reward` is a spec.

    Raises:
        ValueError, TypeError: a bad spec or option (from :func:`rewards.build_reward`), or options given with
            a callable; OSError: the port cannot be bound.
    """
    if isinstance(reward, str):
        name, reward = reward, build_reward(reward, **options)
    elif options:
        raise TypeError(f"serve: options {sorted(options)} are only for a reward given by name")
    else:
        name = reward_name(reward)
    server = RewardServer(
        reward, host, port, batch_size, max_request_mb, name=name, workers=workers, max_queue=max_queue
    )
    print(f"serving reward {name} on {server.url} (POST /score, GET /health); Ctrl-C stops", flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: {host} is not a loopback address and the server has no authentication", file=sys.stderr)
    server.serve_forever()


class RemoteReward:
    """A reward scored by a :class:`RewardServer` (``flowrl serve-reward``), used like any local reward.

    Each call sends the batch (in requests of ``batch_size`` images, if set) to ``URL/score``. A request that
    cannot connect, times out, or gets status 502/503/504 is retried ``retries`` times with backoff (0.5 s,
    1 s, 2 s, ...). Nothing is sent when the reward is built: the trainer's smoke call of its rewards is the
    first request, so a server that is down stops training before any sampling.

    Args:
        url (`str`): the server, ``http://HOST:PORT`` (as printed by ``flowrl serve-reward``).
        timeout (`float`, `> 0`): seconds per request once connected (scoring included): a server that accepts but
            does not answer fails after ``(retries + 1) * timeout`` seconds and the backoff (about 92 s with the
            defaults, 30 s and 2 retries, for a reward that answers a batch in seconds; raise it for a slower one).
        connect_timeout (`float`, `> 0`): seconds to open the connection: an unreachable server fails within
            ``(retries + 1) * connect_timeout`` seconds and the backoff (about 10 s with the defaults).
        retries (`int`, `>= 0`): retries per request after the first attempt.
        encoding (`str`): how images travel, one of :data:`ENCODINGS`: ``float32`` (default; lossless, remote
            scores equal local ones exactly), ``uint8`` or ``png`` (8-bit, for slow links).
        batch_size (`int` or `None`): images per request; `None` sends each call as one request.
        video (`bool`): the served reward scores `(B, F, 3, H, W)` videos (sets :attr:`accepts_video`).
        notice_after (`float`, `> 0`): a request still unanswered after this many seconds prints one line on stderr
            naming the server, the batch and the attempt (once per reward for first attempts, on every retry).

    Raises:
        ValueError: a `url` that is not ``http(s)://HOST[:PORT]``, or an option out of range (named).
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        retries: int = 2,
        encoding: str = "float32",
        batch_size: int | None = None,
        video: bool = False,
        connect_timeout: float = 2.0,
        notice_after: float = 5.0,
    ):
        parsed = urllib.parse.urlparse(url if isinstance(url, str) else "")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"remote reward: url must look like http://HOST:PORT (the address flowrl serve-reward "
                f"prints), got {url!r}"
            )
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"remote reward: timeout must be a number of seconds > 0, got {timeout!r}")
        if not is_integer(retries) or retries < 0:
            raise ValueError(f"remote reward: retries must be an integer >= 0, got {retries!r}")
        if (
            not isinstance(connect_timeout, (int, float))
            or isinstance(connect_timeout, bool)
            or not connect_timeout > 0
        ):
            raise ValueError(f"remote reward: connect_timeout must be seconds > 0, got {connect_timeout!r}")
        if not isinstance(notice_after, (int, float)) or isinstance(notice_after, bool) or not notice_after > 0:
            raise ValueError(f"remote reward: notice_after must be seconds > 0, got {notice_after!r}")
        if encoding not in ENCODINGS:
            raise ValueError(f"remote reward: encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        if batch_size is not None and (not is_integer(batch_size) or batch_size < 1):
            raise ValueError(f"remote reward: batch_size must be an integer >= 1 or None, got {batch_size!r}")
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.encoding, self.batch_size = float(timeout), retries, encoding, batch_size
        self.accepts_video = bool(video)
        self.connect_timeout, self.notice_after, self._noticed = float(connect_timeout), float(notice_after), False
        self.address = (parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80))

    def _notice(self, target: str, what: str, attempt: int) -> threading.Timer | None:
        """A started timer that prints, after ``notice_after`` seconds without an answer, what the request waits for
        (None where it would not print: a first attempt once one has printed)."""
        if attempt == 0 and self._noticed:
            return None
        line = (
            f"remote reward: waiting for {target} ({what}attempt {attempt + 1} of {self.retries + 1}): no answer "
            f"after {self.notice_after:g} s; the attempt gives up after {self.timeout:g} s (option timeout)"
        )

        def say() -> None:
            self._noticed = True
            print(line, file=sys.stderr, flush=True)

        timer = threading.Timer(self.notice_after, say)
        timer.daemon = True
        timer.start()
        return timer

    def _request(self, path: str, body: bytes | None = None, what: str = "") -> dict:
        """The JSON reply of ``GET`` (no body) or ``POST`` ``path``, retried as the class says; `what` (``"batch 2
        of 3, 8 images; "``) is named in the line printed while an answer is late.

        Raises:
            ConnectionError: the server cannot be reached (or times out) after the retries; the message names
                the URL. RuntimeError: an error status (the server's message quoted) or a malformed reply.
        """
        target = self.url + path
        headers = {"Content-Type": "application/json"} if body is not None else {}
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            request = urllib.request.Request(target, data=body, headers=headers, method="POST" if body else "GET")
            timer = None
            try:
                socket.create_connection(self.address, timeout=self.connect_timeout).close()  # unreachable: fast
                timer = self._notice(target, what, attempt)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
                break
            except urllib.error.HTTPError as e:
                detail = _error_message(e)
                if e.code in _RETRY_STATUS:
                    reason = f"status {e.code}: {detail}"
                    continue
                raise RuntimeError(f"remote reward: {target} answered status {e.code}: {detail}") from None
            except (
                urllib.error.URLError,
                TimeoutError,
                socket.timeout,
                ConnectionError,
                http.client.HTTPException,
            ) as e:
                cause = getattr(e, "reason", e)
                reason = f"{type(cause).__name__}: {_one_line(cause)}" if str(cause) else type(cause).__name__
            finally:
                if timer is not None:
                    timer.cancel()
        else:
            raise ConnectionError(
                f"remote reward: reward server {self.url} is unreachable after "
                f"{self.retries + 1} attempt(s) ({reason}); start it with "
                "`flowrl serve-reward NAME --port PORT` or fix the url option"
            )
        try:
            reply = json.loads(raw)
        except ValueError:
            raise RuntimeError(f"remote reward: malformed reply from {target}: not JSON ({raw[:80]!r})") from None
        if not isinstance(reply, dict):
            raise RuntimeError(
                f"remote reward: malformed reply from {target}: expected a JSON object, got {type(reply).__name__}"
            )
        return reply

    def health(self) -> dict:
        """The server's ``/health`` reply (``status``, ``reward``, ``protocol``, ``encodings``, ``accepts_video``,
        ``requests``).

        Raises:
            ConnectionError, RuntimeError: as :meth:`__call__`.
        """
        return self._request("/health")

    def _score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], what: str = "") -> torch.Tensor:
        body = json.dumps(
            {"images": encode_images(images, self.encoding), "prompts": prompts, "metadata": metadata}
        ).encode()
        reply = self._request("/score", body, what)
        scores = reply.get("scores")
        if (
            not isinstance(scores, list)
            or len(scores) != len(prompts)
            or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)
        ):
            shown = json.dumps(reply)[:120]
            raise RuntimeError(
                f"remote reward: malformed reply from {self.url}/score: expected 'scores', a list of "
                f"{len(prompts)} numbers; got {shown}"
            )
        return torch.tensor(scores, dtype=torch.float32)

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        """Scores `(B,)` float32 on CPU, in the served reward's units.

        Args:
            images (`(B, 3, H, W)` float in [0, 1], or `(B, F, 3, H, W)` videos with ``video=True``), prompts (`B` strings), metadata (`B` JSON-serialisable dicts).

        Raises:
            ConnectionError: the server is unreachable after the retries (one line naming the URL).
            RuntimeError: the server answered an error (its message quoted), or a malformed reply.
            TypeError: metadata that is not JSON-serialisable; ValueError: malformed inputs.
        """
        check_inputs(images, prompts, metadata, video=self.accepts_video)
        prompts, metadata = list(prompts), [dict(m) for m in metadata]
        step = self.batch_size or max(len(prompts), 1)
        starts = range(0, len(prompts), step)
        parts = [
            self._score(
                images[i : i + step],
                prompts[i : i + step],
                metadata[i : i + step],
                f"batch {n} of {len(starts)}, {len(prompts[i : i + step])} images; ",
            )
            for n, i in enumerate(starts, 1)
        ]
        return torch.cat(parts) if parts else torch.zeros(0)

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, encoding={self.encoding!r})"


def _error_message(error: urllib.error.HTTPError) -> str:
    """The ``error`` field of an error reply, else its first bytes."""
    try:
        raw = error.read()
    except Exception:
        raw = b""
    try:
        return _one_line(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return _one_line(raw[:200].decode(errors="replace")) or error.reason


remote = register_reward(
    "remote", modality="image, video", weights="none here: the served reward's, in the server's process"
)(RemoteReward)
"""The ``remote`` reward: :class:`RemoteReward` itself, registered (``flowrl serve-reward NAME --port PORT`` there, its
``url`` here); its scores are the served reward's, `(B,)` float32 on CPU."""
