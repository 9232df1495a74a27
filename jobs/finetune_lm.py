"""Pretrain a byte-level GPT-2 on Python sources, then fine-tune it with LoRA on English.

    python jobs/finetune_lm.py                    # stdlib sources, then the stdlib's English docs
    python jobs/finetune_lm.py --text-dir ~/books --glob '*.txt'   # fine-tune on your text
    spark-submit --master spark://host:7077 jobs/finetune_lm.py --work-dir /shared/finetune

Two fits, children of one MLflow run: the first trains the whole model on corpus A, is
saved in Hugging Face's format under --work-dir (a folder every executor reads), and the
second loads it in each task and trains only LoRA adapters on corpus B. Reports the
perplexity on held-out B before and after fine-tuning, and the bytes through the driver a
round of each fit (whole model vs adapters). Needs the `hf` extra.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import _job


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--master", help="Spark master (default: spark-submit's, else local[N])")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--text-dir", nargs="+", help="corpus B's folders (default: pydoc's topics)")
    p.add_argument("--glob", help="corpus B's file names (e.g. '*.txt')")
    p.add_argument("--pretrain-bytes", type=int, help="about this many bytes of A (small runs)")
    p.add_argument("--max-bytes", type=int, help="about this many bytes of B (small runs)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes of context a window")
    p.add_argument("--pretrain-epochs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2, help="fine-tuning epochs")
    p.add_argument("--batch-size", type=int, default=32, help="windows per worker step")
    p.add_argument("--pretrain-lr", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=3e-3, help="fine-tuning learning rate")
    p.add_argument("--averaging-frequency", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--targets", nargs="+", default=["c_attn", "c_fc"],
                   help="GPT-2 projections LoRA adapts")
    p.add_argument("--full-finetune", action="store_true",
                   help="train every weight on B, not adapters (LoRA's reference)")
    p.add_argument("--work-dir", help="where the pretrained model is saved (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experiment", default="sparkdl-avg-finetune-lm")
    p.add_argument("--no-log-model", action="store_true", help="log no adapters")
    return p.parse_args(argv)


def corpora(spark, args: argparse.Namespace):
    """(train A, train B, held-out B): windows of the stdlib's sources and of B, as
    `char_lm.windows` cuts them (input_ids, labels: the next bytes)."""
    from sparkdl_avg.examples import char_lm, finetune_lm

    code = char_lm.read_files(spark, char_lm.stdlib_text_dirs(), "*.py")
    english = (char_lm.read_files(spark, args.text_dir, args.glob) if args.text_dir
               else finetune_lm.english_docs(spark))
    train_a, _ = char_lm.windows(code, args.seq_len, max_bytes=args.pretrain_bytes,
                                 eval_percent=0)
    train_b, eval_b = char_lm.windows(english, args.seq_len, max_bytes=args.max_bytes)
    return train_a.cache(), train_b.cache(), eval_b.cache()  # each read by several jobs


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import mlflow

    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import char_lm
    from sparkdl_avg.examples import finetune_lm as ft

    def config(epochs: int, lr: float, log_model: bool | str = False) -> TrainConfig:
        return TrainConfig(num_workers=args.num_workers, epochs=epochs, lr=lr, seed=args.seed,
                           batch_size=args.batch_size, optimizer="adam", log_model=log_model,
                           averaging_frequency=args.averaging_frequency,
                           experiment_name=args.experiment)

    # the model's own loss: the window goes in as input_ids and labels, the model shifts it
    data = dict(inputs={"input_ids": "input_ids"}, label_col="labels", loss="model")
    mlflow.set_experiment(args.experiment)
    with (_job.session("sparkdl-avg-finetune-lm", args.master, args.num_workers) as spark,
          tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_name="finetune-lm") as run):
        windows = corpora(spark, args)
        unigram = char_lm.unigram_bits_per_byte(windows[1])
        train_a, train_b, eval_b = map(ft.causal_windows, windows)
        folder = args.work_dir or os.path.join(tmp, "pretrained")
        gpt2 = ft.gpt2(args.d_model, args.heads, args.layers, args.seq_len + 1)
        # evaluated on held-out B: its last evaluation is the perplexity before fine-tuning
        pre = fit(train_a, gpt2, config(args.pretrain_epochs, args.pretrain_lr),
                  eval_df=eval_b, **data)
        pre.model.save_pretrained(folder)  # what every task's model_fn loads
        model_fn = (ft.whole(folder) if args.full_finetune
                    else ft.lora(folder, args.rank, args.targets))
        tuned = fit(train_b, model_fn,
                    config(args.epochs, args.lr, False if args.no_log_model else "adapters"),
                    eval_df=eval_b, **data)
        report = ft.report(pre, tuned, unigram)
        mlflow.log_metrics(report)
        mlflow.log_artifacts(folder, "pretrained")
    logging.info("%s", report)
    print(f"perplexity before {report['perplexity_before']:.3f}  after "
          f"{report['perplexity_after']:.3f}  unigram {report['perplexity_unigram']:.3f}  "
          f"driver MB a round {report['driver_mb_pretrain']:.3f} whole, "
          f"{report['driver_mb_finetune']:.3f} fine-tuning  MLflow run {run.info.run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
