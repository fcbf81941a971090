"""A deterministic, hand-made object detector for the tiny world (no learned weights).

GenEval (arXiv 2310.11513) runs Mask2Former on photographs; the tiny world's flat shapes on a grey
background are read back by classical image processing instead:

1. Pixel colours. Each pixel is explained as ``BACKGROUND + a * (colour - BACKGROUND)`` for the
   palette colour whose mixing line passes closest to it (``0 <= a <= ALPHA_MAX``; a > 1 allows
   over-saturated colours). It takes that colour when ``a >= 0.5`` and the line passes within
   ``MAX_COLOR_DISTANCE``, is background when ``a < 0.5``, and unknown otherwise. Mixing lines rather
   than nearest palette colours keep a blurred edge with its own object: a pixel half yellow, half
   grey is nearer orange than yellow, but lies on the grey-yellow line.
2. Objects. Per colour, the mask is opened with a 3x3 square *by reconstruction*: a connected
   component (8-connectivity) survives when a 3x3 square fits inside it somewhere, and then survives
   whole, so thin star tips stay while one-pixel lines, blurred rims and speckle vanish. Holes are
   filled and components under ``MIN_AREA`` pixels (scaled with the image area) are dropped.
3. Shapes. Each object is described by ten scale-invariant ``FEATURES`` (fill, solidity, symmetry,
   corner fill, harmonics of the radial profile; see ``shape_features``) and each shape by a
   diagonal Gaussian over them (``PROTOTYPES``: means over clean and mildly blurred renders, spreads
   over clean, mildly and strongly blurred ones, floored; measured on 1500 seeded scenes each). The
   object takes the most likely shape (equal priors).

``Detection.score`` is that shape's posterior probability times a fit term: the product of two ramps
from 1 to 0, one over the distance to the shape's mean in spreads (``FIT_DISTANCE`` to
``REJECT_DISTANCE``), one over the largest single-feature deviation (``FIT_DEVIATION`` to
``REJECT_DEVIATION``). Objects scoring 0 are not reported. Clean renders score 1.0 and renders blurred
with a 3x3 Gaussian plus noise of sigma 0.03 score > 0.9 (GenEval's counting threshold) in > 99% of
objects; irregular blobs, elongated shapes and off-palette colours score low or are not reported.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import ndimage
from scipy.spatial import ConvexHull, QhullError

from .rules import Detection
from .world import BACKGROUND, COLORS, IMAGE_SIZE

COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
_BG = np.asarray(BACKGROUND, dtype=np.float32)  # (3,)
_DIRS = np.asarray([COLORS[c] for c in COLOR_NAMES], dtype=np.float32) - _BG  # (K, 3)

MAX_COLOR_DISTANCE = 60.0
"""Largest distance (RGB, 0..255 units) from a pixel to its colour's mixing line."""
ALPHA_MAX = 1.5
"""How far past its palette colour (away from the background) a pixel may lie and keep the colour."""
MIN_AREA = 20
"""Smallest object, in pixels of a 64x64 image (scaled with the image area)."""

FEATURES: tuple[str, ...] = (
    "fill",
    "solidity",
    "centroid_offset",
    "log_aspect",
    "flip_iou",
    "corners",
    "lobes_low",
    "lobes3",
    "lobes4",
    "lobes5",
)
PROTOTYPES: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    # shape: ((mean of FEATURES), (spread of FEATURES)), measured on flowrl.tiny renders: clean, blurred
    # once by a 3x3 binomial kernel plus noise of sigma 0.03, and twice plus noise of sigma 0.05.
    "circle": (
        (0.773, 0.933, 0.000, 0.000, 0.999, 0.445, 0.000, 0.000, 0.009, 0.000),
        (0.021, 0.020, 0.015, 0.060, 0.041, 0.067, 0.015, 0.015, 0.015, 0.015),
    ),
    "square": (
        (0.999, 0.999, 0.000, 0.000, 0.998, 0.997, 0.001, 0.001, 0.080, 0.001),
        (0.039, 0.022, 0.015, 0.060, 0.034, 0.066, 0.015, 0.015, 0.015, 0.015),
    ),
    "triangle": (
        (0.553, 0.902, 0.151, 0.019, 0.376, 0.416, 0.039, 0.148, 0.009, 0.021),
        (0.044, 0.027, 0.020, 0.060, 0.047, 0.036, 0.015, 0.015, 0.015, 0.015),
    ),
    "star": (
        (0.443, 0.591, 0.047, 0.064, 0.433, 0.153, 0.043, 0.033, 0.045, 0.207),
        (0.074, 0.078, 0.020, 0.081, 0.072, 0.069, 0.021, 0.020, 0.024, 0.048),
    ),
    "cross": (
        (0.613, 0.762, 0.004, 0.000, 0.959, 0.033, 0.005, 0.012, 0.125, 0.003),
        (0.037, 0.034, 0.015, 0.060, 0.062, 0.069, 0.015, 0.015, 0.019, 0.015),
    ),
}
FIT_DISTANCE, REJECT_DISTANCE = 6.0, 10.0
"""Distance to the shape's mean (root sum of squared deviations, in spreads) where the fit term
starts to fall, and where it reaches 0."""
FIT_DEVIATION, REJECT_DEVIATION = 3.5, 5.5
"""The same for the largest single-feature deviation (in spreads)."""
LENIENT_REJECT_DISTANCE, LENIENT_REJECT_DEVIATION = 20.0, 12.0
"""Where the fit term reaches 0 in lenient mode (``detect(..., lenient=True)``): rough, blob-like
shapes still get a small graded score, a denser RL signal (the gold metric never uses it)."""
_MEANS = np.asarray([m for m, _ in PROTOTYPES.values()])  # (S, F)
_SPREADS = np.asarray([s for _, s in PROTOTYPES.values()])  # (S, F)


def _to_hwc(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """``(3, H, W)`` float in [0, 1] or ``(H, W, 3)`` uint8 -> ``(H, W, 3)`` float32 in 0..255."""
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3 or not image.is_floating_point():
            raise ValueError(f"image tensor must be float of shape (3, H, W), got {image.dtype} {tuple(image.shape)}")
        return (image.detach().float().clamp(0, 1) * 255).permute(1, 2, 0).cpu().numpy()
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"image array must be uint8 of shape (H, W, 3), got {array.dtype} {array.shape}")
    return array.astype(np.float32)


def pixel_labels(pixels: np.ndarray) -> np.ndarray:
    """Colour of every pixel by the background-colour mixing model (see the module docstring).

    Args:
        pixels: ``(H, W, 3)`` float RGB in 0..255.

    Returns:
        ``(H, W)`` int64: ``k`` for ``COLOR_NAMES[k]``, -1 for background, -2 for unknown.
    """
    rel = pixels - _BG  # (H, W, 3)
    alpha = np.clip(rel @ _DIRS.T / (_DIRS**2).sum(1), 0.0, ALPHA_MAX)  # (H, W, K)
    residual = np.linalg.norm(rel[..., None, :] - alpha[..., None] * _DIRS, axis=-1)  # (H, W, K)
    best = residual.argmin(-1)  # (H, W)
    best_alpha = np.take_along_axis(alpha, best[..., None], -1)[..., 0]  # (H, W)
    best_residual = np.take_along_axis(residual, best[..., None], -1)[..., 0]  # (H, W)
    labels = np.where(best_alpha >= 0.5, best, -1)
    return np.where(best_residual > MAX_COLOR_DISTANCE, -2, labels)


def _hull_area(ys: np.ndarray, xs: np.ndarray) -> float:
    """Area of the convex hull of the pixels' unit squares."""
    corners = np.concatenate([np.stack([xs + dx, ys + dy], 1) for dx in (0, 1) for dy in (0, 1)])
    try:
        return float(ConvexHull(corners).volume)
    except QhullError:  # degenerate: all pixels on a line
        return float(len(ys))


def _lobes(ys: np.ndarray, xs: np.ndarray, bins: int = 24) -> np.ndarray:
    """Amplitudes of harmonics 1..5 of the radial profile (outermost radius per angle bin) / mean radius."""
    dy, dx = ys - ys.mean(), xs - xs.mean()
    bin_of = ((np.arctan2(dy, dx) + np.pi) * (bins / (2 * np.pi))).astype(int) % bins
    profile = np.zeros(bins)
    np.maximum.at(profile, bin_of, np.hypot(dy, dx) + 0.5)  # (bins,)
    return np.abs(np.fft.rfft(profile))[1:6] / profile.sum()  # (5,)


def shape_features(mask: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """Scale-invariant features of one object mask, in the order of ``FEATURES``.

    - fill: area / box area (square 1, circle 0.77, triangle 0.5, star 0.4).
    - solidity: area / area of the convex hull of the pixels' unit squares.
    - centroid_offset: ``|centroid height within the box - 0.5|`` (triangle 0.15; symmetric shapes 0).
    - log_aspect: ``|log(width / height)|``.
    - flip_iou: IoU of the box crop with its upside-down copy (1 for shapes symmetric about a row).
    - corners: mean fill of the four corner ninths of the box (square 1, cross 0).
    - lobes_low, lobes3, lobes4, lobes5: amplitudes of the radial profile's harmonics (1 and 2
      together, 3, 4 and 5) over the mean radius: triangles are 3-fold, squares and crosses 4-fold,
      stars 5-fold, and irregular blobs show low harmonics.

    Args:
        mask: ``(H, W)`` bool, one object's pixels (at least one pixel).

    Returns:
        ``(features, box)``: ``features`` float64 of shape ``(len(FEATURES),)``, each >= 0; ``box``
        ``(x0, y0, x1, y1)``, the mask's pixel extent with exclusive ends.
    """
    ys, xs = np.nonzero(mask)
    x0, y0, x1, y1 = int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1
    w, h = x1 - x0, y1 - y0
    crop = mask[y0:y1, x0:x1]  # (h, w)
    ty, tx = max(h // 3, 1), max(w // 3, 1)
    corner_fill = [crop[:ty, :tx].mean(), crop[:ty, -tx:].mean(), crop[-ty:, :tx].mean(), crop[-ty:, -tx:].mean()]
    lobes = _lobes(ys.astype(float), xs.astype(float))
    features = [
        len(ys) / (w * h),
        len(ys) / _hull_area(ys, xs),
        abs((ys.mean() + 0.5 - y0) / h - 0.5),
        abs(np.log(w / h)),
        (crop & crop[::-1]).sum() / (crop | crop[::-1]).sum(),
        np.mean(corner_fill),
        np.hypot(lobes[0], lobes[1]),
        *lobes[2:],
    ]
    return np.asarray(features, dtype=np.float64), (x0, y0, x1, y1)


def _ramp(x: float, start: float, stop: float) -> float:
    """1 up to ``start``, falling linearly to 0 at ``stop``."""
    return float(np.clip((stop - x) / (stop - start), 0.0, 1.0))


def classify(features: np.ndarray, lenient: bool = False) -> tuple[str, float]:
    """The most likely shape of an object and the confidence described in the module docstring.

    Args:
        features: float ``(len(FEATURES),)`` from ``shape_features``.
        lenient: let the fit term fall to 0 only at ``LENIENT_REJECT_DISTANCE`` and
            ``LENIENT_REJECT_DEVIATION`` (a graded score for rough shapes).

    Returns:
        ``(shape name, score)`` with score in [0, 1]; 0 means the object looks like no shape.
    """
    z = (features - _MEANS) / _SPREADS  # (S, F) deviations in spreads
    d = np.sqrt((z**2).sum(1))  # (S,)
    log_lik = -0.5 * d**2 - np.log(_SPREADS).sum(1)  # (S,) diagonal Gaussians, equal priors
    k = int(log_lik.argmax())
    posterior = 1.0 / np.exp(log_lik - log_lik[k]).sum()
    reject_d, reject_dev = (
        (LENIENT_REJECT_DISTANCE, LENIENT_REJECT_DEVIATION) if lenient else (REJECT_DISTANCE, REJECT_DEVIATION)
    )
    fit = _ramp(d[k], FIT_DISTANCE, reject_d) * _ramp(np.abs(z[k]).max(), FIT_DEVIATION, reject_dev)
    return list(PROTOTYPES)[k], float(posterior * fit)


def objects(image: torch.Tensor | np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Object masks of one image, before shape classification (steps 1 and 2 of the module docstring).

    Args:
        image: ``(3, H, W)`` float tensor in [0, 1], or ``(H, W, 3)`` uint8 array.

    Returns:
        ``[(colour name, (H, W) bool mask), ...]``, per colour in palette order, then by label.

    Raises:
        ValueError: for any other image shape or dtype.
    """
    pixels = _to_hwc(image)
    labels = pixel_labels(pixels)
    min_area = MIN_AREA * labels.size / IMAGE_SIZE**2
    eight = np.ones((3, 3), dtype=bool)
    out = []
    for k, name in enumerate(COLOR_NAMES):
        mask = labels == k
        if mask.sum() < min_area:
            continue
        components, _ = ndimage.label(mask, structure=eight)
        opened = ndimage.binary_opening(mask, structure=eight)
        keep = np.unique(components[opened])
        for lab in keep[keep > 0]:
            obj = ndimage.binary_fill_holes(components == lab)
            if obj.sum() >= min_area:
                out.append((name, obj))
    return out


def detect(image: torch.Tensor | np.ndarray, lenient: bool = False) -> list[Detection]:
    """Detect the tiny world's shapes in one image.

    Args:
        image: ``(3, H, W)`` float tensor with values in [0, 1] (any device), or an ``(H, W, 3)``
            uint8 numpy array (as ``flowrl.tiny.render`` returns).
        lenient: graded scores for rough shapes (see ``classify``); for RL rewards, not for evaluation.

    Returns:
        One ``Detection(cls, color, box, score)`` per object, in no particular order; ``box`` is
        ``(x0, y0, x1, y1)`` in pixels with exclusive ends, ``score`` the confidence in (0, 1]
        described in the module docstring. Empty for a blank background.

    Raises:
        ValueError: for any other image shape or dtype.
    """
    detections = []
    for color, mask in objects(image):
        features, box = shape_features(mask)
        shape, score = classify(features, lenient)
        if score > 0:
            detections.append(Detection(shape, color, tuple(float(v) for v in box), score))
    return detections


def detect_batch(images: torch.Tensor, lenient: bool = False) -> list[list[Detection]]:
    """``detect`` on each image of a batch.

    Args:
        images: ``(B, 3, H, W)`` float tensor with values in [0, 1], any device.
        lenient: passed to ``detect``.

    Returns:
        ``B`` lists of detections.

    Raises:
        ValueError: if ``images`` is not a ``(B, 3, H, W)`` tensor, or not floating point.
    """
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        got = tuple(images.shape) if hasattr(images, "shape") else type(images).__name__
        raise ValueError(f"images must be a tensor of shape (B, 3, H, W), got {got}")
    if not images.is_floating_point():
        raise ValueError(f"images must be floating point in [0, 1], got {images.dtype}")
    images = images.detach().float().cpu()
    return [detect(image, lenient) for image in images]
