"""decode="device": JPEGs leave the DataLoader workers encoded and are decoded on the device.

A GPU node's CPUs decode a few hundred JPEGs a second each, fewer than the GPU trains on. With
ShardDataModule(decode="device") a worker reads a JPEG's header only (its size, for the crop and
the max_image_pixels check), draws its crop box and flip with the CPU path's calls on the
stream's rng, and sends the bytes, packed with their boxes and flips under the batch's "jpegs"
(mpp.data.batches.StreamBatch). In the data module's transfer_batch_to_device the batch's
JPEGs are then decoded together on the batch's device (torchvision.io.decode_jpeg: batched
nvjpeg on CUDA, libjpeg on the CPU), and each is cropped, resized and flipped here. Other
images (PNG, CMYK JPEGs, ...) are finished in the worker as on the CPU path and travel decoded.

`finish_on_device` makes of it the batch every module gets, on the device, in the stream's
order: {"image": uint8 (B', C, H, W), "label": (B',), "skipped"}. A JPEG that the device cannot
decode is decoded by the CPU path in this process; one that fails there too is dropped and
counted in "skipped", so B' can be less than B.

Against decode="cpu" with the same seed: the same samples, boxes and flips, and the same resize:
PIL's BILINEAR resize with a box, redone here in PIL's integer arithmetic (a triangle filter
widened by the scale when downscaling, PIL's antialiasing, reading pixels outside the box, in
22-bit fixed point, rounded to 8 bits after each pass, the passes in Pillow 13's order). On the
CPU, where torchvision and PIL both decode with libjpeg-turbo, the images are identical. Two
things differ. On a GPU, nvjpeg decodes with an IDCT and chroma upsampling of its own, so pixels
may be a few levels apart. And where a crop covers twice the output or more in both directions, the
CPU path lets libjpeg decode at 1/2..1/8 scale (PIL's draft), which has no device equivalent:
the device decodes the full image, so there the two are different downscales of one region
(on photo-like images about a level apart on average, tens of levels at sharp edges). After a
JPEG that fails to decode the streams part: the CPU path draws no flip for it, the worker here
already has.
"""

from __future__ import annotations

import importlib
import logging
import math
from types import ModuleType

import torch
from torch import Tensor

from mpp.data.batches import Batch, Crop, StreamBatch
from mpp.data.transforms import DECODE_ERRORS, Box, ImageTransform
from mpp.errors import ConfigError
from mpp.secrets import redact

log = logging.getLogger(__name__)

EXTRA = "gpu-decode"  # the package extra that installs torchvision (pyproject.toml)


def torchvision_io() -> ModuleType:
    """torchvision.io, imported on first use; missing or unusable, a ConfigError naming the extra."""
    try:
        return importlib.import_module("torchvision.io")
    except (ImportError, RuntimeError, OSError) as error:  # one built for another torch fails loading its ops
        raise ConfigError(
            f"data.decode=device needs torchvision built for the installed torch {torch.__version__}: install "
            f"the matching release, e.g. `pip install 'mpp[{EXTRA}]'` (importing torchvision failed: {error})"
        ) from error


def finish_on_device(batch: StreamBatch, device: torch.device, transform: ImageTransform) -> Batch:
    """A worker's batch with encoded JPEGs -> {"image": uint8 (B', C, H, W), "label", "skipped"} on `device`.

    `transform` is the CPU path for the JPEGs the device cannot decode (any split's will do:
    the boxes and flips were drawn in the worker).
    """
    jpegs = batch["jpegs"]
    labels, count = batch["label"], len(batch["label"])
    images = torch.empty((count, transform.channels, *transform.size), dtype=torch.uint8, device=device)
    encoded_at = {crop.at for crop in jpegs.crops}
    finished_at = [at for at in range(count) if at not in encoded_at]
    if finished_at:
        images[_moved(torch.tensor(finished_at), device)] = _moved(batch["image"], device)
    encoded = list(torch.split(jpegs.data, [crop.size for crop in jpegs.crops]))
    decoded = _decode(encoded, transform.channels, device)
    on_device = [(crop, image) for crop, image in zip(jpegs.crops, decoded) if isinstance(image, Tensor)]
    if on_device:
        crops, pixels = [crop for crop, _ in on_device], [image for _, image in on_device]
        resized = resize_crops(pixels, [crop.box for crop in crops], [crop.flip for crop in crops], transform.size)
        images[_moved(torch.tensor([crop.at for crop in crops]), device)] = resized
    failed = [(crop, data, why) for crop, data, why in zip(jpegs.crops, encoded, decoded) if isinstance(why, str)]
    dropped = _on_the_cpu(images, failed, transform)
    if dropped:
        keep = [at for at in range(count) if at not in dropped]
        images, labels = images[_moved(torch.tensor(keep), device)], labels[keep]
    return {
        "image": images,
        "label": _moved(labels, device),
        "skipped": _moved(batch["skipped"] + len(dropped), device),
    }


def _moved(tensor: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without waiting there: a blocking copy to a GPU would first wait for
    the work queued on it (the last training step), and a non-blocking one needs pinned memory."""
    if device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _on_the_cpu(images: Tensor, failed: list[tuple[Crop, Tensor, str]], transform: ImageTransform) -> set[int]:
    """The JPEGs that failed on the device, (crop, bytes, why), through the CPU path into their places
    in `images`; returns the places of those that failed there too."""
    dropped = set()
    for crop, data, why in failed:
        try:
            finished = transform.finish(data.numpy().tobytes(), crop.box, crop.flip)
        except DECODE_ERRORS as error:
            _report(crop, f"{why}; the CPU path failed too, {type(error).__name__}: {error}; skipped")
            dropped.add(crop.at)
            continue
        _report(crop, f"{why}; decoded on the CPU instead")
        images[crop.at] = _moved(torch.tensor(finished).permute(2, 0, 1), images.device)
    return dropped


def resize_crops(images: list[Tensor], boxes: list[Box], flips: list[bool], size: tuple[int, int]) -> Tensor:
    """Decoded uint8 (C, h_k, w_k) images -> uint8 (K, C, H, W): each `box` resized to `size` (H, W) as
    PIL's BILINEAR resize with a box does it (in its integer arithmetic), then flipped where `flips` says."""
    device, (out_h, out_w) = images[0].device, size
    rows = [_span(box[1], box[3], out_h, image.shape[1]) for image, box in zip(images, boxes)]
    cols = [_span(box[0], box[2], out_w, image.shape[2]) for image, box in zip(images, boxes)]
    row_taps, row_weights = _filter([(box[1], box[3], r0, r1) for box, (r0, r1) in zip(boxes, rows)], out_h, device)
    col_taps, col_weights = _filter([(box[0], box[2], c0, c1) for box, (c0, c1) in zip(boxes, cols)], out_w, device)
    out = torch.empty((len(images), images[0].shape[0], out_h, out_w), dtype=torch.uint8, device=device)
    for k, image in enumerate(images):
        (r0, r1), (c0, c1) = rows[k], cols[k]
        across, down = (col_taps[k], col_weights[k], -1), (row_taps[k], row_weights[k], -2)
        # Pillow 13's order: vertical first where the height shrinks by over twice as many pixels as the width.
        shrink_h, shrink_w = image.shape[1] - out_h, image.shape[2] - out_w
        first, second = (down, across) if shrink_h > 0 and shrink_h > 2 * shrink_w else (across, down)
        out[k] = _resample(_resample(image[:, r0:r1, c0:c1], *first), *second)
    flipped = [k for k, flip in enumerate(flips) if flip]
    if flipped:
        index = _moved(torch.tensor(flipped), device)
        out[index] = out[index].flip(-1)
    return out


# PIL's 8-bit resampling: weights in fixed point with 22 fractional bits, rounded to 8 bits after each pass.
_BITS = 22


def _resample(pixels: Tensor, taps: Tensor, weights: Tensor, dim: int) -> Tensor:
    """One pass of the filter over (C, h, w) pixels along `dim`, -1 (across) or -2 (down), through its taps
    (out, taps) and fixed-point weights -> (C, h, out) or (C, out, w) int32 pixel values, 0..255."""
    if dim == -1:
        total = (pixels[:, :, taps] * weights).sum(-1, dtype=torch.int32)  # (C, h, out, taps) -> (C, h, out)
    else:
        total = (pixels[:, taps] * weights[..., None]).sum(2, dtype=torch.int32)  # (C, out, taps, w) -> (C, out, w)
    # Rounded as PIL rounds; no clipping: the weights are positive and sum to 1 (to 2^-23 a tap).
    return (total + (1 << (_BITS - 1))) >> _BITS


def _span(low: float, high: float, out: int, extent: int) -> tuple[int, int]:
    """The pixels [first, last) of an axis of `extent` that the filter resizing the box side [low, high)
    to `out` pixels reaches, and one more each side (the device computes the taps in floats of its own)."""
    support = max((high - low) / out, 1.0)
    return max(math.floor(low - support) - 1, 0), min(math.ceil(high + support) + 1, extent)


def _filter(sides: list[tuple[float, float, int, int]], out: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """PIL's bilinear filter along one axis of each image: (low, high) of the box side and the span
    [first, last) of pixels it reaches -> tap indices (K, out, taps) into the span and their
    fixed-point weights (int32).

    As PIL computes it: the box in float32; output pixel i centred at low + (i + 0.5) * scale;
    pixel j weighing 1 - |j + 0.5 - centre| / support, support = max(scale, 1) (widened when
    downscaling, so that every source pixel counts: PIL's antialiasing), within the image only,
    normalised to sum 1, then rounded to 22 fractional bits. Zero-weight taps pad each row.
    """
    box = torch.tensor([side[:2] for side in sides], dtype=torch.float32).double()
    scale = (box[:, 1].float() - box[:, 0].float()).double() / out  # PIL subtracts in float32
    span = torch.tensor([side[2:] for side in sides], dtype=torch.float64)
    taps = 2 * math.ceil(max(scale.max().item(), 1.0)) + 1
    low, scale, first, last = _moved(torch.stack([box[:, 0], scale, span[:, 0], span[:, 1]]), device)
    support = scale.clamp(min=1.0)[:, None, None]
    centre = low[:, None] - first[:, None] + (torch.arange(out, device=device) + 0.5) * scale[:, None]  # (K, out)
    start = (centre - support[..., 0] + 0.5).floor().clamp(min=0)
    index = start[..., None] + torch.arange(taps, device=device)  # (K, out, taps), in the span's pixels
    weight = (1 - (index + 0.5 - centre[..., None]).abs() * (1 / support)).clamp(min=0)
    extent = (last - first)[:, None, None]
    weight = weight * (index < extent)
    weight = weight / weight.sum(-1, keepdim=True)
    fixed = (weight * (1 << _BITS) + 0.5).floor().int()
    return torch.minimum(index, extent - 1).long(), fixed


def _decode(encoded: list[Tensor], channels: int, device: torch.device) -> list[Tensor | str]:
    """JPEG bytes -> uint8 (channels, h, w) images on `device`, or for each that fails, why.

    On a GPU the decoder runs on a stream of its own (_decoder_stream), whose outputs are then marked
    as used by the caller's stream, which resizes them.
    """
    if not encoded:
        return []
    if device.type != "cuda":
        return _decode_on(encoded, channels, device)
    caller, own = torch.cuda.current_stream(device), _decoder_stream(device)
    with torch.cuda.stream(own):
        decoded = _decode_on(encoded, channels, device)
    own.synchronize()  # nothing of this decode is still queued when the next one is handed memory
    for image in decoded:
        if isinstance(image, Tensor):
            image.record_stream(caller)  # not recycled on `own` before the caller's kernels have read it
    return decoded


_decoder_streams: dict[torch.device, torch.cuda.Stream] = {}


def _decoder_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a GPU's JPEGs are decoded under. torchvision's decode_jpeg on CUDA (nvJPEG) writes on
    a private stream that does not wait for the current one, into outputs the caching allocator hands
    out on the current stream: on the training stream, memory that its queued kernels (the step before)
    may still read, which then fail in ways unrelated to decoding (an index out of bounds in a compiled
    step, seen on an H200). A stream with no other work hands out only memory that no kernel still reads."""
    if device not in _decoder_streams:
        _decoder_streams[device] = torch.cuda.Stream(device=device)
    return _decoder_streams[device]


def _decode_on(encoded: list[Tensor], channels: int, device: torch.device) -> list[Tensor | str]:
    """_decode's work, on the current stream."""
    io = torchvision_io()
    mode = io.ImageReadMode.GRAY if channels == 1 else io.ImageReadMode.RGB
    try:
        return list(io.decode_jpeg(encoded, mode=mode, device=device))
    except RuntimeError:
        pass  # one bad JPEG fails the whole call: decode them one by one to find it
    decoded: list[Tensor | str] = []
    for data in encoded:
        try:
            decoded.append(io.decode_jpeg(data, mode=mode, device=device))
        except RuntimeError as error:
            decoded.append(f"decode_jpeg on {device} failed: {str(error).splitlines()[0]}")
    return decoded


_warned = False


def _report(crop: Crop, what: str) -> None:
    """The first JPEG the device could not decode is a warning, the others are logged at DEBUG level."""
    global _warned
    message = redact(f"{crop.name}: {what}")
    if not _warned:
        _warned = True
        log.warning("%s (further ones are logged at DEBUG level)", message)
    else:
        log.debug("%s", message)
