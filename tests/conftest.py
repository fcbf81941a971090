"""Shared fixtures: seeded random tiny SD3 and FLUX pipelines (built in seconds, no download: ``tiny_pipelines``) and
prompts, and the helpers that shrink a run onto a tiny pipeline and check it."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from tiny_pipelines.flux import build_random_flux_pipeline
from tiny_pipelines.sd3 import build_random_sd3_pipeline

import flowrl  # noqa: F401 (its import sets MKL's reproducible mode where needed: flowrl.cpu)

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """Under pytest-xdist (``-n``), each worker takes an equal share of this machine's cores for torch and for the
    processes a test launches (``OMP_NUM_THREADS``), instead of every worker starting one thread per core: the suite's
    tests are mostly single-threaded, so two workers on two cores run it in about half the time, where four threads
    on two cores would stall one another. A run without workers keeps torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        affinity = getattr(os, "sched_getaffinity", None)  # absent on macOS
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


FIRST = ("test_distributed.py",)
"""Modules run first: their tests share fixtures that take minutes (the two-process launches, :func:`built_once`).
Begun first, they are built by the worker whose initial share they open, while the other worker runs the rest; begun
last, a worker stealing one of their tests would wait on the fixture's lock with nothing to do."""


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (end-to-end runs of a minute or more) run in CI (``CI=true``, as ``.ci/run``) or when
    asked for (``-m slow``); the default run skips them, so that it stays within a few minutes on 2 cores. The
    modules of :data:`FIRST` are moved to the front (a stable sort: the order within each part is kept)."""
    items.sort(key=lambda item: item.path.name not in FIRST)
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") or config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason="slow: runs with CI=true (as .ci/run does) or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


ASSETS = REPO / "assets"


@contextlib.contextmanager
def built_once(tmp_path_factory, name: str):
    """A folder of this test session shared by every pytest-xdist worker, for fixtures whose work takes minutes (the
    two-process launches): yields ``(folder, todo)``; ``todo`` is True for the one worker that must fill the folder
    (the others wait on a file lock, then get False and read what it wrote). Without it, a module-scoped fixture is
    built again on every worker that runs one of its tests. A build that raises leaves the folder to be built
    again by the next worker that asks."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder, built = root / name, root / name / ".built"
    with FileLock(str(root / f"{name}.lock")):
        if built.exists():
            yield folder, False
            return
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        yield folder, True
        built.touch()


def tiny_pipeline(name: str, build, scope: str = "module", **kwargs):
    """A pytest fixture named ``name``: the path of ``build(folder, **kwargs)`` (a ``tiny_pipelines`` builder) saved
    into a fresh temporary folder once per ``scope``. Assign it to a module-level name of the test module (or
    conftest)."""

    def fixture(tmp_path_factory) -> Path:
        return build(tmp_path_factory.mktemp(name) / "pipeline", **kwargs)

    return pytest.fixture(scope=scope, name=name)(fixture)


random_pipeline = tiny_pipeline("random_pipeline", build_random_sd3_pipeline, "session")
random_flux_pipeline = tiny_pipeline("random_flux_pipeline", build_random_flux_pipeline, "session")


def _prompts(kind: str):
    """A session fixture of :func:`families.prompt_files` of ``kind``: train and test prompt files."""

    def fixture(tmp_path_factory) -> tuple[Path, Path]:
        from families import prompt_files

        return prompt_files(kind, tmp_path_factory.mktemp(f"{kind}-prompts"))

    return fixture


prompt_files = pytest.fixture(_prompts("image"), scope="session", name="prompt_files")
"""The tiny world's prompts (GenEval metadata), train and test files."""
video_prompts = pytest.fixture(_prompts("video"), scope="session", name="video_prompts")
"""Motion prompts without GenEval metadata (an evaluation is then the rewards' mean): the conformance suite's."""
i2v_prompts = pytest.fixture(_prompts("i2v"), scope="session", name="i2v_prompts")
"""Motion prompts, each with a random 32 px source image (a path relative to the file): the conformance suite's."""


def shape_overrides(cfg) -> dict:
    """Step and group counts that keep a preset's own rollout shape (its tree, window or probe steps) at the tiny size
    of :func:`tiny_overrides`; `cfg` is the preset's loaded :class:`flowrl.config.Config`."""
    if cfg.sampling.tree.split_steps:
        return {"sampling.num_steps": 6, "sampling.group_size": 8}
    if cfg.sampling.window.size:
        return {"sampling.num_steps": 5}
    if cfg.sampling.shape in ("tempflow", "g2rpo", "tp_grpo"):
        return {"sampling.num_steps": 8}
    return {}


FLOAT32 = {"run.mixed_precision": "no", "sampling.decode_precision": "no", "sampling.ode_precision": "no"}
"""Every precision setting float32: tests compute in float32 unless they test bf16, so that they give the same
numbers on CPUs with and without native bf16 (``auto`` would pick bf16 on one and float32 on the other)."""


def save_random_lora(model, folder: Path, rank: int, alpha: float, seed: int) -> Path:
    """Add a LoRA of `rank` and `alpha` to `model` (a loaded :class:`flowrl.models.FlowModel`) with random nonzero
    factors (``lora_B`` drawn from N(0, 0.05^2) after seeding torch with `seed`) and save it into `folder` (diffusers
    format): a teacher or a LoRA to load that changes the velocity. Returns `folder`."""
    torch.manual_seed(seed)
    model.add_lora(rank, alpha)
    with torch.no_grad():
        for n, p in model.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.save_lora(folder)
    return folder


def tiny_overrides(model: Path, train: Path, test: Path, out: Path, **extra) -> list[str]:
    """Overrides that make a run take seconds, in float32 (:data:`FLOAT32`); `extra` overrides them."""
    base = {
        "model.path": str(model),
        "train_prompts": str(train),
        "eval.prompts": str(test),
        "run.output_dir": str(out),
        "run.iterations": 2,
        "run.save_every": 1,
        "run.device": "cpu",
        "sampling.num_steps": 3,
        "sampling.group_size": 2,
        "sampling.prompts_per_iteration": 2,
        "eval.images_per_tag": 1,
        "eval.num_steps": 2,
        "train.minibatch_size": 4,
        "model.lora_rank": 2,
        "run.diversity_model": "",  # off: test_diversity.py measures it
        **FLOAT32,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def read_metrics(run: Path) -> list[dict]:
    """The rows of a run folder's ``metrics.jsonl``, one dict per iteration."""
    import json

    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def no_download(*dropped: str, reward: str = "jpeg_compressibility") -> dict:
    """Overrides that drop the named rewards of a recipe (models to download) and score ``reward``, one that needs no
    download (JPEG compressibility; a video family's ``families:brightness``), with weight 1."""
    return {**{f"rewards.{name}": "null" for name in dropped}, f"rewards.{reward}.weight": 1.0}


RECIPE_SIZES = {"model.dtype": "float32", "sampling.group_size": 4, "sampling.batch_size": 8}
"""A recipe's sizes shrunk for a tiny pipeline: float32 weights, groups of 4 sampled 8 images at a time."""
WHOLE_MINIBATCHES = {"train.micro_batch_size": "null", "train.gradient_checkpointing": False}
"""No micro-batching and no gradient checkpointing: a tiny minibatch in one pass."""


def shrink_recipe(recipe: str, model: Path, prompts: tuple[Path, Path], out: Path, keep_shape=False, **settings):
    """``configs/recipes/<recipe>.yaml`` shrunk onto the tiny pipeline ``model``: its loaded
    :class:`flowrl.config.Config` with :func:`tiny_overrides` for the prompt files ``prompts`` (train, test) and the
    run folder ``out``, then ``settings``, then where ``keep_shape`` the recipe's own rollout shape at the tiny size
    (:func:`shape_overrides`). A ConfigError names a key the recipe or the settings get wrong."""
    from flowrl.config import load_config

    path = REPO / "configs" / "recipes" / f"{recipe}.yaml"
    shape = shape_overrides(load_config(path)) if keep_shape else {}
    return load_config(path, tiny_overrides(model, *prompts, out, **{**settings, **shape}))


def train_shrunk_recipe(trainer, iterations: int = 2) -> list[dict]:
    """Train a recipe shrunk onto a tiny pipeline and check what every family's recipe test checks: ``iterations``
    rows in ``metrics.jsonl``, the PPO ratio exactly 1 before each iteration's first step, an optimizer step in each,
    and the trained parameters moved. Returns the metrics rows."""
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    metrics = read_metrics(trainer.cfg.run.output_dir)
    assert len(metrics) == iterations
    assert all(m["policy/ratio_first_max_dev"] == 0.0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    return metrics


def record_reward_metadata(trainer) -> list[dict]:
    """Wrap ``trainer``'s rewards so that each call's metadata rows (the prompt records the rewards receive: source
    images of edit and image-to-video families) are appended to the returned list."""
    seen, inner = [], trainer.rewards

    class Recording:
        rewards = inner.rewards

        def __call__(self, images, prompts, metadata):
            seen.extend(metadata)
            return inner(images, prompts, metadata)

    trainer.rewards = trainer.method.rewards = trainer.scorer.rewards = Recording()
    return seen


def assert_resume_is_exact(config: Path, overrides, out: Path):
    """Train `config` for 2 iterations straight and for 1 iteration + a resume for the second (``overrides(folder)``:
    the run's ``key=value`` list for an output folder) and check they end on the same weights (atol 1e-6) and log the
    same second iteration: rollout noise, prompts and optimizer state are restored; the resumed iteration trained.
    Returns the straight run's :class:`flowrl.trainer.Trainer` (after training)."""
    import json

    from safetensors.torch import load_file

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    runs, trainers = {}, {}
    for name, passes in (("full", [[]]), ("part", [["run.iterations=1"], ["run.resume=true"]])):
        for more in passes:
            trainers[name] = Trainer(load_config(config, overrides(out / name) + more))
            trainers[name].train()
        lines = (out / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = (
            load_file(out / name / "checkpoints/checkpoint-000002/trainable.safetensors"),
            json.loads(lines[-1]),
        )
    (a, last_a), (b, last_b) = runs["full"], runs["part"]
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    first = load_file(out / "part/checkpoints/checkpoint-000001/trainable.safetensors")
    assert any(not torch.equal(first[k], b[k]) for k in b)  # the resumed iteration trained
    assert last_a["iteration"] == last_b["iteration"] == 2
    key = "reward/total/mean" if "reward/total/mean" in last_a else "policy/loss"  # offline methods score nothing
    assert last_a[key] == last_b[key]
    return trainers["full"]


def cli_fails(capsys, *argv) -> str:
    """Run ``flowrl ARGV`` in this process; assert exit status 2 and one ``flowrl ...`` line on stderr, and return it."""
    from flowrl import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip().startswith("flowrl ")]
    assert len(lines) == 1, lines
    return lines[0]
