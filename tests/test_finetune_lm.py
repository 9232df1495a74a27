"""The fine-tuning job's pieces, each against an independent computation: the English corpus
Spark SQL decodes against Python's own reading of the same literals, and the LoRA model
against the pretrained one it wraps. The job itself runs in test_job."""

from __future__ import annotations

import pprint

import pytest
import torch
from test_hf import needs_hf

from sparkdl_avg.examples import char_lm, finetune_lm

# a skip by find_spec, not importorskip: importing transformers at collection costs every
# pytest run about 6 s, also the ones that select none of these tests (CI's second passes)
pytestmark = needs_hf


def decoded(df) -> list[str]:
    rows = df.collect()
    return [r.text for r in sorted(rows, key=lambda r: int(r.path.rsplit("#", 1)[1]))]


@pytest.mark.spark
def test_english_docs_are_the_topics_python_reads(spark):
    from pydoc_data.topics import topics

    assert decoded(finetune_lm.english_docs(spark)) == list(topics.values())


@pytest.mark.spark
def test_every_escape_and_quote_decodes_as_python_reads_it(spark, tmp_path):
    """A file written as pprint writes topics.py (adjacent literals a line, either quote),
    of texts with each escape the decoder knows, a backslash before an n among them."""
    texts = {"a": "it's \"both\" quotes\n" * 9, "b-c": 'say "x"\\n is not a newline\n' * 7,
             "d": "a\\b \\\\ d \u2014 caf\u00e9\n" * 5, "e": "", "f": "only ' a single one"}
    path = tmp_path / "topics.py"
    path.write_text("# header\ntopics = " + pprint.pformat(texts, width=40) + "\n",
                    encoding="utf-8")
    assert path.read_text().count("\n") > 20  # the texts were split over lines
    docs = finetune_lm.english_docs(spark, str(path))
    assert decoded(docs) == list(texts.values())
    # as the job feeds the model its own loss: each whole window of T+1 bytes, twice
    train, _ = char_lm.windows(docs, 8, eval_percent=0)
    got = [(list(r.input_ids), list(r.labels)) for r in
           finetune_lm.causal_windows(train).collect()]
    expected = [list(t.encode()[k:k + 9]) for t in texts.values()
                for k in range(0, len(t.encode()) - 1, 8) if len(t.encode()[k:k + 9]) == 9]
    assert sorted(got) == sorted((w, w) for w in expected)


def test_lora_starts_as_the_pretrained_model_and_trains_only_adapters(tmp_path):
    """LoRA's B starts at zero, so the fine-tune's first model is the pretrained one (its
    perplexity before fine-tuning is the pretraining fit's evaluation), and only the adapters
    require gradients."""
    torch.manual_seed(0)
    pretrained = finetune_lm.gpt2(d_model=32, heads=2, layers=2, max_len=16)()
    with torch.no_grad():  # a pretrained model is not an initial one: move every weight
        for p in pretrained.parameters():
            p.add_(0.1 * torch.randn_like(p))
    pretrained.save_pretrained(str(tmp_path))
    tuned = finetune_lm.lora(str(tmp_path), rank=4, targets=("c_attn",))()
    ids = torch.randint(0, 256, (3, 16))
    with torch.no_grad():
        assert torch.equal(tuned(input_ids=ids).logits, pretrained(input_ids=ids).logits)
    trainable = [n for n, p in tuned.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2  # A and B on each layer's c_attn
    # 32 in, 96 out: rank 4 x (32 + 96) a layer
    assert finetune_lm.parameter_counts(tuned) == (2 * 4 * (32 + 96),
                                                   sum(p.numel() for p in tuned.parameters()))
