"""Train a small CNN on a folder of image files (one subfolder per class) across Spark executors.

    python jobs/train_images.py                   # scikit-learn's digits, written as PNG files
    python jobs/train_images.py --data ~/pets --size 64 --channels 3
    spark-submit --master spark://host:7077 jobs/train_images.py --data /shared/images

Spark reads the files as raw bytes (`binaryFile`) and the labels from their paths (Spark SQL);
each worker decodes and augments its batches in `preprocess`, off the training thread.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import _job


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--master", help="Spark master (default: spark-submit's, else local[N])")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--data", help="an ImageFolder tree: DIR/<class>/<image> (default: "
                                  "scikit-learn's digits as PNG files in a temporary folder)")
    p.add_argument("--max-images", type=int, help="digits: write only the first this many")
    p.add_argument("--size", type=int, default=8, help="images are decoded to size x size")
    p.add_argument("--channels", type=int, choices=[1, 3], default=1, help="1 gray, 3 RGB")
    p.add_argument("--max-shift", type=int, default=1, help="augmentation: random shift, px")
    p.add_argument("--eval-percent", type=int, default=10, help="files held out (by class/name)")
    p.add_argument("--width", type=int, default=32, help="the CNN's channels")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="images per worker step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--averaging-frequency", type=int, default=8)
    p.add_argument("--preprocess-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experiment", default="sparkdl-avg-images")
    p.add_argument("--no-log-model", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import digits_images as images

    config = TrainConfig(
        num_workers=args.num_workers, epochs=args.epochs, batch_size=args.batch_size,
        optimizer="adam", lr=args.lr, averaging_frequency=args.averaging_frequency,
        preprocess_threads=args.preprocess_threads, seed=args.seed,
        experiment_name=args.experiment, log_model=not args.no_log_model)
    # the digits live as long as the fit reads them: the folder is removed on every path
    with (_job.session("sparkdl-avg-images", args.master, args.num_workers) as spark,
          tempfile.TemporaryDirectory(prefix="digits-") as scratch):
        folder = args.data or scratch
        if args.data is None:
            images.write_digits(folder, limit=args.max_images)
        train_df, eval_df, classes = images.read_image_folder(spark, folder,
                                                              eval_percent=args.eval_percent)
        model_fn = images.cnn(args.channels, len(classes), args.width, args.seed)
        result = fit(train_df, model_fn, config, features_col="content", label_col="label",
                     eval_df=eval_df, preprocess=images.Decode((args.size, args.size),
                                                               args.channels, args.max_shift))
    final = result.history[-1]
    print(f"test accuracy {final['eval_accuracy']:.4f}  test loss {final['eval_loss']:.4f}  "
          f"classes {len(classes)}  fit {result.timings['total_s']:.1f}s  "
          f"MLflow run {result.run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
