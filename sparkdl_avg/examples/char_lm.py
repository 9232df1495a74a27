"""A byte-level causal transformer and its data, made in Spark from any folder of text files.

The data path is Spark SQL only (no Python UDF): `spark.read.text` reads the files, each
file's UTF-8 bytes are cut into windows of T+1 bytes (`substring` of the `encode`d text, its
`hex` read two digits a byte), and a window gives `input_ids` (bytes 0..T-1) and per-token
`labels` (bytes 1..T), both array<int>. A hash of (file, window) picks the eval split, so the
split does not depend on partitioning. The model is nanoGPT's shape at toy size: token and
position embeddings, pre-LayerNorm blocks with causal self-attention, logits [B, T, 256].
"""

from __future__ import annotations

import math
import os
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256  # bytes: any text (any file) has a vocabulary of 256, no tokenizer needed


def stdlib_text_dirs() -> list[str]:
    """Folders of real text every Python install has: the sources of json, email, asyncio
    (0.73 MB of .py files with Python 3.11)."""
    import asyncio
    import email
    import json

    return [os.path.dirname(m.__file__) for m in (json, email, asyncio)]


# --8<-- [start:read_files]
def read_files(spark, paths: list[str], glob: str | None = None):
    """One row per file: `path` and `text` (the whole file). Spark skips `_`/`.` entries
    (so `__pycache__`); `glob` keeps only matching names (e.g. "*.py")."""
    from pyspark.sql import functions as sf

    reader = spark.read.option("pathGlobFilter", glob) if glob else spark.read
    return reader.text(paths, wholetext=True).select(
        sf.col("_metadata.file_path").alias("path"), sf.col("value").alias("text"))
# --8<-- [end:read_files]


def read_lines(spark, paths: list[str], glob: str | None = None):
    """One row per line, newline kept: `path` (the file and a row id) and `text`. Lines are
    ragged sequences: the padding bench's other kind of window."""
    from pyspark.sql import functions as sf

    reader = spark.read.option("pathGlobFilter", glob) if glob else spark.read
    return reader.text(paths).select(
        sf.concat_ws("#", "_metadata.file_path", sf.monotonically_increasing_id()).alias("path"),
        sf.concat("value", sf.lit("\n")).alias("text"))


# --8<-- [start:windows]  (docs/howto/char-lm.md shows this function as it is)
def windows(texts, seq_len: int, *, keep_tails: bool = False, max_bytes: int | None = None,
            eval_percent: int = 5):
    """(train_df, eval_df) of `input_ids` and `labels` (array<int>, seq_len each) cut from
    `texts` (columns path, text). Consecutive windows overlap by one byte, so every byte but
    a text's first is a label once. `keep_tails`: also each text's last, shorter window (at
    least one label): ragged rows. `max_bytes`: about that many bytes of windows, drawn by
    a hash of (path, window) from all the texts (one small job sums their sizes), for small
    runs."""
    from pyspark.sql import functions as sf

    t = seq_len
    data = sf.encode("text", "UTF-8")
    starts = sf.sequence(sf.lit(0), sf.floor((sf.octet_length(data) - 2) / t).cast("int"))
    cut = (texts.where(sf.octet_length(data) >= 2)
           .select("path", sf.explode(starts).alias("k"), data.alias("data"))
           .select("path", "k", sf.hex(sf.substring("data", sf.col("k") * t + 1, t + 1))
                   .alias("hex")))
    if not keep_tails:
        cut = cut.where(sf.length("hex") == 2 * (t + 1))
    if max_bytes is not None:  # a sample of the windows, spread over all the texts
        total = texts.select(sf.sum(sf.octet_length(data))).first()[0] or 1
        keep = sf.pmod(sf.xxhash64("path", "k", sf.lit("sample")), sf.lit(1 << 20))
        cut = cut.where(keep < min(1.0, max_bytes / total) * (1 << 20))
    # each byte: two hex digits -> conv base 16 -> 10 -> int; Spark evaluates it, no UDF
    ids = sf.expr("transform(sequence(0, length(hex) DIV 2 - 1), "
                  "i -> CAST(conv(substring(hex, 2 * i + 1, 2), 16, 10) AS INT))")
    out = cut.select("path", "k", ids.alias("ids")).select(
        "path", "k", sf.expr("slice(ids, 1, size(ids) - 1)").alias("input_ids"),
        sf.expr("slice(ids, 2, size(ids) - 1)").alias("labels"))
    held_out = sf.pmod(sf.xxhash64("path", "k"), sf.lit(100)) < eval_percent
    return (out.where(~held_out).select("input_ids", "labels"),
            out.where(held_out).select("input_ids", "labels"))
# --8<-- [end:windows]


def unigram_bits_per_byte(df, labels_col: str = "labels") -> float:
    """The entropy, in bits, of the byte distribution of `df`'s labels, computed in Spark: the
    cross-entropy of the best model that ignores context (a model must beat it to have
    learned anything from the context)."""
    from pyspark.sql import functions as sf

    counts = df.select(sf.explode(labels_col).alias("b")).groupBy("b").count()
    n, s = counts.agg(sf.sum("count"), sf.sum(sf.col("count") * sf.log2("count"))).first()
    return math.log2(n) - s / n  # -sum p log2 p with p = c / n


def bits_per_byte(nats_per_byte: float) -> float:
    return nats_per_byte / math.log(2)


class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal self-attention: a position sees itself
    and the bytes before it, so padding after a row's end never reaches its real positions."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """input_ids [B, T] (int64, T <= max_len) -> next-byte logits [B, T, 256]."""

    def __init__(self, d_model: int = 128, heads: int = 4, layers: int = 2,
                 max_len: int = 128) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos.weight[: input_ids.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def _build(d_model: int, heads: int, layers: int, max_len: int, seed: int) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(d_model, heads, layers, max_len)


def transformer(d_model: int = 128, heads: int = 4, layers: int = 2, max_len: int = 128,
                seed: int = 0):
    """A picklable zero-argument model factory for `fit(model_fn=...)`."""
    return partial(_build, d_model, heads, layers, max_len, seed)


@torch.no_grad()
def sample(model: CharTransformer, prompt: str, num_bytes: int = 120,
           temperature: float = 0.0, seed: int = 0) -> str:
    """`prompt` continued by `num_bytes` bytes: greedy (temperature 0) or sampled at
    `temperature`, each step seeing the last `max_len` bytes. Invalid UTF-8 shows as U+FFFD."""
    model.eval()
    ids = list(prompt.encode("utf-8")) or [ord("\n")]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(num_bytes):
        context = torch.tensor([ids[-model.max_len:]], dtype=torch.int64)
        logits = model(context)[0, -1].double()
        if temperature <= 0:
            ids.append(int(logits.argmax()))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return bytes(ids).decode("utf-8", errors="replace")


PROMPTS = ("def ", "import ", "class ")


def log_results(run_id: str, model: CharTransformer, bpb: float, unigram: float,
                prompts, num_bytes: int, temperature: float) -> str:
    """Logs `bits_per_byte` and `unigram_bits_per_byte` to the fit's MLflow run, and a
    sample from each prompt as the artifact samples.txt; returns the samples' text."""
    from mlflow.tracking import MlflowClient

    text = "\n\n".join(f"--- {p!r}\n{sample(model, p, num_bytes, temperature)}" for p in prompts)
    client = MlflowClient()
    client.log_metric(run_id, "bits_per_byte", bpb)
    client.log_metric(run_id, "unigram_bits_per_byte", unigram)
    client.log_text(run_id, text, "samples.txt")
    return text
