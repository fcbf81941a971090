"""Load test of the reward server as several training processes use it: concurrent clients, each reply checked
against its own request, latency percentiles and throughput, one client killed mid-request, the server still healthy.

A :class:`flowrl.rewards.server.RewardServer` on 127.0.0.1 scores with a reward that needs no model (each image's
mean, plus a delay per call standing for a model's forward); ``--clients`` threads each send ``--requests`` requests
of ``--images`` images of ``--side`` px through the ``remote`` reward (:class:`RemoteReward`), every request's images
filled with values unique to the client and request, so that a reply carrying another request's scores is caught.
Halfway, one more client opens a connection, sends half of a request's body and disappears. Bounded in count and
time (each client's requests, ``--timeout-s`` overall); stops by itself.

    python benchmarks/reward_server_load.py --out benchmarks/results/reward_server_load.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> dict:
    """Run the load test (module docstring); returns and writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=50, help="requests per client (default: %(default)s)")
    parser.add_argument("--images", type=int, default=8, help="images per request (default: %(default)s)")
    parser.add_argument("--side", type=int, default=64, help="image side in px (default: %(default)s)")
    parser.add_argument("--delay-s", type=float, default=0.005, help="seconds per reward call (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1, help="the server's reward calls at once")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="stop waiting for clients after this")
    parser.add_argument("--out", default="benchmarks/results/reward_server_load.json", help="JSON out")
    a = parser.parse_args(argv)
    import torch  # after the arguments: --help answers at once

    from flowrl.evaluation import machine
    from flowrl.rewards.server import RemoteReward, RewardServer

    def reward(images, prompts, metadata):
        time.sleep(a.delay_s)
        return images.float().mean(dim=(1, 2, 3))

    server = RewardServer(reward, port=0, workers=a.workers, max_queue=a.clients + 1, read_timeout=5.0).start()
    latencies, mixed, failures = [], [], []
    spacing = 1.0 / (a.clients * a.requests * a.images)  # between the values of any two images
    lock = threading.Lock()

    def client(c: int) -> None:
        remote = RemoteReward(server.url, timeout=60, retries=2)
        for r in range(a.requests):
            # every image of request (c, r) is one value unique to it: the scores must be exactly these values
            values = torch.tensor([(c * a.requests + r) * a.images + i for i in range(a.images)], dtype=torch.float32)
            values = values * spacing
            images = values.view(-1, 1, 1, 1).expand(-1, 3, a.side, a.side).contiguous()
            t0 = time.perf_counter()
            try:
                scores = remote(images, [""] * a.images, [{}] * a.images)
            except Exception as e:  # counted, not raised: the test reports every failure
                with lock:
                    failures.append(f"client {c} request {r}: {type(e).__name__}: {e}")
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)
                if (scores - values).abs().max() > spacing / 4:  # another request's scores (a mean rounds: no ==)
                    mixed.append((c, r))

    def killed_client() -> bool:
        host, port = server.httpd.server_address[:2]
        conn = socket.create_connection((host, port), timeout=5)
        head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        conn.sendall(head + b'{"images": {"encoding": "float32", ')
        conn.close()  # gone mid-request
        return True

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(a.clients)]
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(0.2)
    killed = killed_client()
    deadline = t_start + a.timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    wall = time.perf_counter() - t_start
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
        health = json.loads(response.read())
    server.close()
    lat = sorted(latencies)
    result = {
        "machine": machine(),
        "clients": a.clients,
        "requests_per_client": a.requests,
        "images_per_request": a.images,
        "side": a.side,
        "reward_delay_s": a.delay_s,
        "workers": a.workers,
        "answered": len(lat),
        "expected": a.clients * a.requests,
        "mixed_replies": len(mixed),
        "failures": failures[:10],
        "killed_client": killed,
        "health_after": health.get("status"),
        "wall_s": wall,
        "requests_per_s": len(lat) / wall if wall else None,
        "latency_p50_ms": 1000 * statistics.median(lat) if lat else None,
        "latency_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "unfinished_clients": sum(t.is_alive() for t in threads),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
