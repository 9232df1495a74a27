"""The images example's parts, each against an independent computation: the PNG writer
against PIL reading the files back, the preprocess step against the digits' own pixels and
against shifts done image by image with slicing, and the Spark read against the files on disk
and torchvision's class numbering (sorted folder names). The job itself runs in test_job."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rounding import classes_agree, forward_tolerance

from sparkdl_avg.examples import digits_images as di


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The first 40 digits as PNG files, their bytes (in index order) and their pixels."""
    folder = tmp_path_factory.mktemp("digits")
    paths = di.write_digits(folder, limit=40)
    pixels, labels = di.digits_pixels(40)
    return folder, [p.read_bytes() for p in paths], pixels, labels


def test_the_writer_makes_an_image_folder_tree_of_lossless_pngs(digits):
    folder, _, pixels, labels = digits
    assert sorted(p.name for p in folder.iterdir()) == [str(c) for c in range(10)]
    files = sorted(folder.glob("*/*.png"))
    assert len(files) == 40
    for f in files:
        n = int(f.stem)
        assert int(f.parent.name) == labels[n]
        with Image.open(f) as image:
            assert image.format == "PNG" and image.mode == "L"
            np.testing.assert_array_equal(np.asarray(image), pixels[n])
    assert pixels.max() == 255 and pixels.min() == 0  # 0..16 levels stretched to 0..255


def test_the_writer_keeps_rgb_and_refuses_other_arrays(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (3, 5, 7, 3), dtype=np.uint8)
    paths = di.write_image_folder(tmp_path, rgb, np.array([1, 0, 1]), ["cat", "dog"])
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        "dog/0.png", "cat/1.png", "dog/2.png"]
    for path, image in zip(paths, rgb, strict=True):
        with Image.open(path) as read:
            np.testing.assert_array_equal(np.asarray(read), image)
    with pytest.raises(ValueError, match="uint8"):
        di.write_image_folder(tmp_path, rgb.astype(np.float32), np.zeros(3), ["a"])
    with pytest.raises(ValueError, match="2 labels for 3 images"):
        di.write_image_folder(tmp_path, rgb, np.zeros(2), ["a"])


def test_evaluation_decodes_exactly_and_ignores_rng(digits):
    _, contents, pixels, labels = digits
    batch = {"content": contents, "label": labels}
    out = di.Decode()(batch, training=False, rng=np.random.default_rng(1))
    assert set(out) == {"content"}  # the label is not returned: it passes through
    x = out["content"]
    assert x.shape == (40, 1, 8, 8) and x.dtype == np.float32
    np.testing.assert_array_equal(x[:, 0], pixels.astype(np.float32) / 255)
    again = di.Decode()(batch, training=False, rng=np.random.default_rng(2))["content"]
    np.testing.assert_array_equal(x, again)


def test_decode_resizes_and_gives_rgb_channels_first(digits):
    _, contents, pixels, _ = digits
    x = di.Decode(size=(12, 10), channels=3)({"content": contents[:4]}, training=False,
                                             rng=None)["content"]
    assert x.shape == (4, 3, 12, 10) and x.dtype == np.float32
    with Image.open(di.io.BytesIO(contents[2])) as image:  # PIL's own resize, independently
        want = np.asarray(image.convert("RGB").resize((10, 12), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(x[2], want.transpose(2, 0, 1).astype(np.float32) / 255)


def shifted(image: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """`image` [C, H, W] moved down dy and right dx, zeros where nothing moved in."""
    out = np.zeros_like(image)
    h, w = image.shape[1:]
    out[:, max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        image[:, max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def test_training_shifts_each_image_by_at_most_one_pixel(digits):
    _, contents, pixels, _ = digits
    plain = pixels[:, None].astype(np.float32) / 255
    x = di.Decode()({"content": contents}, training=True, rng=np.random.default_rng(7))["content"]
    assert x.shape == plain.shape and x.dtype == np.float32
    moves = set()
    for image, original in zip(x, plain, strict=True):
        matches = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)
                   if np.array_equal(image, shifted(original, dy, dx))]
        assert matches, "not a shift of its image by at most one pixel"
        moves.add(matches[0])
    assert len(moves) >= 5  # 40 draws of 9 shifts: the images move independently


def test_augmentation_is_a_function_of_the_rng(digits):
    _, contents, _, _ = digits

    def augment(seed):
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0, 1, 2])))
        return di.Decode()({"content": contents}, training=True, rng=rng)["content"]

    np.testing.assert_array_equal(augment(0), augment(0))  # same seed: bit-identical
    assert not np.array_equal(augment(0), augment(1))


def test_decode_travels_to_executors_as_the_fit_sends_it(digits):
    from sparkdl_avg._model import pickle_for_executors

    _, contents, _, _ = digits
    decode = di.Decode(size=(6, 6), max_shift=2)
    sent = pickle_for_executors("preprocess", decode)
    assert b"sparkdl_avg.examples.digits_images" in sent  # by reference: executors import it
    received = pickle.loads(sent)
    assert received == decode
    batch = {"content": contents}
    np.testing.assert_array_equal(
        received(batch, training=True, rng=np.random.default_rng(3))["content"],
        decode(batch, training=True, rng=np.random.default_rng(3))["content"])


def test_the_cnn_takes_the_decoded_batch(digits):
    import torch

    _, contents, _, _ = digits
    x = di.Decode(size=(16, 16), channels=3)({"content": contents}, training=False, rng=None)
    model = di.cnn(channels=3, num_classes=4, width=8, seed=3)()
    assert model(torch.from_numpy(x["content"])).shape == (40, 4)
    same = di.cnn(channels=3, num_classes=4, width=8, seed=3)()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters(),
                                                 strict=True))


@pytest.mark.spark
def test_spark_reads_the_files_bytes_and_labels_from_their_folders(spark, tmp_path,
                                                                    tmp_path_factory):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (30, 4, 4), dtype=np.uint8)
    labels = np.arange(30) % 3
    names = ["zebra", "cat", "dog"]  # sorted: cat 0, dog 1, zebra 2
    paths = di.write_image_folder(tmp_path, images, labels, names)
    (tmp_path / "README.txt").write_text("not an image")  # the glob leaves it out
    (tmp_path / "cat" / "notes.md").write_text("nor this")
    train, held_out, classes = di.read_image_folder(spark, str(tmp_path), eval_percent=30)
    assert classes == ["cat", "dog", "zebra"]
    assert train.schema["content"].dataType.simpleString() == "binary"
    assert train.schema["label"].dataType.simpleString() == "int"
    want = {p.as_posix(): (p.read_bytes(), sorted(names).index(p.parent.name)) for p in paths}
    got_train = {r.path.removeprefix("file:"): (bytes(r.content), r.label)
                 for r in train.collect()}
    got_eval = {r.path.removeprefix("file:"): (bytes(r.content), r.label)
                for r in held_out.collect()}
    assert got_train and got_eval and not set(got_train) & set(got_eval)
    assert {**got_train, **got_eval} == want
    copy = tmp_path_factory.mktemp("elsewhere") / "tree"
    shutil.copytree(tmp_path, copy)  # the split is by "<class>/<file>", not where it lives
    _, copy_held, _ = di.read_image_folder(spark, str(copy), eval_percent=30)
    assert ({r.path.removeprefix(f"file:{copy}/") for r in copy_held.select("path").collect()}
            == {str(Path(p).relative_to(tmp_path)) for p in got_eval})
    with pytest.raises(ValueError, match="no files matching"):
        di.read_image_folder(spark, str(tmp_path), glob="*.gif")


@pytest.mark.spark
def test_a_cnn_learns_png_files_and_every_way_of_scoring_them_agrees(spark, tmp_path):
    """The issue's end-to-end check: 300 digits as PNG files, read as bytes by binaryFile,
    decoded and shifted in preprocess; the CNN beats chance by far on held-out files, and
    `transform`, the logged MLflow pyfunc model on the raw bytes and decoding + the returned
    model give the same classes."""
    import mlflow
    import pandas as pd
    import torch

    from sparkdl_avg import TrainConfig, fit

    di.write_digits(tmp_path / "tree", limit=300)
    train, held_out, _ = di.read_image_folder(spark, str(tmp_path / "tree"), eval_percent=20)
    config = TrainConfig(num_workers=2, epochs=6, batch_size=16, optimizer="adam", lr=3e-3,
                         averaging_frequency=4, seed=1, experiment_name="digits-images")
    result = fit(train, di.cnn(), config, features_col="content", label_col="label",
                 eval_df=held_out, preprocess=di.Decode((8, 8)))
    rows = held_out.orderBy("path").collect()
    labels = np.array([r["label"] for r in rows])
    with torch.no_grad():
        decoded = di.Decode((8, 8))({"content": [r["content"] for r in rows]},
                                    training=False, rng=np.random.default_rng(0))
        x = torch.from_numpy(decoded["content"])
        logits = result.model(x)
    direct = logits.argmax(1).numpy()
    assert (direct == labels).mean() > 0.5  # ten classes: chance is 0.1
    # scored in other chunks (and by the exported program): a class within rounding of a
    # tie may go either way (`rounding`; sums of up to 513 float32 terms: probably)
    model = result.model
    apart = forward_tolerance(torch.nn.Sequential(model.features, torch.nn.Flatten(),
                                                  model.head), x, probable=True)
    scored = result.transform(held_out.orderBy("path")).select("prediction").collect()
    assert classes_agree([int(r["prediction"]) for r in scored], logits, apart)
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{result.run_id}/model")
    served = pyfunc.predict(pd.DataFrame({"content": [r["content"] for r in rows]}))
    served = np.asarray(served["prediction"] if isinstance(served, pd.DataFrame) else served)
    assert classes_agree(served.reshape(-1).astype(int), logits, apart)
