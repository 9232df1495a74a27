"""Tokens per second of the char LM (jobs/train_char_lm.py's model and data): `fit` with 2
workers in sync mode on local[2], against one plain-torch process with 2 threads training the
same model on the same windows; and what ragged rows cost, on both sides.

The data: the stdlib's json, email and asyncio sources (`--max-bytes` of them), cut by
`examples/char_lm.windows` in Spark SQL two ways: **fixed** windows of `--seq-len` + 1 bytes
of each file (every row the same length, no padding), and **ragged** rows, one source line
each (newline kept; longer lines cut into windows), padded to each minibatch's longest row.
A token is a label position that counts in the loss (pads, -100, do not): the tokens of an
epoch are the same on both sides. Tokens per second = tokens x epochs / training time:
`fit`'s `train_s` (its first step to its end, the per-epoch evaluation of the 5% held-out
windows and the rounds' averaging included), plain torch's loop (its evaluation included the
same way); `wall_tokens_per_s` divides by the whole `fit` call instead (validation, Spark's
data job and shuffle, the MLflow run; the model is not logged).

Plain torch takes minibatches of `--batch-size` windows (each of our workers' minibatch) from
one shuffled copy of all the windows in numpy, Adam with the same lr, no averaging, no Spark,
no MLflow; `--torch-batch` adds its run at another batch size (the global batch, 2x, by
default). Plain torch's first run in its process (fixed windows) is its cold run, the
others warm. Ours: 2 tasks, each with its half of the rows and one thread, averaging every 8
steps. Each of our sessions is a fresh process with a fresh local[2] session with
`SPARK_CONF`, running fixed and ragged fits alternately, `--repeats` of each: a session's
first fit (fixed windows) is cold (it also starts Spark's Python workers), the rest warm.
Plain torch: `--repeats` runs of each kind in one fresh process. Medians.

Last, `job_defaults`: one fit as `python jobs/train_char_lm.py` runs it (all the text, 3
epochs), in a fresh session: its held-out bits per byte, the unigram baseline, tokens/s.

    python bench/char_lm.py [--sessions 2] [--repeats 3] [--max-bytes 200000] [--epochs 1]
        [--job-epochs 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import in_fresh_process, local_session, median, report  # noqa: E402

D_MODEL, HEADS, LAYERS, LR, SEED = 128, 4, 2, 3e-3, 0


def make_data(spark, seq_len: int, max_bytes: int | None, ragged: bool):
    from sparkdl_avg.examples import char_lm

    dirs = char_lm.stdlib_text_dirs()
    texts = (char_lm.read_lines if ragged else char_lm.read_files)(spark, dirs, "*.py")
    train, held_out = char_lm.windows(texts, seq_len, keep_tails=ragged, max_bytes=max_bytes)
    return train.cache(), held_out.cache()


def save_numpy(spark, folder: str, seq_len: int, max_bytes: int) -> dict:
    """Both kinds of windows as .npy (flat values + lengths) for the plain-torch process;
    returns the tokens of an epoch of each kind."""
    import numpy as np

    tokens = {}
    for kind in ("fixed", "ragged"):
        for split, df in zip(("train", "eval"), make_data(spark, seq_len, max_bytes,
                                                           kind == "ragged"), strict=True):
            table = df.toArrow()
            for col in ("input_ids", "labels"):
                arr = table.column(col).combine_chunks()
                np.save(f"{folder}/{kind}_{split}_{col}.npy", arr.values.to_numpy())
            lengths = np.diff(table.column("labels").combine_chunks().offsets.to_numpy())
            np.save(f"{folder}/{kind}_{split}_lengths.npy", lengths)
            if split == "train":
                tokens[kind] = int(lengths.sum())
    return tokens


def padded(values, offsets, rows, pad: int):
    import numpy as np
    import torch

    starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
    steps = np.arange(int(lengths.max()))
    index = np.minimum(starts[:, None] + steps, len(values) - 1)
    out = np.where(steps < lengths[:, None], values[index], pad).astype(np.int64)
    return torch.from_numpy(out)


def torch_run(folder: str, kind: str, seq_len: int, batch: int, epochs: int) -> dict:
    """One plain-torch training run: tokens/s, pad fraction, held-out bits per byte."""
    import numpy as np
    import torch

    from sparkdl_avg.examples import char_lm

    def load(split):
        lengths = np.load(f"{folder}/{kind}_{split}_lengths.npy")
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return (np.load(f"{folder}/{kind}_{split}_input_ids.npy"),
                np.load(f"{folder}/{kind}_{split}_labels.npy"), offsets)

    (x, y, off), (ex, ey, eoff) = load("train"), load("eval")
    model = char_lm.transformer(D_MODEL, HEADS, LAYERS, seq_len, SEED)()
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    rng = np.random.default_rng(SEED)
    n = len(off) - 1
    tokens = positions = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(n)
        for s in range(0, n - batch + 1, batch):
            rows = order[s:s + batch]
            xb, yb = padded(x, off, rows, 0), padded(y, off, rows, -100)
            loss = torch.nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            tokens += int((yb != -100).sum())
            positions += yb.numel()
        with torch.no_grad():
            rows = np.arange(len(eoff) - 1)
            logits = model(padded(ex, eoff, rows, 0))
            eval_loss = float(torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), padded(ey, eoff, rows, -100).flatten()))
    train_s = time.perf_counter() - t0
    return {"tokens_per_s": tokens / train_s, "train_s": train_s,
            "pad_fraction": 1 - tokens / positions, "bits_per_byte": eval_loss / math.log(2)}


def torch_side(folder: str, seq_len: int, batches: list, epochs: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(2)  # the two cores our two tasks use
    runs = {"cold": [torch_run(folder, "fixed", seq_len, batches[0], epochs)]}  # first in
    for _ in range(repeats):  # the process: torch's first calls; the rest are warm
        for b in batches:
            for kind in ("fixed", "ragged"):
                runs.setdefault(f"{kind}_batch_{b}", []).append(
                    torch_run(folder, kind, seq_len, b, epochs))
    return runs


def fit_run(data, tokens: int, seq_len: int, batch: int, epochs: int) -> dict:
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import char_lm

    config = TrainConfig(num_workers=2, epochs=epochs, batch_size=batch, optimizer="adam",
                         lr=LR, seed=SEED, averaging_frequency=8, log_model=False,
                         experiment_name="bench-char-lm")
    t0 = time.perf_counter()
    result = fit(data[0], char_lm.transformer(D_MODEL, HEADS, LAYERS, seq_len, SEED), config,
                 inputs={"input_ids": "input_ids"}, label_col="labels", eval_df=data[1])
    wall = time.perf_counter() - t0
    padding = [w["pad_fraction"] or 0.0 for w in result.workers]  # None: nothing ragged
    return {"tokens_per_s": tokens * epochs / result.timings["train_s"],
            "wall_tokens_per_s": tokens * epochs / wall, "train_s": result.timings["train_s"],
            "wall_s": wall, "pad_fraction": sum(padding) / len(padding),
            "bits_per_byte": result.history[-1]["eval_loss"] / math.log(2)}


def our_side(seq_len: int, max_bytes: int, batch: int, epochs: int, repeats: int) -> dict:
    from sparkdl_avg import SPARK_CONF

    spark = local_session(2, **SPARK_CONF)
    try:
        data = {kind: make_data(spark, seq_len, max_bytes, kind == "ragged")
                for kind in ("fixed", "ragged")}
        tokens = {kind: int(d[0].selectExpr("sum(size(labels))").first()[0])
                  for kind, d in data.items()}
        runs: dict[str, list] = {"fixed": [], "ragged": []}
        for i in range(repeats):  # the first fit (cold) is a fixed one, then they alternate
            for kind in ("fixed", "ragged") if i % 2 == 0 else ("ragged", "fixed"):
                runs[kind].append(fit_run(data[kind], tokens[kind], seq_len, batch, epochs))
        return runs
    finally:
        spark.stop()


def job_defaults(seq_len: int, batch: int, epochs: int) -> dict:
    """One fit as `python jobs/train_char_lm.py` runs it (all the text, its epochs, its
    model), in a fresh session: the job's figures for the docs."""
    from sparkdl_avg import SPARK_CONF
    from sparkdl_avg.examples import char_lm

    spark = local_session(2, **SPARK_CONF)
    try:
        data = make_data(spark, seq_len, None, ragged=False)
        tokens = int(data[0].selectExpr("sum(size(labels))").first()[0])
        run = fit_run(data, tokens, seq_len, batch, epochs)
        return {**run, "epochs": epochs, "tokens_per_epoch": tokens,
                "unigram_bits_per_byte": char_lm.unigram_bits_per_byte(data[0])}
    finally:
        spark.stop()


def medians(runs: list) -> dict:
    keys = [k for k in runs[0] if all(r[k] is not None for r in runs)]
    return {k: median([r[k] for r in runs]) for k in keys} | {"runs": len(runs)}


def summary(sessions: list, torch_runs: dict, batch: int) -> dict:
    """Ours: medians of the cold fits (each session's first, fixed windows) and, per kind,
    of the warm ones (the rest);
    plain torch: its process's first run (cold, fixed windows) and the medians of the rest
    (warm); the ratios of ours to plain torch at the same batch, and of ragged to fixed."""
    torch_warm = {k: medians(v) for k, v in torch_runs.items() if k != "cold"}
    out: dict = {"ours": {}, "plain_torch": {"cold_fixed": torch_runs["cold"][0], **torch_warm}}
    out["ours"]["cold_fixed"] = medians([s["fixed"][0] for s in sessions])  # first fits
    for kind in ("fixed", "ragged"):
        warm = [r for s in sessions for r in s[kind][kind == "fixed":]]
        out["ours"][kind] = medians(warm) if warm else None

    def tps(d):
        return d["tokens_per_s"] if d else math.nan

    ours, torch_side = out["ours"], out["plain_torch"]
    out["ratio_ours_to_plain_torch"] = {
        "fixed_cold": tps(ours["cold_fixed"]) / tps(torch_side["cold_fixed"]),
        **{f"{kind}_warm": tps(ours[kind]) / tps(torch_side[f"{kind}_batch_{batch}"])
           for kind in ("fixed", "ragged")}}
    out["ratio_ragged_to_fixed"] = {
        "ours_warm": tps(ours["ragged"]) / tps(ours["fixed"]),
        "plain_torch": tps(torch_side[f"ragged_batch_{batch}"])
        / tps(torch_side[f"fixed_batch_{batch}"])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=2, help="fresh processes of ours")
    parser.add_argument("--repeats", type=int, default=3, help="fits of each kind a session")
    parser.add_argument("--max-bytes", type=int, default=200_000, help="of the stdlib text")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--torch-batch", type=int, nargs="*", help="plain torch's other "
                        "batch sizes (default: the global batch, 2 x --batch-size)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--job-epochs", type=int, default=3,
                        help="one more fit as the job runs it, all the text (0: none)")
    parser.add_argument("--side", choices=["ours", "torch", "job"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [args.batch_size, *(args.torch_batch if args.torch_batch is not None
                                  else [2 * args.batch_size])]
    if args.side == "ours":
        print(json.dumps(our_side(args.seq_len, args.max_bytes, args.batch_size, args.epochs,
                                  args.repeats)))
        return
    if args.side == "job":
        print(json.dumps(job_defaults(args.seq_len, args.batch_size, args.job_epochs)))
        return
    if args.side == "torch":
        print(json.dumps(torch_side(args.folder, args.seq_len, batches, args.epochs,
                                    args.repeats)))
        return
    folder = tempfile.mkdtemp(prefix="bench-char-lm-")
    spark = local_session(2)
    try:
        tokens = save_numpy(spark, folder, args.seq_len, args.max_bytes)
    finally:
        spark.stop()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"}
    common = ["--seq-len", str(args.seq_len), "--max-bytes", str(args.max_bytes),
              "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
              "--repeats", str(args.repeats), "--torch-batch", *map(str, batches[1:])]
    sessions, torch_runs = [], None
    for i in range(args.sessions):  # the sides' order alternates from session to session
        for side in ("ours", "torch") if i % 2 == 0 else ("torch", "ours"):
            if side == "torch" and torch_runs is not None:
                continue  # plain torch has no session to warm: one process of runs
            logging.info("session %d: %s", i + 1, side)
            out = in_fresh_process(__file__, "--side", side, "--folder", folder, *common,
                                   env=env)
            if side == "ours":
                sessions.append(out)
            else:
                torch_runs = out
    job = in_fresh_process(__file__, "--side", "job", "--job-epochs", str(args.job_epochs),
                           *common, env=env) if args.job_epochs else None
    report("char_lm", {
        "seq_len": args.seq_len, "max_bytes": args.max_bytes, "batch_size": args.batch_size,
        "epochs": args.epochs, "sessions": args.sessions, "repeats": args.repeats,
        "model": {"d_model": D_MODEL, "heads": HEADS, "layers": LAYERS, "lr": LR},
        "tokens_per_epoch": tokens,
        "summary": summary(sessions, torch_runs, args.batch_size),
        "job_defaults": job,
        "runs": {"ours": sessions, "plain_torch": torch_runs},
    })


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
