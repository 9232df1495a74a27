"""Hugging Face models as they are: a `transformers` GPT-2 built from a config (nothing is
downloaded), wrapped in PEFT LoRA, trained on byte tokens of real text (the stdlib's own
sources) with the model's own loss (`loss="model"`: labels= in, `.loss` out) or a built-in
loss on its `.logits`; only the adapters train and travel, a restart is bit-identical, and
the logged adapters load back with `PeftModel.from_pretrained`."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
from functools import partial

import numpy as np
import pytest
import torch
from rounding import gamma, sum_tolerance

from sparkdl_avg import ConfigError, ModelError, TrainConfig, fit
from sparkdl_avg._losses import make_objective

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="needs the hf extra (transformers, peft)")

WINDOW = 32
VOCAB = 256  # byte tokens
INPUTS = {"input_ids": "tokens", "attention_mask": "mask"}


def gpt2(seed: int = 11):
    """A 2-layer GPT-2 of 64 wide from its config: the "pretrained" backbone (its own seed, so
    every replica builds the same one whatever seed the fit runs under)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                      n_positions=WINDOW, bos_token_id=0, eos_token_id=0))


def lora_gpt2(fault_marker: str = ""):
    """The backbone with LoRA adapters on its attention and MLP projections, and its final
    norm trained whole (PEFT's `modules_to_save`: a random backbone's logits need it); with
    `fault_marker`, partition 1's 7th training forward raises once (the marker file says it
    fired)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(gpt2(), LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0,
                                              target_modules=["c_attn", "c_fc"],
                                              fan_in_fan_out=True,
                                              modules_to_save=["ln_f"]))
    if fault_marker:
        model.register_forward_pre_hook(_FaultOnce(fault_marker, at_call=7))
    return model.double()


class _FaultOnce:
    """A forward pre-hook that raises in partition 1's `at_call`-th training forward, once
    per `marker` file."""

    def __init__(self, marker: str, at_call: int) -> None:
        self.marker, self.at_call, self.calls = marker, at_call, 0

    def __call__(self, module, args) -> None:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is None or not module.training or ctx.partitionId() != 1:
            return
        self.calls += 1
        if self.calls == self.at_call:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            raise ValueError("injected failure in forward")


def byte_windows(rows: int, offset: int = 0) -> np.ndarray:
    """`rows` windows of WINDOW + 1 bytes of the stdlib's own source text."""
    import email.message
    import json.decoder
    import textwrap

    text = "".join(inspect.getsource(m) for m in (json.decoder, email.message, textwrap))
    data = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
    starts = offset + np.arange(rows) * (WINDOW // 2)
    assert starts[-1] + WINDOW + 1 <= len(data)
    return data[starts[:, None] + np.arange(WINDOW + 1)]


def text_frame(spark, rows: int, offset: int = 0):
    """tokens (the window), mask (all 1), labels (the window itself: a causal LM shifts), and
    next (the byte that follows each position, for a built-in loss on the logits; -100 at
    the last, which a causal LM's own loss leaves out too)."""
    import pandas as pd

    w = byte_windows(rows, offset)
    following = w[:, 1:].copy()
    following[:, -1] = -100
    return spark.createDataFrame(pd.DataFrame({
        "tokens": list(w[:, :-1]), "mask": list(np.ones_like(w[:, :-1])),
        "labels": list(w[:, :-1]), "next": list(following)}))


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def frozen(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


# ---- without Spark or Hugging Face --------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_outputs": 2}, "one label column"),
    ({"loss_weights": [1.0]}, "drop loss_weights"),
    ({"weighted": True}, "no row weights"),
    ({"inputs": ["tokens", "mask"]}, "inputs bound by name"),
    ({"inputs": {"input_ids": "tokens", "labels": "y"}}, "bind the labels with label_col"),
])
def test_model_loss_refuses_what_it_cannot_honour(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_objective("model", **kwargs)


def test_model_loss_cannot_be_one_of_a_list_of_losses():
    with pytest.raises(ConfigError, match="cannot be one of a list"):
        make_objective(["model", "mse"], num_outputs=2)


def _keyword_schema(*names: str, label_dtype: str = "int32"):
    from sparkdl_avg.data.schema import DataSchema, FieldSpec

    return DataSchema(inputs=tuple(FieldSpec("input", n, n, f"_x{i}", "int32", (WINDOW,))
                                   for i, n in enumerate(names)),
                      binding="keyword", labels=(FieldSpec("label", "labels", "labels", "_y0",
                                                           label_dtype, (WINDOW,)),),
                      label_list=False)


_RANGES = {"_x0": (0, 255), "_x1": (0, 1), "_y0": (0, 255)}


class _NoLabels(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 4)

    def forward(self, input_ids):
        return self.emb(input_ids)


def test_the_probe_refuses_a_model_loss_the_model_cannot_compute():
    from sparkdl_avg._model import check_model_takes_data

    objective = make_objective("model", inputs=INPUTS)
    with pytest.raises(ModelError, match="labels=, but _NoLabels.forward has no such"):
        check_model_takes_data(_NoLabels(), _keyword_schema("input_ids"), objective,
                               dtype=torch.float32, ranges=_RANGES, longest={})

    class TensorOut(_NoLabels):
        def forward(self, input_ids, labels=None):
            return self.emb(input_ids)

    with pytest.raises(ModelError, match=r"\.loss.*a tensor of shape \(2, 32, 4\)"):
        check_model_takes_data(TensorOut(), _keyword_schema("input_ids"), objective,
                               dtype=torch.float32, ranges=_RANGES, longest={})

    class KeywordsOnward(_NoLabels):  # **kwargs, but it names its parameters: no labels
        def forward(self, input_ids, **kwargs):
            return self.emb(input_ids)

    with pytest.raises(ModelError, match="labels=, but KeywordsOnward.forward has no such"):
        check_model_takes_data(KeywordsOnward(), _keyword_schema("input_ids"), objective,
                               dtype=torch.float32, ranges=_RANGES, longest={})


def test_a_forward_of_keywords_only_that_names_none_takes_any():
    from sparkdl_avg._model import _check_keywords

    class Anything(_NoLabels):
        def forward(self, *args, **kwargs):
            return self.emb(kwargs["input_ids"])

    _check_keywords(Anything(), _keyword_schema("input_ids", "whatever"), model_loss=True)


def test_a_tuple_output_is_refused_saying_return_dict():
    """A transformers model built with return_dict=False returns (loss, logits, ...)."""
    from sparkdl_avg._losses import check_outputs

    w = torch.zeros(2, 4, dtype=torch.long)
    as_tuple = (torch.tensor(1.0), torch.zeros(2, 4, VOCAB))
    with pytest.raises(ModelError, match=r"tuple of 2.*return_dict=True"):
        make_objective("model", inputs=INPUTS)(as_tuple, (w,))
    with pytest.raises(ModelError, match=r"tuple of 2.*return_dict=True"):  # the probe's
        check_outputs(make_objective("cross_entropy"), as_tuple, (w,), ["column 'next'"])


def test_a_chunk_with_no_label_left_after_the_shift_has_loss_0_and_weight_0():
    """A causal LM shifts its labels: rows of one token (the rest -100 pads) keep none, and
    its loss is the mean of nothing, NaN. Such a chunk is 0 and weighs nothing, in
    training (with a zero, finite gradient) and evaluation; a chunk with labels left keeps
    the model's loss, and a NaN it gives with labels left stays NaN."""
    objective = make_objective("model", inputs=INPUTS)
    one_token = torch.tensor([[5, -100, -100], [7, -100, -100]])
    logits = torch.zeros(2, 3, 8, requires_grad=True)
    shifted = torch.nn.functional.cross_entropy(  # as a causal LM's loss: the mean of nothing
        logits[:, :-1].reshape(-1, 8), one_token[:, 1:].reshape(-1), ignore_index=-100)
    nan = {"loss": shifted, "logits": logits}
    assert shifted.isnan()
    loss = objective(nan, (one_token,))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    sums = objective.evaluate(nan, (one_token,))
    assert sums.loss_sum.item() == 0.0 and sums.loss_weight.item() == 0.0
    left = torch.tensor([[5, 6, -100], [7, -100, -100]])
    assert objective.evaluate({"loss": torch.tensor(2.0)}, (left,)).loss_sum.item() == 4.0
    assert objective({"loss": torch.tensor(float("nan"))}, (left,)).isnan()
    # [B] labels (a classifier's): a chunk keeps nothing only when every one is -100
    assert objective.evaluate(nan, (torch.tensor([-100, -100]),)).loss_weight.item() == 0.0
    assert objective({"loss": torch.tensor(float("nan"))}, (torch.tensor([1, -100]),)).isnan()


def _bn_model():
    """A frozen Linear, a BatchNorm in training mode (its affine frozen: only its statistics
    train) and a trained Linear."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 2))
    net[0].requires_grad_(False)
    net[1].requires_grad_(False)
    return net


def test_adapters_of_a_plain_model_are_what_trained_by_name_buffers_included(tmp_path):
    """What trained is what was averaged (the head, the BatchNorm's statistics) and the
    counted buffers carried (num_batches_tracked), named while the model is in training
    mode: the result is logged in eval mode, where those buffers would not count."""
    from safetensors.torch import load_file

    from sparkdl_avg.tracking.adapters import TRAINABLE_FILE, save_adapters, trained_names

    trained = _bn_model()
    trained(torch.randn(16, 4) * 3 + 1)  # training mode: the statistics move
    with torch.no_grad():
        trained[2].weight.add_(1.0)
    names = trained_names(trained)
    info = save_adapters(trained.eval(), str(tmp_path), names)
    tensors = load_file(str(tmp_path / TRAINABLE_FILE))
    assert sorted(tensors) == ["1.num_batches_tracked", "1.running_mean", "1.running_var",
                               "2.bias", "2.weight"]
    assert info["format"] == "safetensors" and info["trained_values"] == 18 + 16
    loaded = _bn_model()
    loaded.load_state_dict(tensors, strict=False)  # as sparkdl_avg.json says
    x = torch.randn(3, 4)
    assert torch.equal(loaded.eval()(x), trained(x))
    assert torch.equal(loaded[1].num_batches_tracked, torch.tensor(1))


def test_adapters_are_refused_a_registered_model():
    with pytest.raises(ConfigError, match="'adapters' logs files"):
        TrainConfig(log_model="adapters", registered_model_name="lm")


def test_a_ragged_label_is_the_models_to_mask_only_when_it_is_padded_with_minus_100():
    """Ragged integer labels pad with -100, which a Hugging Face loss ignores; float ones pad
    with 0, which the model's loss would train towards."""
    from sparkdl_avg import DataError
    from sparkdl_avg.data.schema import DataSchema, FieldSpec
    from sparkdl_avg.driver.plan import check_ragged_labels

    def schema(dtype):
        return DataSchema(inputs=(FieldSpec("input", "input_ids", "t", "_x0", "int32", (-1,)),),
                          binding="keyword", label_list=False,
                          labels=(FieldSpec("label", "labels", "y", "_y0", dtype, (-1,)),))

    check_ragged_labels(schema("int32"), make_objective("model", inputs=INPUTS))
    with pytest.raises(DataError, match="ragged"):
        check_ragged_labels(schema("float32"), make_objective("model", inputs=INPUTS))


# ---- Hugging Face models, without Spark ------------------------------------------------


@needs_hf
@pytest.mark.exact
def test_model_loss_is_the_outputs_loss_in_training_evaluation_and_step_weight():
    model = lora_gpt2()
    w = torch.as_tensor(byte_windows(6))[:, :-1]
    out = model(input_ids=w, labels=w)
    objective = make_objective("model", inputs=INPUTS)
    assert objective.model_loss and not objective.classify
    assert objective.model_labels((w,)) is w
    assert torch.equal(objective(out, (w,)), out.loss)
    sums = objective.evaluate(out, (w,))
    assert sums.loss_weight.item() == 6 and sums.correct is None
    assert sums.loss_sum.item() == pytest.approx(6 * out.loss.item(), rel=1e-12)
    assert objective.step_weight((w,)).item() == 6  # rows, not tokens
    with pytest.raises(ModelError, match=r"\.loss.*labels="):
        objective(model(input_ids=w), (w,))  # no labels given: no .loss


@needs_hf
def test_a_causal_lms_chunk_of_one_token_rows_is_0_not_nan():
    model = lora_gpt2()
    one_token = torch.tensor([[40, -100, -100], [41, -100, -100]])
    out = model(input_ids=one_token.clamp(min=0), labels=one_token)
    assert out.loss.isnan()  # the model's own: the mean over no label
    objective = make_objective("model", inputs=INPUTS)
    assert objective(out, (one_token,)).item() == 0.0
    assert objective.evaluate(out, (one_token,)).loss_weight.item() == 0.0


@needs_hf
@pytest.mark.exact
def test_a_built_in_loss_reads_a_model_outputs_logits_through_the_schema():
    from sparkdl_avg.data.schema import DataSchema, FieldSpec

    model = lora_gpt2().eval()
    w = torch.as_tensor(byte_windows(4))
    schema = DataSchema(inputs=(FieldSpec("input", "input_ids", "tokens", "_x0", "int64",
                                          (WINDOW,)),),
                        binding="keyword", labels=(), label_list=False)
    with torch.no_grad():
        logits = schema.call(model, (w[:, :-1],))
        assert torch.equal(logits, model(input_ids=w[:, :-1]).logits)
        loss = make_objective("cross_entropy")(logits, (w[:, 1:],))
        by_hand = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                    w[:, 1:].reshape(-1))
    # the same per-token losses, averaged in another order (a masked sum, then one division):
    # each mean within gamma_n of the exact one, relative to it (every term is >= 0)
    tokens = w[:, 1:].numel()
    assert loss.item() == pytest.approx(by_hand.item(), rel=sum_tolerance(torch.float32,
                                                                          tokens + 1))


@needs_hf
@pytest.mark.parametrize("wrapped", [False, True], ids=["gpt2", "peft"])
def test_a_misspelled_input_is_refused_though_forward_takes_kwargs(wrapped):
    """transformers 5's forward (and PEFT's, (*args, **kwargs)) takes **kwargs, which would
    swallow `attn_mask`: the model would train unmasked. The names of the forwards along
    the wrapped chain are what may be bound."""
    from sparkdl_avg._model import check_model_takes_data

    model = lora_gpt2() if wrapped else gpt2().double()
    assert any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters
               .values())
    objective = make_objective("model", inputs=INPUTS)
    check_model_takes_data(model, _keyword_schema("input_ids", "attention_mask"), objective,
                           dtype=torch.float64, ranges=_RANGES, longest={})
    with pytest.raises(ModelError, match=r"inputs binds 'attn_mask'.*\(did you mean "
                                         r"'attention_mask'\?\); its parameters"):
        check_model_takes_data(model, _keyword_schema("input_ids", "attn_mask"), objective,
                               dtype=torch.float64, ranges=_RANGES, longest={})


@needs_hf
def test_a_model_loss_is_scored_by_the_models_problem_type_else_its_logits():
    """loss="model" says nothing of the head: a Hugging Face classifier's problem_type does
    (set by its forward from the labels, as in the driver's probe), else the logits' width."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from sparkdl_avg._model import check_model_takes_data
    from sparkdl_avg._model_output import model_head

    def classifier(labels: int, problem_type=None):
        torch.manual_seed(0)
        return GPT2ForSequenceClassification(GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=WINDOW,
            num_labels=labels, pad_token_id=0, problem_type=problem_type)).double()

    from sparkdl_avg.data.schema import DataSchema, FieldSpec

    def schema(dtype, shape):
        return DataSchema(inputs=(FieldSpec("input", "input_ids", "t", "_x0", "int32",
                                            (WINDOW,)),),
                          binding="keyword", label_list=False,
                          labels=(FieldSpec("label", "labels", "y", "_y0", dtype, shape),))

    objective = make_objective("model", inputs=INPUTS)
    probe = {"dtype": torch.float64, "ranges": {"_x0": (0, 255), "_y0": (0, 2)},
             "longest": {}}
    regression = classifier(1)
    out = check_model_takes_data(regression, schema("float64", ()), objective, **probe)
    assert regression.config.problem_type == "regression"
    assert model_head(regression, out) == "value"
    labelled = classifier(3)
    out = check_model_takes_data(labelled, schema("int32", ()), objective, **probe)
    assert model_head(labelled, out) == "class"
    multi = classifier(3, "multi_label_classification")
    assert model_head(multi, None) == "multilabel"
    assert model_head(gpt2(), None) == "class"  # no problem_type, no output (a meta driver)
    assert model_head(torch.nn.Linear(2, 1), torch.zeros(4, 1)) == "value"
    assert model_head(torch.nn.Linear(2, 3), {"logits": torch.zeros(4, 3)}) == "class"


@needs_hf
def test_adapters_of_a_driver_without_the_frozen_weights_save_and_load(tmp_path):
    """driver_model="meta": the driver's PEFT model holds only what trains (the rest on the
    meta device); its adapters are saved from that, without assembling the whole model."""
    from peft import PeftModel

    from sparkdl_avg.driver.meta_model import _make_real, build_on_meta
    from sparkdl_avg.tracking.adapters import save_adapters, trained_names

    driver = build_on_meta(lora_gpt2)
    _make_real(driver)  # as the initial state from an executor's build does
    with torch.no_grad():
        for p in driver.parameters():
            if p.requires_grad:
                p.fill_(0.01)  # trained values
    assert any(p.is_meta for p in driver.parameters())  # the frozen base is not there
    info = save_adapters(driver, str(tmp_path), trained_names(driver))
    assert "not_in_adapters" not in info  # PEFT's file holds all that trained
    loaded = PeftModel.from_pretrained(gpt2().double(), str(tmp_path))
    assert all(torch.all(p == 0.01) for n, p in loaded.named_parameters()
               if "lora_" in n or ".modules_to_save." in n)


@needs_hf
def test_adapters_of_a_peft_model_add_what_trained_that_peft_does_not_save(tmp_path):
    """LoRA on both Linears of `_bn_model`: PEFT saves the adapters; the base's BatchNorm in
    training mode trained its statistics too, which PEFT's file leaves out."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from sparkdl_avg.tracking.adapters import NOT_IN_ADAPTERS_FILE, save_adapters, trained_names

    def lora():
        return get_peft_model(_bn_model(), LoraConfig(r=2, target_modules=["0", "2"]))

    trained = lora()
    trained(torch.randn(16, 4) * 3 + 1)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.fill_(0.1)
    info = save_adapters(trained.eval(), str(tmp_path), trained_names(trained.train()))
    rest = load_file(str(tmp_path / NOT_IN_ADAPTERS_FILE))
    assert sorted(rest) == sorted(info["not_in_adapters"]) == [
        f"base_model.model.1.{b}" for b in ("num_batches_tracked", "running_mean",
                                            "running_var")]
    assert NOT_IN_ADAPTERS_FILE in info["load"]
    loaded = PeftModel.from_pretrained(_bn_model(), str(tmp_path))
    loaded.load_state_dict(rest, strict=False)  # as sparkdl_avg.json says
    x = torch.randn(3, 4)
    assert torch.equal(loaded.eval()(x), trained.eval()(x))


# ---- fits ----------------------------------------------------------------------------

HELD_OUT = 192 * WINDOW // 2 + WINDOW  # past the training windows
BASE = dict(num_workers=2, epochs=2, batch_size=16, averaging_frequency=2, optimizer="adam",
            lr=0.03, seed=3, experiment_name="hf", checkpoint_every=2)


@pytest.fixture(scope="module")
def text(spark):
    return text_frame(spark, 192).cache()


@pytest.fixture(scope="module")
def held_out(spark):
    return text_frame(spark, 32, offset=HELD_OUT).cache()


@pytest.fixture(scope="module")
def own_loss(text, held_out):
    """LoRA trained with the model's own loss, its adapters logged."""
    return fit(text, lora_gpt2, TrainConfig(**BASE, log_model="adapters"), inputs=INPUTS,
               label_col="labels", loss="model", eval_df=held_out)


def held_out_loss(model, windows: np.ndarray) -> float:
    """The model's own loss on `windows` (each WINDOW + 1 bytes), in one batch."""
    w = torch.as_tensor(windows)[:, :-1]
    with torch.no_grad():
        return model.eval()(input_ids=w, attention_mask=torch.ones_like(w), labels=w).loss.item()


def own_loss_tolerance(model, windows: np.ndarray, rows_at_once: int) -> float:
    """How far the model's own loss on `windows` as a task computes it (`rows_at_once`
    windows a chunk) may lie from `held_out_loss`'s: the model casts the logits to float32,
    so each token's cross-entropy rounds its log-sum-exp of VOCAB exps there (VOCAB + 4
    roundings of terms of at most 2 max|z| + loss + 1), and each chunk's mean sums its
    tokens in float32 (gamma of their count, relative to the loss); twice, once a side."""
    z = logits(model, windows).abs().max().item()
    loss = held_out_loss(model, windows)
    tokens = max(rows_at_once, len(windows)) * WINDOW
    return 2 * (gamma(torch.float32, VOCAB + 4) * (2 * z + loss + 1) +
                gamma(torch.float32, tokens) * loss)


def logits(model, windows: np.ndarray) -> torch.Tensor:
    w = torch.as_tensor(windows)[:, :-1]
    with torch.no_grad():
        return model.eval()(input_ids=w, attention_mask=torch.ones_like(w)).logits


@pytest.mark.spark
def test_lora_trains_with_the_models_own_loss_and_only_its_adapters_move(own_loss):
    windows = byte_windows(32, offset=HELD_OUT)
    before, after = held_out_loss(lora_gpt2(), windows), own_loss.history[-1]["eval_loss"]
    assert after < before - 0.3, (before, after)
    # evaluation's loss is the model's own, on the held-out rows of both workers (16 each)
    assert abs(after - held_out_loss(own_loss.model, windows)) <= \
        own_loss_tolerance(own_loss.model, windows, 16)
    start = lora_gpt2()
    assert all(torch.equal(t, frozen(own_loss.model)[n]) for n, t in frozen(start).items())
    moved = trainable(own_loss.model)
    assert set(moved) == set(trainable(start))
    assert all("lora_" in n or ".modules_to_save." in n for n in moved)
    assert all(not torch.equal(t, moved[n]) for n, t in trainable(start).items())
    # what travels a round is the adapters (and the trained norm): less than half a copy of
    # the model, where averaging everything would send four (2 workers, both ways)
    whole = sum(p.numel() for p in start.parameters()) * 8 / 1e6  # float64
    assert max(h["driver_mb"] for h in own_loss.history if "driver_mb" in h) < whole / 2


@pytest.mark.spark
def test_logged_adapters_load_onto_the_base_with_peft_and_predict_alike(own_loss,
                                                                         mlflow_client):
    from peft import PeftModel

    folder = mlflow_client.download_artifacts(own_loss.run_id, "adapters")
    with open(os.path.join(folder, "sparkdl_avg.json")) as f:
        info = json.load(f)
    assert info["format"] == "peft" and "PeftModel.from_pretrained" in info["load"]
    loaded = PeftModel.from_pretrained(gpt2().double(), folder)
    windows = byte_windows(4, offset=HELD_OUT)
    assert torch.equal(logits(loaded, windows), logits(own_loss.model, windows))
    assert "model" not in {a.path for a in mlflow_client.list_artifacts(own_loss.run_id)}


@pytest.mark.spark
@pytest.mark.exact
def test_a_built_in_loss_on_the_logits_trains_the_adapters_the_models_loss_does(
        own_loss, text, held_out):
    """cross_entropy on .logits against the next bytes (-100 at each row's end) is the causal
    LM's own loss computed another way: the two fits agree (the model's loss casts the
    logits to float32, so not bit for bit); and scoring reads the logits too."""
    import mlflow

    result = fit(text, lora_gpt2, TrainConfig(**BASE), inputs=INPUTS, label_col="next",
                 loss="cross_entropy", eval_df=held_out)
    # The model's loss rounds the logits' softmax in float32 (a sum of VOCAB exps): each
    # gradient of a logit lies within about delta = gamma_{VOCAB+3} of the float64 one,
    # relatively. Adam's step is scale-free and at most 3.16 lr a coordinate (Kingma and Ba,
    # section 2.1), so to first order a relative change delta in the gradients moves each of
    # the 12 steps by at most 2 delta 3.16 lr: 3.5e-5 (measured: 1.2e-6 on one kind of
    # kernels; a wrong target moves the adapters by far more than that)
    a, b = trainable(own_loss.model), trainable(result.model)
    steps = BASE["epochs"] * 192 // BASE["num_workers"] // BASE["batch_size"]
    apart = 2 * gamma(torch.float32, VOCAB + 3) * 3.16 * BASE["lr"] * steps
    assert max((a[n] - b[n]).abs().max().item() for n in a) <= apart
    # its evaluation is the cross-entropy of its float32 logits, computed in the task's own
    # chunks (other batch shapes than here: each logit, and each token's log-sum-exp of
    # VOCAB, may round otherwise), within own_loss_tolerance's float32 bound
    windows = byte_windows(32, offset=HELD_OUT)
    z = logits(result.model, windows)
    expected = torch.nn.functional.cross_entropy(  # each position's next byte, the last's
        z[:, :-1].reshape(-1, VOCAB), torch.as_tensor(windows[:, 1:-1]).reshape(-1)).item()
    assert abs(result.history[-1]["eval_loss"] - expected) <= \
        own_loss_tolerance(result.model, windows, 16)
    scored = result.transform(held_out.limit(4), output="prediction").toPandas()
    windows = np.stack(scored["tokens"].map(list).tolist())
    expected = logits(result.model, np.pad(windows, ((0, 0), (0, 1)))).argmax(-1)
    assert np.array_equal(np.stack(scored["prediction"].map(list).tolist()), expected.numpy())
    # the logged model is the adapters merged into the base, scoring the logits as transform
    logged = mlflow.pyfunc.load_model(f"runs:/{result.run_id}/model")
    predicted = logged.predict(scored[["tokens", "mask"]], params={"output": "prediction"})
    assert np.array_equal(np.stack(predicted), expected.numpy())
    merged = mlflow.pytorch.load_model(f"runs:/{result.run_id}/model")
    assert "lora" not in " ".join(n for n, _ in merged.named_parameters())
    ids = torch.as_tensor(windows, dtype=torch.int64)
    out = merged(ids, torch.ones_like(ids))  # the inputs in the fit's order; logits out
    assert isinstance(out, torch.Tensor)
    assert torch.allclose(out, logits(result.model, np.pad(windows, ((0, 0), (0, 1)))),
                          atol=1e-9)


@pytest.mark.spark
def test_a_restart_after_a_fault_gives_bit_identical_adapters(own_loss, text, held_out,
                                                             tmp_path):
    marker = tmp_path / "fired"
    result = fit(text, partial(lora_gpt2, str(marker)), TrainConfig(**BASE, log_model=False),
                 inputs=INPUTS, label_col="labels", loss="model", eval_df=held_out)
    assert marker.exists() and len(result.failures) == 1
    assert "injected failure in forward" in result.failures[0]["error"]
    assert result.failures[0]["restart_at"] == "round 2"  # mid-training: 6 rounds in all
    a, b = trainable(own_loss.model), trainable(result.model)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.spark
def test_a_causal_lm_takes_its_input_column_as_its_labels(own_loss, text, held_out):
    """label_col="tokens", the column input_ids is bound to (as `labels=input_ids` trains
    every Hugging Face causal LM): carried and cached once, here on disk, it trains as the
    fit whose labels are a copied column (`own_loss`), and scores."""
    windows = byte_windows(32, offset=HELD_OUT)
    result = fit(text.drop("labels"), lora_gpt2,
                 TrainConfig(**BASE, log_model=False, data_cache="disk"), inputs=INPUTS,
                 label_col="tokens", loss="model", eval_df=held_out.drop("labels"))
    assert result.history[-1]["eval_loss"] < held_out_loss(lora_gpt2(), windows) - 0.3
    # the same rows in the same order through the same float64 ops: what differs is only
    # where the labels were read from, so anything beyond float64's rounding is a bug
    a, b = trainable(own_loss.model), trainable(result.model)
    assert a.keys() == b.keys() and all(torch.allclose(a[n], b[n], rtol=0, atol=1e-12)
                                        for n in a)
    evaluated = [[h["eval_loss"] for h in fit_.history if "eval_loss" in h]
                 for fit_ in (result, own_loss)]
    assert evaluated[0] and evaluated[0] == pytest.approx(evaluated[1], abs=1e-12)
    scored = result.transform(held_out.limit(4), output="prediction").toPandas()
    tokens = np.stack(scored["tokens"].map(list).tolist())
    expected = logits(result.model, np.pad(tokens, ((0, 0), (0, 1)))).argmax(-1)
    assert np.array_equal(np.stack(scored["prediction"].map(list).tolist()), expected.numpy())


@pytest.mark.spark
def test_logged_adapters_of_a_fit_hold_the_batchnorm_statistics_it_trained(spark,
                                                                          mlflow_client):
    """The fit names what trained before its result goes to eval mode: the logged file
    holds the BatchNorm's averaged statistics, and loads into `model_fn()` as the result."""
    from safetensors.torch import load_file

    from sparkdl_avg.tracking.adapters import TRAINABLE_FILE

    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, (64, 4))
    frame = spark.createDataFrame([(row.tolist(), int(row[0] > 2)) for row in x],
                                  "features array<double>, label int")
    result = fit(frame, _bn_model, TrainConfig(num_workers=2, epochs=1, batch_size=8,
                                               averaging_frequency=2, experiment_name="hf",
                                               log_model="adapters"))
    folder = mlflow_client.download_artifacts(result.run_id, "adapters")
    tensors = load_file(os.path.join(folder, TRAINABLE_FILE))
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(tensors)
    assert torch.equal(tensors["1.running_mean"], result.model[1].running_mean)
    loaded = _bn_model()
    loaded.load_state_dict(tensors, strict=False)
    probe = torch.as_tensor(x[:5], dtype=torch.float32)
    assert torch.equal(loaded.eval()(probe), result.model(probe))
