"""Seconds per training iteration with and without ``sampling.overlap_rewards``, same seed, same results.

A preset (default ``tiny_geneval``: Flow-GRPO on the shipped tiny model, 8 prompts x 8 images, 10 steps) trains
``--iterations`` iterations (``Trainer.step``, no evaluation or checkpoint) with the rollout sampled in chunks of
``--batch-size`` images, once scoring after the rollout and once scoring each chunk in a worker thread while the next
samples, ``--repeats`` times in alternation (other processes may share the cores). The reward is one of:

- ``remote``: ``flowrl serve-reward overlap_rewards:slow_mean`` in another process, called through the ``remote``
  reward: each image's mean after sleeping ``--seconds-per-call`` per request and ``--seconds-per-image`` per image,
  a stand-in for a reward model on another device or machine;
- ``ocr``: flowrl's ``ocr`` reward (RapidOCR on the CPU, offline), on the preset's training prompts each ending in
  a quoted word (``, captioned "TAG"``).

Checks that both settings logged the same metrics (but times) and end on the same weights; writes the seconds per
iteration (the mean over the iterations after the first) with the machine and the load average.

    python benchmarks/overlap_rewards.py --reward remote --out benchmarks/results/overlap_rewards_remote.json
    python benchmarks/overlap_rewards.py --reward ocr --out benchmarks/results/overlap_rewards_ocr.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def slow_mean(seconds_per_image: float = 0.0, seconds_per_call: float = 0.0):
    """A stand-in slow reward: ``reward(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (B,)`` float32, each
    image's mean pixel value in [0, 1], returned after sleeping ``seconds_per_call + B * seconds_per_image`` seconds
    (not a model: it stands for one's latency; no paper, no weights).

    Raises:
        ValueError: a negative delay.
    """
    if seconds_per_image < 0 or seconds_per_call < 0:
        raise ValueError(f"slow_mean: delays must be >= 0 s, got {seconds_per_image} and {seconds_per_call}")

    def reward(images, prompts, metadata):
        time.sleep(seconds_per_call + seconds_per_image * len(images))
        return images.float().flatten(1).mean(1)

    return reward


def machine() -> dict:
    """The CPU's model name, whether it has AVX-512 BF16, the core count and torch's version and threads."""
    import torch

    from flowrl.cpu import flags, model_name

    return {
        "cpu": model_name() or platform.processor(),
        "avx512_bf16": "avx512_bf16" in flags(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def serve(args, workdir: Path) -> tuple[subprocess.Popen, str]:
    """Start ``flowrl serve-reward overlap_rewards:slow_mean`` on a free local port; its process and URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "flowrl.cli", "serve-reward", "overlap_rewards:slow_mean", "--port", str(port)]
    command += ["--option", f"seconds_per_image={args.seconds_per_image}"]
    command += ["--option", f"seconds_per_call={args.seconds_per_call}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    log = open(workdir / "server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if json.loads(reply.read())["status"] == "ok":
                    return server, url
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise SystemExit(f"flowrl serve-reward did not start: {(workdir / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)


def quoted_prompts(cfg, out: Path) -> Path:
    """The preset's training prompts, each ending in ``, captioned "TAG"`` (the OCR reward's target), as JSONL."""
    from flowrl.data import read_prompts, write_jsonl

    rows = [
        {**m, "prompt": f'{m["prompt"]}, captioned "{m.get("tag", "text")}"'} for m in read_prompts(cfg.train_prompts)
    ]
    write_jsonl(rows, out)
    return out


def run(args, overlap: bool, reward, workdir: Path, train_prompts: list[str]) -> dict:
    """Train ``--iterations`` iterations with ``sampling.overlap_rewards`` = `overlap`; each one's seconds and
    metrics, and the final trained weights."""
    from flowrl.config import REPO_ROOT, load_config
    from flowrl.trainer import Trainer

    out = tempfile.mkdtemp(dir=workdir)
    over = [f"run.output_dir={out}", f"sampling.batch_size={args.batch_size}", f"sampling.overlap_rewards={overlap}"]
    cfg = load_config(REPO_ROOT / "configs" / f"{args.preset}.yaml", [*over, *train_prompts, *args.overrides])
    trainer = Trainer(cfg, rewards={args.reward: reward})
    load, seconds, metrics = os.getloadavg()[0], [], []
    for it in range(args.iterations):
        start = time.perf_counter()
        metrics.append(trainer.step(it))
        seconds.append(time.perf_counter() - start)
    weights = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    later = seconds[1:] or seconds
    return {
        "overlap_rewards": overlap,
        "seconds_per_iteration": sum(later) / len(later),
        "seconds": [round(s, 3) for s in seconds],
        **{k: round(sum(m.get(k, 0.0) for m in metrics[1:] or metrics) / len(later), 3) for k in TIMES},
        "load_average_1min_before": round(load, 2),
        "metrics": metrics,
        "weights": weights,
    }


TIMES = ("time/sample_s", "time/score_s", "time/score_worker_s", "time/train_s")


def same(a: dict, b: dict) -> tuple[bool, bool]:
    """Whether two runs logged the same metrics but times and memory, and hold the same weights."""
    import torch

    def kept(m):
        return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))}

    metrics = [kept(x) for x in a["metrics"]] == [kept(y) for y in b["metrics"]]
    return metrics, all(torch.equal(w, b["weights"][n]) for n, w in a["weights"].items())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", choices=("remote", "ocr"), default="remote")
    parser.add_argument("--preset", default="tiny_geneval", help="a preset of configs/ (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per chunk and sampler forward")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating")
    parser.add_argument("--seconds-per-image", type=float, default=0.03, help="the remote stand-in's delay")
    parser.add_argument("--seconds-per-call", type=float, default=0.05, help="the remote stand-in's delay per request")
    parser.add_argument("--out", help="also write the results to this JSON file")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value overrides of the preset")
    args = parser.parse_args(argv)
    from flowrl.config import REPO_ROOT, load_config
    from flowrl.rewards import build_reward

    with tempfile.TemporaryDirectory() as tmp:
        workdir, server, train_prompts = Path(tmp), None, []
        if args.reward == "remote":
            server, url = serve(args, workdir)
            reward = build_reward("remote", url=url)
        else:
            cfg = load_config(REPO_ROOT / "configs" / f"{args.preset}.yaml", args.overrides)
            train_prompts = [f"train_prompts={quoted_prompts(cfg, workdir / 'quoted.jsonl')}"]
            reward = build_reward("ocr")
        try:
            runs = [
                run(args, overlap, reward, workdir, train_prompts)
                for _ in range(args.repeats)
                for overlap in (False, True)
            ]
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
    checks = [same(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    result = {
        "command": "python benchmarks/overlap_rewards.py "
        + " ".join(sys.argv[1:] if argv is None else map(str, argv)),
        "machine": machine(),
        "reward": args.reward,
        "same_metrics": all(m for m, _ in checks),
        "same_weights": all(w for _, w in checks),
        "runs": [{k: v for k, v in r.items() if k not in ("metrics", "weights")} for r in runs],
    }
    for overlap in (False, True):
        mine = [r["seconds_per_iteration"] for r in runs if r["overlap_rewards"] == overlap]
        result[f"seconds_per_iteration_{'overlap' if overlap else 'sequential'}"] = [round(s, 3) for s in mine]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
