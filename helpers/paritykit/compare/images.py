r"""Side-by-side images and videos of two runs: an amplified difference heatmap, PSNR and the largest pixel
difference per frame.

numpy, Pillow and matplotlib are imported inside the functions that need them, so importing this module is
cheap."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.files import refuse_overwriting_an_input, save_figure
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table
from paritykit.compare.steps import TENSOR_SUFFIXES

_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


_CHANNELS = (1, 3, 4)


# ============================================================================================================
# images and videos
# ============================================================================================================
@dataclass
class FrameStats:
    r"""PSNR and pixel differences of one image or video frame (pixels scaled to [0, 1])."""

    frame: int
    psnr: float
    max_abs: float
    mean_abs: float

    @property
    def max_pixel_diff(self) -> float:
        """Largest difference in 8-bit levels (0–255)."""
        return self.max_abs * 255.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "frame": self.frame,
            "psnr": self.psnr,
            "max_pixel_diff": self.max_pixel_diff,
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
        }


@dataclass
class ImageComparison:
    r"""Reference vs port images (or videos): PSNR, max pixel difference, and a side-by-side figure.

    Pixels are compared in [0, 1] after each side's value range is detected (``range_a``/``range_b``). For
    videos (and batches) every frame is measured; the verdict uses the *worst* frame. ``exit_code`` is 0 when
    every frame's PSNR is at least ``psnr_min`` dB, else 1 (also for different shapes)."""

    a: str
    b: str
    psnr_min: float
    status: str  # "pass" | "fail" | "shape_mismatch"
    shape_a: list[int]
    shape_b: list[int]
    range_a: str
    range_b: str
    frames: list[FrameStats] = field(default_factory=list)
    psnr_all: float | None = None
    chosen: list[tuple[int, str]] = field(default_factory=list)
    out_path: str | None = None
    video: bool = False
    range_note: str | None = None
    nonfinite: tuple[int, int] = (0, 0)  # NaN/Inf pixels in A and B (drawn as 0; any fails the comparison)
    _pixels: tuple[Any, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def worst(self) -> FrameStats | None:
        return min(self.frames, key=lambda f: f.psnr) if self.frames else None

    @property
    def psnr(self) -> float | None:
        """The worst frame's PSNR in dB (``inf`` when identical)."""
        return self.worst.psnr if self.frames else None

    @property
    def max_pixel_diff(self) -> float | None:
        return max(f.max_pixel_diff for f in self.frames) if self.frames else None

    @property
    def mean_abs(self) -> float | None:
        return sum(f.mean_abs for f in self.frames) / len(self.frames) if self.frames else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "images",
            "a": self.a,
            "b": self.b,
            "status": self.status,
            "passed": self.passed,
            "psnr": self.psnr,
            "psnr_all": self.psnr_all,
            "psnr_min": self.psnr_min,
            "max_pixel_diff": self.max_pixel_diff,
            "max_abs": None if not self.frames else max(f.max_abs for f in self.frames),
            "mean_abs": self.mean_abs,
            "shape_a": self.shape_a,
            "shape_b": self.shape_b,
            "range_a": self.range_a,
            "range_b": self.range_b,
            "range_note": self.range_note,
            "nonfinite_pixels": {"a": self.nonfinite[0], "b": self.nonfinite[1]},
            "video": self.video,
            "frames": [f.to_dict() for f in self.frames],
            "chosen_frames": [{"frame": i, "why": why} for i, why in self.chosen],
            "out": self.out_path,
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        lines = [f"images: {self.a} vs {self.b}"]
        lines.append(
            f"shape {self.shape_a} vs {self.shape_b} (frames×H×W×C); value range: A {self.range_a}, B"
            f" {self.range_b}"
        )
        if self.range_note:
            lines.append(f"note: {self.range_note}")
        for side, count in zip("AB", self.nonfinite):
            if count:
                lines.append(f"{side} has {count} NaN/Inf pixel values (drawn as 0): the comparison fails")
        if self.status == "shape_mismatch":
            lines.append("SHAPE MISMATCH: the images cannot be compared pixel by pixel")
            return "\n".join(lines)
        if self.video:
            rows = [[str(f.frame), f.psnr, f.max_pixel_diff, f.mean_abs] for f in self.frames]
            lines.append(render_table(["frame", "psnr_db", "max_pixel_diff", "mean_abs"], rows, limit=limit))
            lines.append(f"PSNR over all frames: {format_number(self.psnr_all)} dB")
        worst = self.worst
        where = f" (worst frame {worst.frame})" if self.video else ""
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(
            f"{verdict}: PSNR {format_number(self.psnr)} dB{where}, threshold {self.psnr_min:g} dB; max pixel"
            f" diff {format_number(self.max_pixel_diff)}/255; mean |diff| {format_number(self.mean_abs)}"
        )
        if self.out_path:
            lines.append(f"reference | port | diff heatmap: {self.out_path}")
        else:
            lines.append("add --out diff.png for reference | port | amplified diff heatmap")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        r"""Write reference | port | amplified ``|diff|`` heatmap as a PNG; one row per chosen frame."""
        if self._pixels is None:
            raise ParityKitError(f"{path}: nothing to draw (the images have different shapes)")
        path = Path(path)
        save_figure(self.figure(), path, format="png")
        self.out_path = str(path)
        return path

    def figure(self):
        r"""The matplotlib ``Figure`` :meth:`plot` saves (needs two images of the same shape).

        The heatmap draws ``|diff| × gain`` on a 0..1 colour scale, so its colorbar shows the amplified values
        the panel's title names (gain = 1 / the largest difference; the raw maximum is in the title too).
        """
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        pa, pb = self._pixels
        rows = self.chosen or [(0, "first")]
        diffs = [np.abs(pa[i] - pb[i]).max(axis=-1) for i, _ in rows]
        vmax = max(float(d.max()) for d in diffs)
        gain = 1.0 / vmax if vmax > 0 else 1.0
        h, w = pa.shape[1:3]
        panel = min(5.0, max(2.5, max(h, w) / 100))
        fig = Figure(figsize=(3 * panel * max(w / h, 0.5) + 1.0, len(rows) * panel + 0.6), dpi=100)
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(rows), 3, squeeze=False)
        for r, ((frame, why), diff) in enumerate(zip(rows, diffs)):
            stats = self.frames[frame]
            label = f"frame {frame} ({why})"
            for c, (img, title) in enumerate(((pa[frame], "reference"), (pb[frame], "port"))):
                ax = axes[r][c]
                ax.imshow(
                    _displayable(img),
                    cmap="gray" if img.shape[-1] == 1 else None,
                    vmin=0,
                    vmax=1,
                    interpolation="nearest",
                )
                ax.set_title(f"{title} — {label}" if c == 0 and self.video else title, fontsize=9)
                ax.axis("off")
            ax = axes[r][2]
            shown = ax.imshow(diff * gain, cmap="magma", vmin=0, vmax=1, interpolation="nearest")
            psnr = "inf" if math.isinf(stats.psnr) else f"{stats.psnr:.2f}"
            ax.set_title(f"|diff| ×{gain:.3g} (max {vmax:.3g})  PSNR {psnr} dB", fontsize=9)
            ax.axis("off")
            fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
        verdict = "PASS" if self.passed else "FAIL"
        fig.suptitle(
            f"{verdict}: PSNR {format_number(self.psnr)} dB (min {self.psnr_min:g}), "
            f"max pixel diff {format_number(self.max_pixel_diff)}/255",
            fontsize=10,
        )
        fig.tight_layout()
        return fig


def _displayable(img):
    if img.shape[-1] == 1:
        return img[..., 0]
    if img.shape[-1] == 4:
        return img[..., :3]
    return img


def _label(x: Any) -> str:
    if isinstance(x, (str, Path)):
        return str(x)
    shape = getattr(x, "shape", None) or getattr(x, "size", None)
    return f"<{type(x).__name__} {tuple(shape) if shape is not None else ''}>".replace(" ()", "")


def _pil_array(img: Any):
    import numpy as np

    mode = "L" if img.mode in ("1", "L", "I", "I;16", "F") else "RGB"
    return np.asarray(img.convert(mode))


def _load_image_source(x: Any, label: str) -> tuple[Any, bool, bool]:
    """Return ``(array_like, channels_first_likely, is_sequence_of_frames)`` for any accepted input."""
    import numpy as np

    if isinstance(x, (str, Path)):
        path = Path(x)
        if path.is_dir():
            raise ParityKitError(f"{path}: is a folder; give an image or tensor file")
        if not path.is_file():
            raise ParityKitError(f"{path}: no such image or tensor file")
        suffix = path.suffix.lower()
        if suffix in _IMAGE_SUFFIXES:
            from PIL import Image, UnidentifiedImageError

            try:
                with Image.open(path) as img:
                    count = getattr(img, "n_frames", 1)
                    frames = []
                    for i in range(count):
                        img.seek(i)
                        frames.append(_pil_array(img))
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
                # a damaged PNG reaches PIL's decoders as SyntaxError ("broken PNG file") or ValueError
                raise ParityKitError(
                    f"{path}: cannot read this image ({type(exc).__name__}: {exc})"
                ) from None
            return (np.stack(frames) if count > 1 else frames[0]), False, count > 1
        if suffix in TENSOR_SUFFIXES:
            from paritykit.base.io import load_tensors

            tensors = load_tensors(path)
            if len(tensors) != 1:
                names = [
                    n for n in tensors if n.rsplit("/", 1)[-1] in ("image", "images", "sample", "frames")
                ]
                if len(names) != 1:
                    raise ParityKitError(
                        f"{path}: holds {len(tensors)} tensors; expected one image/video tensor "
                        "(or one named image, images, sample or frames)"
                    )
                return tensors[names[0]], True, False
            return next(iter(tensors.values())), True, False
        raise ParityKitError(
            f"{path}: unknown suffix {suffix!r} (images: {', '.join(_IMAGE_SUFFIXES)}; "
            f"tensors: {', '.join(TENSOR_SUFFIXES)})"
        )
    if hasattr(x, "convert") and hasattr(x, "mode"):  # a PIL image
        return _pil_array(x), False, False
    if isinstance(x, (list, tuple)):
        if not x:
            raise ParityKitError(f"{label}: empty list of frames")
        frames = [_load_image_source(f, label)[0] for f in x]
        frames = [f.detach().float().cpu().numpy() if hasattr(f, "detach") else np.asarray(f) for f in frames]
        return np.stack(frames), hasattr(x[0], "detach"), True
    if hasattr(x, "detach"):
        return x, True, False
    if isinstance(x, np.ndarray):
        return x, False, False
    raise ParityKitError(
        f"{label}: expected a PIL image, numpy array, torch tensor, or an image/tensor file path"
    )


def _to_frames(arr: Any, channels_first: bool, label: str):
    """Any image/video layout -> float array F×H×W×C."""
    import numpy as np

    shape = arr.shape
    if arr.ndim == 5:
        if shape[0] != 1:
            raise ParityKitError(f"{label}: shape {list(shape)} is a batch of videos; pass one video")
        arr, shape = arr[0], arr.shape[1:]
    if arr.ndim == 2:
        return arr[None, :, :, None]
    if arr.ndim == 3:
        first, last = shape[0] in _CHANNELS, shape[-1] in _CHANNELS
        if first and (channels_first or not last):
            return np.moveaxis(arr, 0, -1)[None]
        if last:
            return arr[None]
        return arr[..., None]  # F×H×W grayscale frames
    if arr.ndim == 4:
        c1, c_last, c0 = shape[1] in _CHANNELS, shape[-1] in _CHANNELS, shape[0] in _CHANNELS
        if c1 and (channels_first or not c_last):
            return np.moveaxis(arr, 1, -1)
        if c_last:
            return arr
        if c0:
            return np.moveaxis(arr, 0, -1)  # C×F×H×W
    raise ParityKitError(
        f"{label}: cannot read shape {list(shape)} as an image (H×W[×C], C×H×W) or video (F×H×W×C, F×C×H×W)"
    )


_RANGES = {"0..1": (0.0, 1.0), "-1..1": (-1.0, 1.0), "0..255": (0.0, 255.0)}


def _normalise(x: Any, label: str, value_range: str = "auto", flag: str = "--range-a"):
    r"""Any accepted input -> (float32 F×H×W×C in [0, 1], detected range, is_video, non-finite pixel count).

    ``flag`` is the CLI option that sets this side's range (``--range-a``/``--range-b``), named in errors.

    NaN/Inf pixels are a finding, not bad input (a port that renders NaN is the commonest way to differ): they
    are counted, drawn as 0 and fail the comparison.
    """
    import numpy as np

    raw, channels_first, is_sequence = _load_image_source(x, label)
    if hasattr(raw, "detach"):
        raw = raw.detach().cpu()
        if raw.dtype.is_floating_point:
            raw = raw.float()
        raw = raw.numpy()
    arr = np.asarray(raw)
    nonfinite = 0
    if arr.dtype == np.uint8:
        detected, arr = "0..255 (uint8)", arr.astype(np.float32) / 255.0
    elif arr.dtype == np.uint16:
        detected, arr = "0..65535 (uint16)", arr.astype(np.float32) / 65535.0
    elif arr.dtype == np.bool_:
        detected, arr = "0..1 (bool)", arr.astype(np.float32)
    elif np.issubdtype(arr.dtype, np.number):
        arr = arr.astype(np.float32)
        finite = np.isfinite(arr)
        nonfinite = int(arr.size - np.count_nonzero(finite))
        if nonfinite:
            arr = np.where(finite, arr, np.float32(0.0))
        detected = value_range if value_range != "auto" else _detect_range(arr, label, flag)
        if detected not in _RANGES:
            raise ParityKitError(
                f"{label}: {flag} {detected!r}: expected auto, 0..1, -1..1 or 0..255 (value_range in Python)"
            )
        lo, hi = _RANGES[detected]
        arr = (arr - lo) / (hi - lo)
    else:
        raise ParityKitError(f"{label}: unsupported pixel dtype {arr.dtype}")
    frames = _to_frames(arr, channels_first, label)
    video = is_sequence or frames.shape[0] > 1
    return np.clip(frames, 0.0, 1.0).astype(np.float32), detected, video, nonfinite


def _detect_range(arr: Any, label: str, flag: str = "--range-a") -> str:
    r"""[-1, 1] when there are negative values; [0, 1] up to a 10% overshoot; [0, 255] above that."""
    lo, hi = float(arr.min()), float(arr.max())
    if lo < -1e-6:
        if lo >= -1.1 and hi <= 1.1:
            return "-1..1"
    elif hi <= 1.1:
        return "0..1"
    elif hi <= 255.0 + 1e-3:
        return "0..255"
    raise ParityKitError(
        f"{label}: values span [{lo:.4g}, {hi:.4g}]; expected [0, 1], [-1, 1] or [0, 255]: pass {flag} with "
        "the range to read them in (value_range in Python)"
    )


def compare_images(
    a: Any,
    b: Any,
    *,
    psnr_min: float = 40.0,
    out: str | Path | None = None,
    value_range: str | tuple[str, str] = "auto",
) -> ImageComparison:
    r"""Compare a reference image (or video) with the port's: PSNR, max pixel difference, side-by-side figure.

    Args:
        a: the reference — a PIL image, a numpy array, a torch tensor, a list of frames, or a path to an image
            file (``.png``, ``.jpg``, …; animated GIFs are videos) or a tensor file (``.pt``,
            ``.safetensors``,
            ``.npy``, …). Arrays may be H×W, H×W×C, C×H×W (torch), F×H×W×C or F×C×H×W (videos, batches), or
            1×… with a leading batch of one.
        b: the port's image, in any of the same forms.
        psnr_min: the pass threshold in dB, applied to the worst frame.
        out: if given, write reference | port | amplified diff heatmap there (PNG; for videos one row per
            chosen
            frame: worst, first, last).
        value_range: ``"auto"`` (uint8 -> 0..255; floats: [-1, 1] when any value is negative, else [0, 1], or
            [0, 255] above 1.1; when one side reads as [-1, 1] and the other as [0, 1] but reading both as
            [-1, 1] matches over 4× better in mean squared difference, both are read as [-1, 1] and
            ``range_note`` says so), or ``"0..1"``, ``"-1..1"``, ``"0..255"``; a pair sets each side.

    Returns:
        An :class:`ImageComparison`; ``exit_code`` 0 at or above ``psnr_min``, 1 below it or on a shape
        mismatch.
    """
    import numpy as np

    refuse_overwriting_an_input("--out", out, a, b)
    label_a, label_b = _label(a), _label(b)
    range_a, range_b = (value_range, value_range) if isinstance(value_range, str) else value_range
    pa, detected_a, video_a, nonfinite_a = _normalise(a, label_a, range_a, "--range-a")
    pb, detected_b, video_b, nonfinite_b = _normalise(b, label_b, range_b, "--range-b")
    if pa.shape[-1] != pb.shape[-1] and 1 in (pa.shape[-1], pb.shape[-1]):
        channels = max(pa.shape[-1], pb.shape[-1])
        pa = np.repeat(pa, channels, axis=-1) if pa.shape[-1] == 1 else pa
        pb = np.repeat(pb, channels, axis=-1) if pb.shape[-1] == 1 else pb
    result = ImageComparison(
        a=label_a,
        b=label_b,
        psnr_min=float(psnr_min),
        status="shape_mismatch",
        shape_a=list(pa.shape),
        shape_b=list(pb.shape),
        range_a=detected_a,
        range_b=detected_b,
        video=video_a or video_b,
        nonfinite=(nonfinite_a, nonfinite_b),
    )
    if pa.shape != pb.shape:
        return result
    if {detected_a, detected_b} == {"-1..1", "0..1"} and range_a == range_b == "auto":
        # A [-1, 1] image need not contain a negative value (a bright picture): when reading the non-negative
        # side as [-1, 1] too matches far better, that is the likelier reading.
        mixed = float(np.mean((pa.astype(np.float64) - pb) ** 2))
        if detected_a == "0..1":
            alt_a, alt_b = (pa + 1.0) / 2.0, pb
        else:
            alt_a, alt_b = pa, (pb + 1.0) / 2.0
        both = float(np.mean((alt_a.astype(np.float64) - alt_b) ** 2))
        if both < mixed / 4:
            side = "A" if detected_a == "0..1" else "B"
            pa, pb = alt_a.astype(np.float32), alt_b.astype(np.float32)
            result.range_a = result.range_b = "-1..1"
            result.range_note = (
                f"{side} has no negative values but reads as [-1, 1] like the other side "
                f"(mean squared difference {both:.3g} vs {mixed:.3g} as [0, 1]); set value_range to override"
            )

    frames = []
    total_sq = 0.0
    for i in range(pa.shape[0]):
        diff = pa[i].astype(np.float64) - pb[i].astype(np.float64)
        sq = float(np.mean(diff * diff))
        total_sq += sq
        frames.append(
            FrameStats(
                frame=i,
                psnr=math.inf if sq == 0 else 10.0 * math.log10(1.0 / sq),
                max_abs=float(np.abs(diff).max()),
                mean_abs=float(np.abs(diff).mean()),
            )
        )
    mse_all = total_sq / len(frames)
    result.frames = frames
    result.psnr_all = math.inf if mse_all == 0 else 10.0 * math.log10(1.0 / mse_all)
    passed = min(f.psnr for f in frames) >= psnr_min and not (nonfinite_a or nonfinite_b)
    result.status = "pass" if passed else "fail"
    worst = min(frames, key=lambda f: f.psnr).frame
    chosen: dict[int, list[str]] = {}
    for frame, why in ((worst, "worst"), (0, "first"), (len(frames) - 1, "last")):
        chosen.setdefault(frame, []).append(why)
    result.chosen = sorted((i, "+".join(w)) for i, w in chosen.items())
    result._pixels = (pa, pb)
    if out is not None:
        result.plot(out)
    return result
