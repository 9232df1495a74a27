"""Fine-tuning a pretrained causal LM with LoRA on a second corpus: the pieces of
jobs/finetune_lm.py (needs the `hf` extra: transformers and peft).

The model is a Hugging Face `GPT2LMHeadModel` built from a config over byte tokens (no
tokenizer, nothing downloaded). It is pretrained by a fit on one corpus, saved with
`save_pretrained` to a folder every executor reads, and fine-tuned by a second fit whose
`model_fn` loads that folder and wraps it in PEFT LoRA: the base is frozen, so only the
adapters travel each round. Both fits take the model as it is, with its own loss
(`loss="model"`). The second corpus is English: the Python reference
documentation that ships with every Python (`pydoc_data/topics.py`), its string literals
decoded in Spark SQL, one row per topic. Windows of bytes are `char_lm.windows`'.
"""

from __future__ import annotations

import math
import os
import statistics
import warnings
from functools import partial

from torch import nn

from sparkdl_avg.examples.char_lm import VOCAB

# topics.py is `topics = {'assert': 'The "assert" statement\n' '****\n' ..., 'assignment': ...}`
# as pprint writes it: a key opens each topic's line, then adjacent string literals, single-
# quoted unless the text holds a single quote and no double one.
_TOPIC_KEY = r"(?m)^(?:topics = \{)? *'[^'\n]*': "
# one literal, either quote; possessive (*+): a literal is a line, no backtracking into it
_LITERAL = "|".join(q + r"(?:[^" + q + r"\\\n]|\\.)*+" + q for q in "'\"")


def topics_path() -> str:
    """The stdlib's English: the reference documentation pydoc prints (0.47 MB of text with
    Python 3.11)."""
    import pydoc_data

    return os.path.join(os.path.dirname(pydoc_data.__file__), "topics.py")


def english_docs(spark, path: str | None = None):
    """One row per topic of `pydoc_data/topics.py` (columns path, text as
    `char_lm.read_files`): the topic's literals decoded in Spark SQL, no Python UDF. The
    file holds only the escapes \\n, \\', \\" and \\\\; a backslash pair becomes NUL first,
    so that the pair before an `n` is not read as a newline."""
    from pyspark.sql import functions as sf

    from sparkdl_avg.examples.char_lm import read_files

    whole = read_files(spark, [path or topics_path()])
    topics = whole.select("path", sf.posexplode(sf.split("text", _TOPIC_KEY)).alias("i", "body"))
    literals = sf.regexp_extract_all("body", sf.lit(_LITERAL), 0)
    text = sf.array_join(sf.transform(literals, lambda s: sf.substring(s, 2, sf.length(s) - 2)),
                         "")
    for escape, char in (("\\\\\\\\", "\u0000"), ("\\\\n", "\n"), ("\\\\'", "'"),
                         ('\\\\"', '"'), ("\u0000", "\\\\")):
        text = sf.regexp_replace(text, escape, char)
    return topics.where(sf.col("i") > 0).select(  # before the first key: the file's header
        sf.concat_ws("#", "path", "i").alias("path"), text.alias("text"))


def causal_windows(windows):
    """`char_lm.windows`' rows as a Hugging Face causal LM takes them with its own loss:
    `input_ids` and `labels` both the whole window of T+1 bytes (the model shifts the labels
    itself, so it is scored on the same T next bytes as the built-in loss on `labels`)."""
    from pyspark.sql import functions as sf

    window = sf.concat("input_ids", sf.slice("labels", -1, 1))
    return windows.select(window.alias("input_ids"), window.alias("labels"))


def gpt2_config(d_model: int, heads: int, layers: int, max_len: int):
    """GPT-2's architecture at toy size over bytes. Dropout off: the fits compared are
    deterministic and small; the same input gives the same loss in training and evaluation."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=max_len, n_embd=d_model, n_layer=layers,
                      n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=ord("\n"), eos_token_id=ord("\n"))


def _build_gpt2(d_model: int, heads: int, layers: int, max_len: int) -> nn.Module:
    from transformers import GPT2LMHeadModel

    return _causal_lm_loss(GPT2LMHeadModel(gpt2_config(d_model, heads, layers, max_len)))


def _causal_lm_loss(model: nn.Module) -> nn.Module:
    """Name the loss transformers gives the model anyway: it reads the kind from the class's
    name, which for GPT2LMHeadModel matches none, and warns at the first loss of every
    process (each task's too) before falling back to this one."""
    model.loss_type = "ForCausalLM"
    return model


def gpt2(d_model: int = 128, heads: int = 4, layers: int = 4, max_len: int = 128):
    """A picklable model factory: a fresh GPT-2 taking `max_len` bytes (the fit seeds it
    with `TrainConfig.seed`)."""
    return partial(_build_gpt2, d_model, heads, layers, max_len)


def _load(pretrained: str) -> nn.Module:
    from transformers import GPT2LMHeadModel

    return _causal_lm_loss(GPT2LMHeadModel.from_pretrained(pretrained).train())  # loads in eval


def whole(pretrained: str):
    """A picklable model factory: the GPT-2 saved in the folder `pretrained`, every weight
    trained (full fine-tuning, what LoRA is measured against)."""
    return partial(_load, pretrained)


def _build_lora(pretrained: str, rank: int, targets: tuple[str, ...]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    base = _load(pretrained)
    # GPT-2's projections are Conv1D (weights stored in x out): fan_in_fan_out says so.
    # LoRA's B starts at zero, so the wrapped model starts as the pretrained one.
    adapters = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, fan_in_fan_out=True,
                          target_modules=list(targets))
    with warnings.catch_warnings():
        # peft 0.21 asks the model for transformers' deprecated `is_gradient_checkpointing`
        # (transformers 5 warns on every wrap): theirs to change, nothing a user can act on
        warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        return get_peft_model(base, adapters).train()


def lora(pretrained: str, rank: int = 8, targets: tuple[str, ...] = ("c_attn", "c_fc")):
    """A picklable model factory: the GPT-2 saved in the folder `pretrained` (which every
    executor must read: a shared path on a cluster, e.g. a Volume) with LoRA adapters of
    `rank` on the named projections, everything else frozen by PEFT."""
    return partial(_build_lora, pretrained, rank, tuple(targets))


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of `model`."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def perplexity(nats_per_byte: float) -> float:
    """Per-byte perplexity: e to the mean cross-entropy in nats."""
    return math.exp(nats_per_byte)


def driver_mb(history: list[dict]) -> float:
    """The median megabytes that passed through the driver in a round of a sync fit (every
    worker's push and its average back)."""
    return statistics.median(row["driver_mb"] for row in history if "driver_mb" in row)


def report(pretrained, tuned, unigram_bits: float) -> dict[str, float]:
    """What the job reports and logs, from the two fits' results: held-out B's perplexity
    after pretraining (the fine-tune's start: LoRA starts as the model it wraps) and after
    fine-tuning, against the unigram's (`unigram_bits`: B's byte entropy); each fit's
    megabytes through the driver a round; the parameters fine-tuning trained."""
    def last_eval(result) -> float:
        return next(row["eval_loss"] for row in reversed(result.history) if "eval_loss" in row)

    trainable, total = parameter_counts(tuned.model)
    return {"perplexity_before": perplexity(last_eval(pretrained)),
            "perplexity_after": perplexity(last_eval(tuned)),
            "perplexity_unigram": 2.0 ** unigram_bits,
            "driver_mb_pretrain": driver_mb(pretrained.history),
            "driver_mb_finetune": driver_mb(tuned.history),
            "trainable_params": trainable, "total_params": total,
            "pretrain_s": pretrained.timings["total_s"], "finetune_s": tuned.timings["total_s"]}
