"""What a resumed run trains and evaluates with: the run's own ``config.yaml``, with the keys given at the resume
applied on top and named in one line, and refused where they would evaluate the resumed run differently from its
``eval_before.json`` (its before -> after would then compare two different evaluations).

``flowrl train PRESET run.resume=true KEY=VALUE ...`` reads the run folder's ``config.yaml`` instead of ``PRESET``
(:func:`load_run_config`); the :class:`flowrl.trainer.Trainer` compares the config it is given with the saved one
(:func:`reconcile`), so a Python resume is held to the same rules. Imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .config import Config, ConfigError, load_config

__all__ = [
    "EVALUATION_KEYS",
    "REWARD_CONNECTION",
    "SILENT_KEYS",
    "changed_keys",
    "check_resume",
    "evaluation_changes",
    "load_run_config",
    "reconcile",
]

SILENT_KEYS = ("run.resume", "run.output_dir")
"""Keys a resume differs in without a word: the switch itself, and the folder (spelled another way, it is the same)."""

EVALUATION_KEYS = (
    "eval.",
    "rewards.",
    "model.",
    "sampling.shift",
    "sampling.ode_precision",
    "sampling.decode_precision",
    "run.mixed_precision",
)
"""Prefixes of the keys a resume may not change: what the evaluation draws and how it judges (the prompts, images,
steps, guidance, seed; the rewards; the model and its precision). ``eval.every`` and the placement keys of
``model.*`` (:data:`PLACEMENT_KEYS`) change no evaluated number and are applied."""

PLACEMENT_KEYS = ("eval.every", "model.prompt_cache", "model.text_encoders", "model.vae_placement")
"""Keys under :data:`EVALUATION_KEYS` that change where things live or how often the run evaluates, not what an
evaluation gives."""


def _flat(config: Config) -> dict[str, object]:
    """Every leaf of `config` as ``{"sampling.group_size": 8, "rewards.geneval.weight": 1.0, ...}``."""
    out: dict[str, object] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix.rstrip(".")] = node

    walk(OmegaConf.to_container(OmegaConf.structured(config)), "")
    return out


def changed_keys(saved: Config, given: Config) -> dict[str, tuple[object, object]]:
    """The keys whose value differs between `saved` and `given`, ``{key: (saved value, given value)}`` in the order
    of the config (a key only one of them has, e.g. a reward added, counts with ``None`` on the other side); the
    :data:`SILENT_KEYS` are left out."""
    a, b = _flat(saved), _flat(given)
    keys = list(a) + [k for k in b if k not in a]
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k) and k not in SILENT_KEYS}


REWARD_CONNECTION = tuple(
    f".options.{name}"
    for name in (
        "url",
        "base_url",
        "api_key",
        "timeout",
        "connect_timeout",
        "read_timeout",
        "retries",
        "max_retries",
        "notice_after",
        "concurrency",
        "workers",
        "batch_size",
        "device",
    )
)
"""Reward options that say where and how a reward is reached (a reward server restarted on another port, a judge's
endpoint, timeouts, batching, the device), not what it judges: a resume may change them, named in its line."""


def _records_a_spec(key: str, old: object) -> bool:
    """Whether `key` is a ``rewards.NAME.spec`` the saved config left unset (a reward callable given in Python,
    without an import path or before flowrl recorded one): setting it names the same reward, not another."""
    return key.startswith("rewards.") and key.endswith(".spec") and old is None


def evaluation_changes(changes: dict[str, tuple[object, object]]) -> list[str]:
    """The keys of `changes` (:func:`changed_keys`) that change what an evaluation gives (:data:`EVALUATION_KEYS`),
    less :data:`PLACEMENT_KEYS`, the rewards' :data:`REWARD_CONNECTION` options and a reward's ``spec`` the saved
    config left unset (:func:`_records_a_spec`)."""
    return [
        k
        for k, (old, _) in changes.items()
        if k.startswith(EVALUATION_KEYS)
        and not k.startswith(PLACEMENT_KEYS)
        and not (k.startswith("rewards.") and k.endswith(REWARD_CONNECTION))
        and not _records_a_spec(k, old)
    ]


def _describe(changes: dict[str, tuple[object, object]]) -> str:
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())


def reconcile(saved: Config, given: Config, saved_path: Path) -> list[str]:
    """Check a resume's `given` config against the run's `saved` one (its ``config.yaml`` at `saved_path`).

    Returns:
        `list[str]`: one line to print, ``"resuming with <saved_path>; changed: run.iterations 2 -> 3, ..."``, or no
        line where nothing but :data:`SILENT_KEYS` differs.

    Raises:
        ConfigError: naming every key that would evaluate the resumed run differently from its ``eval_before.json``
            (:func:`evaluation_changes`), with both values and the way out.
    """
    changes = changed_keys(saved, given)
    refused = {k: changes[k] for k in evaluation_changes(changes)}
    if refused:
        raise ConfigError(
            f"run.resume: {_describe(refused)} would evaluate the resumed run differently from its eval_before.json "
            f"(settings in {saved_path}); drop {'it' if len(refused) == 1 else 'them'}, or start a new run in another "
            "run.output_dir"
        )
    return [f"resuming with {saved_path}; changed: {_describe(changes)}"] if changes else []


def load_run_config(path: str | Path | None, overrides: list[str]) -> tuple[Config, str | None]:
    """The config ``flowrl train PATH KEY=VALUE ...`` runs: :func:`flowrl.config.load_config`'s, except for a resume
    (``run.resume`` true) of a folder that holds a ``config.yaml``: that saved config with the `overrides` on top (the
    preset at `path` is not read; its values could differ from the run's).

    Returns:
        ``(config, note)``: `note` is a line saying the run's own config is used (and that the preset was set aside,
        where `path` is not that config), or None.

    Raises:
        ConfigError / FileNotFoundError: as :func:`flowrl.config.load_config`, for the preset, the overrides or the
            saved ``config.yaml`` (named).
    """
    config = load_config(path, overrides)
    saved = Path(config.run.output_dir) / "config.yaml"
    if not config.run.resume or not saved.is_file():
        return config, None
    folder = config.run.output_dir
    try:
        config = load_config(saved, [*overrides, "run.resume=true"])
    except ConfigError as e:
        raise ConfigError(f"run.resume: the run's own {saved} does not load: {e}") from None
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, output_dir=folder))
    note = f"resuming {config.run.output_dir} with the run's own {saved}"
    set_aside = path is not None and Path(path).resolve() != saved.resolve()  # not when given RUN/config.yaml
    return config, note + (f" ({path} is not read; pass key=value to change a setting)" if set_aside else "")


def check_resume(given: Config, folder: Path) -> list[str]:
    """:func:`reconcile` `given` with the ``config.yaml`` of the run `folder` it resumes, where the folder holds one and
    an ``eval_before.json`` (a folder without them starts over: nothing to compare with). Returns its line(s).

    Raises:
        ConfigError: as :func:`reconcile`, or a saved ``config.yaml`` that does not load (named).
    """
    saved_path = Path(folder) / "config.yaml"
    if not (saved_path.is_file() and (Path(folder) / "eval_before.json").is_file()):
        return []
    try:
        saved = load_config(saved_path)
    except (ConfigError, FileNotFoundError) as e:
        raise ConfigError(f"run.resume: the run's own {saved_path} does not load: {e}") from None
    return reconcile(saved, given, saved_path)


def say(lines: list[str], prefix: str = "flowrl train") -> None:
    """Print each of `lines` as ``<prefix>: <line>`` to stderr."""
    for line in lines:
        print(f"{prefix}: {line}", file=sys.stderr, flush=True)
