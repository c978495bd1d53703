"""Images in shards: which members are images, and any PIL mode as 8 bits per channel."""

from __future__ import annotations

import numpy as np
from PIL import Image

# Member extensions read as a sample's image, in order of preference; PIL decodes them all.
# The one list: the shard inspector checks them and folder sources pick up files with them.
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp", "bmp", "ppm", "pgm", "pbm", "tif", "tiff", "gif")

# PIL's own default for Image.MAX_IMAGE_PIXELS: about 0.25 GiB of RGB pixels (a 9459 px square).
DEFAULT_MAX_PIXELS = 89_478_485


def is_16bit(mode: str) -> bool:
    """Whether a PIL mode is one 16-bit PNG and TIFF images open in: "I" (32-bit integers), "I;16", "I;16B", ..."""
    return mode == "I" or mode.startswith("I;16")


def to_8bit(image: Image.Image) -> Image.Image:
    """Any PIL mode -> "L" or "RGB" with 8 bits per channel; alpha is composited on black."""
    mode = image.mode
    if mode in ("L", "RGB"):
        return image
    if mode == "1":
        return image.convert("L")
    if is_16bit(mode):
        # Map 0..65535 onto 0..255, rounding (Pillow's own convert clips at 255). The writer stores them so.
        wide = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        return Image.fromarray(((wide + 128) // 257).astype(np.uint8), "L")
    if mode == "F":
        # Float images are taken to hold intensities in [0, 1].
        unit = np.nan_to_num(np.asarray(image, dtype=np.float32), nan=0.0)
        return Image.fromarray(np.rint(np.clip(unit, 0.0, 1.0) * 255).astype(np.uint8), "L")
    alpha = mode in ("LA", "La", "RGBA", "RGBa", "PA") or "transparency" in image.info
    if mode in ("LA", "La"):
        return _on_black(image.convert("LA"), "L")
    if alpha:
        return _on_black(image.convert("RGBA"), "RGB")
    return image.convert("RGB")  # P, CMYK, YCbCr, LAB, HSV, RGBX


def _on_black(image: Image.Image, mode: str) -> Image.Image:
    """Composite an image with an alpha band over black: colour * alpha / 255."""
    canvas = Image.new(mode, image.size, 0)
    canvas.paste(image.convert(mode), mask=image.getchannel("A"))
    return canvas
