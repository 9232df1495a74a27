"""Images per second, decode + train, of jobs/train_images.py's data and model: `fit` with 2
workers on local[2], each decoding its batches in `preprocess` on its own threads
(`TrainConfig.preprocess_threads`), against a plain-torch `DataLoader(num_workers=2)` over the
same files, decoding with the same function, training the same CNN, on the same cores.

The files: scikit-learn's digits written as PNG files in the ImageFolder layout
(`examples/digits_images.write_digits`), upscaled to `--image-size` (32 by default, so decoding
and the CNN do more than 8x8 pixels' work; 8 is the digits' own size). Every file trains (no
held-out split: the figure is throughput). An image counts once an epoch on both sides:
images per second = files x epochs / training time: `fit`'s `train_s` (its first step to its
end, the rounds' averaging included; `wall_images_per_s` divides by the whole `fit` call:
validation, Spark's read of the files and its shuffle, the MLflow run); plain torch's from
its first `next()` of the first epoch to its last step (the loader's workers start each
epoch, as a default `DataLoader` does: its first epoch is `cold`, its others `warm_epoch_s`).

Plain torch: a Dataset of (path, label) that reads a file's bytes; the loader's `collate_fn`
decodes a batch with `Decode` (training=True: the random shift from a seeded rng), Adam,
batches of `--batch-size` (each of our workers' step) and, by default, of twice that (our
global batch), with `torch.set_num_threads` at each of `--torch-threads` (1 and 2: on a busy
machine two OpenMP threads can be 10x slower than one, as their barriers wait for a core;
the ratio is taken against plain torch's fastest). Ours: 2 tasks, each with its half of the files,
Adam with the same lr, averaging every 8 steps, `preprocess_threads=2`. Each side runs in a
fresh process (ours: a fresh local[2] session with `SPARK_CONF`, its first fit cold, the rest
warm); `--repeats` runs each; medians.

Last, `job_defaults`: one fit as `python jobs/train_images.py --no-log-model` runs it (the
1,797 digits at 8x8, 10% held out by class/name, 10 epochs), in a fresh session: its held-out
accuracy and loss, and images per second.

Without `fit(preprocess=)` (a checkout before issue 31), the run records plain torch only and
says why ours is missing.

    python bench/images.py [--repeats 3] [--epochs 3] [--image-size 32] [--batch-size 32]
        [--job-epochs 10]
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import in_fresh_process, local_session, median, report  # noqa: E402

LR, SEED, WIDTH, FREQUENCY = 3e-3, 0, 32, 8
MISSING = ("needs fit(preprocess=), binary columns and TrainConfig.preprocess_threads "
           "(issue 31's core, branch wt-31data): not in this checkout")


def has_preprocess() -> bool:
    from sparkdl_avg import fit

    return "preprocess" in inspect.signature(fit).parameters


class Files:
    """A map-style Dataset: item i is (the bytes of file i, its label)."""

    def __init__(self, samples: list[tuple[str, int]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        path, label = self.samples[i]
        with open(path, "rb") as f:
            return f.read(), label


class Collate:
    """Decodes a batch in the loader's worker with the fit's preprocess (training=True); the
    rng is seeded from the worker's seed and its batch count, as ours is from the step."""

    def __init__(self, decode) -> None:
        self.decode, self.calls = decode, 0

    def __call__(self, items):
        import numpy as np
        import torch

        info = torch.utils.data.get_worker_info()
        self.calls += 1
        rng = np.random.default_rng([info.seed if info else SEED, self.calls])
        contents, labels = zip(*items, strict=True)
        x = self.decode({"content": list(contents)}, training=True, rng=rng)["content"]
        return torch.from_numpy(x), torch.tensor(labels, dtype=torch.int64)


def image_folder_samples(folder: str) -> tuple[list[tuple[str, int]], int]:
    """torchvision's ImageFolder order: (path, class index) with sorted class folders."""
    classes = sorted(d.name for d in os.scandir(folder) if d.is_dir())
    samples = [(os.path.join(folder, c, f), k) for k, c in enumerate(classes)
               for f in sorted(os.listdir(os.path.join(folder, c))) if f.endswith(".png")]
    return samples, len(classes)


def torch_run(folder: str, size: int, batch: int, epochs: int) -> dict:
    import torch

    from sparkdl_avg.examples import digits_images as di

    samples, classes = image_folder_samples(folder)
    loader = torch.utils.data.DataLoader(
        Files(samples), batch_size=batch, shuffle=True, num_workers=2, drop_last=True,
        collate_fn=Collate(di.Decode((size, size))),
        generator=torch.Generator().manual_seed(SEED))
    model = di.cnn(1, classes, WIDTH, SEED)()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    images, epoch_s, losses = 0, [], []
    t0 = time.perf_counter()
    for _ in range(epochs):
        start, total = time.perf_counter(), 0.0
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            images += len(y)
            total += loss.item() * len(y)
        epoch_s.append(time.perf_counter() - start)
        losses.append(total / (len(loader) * batch))
    train_s = time.perf_counter() - t0
    return {"images_per_s": images / train_s, "train_s": train_s, "epoch_s": epoch_s,
            "cold_epoch_s": epoch_s[0], "warm_epoch_s": median(epoch_s[1:] or epoch_s),
            "train_loss": losses[-1]}


def torch_side(folder: str, size: int, batches: list[int], threads: list[int], epochs: int,
               repeats: int) -> dict:
    import torch

    runs = {}
    for t in threads:  # the training threads of the main process (the loader's are 1 each)
        torch.set_num_threads(t)
        for b in batches:
            runs[f"threads_{t}_batch_{b}"] = [torch_run(folder, size, b, epochs)
                                              for _ in range(repeats)]
    return runs


def fit_run(train_df, images: int, classes: int, size: int, batch: int, epochs: int) -> dict:
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import digits_images as di

    config = TrainConfig(num_workers=2, epochs=epochs, batch_size=batch, optimizer="adam",
                         lr=LR, seed=SEED, averaging_frequency=FREQUENCY, log_model=False,
                         preprocess_threads=2, experiment_name="bench-images")
    t0 = time.perf_counter()
    result = fit(train_df, di.cnn(1, classes, WIDTH, SEED), config, features_col="content",
                 label_col="label", preprocess=di.Decode((size, size)))
    wall = time.perf_counter() - t0
    return {"images_per_s": images * epochs / result.timings["train_s"],
            "wall_images_per_s": images * epochs / wall, "train_s": result.timings["train_s"],
            "wall_s": wall, "train_loss": result.history[-1].get("train_loss")}


def our_side(folder: str, size: int, batch: int, epochs: int, repeats: int) -> dict:
    from sparkdl_avg import SPARK_CONF
    from sparkdl_avg.examples import digits_images as di

    spark = local_session(2, **SPARK_CONF)
    try:
        train_df, _, classes = di.read_image_folder(spark, folder, eval_percent=0)
        images = train_df.count()
        return {"images": images, "runs": [fit_run(train_df, images, len(classes), size,
                                                   batch, epochs) for _ in range(repeats)]}
    finally:
        spark.stop()


def job_defaults(folder: str, epochs: int) -> dict:
    """One fit as the job runs it by default (its data, split, model and settings), in a
    fresh session: the docs' accuracy."""
    from sparkdl_avg import SPARK_CONF, TrainConfig, fit
    from sparkdl_avg.examples import digits_images as di

    spark = local_session(2, **SPARK_CONF)
    try:
        train_df, eval_df, classes = di.read_image_folder(spark, folder)
        images, held_out = train_df.count(), eval_df.count()
        config = TrainConfig(num_workers=2, epochs=epochs, batch_size=32, optimizer="adam",
                             lr=LR, seed=SEED, averaging_frequency=FREQUENCY, log_model=False,
                             experiment_name="bench-images")
        result = fit(train_df, di.cnn(1, len(classes), WIDTH, SEED), config,
                     features_col="content", label_col="label", eval_df=eval_df,
                     preprocess=di.Decode())
    finally:
        spark.stop()
    final = result.history[-1]
    return {"epochs": epochs, "train_images": images, "held_out_images": held_out,
            "eval_accuracy": final["eval_accuracy"], "eval_loss": final["eval_loss"],
            "images_per_s": images * epochs / result.timings["train_s"],
            "train_s": result.timings["train_s"], "wall_s": result.timings["total_s"]}


def medians(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    return {k: median([r[k] for r in runs]) for k in keys} | {"runs": len(runs)}


def summary(ours: dict | None, plain: dict, batch: int) -> dict:
    out = {"plain_torch": {k: medians(v) for k, v in plain.items()}}
    if ours is None:
        return out | {"ours": None, "ours_missing": MISSING}
    out["ours"] = {"cold": ours["runs"][0], "warm": medians(ours["runs"][1:] or ours["runs"])}
    # against plain torch's fastest setting at our per-worker batch
    best = max(v["images_per_s"] for k, v in out["plain_torch"].items()
               if k.endswith(f"_batch_{batch}"))
    out["ratio_ours_warm_to_best_plain_torch"] = out["ours"]["warm"]["images_per_s"] / best
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=32, help="the PNGs' size (8: as is)")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--torch-batch", type=int, nargs="*", help="plain torch's other "
                        "batch sizes (default: the global batch, 2 x --batch-size)")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2],
                        help="plain torch's training threads, each run")
    parser.add_argument("--job-epochs", type=int, default=10,
                        help="one more fit as the job runs it, with its held-out files (0: none)")
    parser.add_argument("--side", choices=["ours", "torch", "job"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size, b = args.image_size, args.batch_size
    batches = [b, *(args.torch_batch if args.torch_batch is not None else [2 * b])]
    if args.side == "ours":
        print(json.dumps(our_side(args.folder, size, b, args.epochs, args.repeats)))
        return
    if args.side == "job":
        print(json.dumps(job_defaults(args.folder, args.job_epochs)))
        return
    if args.side == "torch":
        print(json.dumps(torch_side(args.folder, size, batches, args.torch_threads,
                                    args.epochs, args.repeats)))
        return
    from sparkdl_avg.examples import digits_images as di

    with tempfile.TemporaryDirectory(prefix="bench-images-") as folder:
        files = len(di.write_digits(f"{folder}/digits", size=size))
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"}
        common = ["--folder", f"{folder}/digits", "--image-size", str(size), "--batch-size",
                  str(b), "--epochs", str(args.epochs), "--repeats", str(args.repeats),
                  "--torch-batch", *map(str, batches[1:]),
                  "--torch-threads", *map(str, args.torch_threads)]
        plain = in_fresh_process(__file__, "--side", "torch", *common, env=env)
        ours = job = None
        if has_preprocess():
            ours = in_fresh_process(__file__, "--side", "ours", *common, env=env)
            if args.job_epochs:
                di.write_digits(f"{folder}/job")  # the job's own files: the digits at 8x8
                job = in_fresh_process(__file__, "--side", "job", "--folder", f"{folder}/job",
                                       "--job-epochs", str(args.job_epochs), env=env)
        else:
            logging.warning("ours not run: %s", MISSING)
    report("images", {
        "files": files, "image_size": size, "batch_size": b, "epochs": args.epochs,
        "repeats": args.repeats, "torch_threads": args.torch_threads,
        "model": {"cnn_width": WIDTH, "lr": LR},
        "summary": summary(ours, plain, b), "job_defaults": job,
        "runs": {"ours": ours, "plain_torch": plain}})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
