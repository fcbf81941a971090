"""Offline methods: Diffusion-DPO on a preference data set and supervised fine-tuning (SFT) on images, no rollouts
(Wallace et al., arXiv 2311.12908; X-GenGroup/Flow-Factory ``src/flow_factory/trainers/offline/``; SalesforceAIResearch
DiffusionDPO's Pick-a-Pic layout).

The data set (``train.offline.data``) is a ``.jsonl`` file, or a ``.parquet`` file (needs ``pyarrow``), of rows:

- preference pairs: ``{"prompt": ..., "image_w": PATH, "image_l": PATH}`` (flowrl's layout), or Pick-a-Pic's
  ``{"caption": ..., "jpg_0": PATH or bytes, "jpg_1": ..., "label_0": 1 | 0 | 0.5}`` (``label_0`` 1: ``jpg_0``
  preferred; ties are skipped);
- SFT: ``{"prompt": ..., "image": PATH}``.

Paths are relative to the data file's folder. Images are resized (shorter side) and centre-cropped to
``model.resolution``, encoded once with the family's VAE (:meth:`FlowModel.encode_latents`) and kept in memory.
Each iteration draws ``train.offline.batch_size`` rows with the iteration's generator (a resumed run draws the same).

- ``dpo_offline``: :func:`flowrl.methods.dpo.dpo_loss` on each pair (one noise and time shared by the pair) against a
  frozen reference, the initial policy (``train.dpo.*``: beta, timesteps, time sampling, guidance);
- ``sft``: the flow-matching loss ``mean_d (v - (eps - x0))^2`` on each image at ``train.dpo.timesteps`` times.

Evaluation, checkpoints and exports are the online methods'; the rewards only score the evaluation.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..fields import check, config_section, setting
from .base import Samples, register_method
from .dpo import DiffusionDPO
from .forward import flow_matching_error


@config_section("train", "offline", "the data set of the offline methods (train.method dpo_offline, sft)")
@dataclass
class OfflineConfig:
    """``train.offline.*``: the data set of ``train.method: dpo_offline`` and ``sft``."""

    data: str = setting("", "a .jsonl or .parquet file of preference pairs (dpo_offline) or images (sft)")
    batch_size: int = setting(16, "rows (pairs or images) drawn per iteration")

    def __post_init__(self):
        check(self.batch_size >= 1, "train.offline.batch_size", ">= 1", self.batch_size)


@dataclass
class DataSamples(Samples):
    """One iteration's rows of an offline data set (no images to score: ``images`` is empty).

    Attributes:
        x0 (`torch.Tensor` of shape `(R, K, *latent_shape)`, float32): the rows' latents, ``K`` = 2 (preferred,
            other) for pairs, 1 for SFT, on the device.
        cond (`torch.Tensor` of shape `(R,)`, long): each row's prompt row of `table`. table: the prompt table.
    """

    x0: torch.Tensor
    cond: torch.Tensor
    table: object


def _read_rows(path: Path) -> list[dict]:
    """The data file's rows as dicts (jsonl: one object per line; parquet: through pyarrow).

    Raises:
        ValueError: naming the file (and line), for a missing file, one that is not UTF-8 (jsonl) or not readable
            parquet, a bad line or a missing pyarrow.
    """
    if not path.is_file():
        raise ValueError(f"no file {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        try:
            return pq.read_table(path).to_pylist()
        except (OSError, pyarrow.ArrowException) as e:  # truncated, or not parquet at all
            raise ValueError(f"{path} is not a readable parquet file ({_one_line(e)})") from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _one_line(error: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


def read_preference_rows(path: str | Path, pairs: bool) -> list[tuple]:
    """Rows of a data set as ``(prompt, image_a, image_b)`` for `pairs` (a preferred first), else ``(prompt, image)``;
    an image is a path (resolved against the file's folder) or encoded bytes.

    Raises:
        ValueError: naming the file and row, for a row without the fields of either layout, an image that is neither
            a path nor bytes (a null), a prompt that is not text, or an empty set; as :func:`_read_rows`.
    """
    path = Path(path)
    folder, out = path.parent, []

    def image(row: dict, key: str, n: int):
        value = row[key]
        if isinstance(value, (bytes, bytearray)):
            return value
        if not isinstance(value, str) or not value:
            raise ValueError(f"{path} row {n}: {key!r} is {value!r}; expected an image path (relative to the file) or "
                             "an encoded image's bytes")  # fmt: skip
        return str(folder / value)

    def prompt(row: dict, key: str, n: int) -> str:
        if not isinstance(row[key], str):
            raise ValueError(f"{path} row {n}: {key!r} is {row[key]!r}; expected the prompt's text")
        return row[key]

    for n, row in enumerate(_read_rows(path), 1):
        if pairs and {"prompt", "image_w", "image_l"} <= row.keys():
            out.append((prompt(row, "prompt", n), image(row, "image_w", n), image(row, "image_l", n)))
        elif pairs and {"caption", "jpg_0", "jpg_1", "label_0"} <= row.keys():
            if row["label_0"] in (0, 1):  # Pick-a-Pic: ties (0.5) carry no preference
                a, b = ("jpg_0", "jpg_1") if row["label_0"] == 1 else ("jpg_1", "jpg_0")
                out.append((prompt(row, "caption", n), image(row, a, n), image(row, b, n)))
        elif not pairs and {"prompt", "image"} <= row.keys():
            out.append((prompt(row, "prompt", n), image(row, "image", n)))
        else:
            need = (
                "prompt, image_w, image_l (or Pick-a-Pic's caption, jpg_0, jpg_1, label_0)"
                if pairs
                else "prompt, image"
            )
            raise ValueError(f"{path} row {n}: expected fields {need}; got {sorted(row)}")
    if not out:
        raise ValueError(f"{path}: no usable rows")
    return out


def offline_rows(cfg, pairs: bool) -> list[tuple]:
    """The rows of config key ``train.offline.data`` (:func:`read_preference_rows`), its path resolved as every
    relative path of a config (:func:`flowrl.files.resolve_path`: the working folder, else the repository).

    Raises:
        ConfigError: naming ``train.offline.data``, for what :func:`read_preference_rows` refuses.
    """
    from ..fields import config_key
    from ..files import resolve_path

    with config_key("train.offline.data"):
        return read_preference_rows(resolve_path(cfg.train.offline.data).absolute(), pairs)


def load_image(source, side: int) -> torch.Tensor:
    """An image (path or bytes) as `(3, side, side)` float32 in [0, 1]: shorter side resized to `side`, centre crop.

    Raises:
        ValueError: naming the file, for one that cannot be read as an image.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as picture:
            picture = picture.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        name = "an image given as bytes" if isinstance(source, (bytes, bytearray)) else source
        raise ValueError(f"{name} cannot be read as an image ({type(e).__name__})") from None
    w, h = picture.size
    scale = side / min(w, h)
    picture = picture.resize((max(side, round(w * scale)), max(side, round(h * scale))), Image.BICUBIC)
    w, h = picture.size
    left, top = (w - side) // 2, (h - side) // 2
    picture = picture.crop((left, top, left + side, top + side))
    return (
        torch.frombuffer(bytearray(picture.tobytes()), dtype=torch.uint8).view(side, side, 3).permute(2, 0, 1) / 255.0
    )


class OfflineData:
    """An offline data set, its images encoded into latents once (module docstring).

    Args:
        rows: :func:`read_preference_rows`'s rows. model: the model adapter (``encode_latents``, ``resolution``).
    """

    def __init__(self, rows: list[tuple], model):
        self.prompts = [r[0] for r in rows]
        side = model.resolution
        latents = []
        for start in range(0, len(rows), 16):
            chunk = rows[start : start + 16]
            images = torch.stack([load_image(src, side) for r in chunk for src in r[1:]])  # (n K, 3, side, side)
            latents.append(model.encode_latents(images).cpu().view(len(chunk), len(rows[0]) - 1, *model.latent_shape))
        self.latents = torch.cat(latents)  # (R, K, *latent_shape)

    def __len__(self) -> int:
        return len(self.prompts)

    def batch(self, size: int, generator: torch.Generator) -> tuple[list[str], torch.Tensor]:
        """`size` rows drawn uniformly with replacement: their prompts and latents `(size, K, *latent_shape)`."""
        idx = torch.randint(0, len(self), (size,), generator=generator)
        return [self.prompts[i] for i in idx.tolist()], self.latents[idx]


@register_method("dpo_offline", "offline: Diffusion-DPO on train.offline.data")
class OfflineDPO(DiffusionDPO):
    """``train.method: dpo_offline``: Diffusion-DPO on the pairs of ``train.offline.data`` against the initial policy
    (module docstring). Args: as :class:`flowrl.methods.base.Method`.
    """

    online = False
    pairs = True
    requires = ("forward_process", "vae_inverse", "text_only")
    """The flow-matching loss, images encoded by the family's VAE, and data rows of text prompts alone (no source
    image per row: not built)."""

    @classmethod
    def check_config(cls, cfg) -> None:
        check(bool(cfg.train.offline.data), "train.offline.data", f"a data file with train.method {cls.name!r}", "")
        check(cfg.train.kl_beta == 0.0, "train.kl_beta", f"0 with train.method {cls.name!r}", cfg.train.kl_beta)

    @classmethod
    def read_data(cls, cfg) -> list[tuple]:
        """The rows of ``train.offline.data`` (:func:`offline_rows`), read before the model loads."""
        return offline_rows(cfg, cls.pairs)

    def __init__(self, cfg, model, policy, rewards, data: list[tuple] | None = None):
        super().__init__(cfg, model, policy, rewards)
        self.data = OfflineData(offline_rows(cfg, self.pairs) if data is None else data, model)

    def rollout(self, metas: list[dict], generator: torch.Generator) -> DataSamples:
        """The iteration's rows of the data set (`metas` unused: the data set holds the prompts)."""
        prompts, latents = self.data.batch(self.cfg.train.offline.batch_size, generator)
        table = self.model.prompt_table([{"prompt": p} for p in prompts])
        cond = table.rows(torch.arange(len(prompts), device=self.device))
        empty = torch.zeros(0, 3, 1, 1)
        return DataSamples(empty, torch.zeros(0, dtype=torch.long), 0, latents.to(self.device), cond, table)

    def update(self, samples: DataSamples, adv, keep, generator: torch.Generator) -> dict:
        """DPO on the rows' pairs (:meth:`DiffusionDPO.update` with the data set's pairs)."""
        from .base import FinalSamples

        r = len(samples.cond)
        x0 = samples.x0.transpose(0, 1).reshape(2 * r, *samples.x0.shape[2:])  # preferred rows, then the others
        flat = FinalSamples(samples.images, torch.arange(r).repeat(2), 0, x0, samples.cond.repeat(2), samples.table)
        adv = torch.cat([torch.ones(r), -torch.ones(r)])
        return super().update(flat, adv, adv != 0, generator)

    def end_iteration(self, stats: dict) -> None:
        """The reference stays the initial policy."""


@register_method("sft", "offline: flow matching on train.offline.data")
class SFT(OfflineDPO):
    """``train.method: sft``: flow matching on the images of ``train.offline.data`` (module docstring).
    Args: as :class:`flowrl.methods.base.Method`.
    """

    pairs = False

    @classmethod
    def held_copies(cls, cfg) -> int:
        """None: no reference."""
        return 0

    def __init__(self, cfg, model, policy, rewards, data: list[tuple] | None = None):
        super(DiffusionDPO, self).__init__(cfg, model, policy, rewards)
        self.data = OfflineData(offline_rows(cfg, False) if data is None else data, model)
        self.reference = None

    def sampling_weights(self):
        return None

    def update(self, samples: DataSamples, adv, keep, generator: torch.Generator) -> dict:
        """Flow matching on the rows' images at ``train.dpo.timesteps`` times each; returns ``policy/loss``,
        ``policy/grad_norm``, ``policy/optimizer_steps`` and ``cost/*``."""
        d = self.cfg.train.dpo
        x0 = samples.x0[:, 0].repeat(d.timesteps, *([1] * (samples.x0.ndim - 2)))  # (N, *latent)
        cond = samples.cond.repeat(d.timesteps)
        times = self.pair_times(len(x0), generator)
        x_t, eps = self.noised(x0, times, generator)
        velocity = self.model.velocity_fn(samples.table, d.guidance_scale)

        def micro_loss(idx, stats, at):
            with self.policy.autocast():
                v = velocity(x_t[idx], times[idx], cond[idx])
            return flow_matching_error(v, x0[idx], eps[idx]).mean()

        stats, steps = self.optimizer_steps(len(x0), generator, micro_loss)
        return self.update_metrics(stats, steps, len(x0), len(x0) * self.model.cfg_rows(d.guidance_scale))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
