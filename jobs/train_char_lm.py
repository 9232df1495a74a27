"""Train a byte-level causal transformer on a folder of text files across Spark executors.

    python jobs/train_char_lm.py                        # the stdlib's json, email, asyncio
    python jobs/train_char_lm.py --text-dir ~/books --glob '*.txt'
    spark-submit --master spark://host:7077 jobs/train_char_lm.py --num-workers 4

Reports bits per byte on held-out windows against the unigram baseline, and samples text.
"""

from __future__ import annotations

import argparse
import logging
import sys

import _job


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--master", help="Spark master (default: spark-submit's, else local[N])")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--text-dir", nargs="+", help="folders of text (default: stdlib sources)")
    p.add_argument("--glob", help="file names to read (default: *.py for the stdlib)")
    p.add_argument("--max-bytes", type=int, help="train on about this many bytes (small runs)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes of context a window")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="windows per worker step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--averaging-frequency", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt", action="append", help="sample from it (repeatable)")
    p.add_argument("--sample-bytes", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experiment", default="sparkdl-avg-char-lm")
    p.add_argument("--no-log-model", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import char_lm

    config = TrainConfig(
        num_workers=args.num_workers, epochs=args.epochs, batch_size=args.batch_size,
        optimizer="adam", lr=args.lr, averaging_frequency=args.averaging_frequency,
        seed=args.seed, experiment_name=args.experiment, log_model=not args.no_log_model)
    with _job.session("sparkdl-avg-char-lm", args.master, args.num_workers) as spark:
        # --8<-- [start:fit]  (docs/howto/char-lm.md shows these lines as they are)
        texts = char_lm.read_files(spark, args.text_dir or char_lm.stdlib_text_dirs(),
                                   args.glob or (None if args.text_dir else "*.py"))
        train_df, eval_df = (df.cache() for df in  # read by several jobs: cut once
                             char_lm.windows(texts, args.seq_len, max_bytes=args.max_bytes))
        unigram = char_lm.unigram_bits_per_byte(train_df)
        model_fn = char_lm.transformer(args.d_model, args.heads, args.layers, args.seq_len,
                                       args.seed)
        result = fit(train_df, model_fn, config, inputs={"input_ids": "input_ids"},
                     label_col="labels", loss="cross_entropy", eval_df=eval_df)
        # --8<-- [end:fit]
    bpb = char_lm.bits_per_byte(result.history[-1]["eval_loss"])
    samples = char_lm.log_results(result.run_id, result.model, bpb, unigram,
                                  args.prompt or char_lm.PROMPTS, args.sample_bytes,
                                  args.temperature)
    logging.info("samples:\n%s", samples)
    print(f"bits per byte {bpb:.3f}  unigram {unigram:.3f}  fit {result.timings['total_s']:.1f}s"
          f"  MLflow run {result.run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
