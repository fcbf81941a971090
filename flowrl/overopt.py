"""``flowrl overopt``: reward over-optimisation on the tiny world (GRPO-Guard, arXiv 2510.22319, Sec. 5).

Each preset is trained on the proxy reward ``clipscore`` alone (its own rewards dropped, the gold kept at weight 0
so that every iteration logs the rollouts' gold mean) and, every
``eval_every`` iterations, the same held-out ODE samples are scored twice: by the proxy (mean CLIP score)
and by the gold metric (GenEval strict accuracy of the tiny-world detector). The paper's claim, in kind:
with the guard (RatioNorm + gradient reweighting) the gold metric stays at least as high while the proxy
rises. Writes JSON (every evaluation) and a Markdown table.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from .bench import save_results
from .config import REPO_ROOT, load_config

PRESETS = ("flow_grpo", "grpo_guard", "dance_grpo", "grpo_guard_dance")
GOLD = "geneval_strict"
"""The gold reward: kept in every preset at weight 0, so each iteration logs the rollouts' gold mean
(``reward/geneval_strict/mean``, also drawn in ``diagnostics.png``) beside the held-out evaluations."""


def say(line: str) -> None:
    """Print ``flowrl overopt: <line>`` to stderr at once: the study's progress, a line per training iteration."""
    print(f"flowrl overopt: {line}", file=sys.stderr, flush=True)


def proxy_and_gold(trainer, proxy) -> dict[str, float]:
    """Held-out proxy and gold scores of ``trainer``'s current policy on the same images.

    Args:
        trainer: a :class:`flowrl.trainer.Trainer` whose eval prompts carry GenEval metadata.
        proxy: a reward callable ``(images, prompts, metadata) -> (B,)`` scores.

    Returns:
        ``{"proxy": mean proxy score, "gold": GenEval strict accuracy in [0, 1], "gold_dense": dense
        GenEval score in [0, 1], "per_tag": {tag: strict accuracy}}``.
    """
    from .evaluation import evaluate

    e, s = trainer.cfg.eval, trainer.cfg.sampling
    with trainer.policy.ema_weights(), trainer.policy.autocast():
        result = evaluate(
            trainer.model,
            trainer.eval_metas,
            e.images_per_tag,
            e.num_steps,
            e.guidance_scale,
            s.shift,
            e.seed,
            s.batch_size,
            return_images=True,
        )
    scores = proxy(result["images"], result["prompts"], result["metas"])
    return {
        "proxy": float(torch.as_tensor(scores).float().mean()),
        "gold": result["overall"],
        "gold_dense": result["dense_overall"],
        "per_tag": result["per_tag"],
    }


def check_trains_on_rewards(presets) -> None:
    """Check that every preset trains on its rewards, which ``overopt`` swaps for the proxy: an offline method
    (``dpo_offline``, ``sft``) trains on its data set and scores no rollout.

    Raises:
        ValueError: naming the presets of offline methods and what overopt needs.
    """
    from .methods import METHODS

    offline = [n for n in presets if not METHODS[load_config(REPO_ROOT / "configs" / f"{n}.yaml").train.method].online]
    if offline:
        raise ValueError(
            f"preset(s) {', '.join(offline)} train on a data set (train.offline.data), not on a reward: overopt trains "
            "on the proxy reward and needs a method that samples and scores rollouts (a GRPO, forward-process or "
            "direct-reward preset)"
        )


def run_overopt(
    presets=PRESETS,
    iterations: int = 30,
    eval_every: int = 10,
    proxy: str = "clipscore",
    proxy_options: dict | None = None,
    overrides=(),
    out: str | Path = "runs/overopt.json",
    progress=say,
) -> dict:
    """Train each preset (names in configs/) on ``proxy`` and track proxy and gold on held-out prompts.

    Args:
        iterations: training iterations per preset; eval_every: iterations between evaluations (and at 0).
        proxy: registered reward name used as the only training reward; proxy_options: its options (default
            for ``clipscore``: the shipped tiny CLIP, ``assets/tiny-clip``).
        overrides: ``key=value`` overrides applied to every preset (after the proxy swap).
        progress: called with a line of what the study is doing: each preset as it starts, each evaluation as it
            starts and each training iteration as it ends (default :func:`say`, to stderr).

    Returns:
        ``{preset: [{"iteration", "proxy", "gold", "gold_dense", "per_tag", "elapsed_s"}, ...]}``; also
        written to ``out`` (JSON, with ``"rollouts"``: per preset, each iteration's training-rollout means
        ``{"proxy", "gold"}``) and ``out`` with suffix ``.md`` (table).

    Raises:
        ValueError: ``eval_every`` < 1 or ``iterations`` < 1, or a preset of an offline method
            (:func:`check_trains_on_rewards`), before any work.
    """
    from .rewards import build_reward
    from .trainer import Trainer

    if iterations < 1 or eval_every < 1:
        raise ValueError(f"overopt: iterations ({iterations}) and eval_every ({eval_every}) must be >= 1")
    check_trains_on_rewards(presets)
    if proxy_options is None:
        proxy_options = {"model_path": str(REPO_ROOT / "assets" / "tiny-clip")} if proxy == "clipscore" else {}
    scorer = build_reward(proxy, **proxy_options)
    results, per_iteration = {}, {}
    for k, name in enumerate(presets):
        progress(f"{name} ({k + 1}/{len(presets)}): building the trainer")
        base = load_config(REPO_ROOT / "configs" / f"{name}.yaml")
        swap = [f"rewards.{r}=null" for r in base.rewards if r not in (proxy, GOLD)] + [f"rewards.{proxy}.weight=1.0"]
        swap += [f"rewards.{GOLD}.weight=0.0"]  # watched on every rollout, not trained on
        swap += [f"rewards.{proxy}.options.{k}={v}" for k, v in proxy_options.items()]
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(
                REPO_ROOT / "configs" / f"{name}.yaml",
                [f"run.output_dir={tmp}/run", "eval.every=0", *swap, *overrides],
            )
            trainer = Trainer(cfg)
            rows, rollouts, t0 = [], [], time.time()
            for it in range(iterations + 1):
                if it % eval_every == 0 or it == iterations:
                    progress(f"{name} iteration {it}: evaluating proxy and gold ({trainer.evaluator.plan()})")
                    row = {"iteration": it, **proxy_and_gold(trainer, scorer), "elapsed_s": time.time() - t0}
                    rows.append(row)
                    print(name, json.dumps(row))
                if it < iterations:
                    m = trainer.step(it)
                    rollouts.append({"proxy": m[f"reward/{proxy}/mean"], "gold": m[f"reward/{GOLD}/mean"]})
                    progress(
                        f"{name} iteration {it + 1}/{iterations}: rollout proxy {rollouts[-1]['proxy']:.3f}, "
                        f"gold {rollouts[-1]['gold']:.3f}, {time.time() - t0:.0f} s"
                    )
            results[name] = rows
            per_iteration[name] = rollouts
    meta = {"iterations": iterations, "eval_every": eval_every, "proxy": proxy, "overrides": list(overrides)}
    save_results(out, meta, results, markdown_table, rollouts=per_iteration)
    return results


def markdown_table(results: dict, meta: dict) -> str:
    """One row per preset: proxy and gold at the start, at the gold's best evaluation and at the end."""
    lines = [
        f"Machine: {meta['machine']}; proxy `{meta['proxy']}`, gold GenEval strict accuracy on held-out prompts; "
        f"{meta['iterations']} iterations, evaluated every {meta['eval_every']}.",
        "",
        "| preset | proxy start | proxy end | gold start | gold best (iteration) | gold end | proxy along training | "
        "gold along training | dense gold along training |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        first, last = rows[0], rows[-1]
        best = max(rows, key=lambda r: r["gold"])
        along = {k: " ".join(f"{r[k]:.3f}" for r in rows) for k in ("proxy", "gold", "gold_dense")}
        lines.append(
            f"| {name} | {first['proxy']:.3f} | {last['proxy']:.3f} | {first['gold']:.3f} | "
            f"{best['gold']:.3f} ({best['iteration']}) | {last['gold']:.3f} | {along['proxy']} | {along['gold']} | "
            f"{along['gold_dense']} |"
        )
    return "\n".join(lines) + "\n"
