"""The char LM example's pieces, each against an independent computation: the windows Spark
SQL cuts against Python slicing the files' bytes, the unigram baseline against numpy, and the
transformer's causality. The job itself runs in test_job."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparkdl_avg.examples import char_lm

TEXTS = {
    "a.txt": "def f(x):\n    return x + 1  # naïve, 中文, ü\n" * 9,  # multi-byte UTF-8
    "b.txt": "class A:\n    pass\n" * 3,
    "c.txt": "hi",  # 2 bytes: one input, one label (a tail only)
    "d.txt": "x",   # 1 byte: no label, no window
}


def reference_windows(seq_len: int, keep_tails: bool) -> list[tuple[list[int], list[int]]]:
    out = []
    for text in TEXTS.values():
        data = text.encode("utf-8")
        for start in range(0, max(len(data) - 1, 0), seq_len):
            w = list(data[start:start + seq_len + 1])
            if len(w) == seq_len + 1 or (keep_tails and len(w) >= 2):
                out.append((w[:-1], w[1:]))
    return sorted(out)


@pytest.fixture(scope="module")
def texts(spark, tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    for name, text in TEXTS.items():
        (folder / name).write_text(text, encoding="utf-8")
    return char_lm.read_files(spark, [str(folder)])


def rows(df) -> list[tuple[list[int], list[int]]]:
    return [(list(r.input_ids), list(r.labels)) for r in df.collect()]


@pytest.mark.spark
@pytest.mark.parametrize("keep_tails", [False, True])
def test_windows_are_the_files_bytes_shifted_by_one(texts, keep_tails):
    train, held_out = char_lm.windows(texts, 16, keep_tails=keep_tails, eval_percent=30)
    assert train.schema["input_ids"].dataType.simpleString() == "array<int>"
    got_train, got_eval = rows(train), rows(held_out)
    assert got_train and got_eval  # both splits hold windows
    assert sorted(got_train + got_eval) == reference_windows(16, keep_tails)


@pytest.mark.spark
def test_max_bytes_keeps_a_sample_of_the_windows(texts):
    every = reference_windows(16, False)
    half, _ = char_lm.windows(texts, 16, max_bytes=len(every) * 16 // 2, eval_percent=0)
    kept = rows(half)
    assert 0.25 * len(every) < len(kept) < 0.75 * len(every)
    assert set(map(str, kept)) <= set(map(str, every))  # whole windows, none made up
    more, _ = char_lm.windows(texts, 16, max_bytes=10**9, eval_percent=0)
    assert sorted(rows(more)) == every


@pytest.mark.spark
def test_unigram_baseline_is_the_entropy_of_the_label_bytes(texts):
    train, _ = char_lm.windows(texts, 16, keep_tails=True, eval_percent=0)
    labels = np.concatenate([np.array(y) for _, y in reference_windows(16, True)])
    p = np.bincount(labels) / len(labels)
    p = p[p > 0]
    expected = float(-(p * np.log2(p)).sum())
    assert char_lm.unigram_bits_per_byte(train) == pytest.approx(expected, abs=1e-9)
    assert char_lm.bits_per_byte(math.log(256)) == pytest.approx(8.0)


@pytest.mark.exact
def test_the_transformer_is_causal_and_ignores_padding_after_a_row():
    model = char_lm.transformer(d_model=32, heads=4, layers=2, max_len=24)().double().eval()
    ids = torch.randint(0, 256, (3, 24))
    later_changed = ids.clone()
    later_changed[:, 10:] = torch.randint(0, 256, (3, 14))  # or padded with 0 there
    with torch.no_grad():
        a, b = model(ids), model(later_changed)
        short = model(ids[:, :10])
    assert a.shape == (3, 24, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-12)
    torch.testing.assert_close(a[:, :10], short, rtol=0, atol=1e-12)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3  # the later bytes are seen after them


def test_greedy_sampling_continues_the_prompt():
    model = char_lm.transformer(d_model=32, heads=2, layers=1, max_len=8)()
    text = char_lm.sample(model, "def ", num_bytes=20)
    assert text.startswith("def ")
    assert text == char_lm.sample(model, "def ", num_bytes=20)  # greedy: deterministic
    assert text != char_lm.sample(model, "def ", num_bytes=20, temperature=1.0)
