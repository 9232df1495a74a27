"""Image files in the ImageFolder layout (one subfolder per class), read by Spark as raw
bytes and decoded in `fit(..., preprocess=)`: the images job's and the images bench's parts.

- `write_digits`: scikit-learn's digits (1,797 real handwritten 8x8 digits that ship with
  scikit-learn, no download) written as grayscale PNG files, `<folder>/<class>/<n>.png`.
- `read_image_folder`: one row per file with Spark's `binaryFile` source (`path`, `content`:
  the file's bytes) and its label from the path in Spark SQL (`regexp_extract` of the class
  folder, numbered in sorted order as torchvision's ImageFolder numbers them), split by a hash
  of the file's class folder and name, so the split depends on neither partitioning nor where
  the tree lives (a temporary folder each run).
- `Decode`: the `preprocess(batch, *, training, rng)` step: PNG/JPEG bytes -> float32
  [B, C, H, W] in [0, 1], with a random shift of up to `max_shift` pixels drawn from `rng` in
  training (reproducible: the fit seeds `rng` from the step). PIL decodes with the GIL
  released, so the fit's preprocessing threads overlap it with training.
- `cnn`: a small CNN for those tensors.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

IMAGE_GLOB = "*.{png,jpg,jpeg,PNG,JPG,JPEG}"
"""The files `read_image_folder` reads by default (`binaryFile`'s pathGlobFilter)."""


def write_image_folder(folder: str | Path, images: np.ndarray, labels: np.ndarray,
                       class_names: list[str]) -> list[Path]:
    """`images` (uint8 [N, H, W] grayscale, or [N, H, W, 3] RGB) written losslessly as PNG
    files `<folder>/<class_names[label]>/<n>.png`, n the image's index (zero-padded, so the
    files sort in input order); returns their paths."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise ValueError(f"images must be uint8 [N, H, W] or [N, H, W, 3], got "
                         f"{images.dtype} {images.shape}")
    if len(labels) != len(images):
        raise ValueError(f"{len(labels)} labels for {len(images)} images")
    from PIL import Image

    folder = Path(folder)
    width = len(str(max(len(images) - 1, 0)))
    paths = []
    for name in class_names:
        (folder / name).mkdir(parents=True, exist_ok=True)
    for n, (image, label) in enumerate(zip(images, labels, strict=True)):
        path = folder / class_names[int(label)] / f"{n:0{width}d}.png"
        Image.fromarray(image).save(path, format="PNG")
        paths.append(path)
    return paths


def digits_pixels(limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as uint8 [N, 8, 8] (its 0..16 levels scaled to 0..255) and
    their int64 labels; `limit`: the first that many (the classes cycle, so any prefix
    holds every class about equally)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images[:limit] * (255 / 16)).astype(np.uint8)
    return images, digits.target[:limit].astype(np.int64)


def write_digits(folder: str | Path, limit: int | None = None,
                 size: int | None = None) -> list[Path]:
    """scikit-learn's digits as PNG files in the ImageFolder layout under `folder` (classes
    "0".."9"); `size`: upscaled to size x size (bilinear) for heavier decoding."""
    images, labels = digits_pixels(limit)
    if size is not None and size != images.shape[1]:
        from PIL import Image

        images = np.stack([np.asarray(Image.fromarray(im).resize((size, size),
                                                                 Image.Resampling.BILINEAR))
                           for im in images])
    return write_image_folder(folder, images, labels, [str(c) for c in range(10)])


def class_names(files) -> list[str]:
    """The class folders of a `binaryFile` DataFrame's `path`s, sorted (one small job)."""
    return sorted(r[0] for r in files.select(_class_of("path")).distinct().collect())


def _class_of(path_col: str):
    from pyspark.sql import functions as sf

    # the last folder of the path: .../<class>/<file>
    return sf.regexp_extract(path_col, r"([^/]+)/[^/]+$", 1).alias("class")


def read_image_folder(spark, folder: str, *, glob: str = IMAGE_GLOB, eval_percent: int = 10):
    """(train_df, eval_df, classes): the image files under `folder` (any depth; `glob` picks
    the names), each a row of `path` (string), `content` (binary: the file's bytes) and
    `label` (int: the class folder's index in `classes`, sorted names); a hash of
    "<class>/<file>" puts `eval_percent` of the files in eval_df."""
    from pyspark.sql import functions as sf
    from pyspark.sql.types import IntegerType

    files = (spark.read.format("binaryFile").option("pathGlobFilter", glob)
             .option("recursiveFileLookup", "true").load(folder).select("path", "content"))
    classes = class_names(files)
    if not classes:
        raise ValueError(f"no files matching {glob!r} under {folder}")
    index = sf.array_position(sf.array(*map(sf.lit, classes)), _class_of("path")) - 1
    rows = files.select("path", "content", index.cast(IntegerType()).alias("label"))
    name = sf.regexp_extract("path", r"([^/]+/[^/]+)$", 1)  # the same in any copy
    held_out = sf.pmod(sf.xxhash64(name), sf.lit(100)) < eval_percent
    return rows.where(~held_out), rows.where(held_out), classes


@dataclass(frozen=True)
class Decode:
    """`fit(..., preprocess=Decode(...))`: `column`'s encoded images -> float32 [B, C, H, W]
    in [0, 1] (C = `channels`: 1 grayscale, 3 RGB), resized to `size` (height, width) when a
    file differs; in training each image moves by a shift of up to `max_shift` pixels in each
    direction, drawn from `rng` (zeros fill what it uncovers). Evaluation (`training=False`)
    is the plain decode. Other columns (the label) pass through. A module-level class, so the
    fit pickles it by reference and an executor imports it."""

    size: tuple[int, int] = (8, 8)
    channels: int = 1
    max_shift: int = 1
    column: str = "content"

    def __call__(self, batch: dict, *, training: bool, rng: np.random.Generator) -> dict:
        pixels = decode_images(batch[self.column], self.size, self.channels)
        if training and self.max_shift:
            pixels = random_shift(pixels, self.max_shift, rng)
        return {self.column: pixels.astype(np.float32) / np.float32(255)}


def decode_images(contents, size: tuple[int, int], channels: int = 1) -> np.ndarray:
    """Encoded images (a list of bytes) -> uint8 [B, C, H, W]. One decode per image is the
    irreducible per-row work; everything after it is on the whole batch."""
    from PIL import Image

    mode = {1: "L", 3: "RGB"}[channels]
    height, width = size
    out = np.empty((len(contents), height, width, channels), np.uint8)
    for i, data in enumerate(contents):
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert(mode)
            if image.size != (width, height):
                image = image.resize((width, height), Image.Resampling.BILINEAR)
            out[i] = np.asarray(image).reshape(height, width, channels)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))


def random_shift(pixels: np.ndarray, max_shift: int, rng: np.random.Generator) -> np.ndarray:
    """Each image of [B, C, H, W] moved by its own (dy, dx), each in [-max_shift, max_shift]
    drawn from `rng`; zeros fill the uncovered edge. One gather over the padded batch."""
    b, c, h, w = pixels.shape
    m = max_shift
    dy, dx = rng.integers(-m, m + 1, size=(2, b))
    padded = np.pad(pixels, ((0, 0), (0, 0), (m, m), (m, m)))
    # output (y, x) reads the padded input at (y - dy + m, x - dx + m); the four index
    # arrays broadcast to [B, C, H, W]
    rows = (np.arange(h)[None, :] - dy[:, None] + m)[:, None, :, None]
    cols = (np.arange(w)[None, :] - dx[:, None] + m)[:, None, None, :]
    return padded[np.arange(b)[:, None, None, None], np.arange(c)[None, :, None, None],
                  rows, cols]


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and a 2x2 max-pool, then an adaptive pool to 4x4 (any input size
    gives the same head) and a linear layer to the classes' logits."""

    def __init__(self, channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width // 2, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width // 2, width, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(width * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _build(channels: int, num_classes: int, width: int, seed: int) -> SmallCNN:
    torch.manual_seed(seed)
    return SmallCNN(channels, num_classes, width)


def cnn(channels: int = 1, num_classes: int = 10, width: int = 32, seed: int = 0):
    """A picklable zero-argument model factory for `fit(model_fn=...)`."""
    return partial(_build, channels, num_classes, width, seed)
