"""Per-sample image work for the shard pipeline: decode, any PIL mode -> 8-bit, crop, resize, to the
size and channels the encoder takes.

Everything happens in PIL on one sample's encoded bytes; the result is a uint8 array
(H, W, C) with no normalisation (the model needs raw pixels for its colour targets), which
the data pipeline collates into (B, C, H, W) tensors. With decode="device" a JPEG's pixels are
left encoded: the worker reads its header and draws its crop and flip, and the device does the
rest (mpp.data.device_decode).
"""

from __future__ import annotations

import io
import math
import random
import zlib
from typing import NamedTuple, Protocol

import numpy as np
from PIL import Image

from mpp.shards.images import DEFAULT_MAX_PIXELS, to_8bit

Box = tuple[float, float, float, float]  # (left, top, right, bottom) in source pixels

# What a broken image raises while PIL reads or decodes it.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, zlib.error, Image.DecompressionBombError)

# The JPEG modes that decode on a device as PIL decodes them; others (CMYK) are decoded in the worker.
DEVICE_JPEG_MODES = ("L", "RGB")


class EncodedJpeg(NamedTuple):
    """A JPEG left for the device to decode (decode="device"), with the crop box and flip drawn for it."""

    data: bytes
    box: Box
    flip: bool
    name: str = ""  # "sample <key> of <shard>", for messages


class Encoder(Protocol):
    """What images must fit: an encoder's config (mpp.model.vit.ViTConfig), read for its size and channels."""

    @property
    def image_size(self) -> int | tuple[int, int]: ...

    @property
    def channels(self) -> int: ...


def pair(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """An int or a (height, width) pair as a (height, width) tuple."""
    if isinstance(size, int):
        return (size, size)
    height, width = size
    return (int(height), int(width))


def fitted_shape(
    size: tuple[int, int] | None, channels: int | None, encoder: Encoder | None
) -> tuple[tuple[int, int], int]:
    """(H, W) and channels of the images: those set (None: unset), else the encoder's, else (224, 224) and 3;
    a size or channels set that differ from the encoder's are an error naming both keys."""
    if encoder is None:
        return size or (224, 224), channels or 3
    wanted_size, wanted_channels = pair(encoder.image_size), encoder.channels
    for name, value, wanted in (("image_size", size, wanted_size), ("channels", channels, wanted_channels)):
        if value is not None and value != wanted:
            raise ValueError(
                f"data.{name}={_plain(value)} does not fit the encoder's model.init_args.encoder.{name}="
                f"{_plain(wanted)}: leave data.{name} unset (it follows the encoder) or make the two equal"
            )
    return wanted_size, wanted_channels


def _plain(value: object) -> object:
    """A size as a user writes it: 224 for (224, 224)."""
    return value[0] if isinstance(value, tuple) and len(set(value)) == 1 else value


def random_resized_box(
    width: int, height: int, *, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> Box:
    """A random crop covering a `scale` fraction of the area with aspect w/h in `ratio` (Inception-style)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(0, width - w)
            top = rng.randint(0, height - h)
            return (left, top, left + w, top + h)
    # No draw fitted (extreme ratios or tiny images): the largest centred crop within `ratio`.
    aspect = min(max(width / height, ratio[0]), ratio[1])
    fit_w, fit_h = (width, width / aspect) if width / height <= aspect else (height * aspect, height)
    return ((width - fit_w) / 2, (height - fit_h) / 2, (width + fit_w) / 2, (height + fit_h) / 2)


def center_box(width: int, height: int, *, size: tuple[int, int], crop_fraction: float) -> Box:
    """The centred region kept by "resize to cover size / crop_fraction, then centre-crop size"."""
    out_h, out_w = size
    zoom = max(out_h / crop_fraction / height, out_w / crop_fraction / width)
    w, h = out_w / zoom, out_h / zoom
    return ((width - w) / 2, (height - h) / 2, (width + w) / 2, (height + h) / 2)


class ImageTransform:
    """Encoded image bytes -> uint8 array (H, W, channels).

    Training: random resized crop (`scale`, `ratio`) and, if `hflip`, a horizontal flip half
    of the time. Evaluation: resize to cover size / crop_fraction, then centre-crop `size`.
    Images smaller than the crop are upscaled. Picklable, so DataLoader workers can use it.

    An image whose header declares more than `max_pixels` pixels raises
    Image.DecompressionBombError before any pixel is decoded. PIL's own guard only warns up
    to twice Image.MAX_IMAGE_PIXELS, and past that refuses regardless of `max_pixels`.

    `for_device` is the worker's part of decode="device": it draws a JPEG's box and flip with the
    same calls on `rng` as __call__, so a seed gives the same crops and flips on either path, and
    leaves the pixels to the device; `finish` is the CPU path for a box and flip drawn before.
    """

    def __init__(
        self,
        *,
        size: tuple[int, int],
        channels: int,
        train: bool,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: bool = True,
        crop_fraction: float = 0.875,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.size, self.channels, self.train = size, channels, train
        self.scale, self.ratio, self.hflip, self.crop_fraction = scale, ratio, hflip, crop_fraction
        self.max_pixels = max_pixels

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        """Decode, crop and resize one image -> (H, W, channels) uint8."""
        image = self._open(data)
        resized = self._resized(image, self._box(image, rng))
        return self._finished(resized, self._flip(rng))  # a flip is drawn only for an image that decoded

    def for_device(self, data: bytes, rng: random.Random) -> np.ndarray | EncodedJpeg:
        """A JPEG's bytes with its box and flip, drawn as __call__ draws them; any other image finished here."""
        image = self._open(data)
        box = self._box(image, rng)
        if image.format != "JPEG" or image.mode not in DEVICE_JPEG_MODES:
            return self._finished(self._resized(image, box), self._flip(rng))
        return EncodedJpeg(data, box, self._flip(rng))

    def finish(self, data: bytes, box: Box, flip: bool) -> np.ndarray:
        """The CPU path for a box and flip drawn before -> (H, W, channels) uint8."""
        return self._finished(self._resized(self._open(data), box), flip)

    def _open(self, data: bytes) -> Image.Image:
        image: Image.Image = Image.open(io.BytesIO(data))  # reads the header only; pixels are decoded on first use
        if image.width * image.height > self.max_pixels:
            raise Image.DecompressionBombError(
                f"a {image.width}x{image.height} image has {image.width * image.height} pixels, over the "
                f"limit of {self.max_pixels} (max_image_pixels)"
            )
        return image

    def _box(self, image: Image.Image, rng: random.Random) -> Box:
        if self.train:
            return random_resized_box(image.width, image.height, scale=self.scale, ratio=self.ratio, rng=rng)
        return center_box(image.width, image.height, size=self.size, crop_fraction=self.crop_fraction)

    def _flip(self, rng: random.Random) -> bool:
        return self.train and self.hflip and rng.random() < 0.5

    def _resized(self, image: Image.Image, box: Box) -> Image.Image:
        box = _draft(image, box, self.size, self.channels)
        image = to_8bit(image)
        out_h, out_w = self.size
        # One resize with `box` crops and scales in a single pass, with no intermediate copy.
        return image.resize((out_w, out_h), Image.Resampling.BILINEAR, box=box)

    def _finished(self, image: Image.Image, flip: bool) -> np.ndarray:
        if flip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        wanted = "L" if self.channels == 1 else "RGB"
        if image.mode != wanted:  # converted after the resize, where it touches fewer pixels
            image = image.convert(wanted)
        pixels = np.asarray(image)  # (H, W) or (H, W, C), read-only
        return pixels[:, :, None] if pixels.ndim == 2 else pixels


def _draft(image: Image.Image, box: Box, size: tuple[int, int], channels: int) -> Box:
    """Let a JPEG decode at 1/2..1/8 scale (grey if wanted) where the crop still covers `size`.

    Returns the crop box in the drafted image's pixels; other formats pass through unchanged.
    """
    if image.format != "JPEG":
        return box
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    # The full-image size at which the crop still has at least as many pixels as the output.
    wanted = (math.ceil(image.width * size[1] / crop_w), math.ceil(image.height * size[0] / crop_h))
    width = image.width
    drafted = image.draft("L" if channels == 1 else "RGB", wanted)
    if drafted is None:
        return box
    shrink = drafted[1][2] / width
    return (box[0] * shrink, box[1] * shrink, box[2] * shrink, box[3] * shrink)
