"""What a model returns, as the objective and scoring read it: a tensor, a tuple of them (one
per label column), or a Hugging Face `ModelOutput` (its `.logits`; under `loss="model"` its
`.loss`). Duck-typed: transformers is never imported here.

`loss="model"` takes the loss the model computes itself: the label column goes to forward as
`labels=` and the loss is the output's `.loss`, as the Hugging Face Trainer does. That loss is
a mean the model chose (a causal LM's: over the batch's tokens whose label is not -100, after
shifting), so a batch weighs its rows among the micro-batches of a step and in evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sparkdl_avg._errors import ConfigError, ModelError

MODEL_LOSS = "model"
"""`fit(loss="model")`: the model's own loss, given the labels as `labels=`."""
LABELS_PARAMETER = "labels"
"""The forward parameter that takes the labels under `loss="model"` (Hugging Face's)."""


def logits_of(output):
    """A `ModelOutput` (anything with `.logits`, or a mapping holding "logits") as its logits;
    anything else (a tensor, a tuple of them) as it is."""
    if isinstance(output, Mapping):
        return output.get("logits", output)
    logits = getattr(output, "logits", None)
    return output if logits is None else logits


_HEAD_OF_PROBLEM = {"regression": "value", "multi_label_classification": "multilabel",
                    "single_label_classification": "class"}


def model_head(model, output=None) -> str:
    """How a model trained with its own loss (`loss="model"`) is scored (a head of
    `scoring.outputs`): by its config's `problem_type` when it has one (a Hugging Face
    classifier's, which its forward sets from the labels: "regression" a value,
    "multi_label_classification" multilabel), else by its `output`'s logits: classes along a
    last dimension of more than 1, a value for 1 (or none); "class" when neither is known."""
    problem = getattr(getattr(model, "config", None), "problem_type", None)
    if problem in _HEAD_OF_PROBLEM:
        return _HEAD_OF_PROBLEM[problem]
    logits = logits_of(output)
    shape = getattr(logits, "shape", None)
    if shape is None:
        return "class"
    return "class" if len(shape) > 1 and shape[-1] > 1 else "value"


def loss_of(output):
    """The scalar loss a model computed (`loss="model"`): its output's `.loss` (or a
    mapping's "loss"). ModelError when there is none, or it is not a scalar tensor."""
    import torch

    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelError(
            f"loss='model' takes the loss from the model's output's .loss, computed from "
            f"labels=; the model returned {describe(output)} whose loss is "
            f"{describe(loss)}{tuple_hint(output)}. Return a ModelOutput (a transformers "
            "model given labels), or use a built-in or callable loss on the model's outputs")
    return loss.reshape(())


def model_loss_term(outputs, label) -> tuple:
    """(None, empty, loss) of the model's own loss on a chunk of rows whose labels are
    `label`: `empty` when it is NaN because no label was left to it (a causal LM shifts its
    labels, so rows of one token keep none: no integer label past each row's first position,
    or none at all in [B] labels); such a chunk's loss is 0, not NaN, and it weighs 0 in
    evaluation, as a built-in loss's chunk that keeps nothing. A NaN loss with labels left
    stays NaN (a diverged model); `empty` is None for float or boolean labels."""
    import torch

    from sparkdl_avg.data.schema import IGNORE_INDEX

    loss = loss_of(outputs)
    if label.is_floating_point() or label.dtype == torch.bool:
        return None, None, loss
    left = label[:, 1:] if label.dim() > 1 else label
    empty = ~(left != IGNORE_INDEX).any() & loss.isnan()
    return None, empty, torch.where(empty, torch.zeros_like(loss), loss)


def check_model_loss(*, num_outputs: int, loss_weights, weighted: bool, inputs) -> None:
    """`loss="model"` gives one label column to forward as `labels=`: refuse (ConfigError,
    naming why) what it cannot honour: several label columns, loss_weights, a weight column
    (the model's loss knows no row weights), inputs bound by position (a Hugging Face
    forward's second parameter is rarely the second column) or an input named `labels`."""
    if num_outputs != 1:
        raise ConfigError(f"loss='model' passes one label column to forward as labels=; "
                          f"label_col names {num_outputs}: give one, or a list of losses")
    if loss_weights is not None:
        raise ConfigError("loss_weights weigh a list of losses; loss='model' is the model's "
                          "one loss: drop loss_weights")
    if weighted:
        raise ConfigError("weight_col: the model's own loss (loss='model') takes no row "
                          "weights; drop weight_col, or use a built-in loss on the logits "
                          "(loss='cross_entropy'), which weighs rows")
    if isinstance(inputs, Sequence) and not isinstance(inputs, str):
        raise ConfigError(f"loss='model' needs inputs bound by name, a dict of forward "
                          f"parameter to column (inputs={{'input_ids': 'tokens', "
                          f"'attention_mask': 'mask'}}): positionally, a Hugging Face model's "
                          f"parameters after the first are not the columns listed; got "
                          f"inputs={inputs!r}"[:400])
    if isinstance(inputs, Mapping) and LABELS_PARAMETER in inputs:
        raise ConfigError("inputs binds 'labels', which loss='model' gives the label column "
                          "to: bind the labels with label_col")


def output_tensors(outputs, num_outputs: int, names: str) -> tuple:
    """The model's `outputs` as a tuple of `num_outputs` tensors, one per label column
    (`names`, for the message), or a ModelError saying what it returns instead."""
    import torch

    if num_outputs == 1:
        if not isinstance(outputs, torch.Tensor):
            raise ModelError(f"the model returns {describe(outputs)} but label column "
                             f"{names} needs one tensor{tuple_hint(outputs)}; give label_col "
                             "a list of columns to train a model of several outputs")
        return (outputs,)
    outs = tuple(outputs) if isinstance(outputs, (tuple, list)) else ()
    if len(outs) != num_outputs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise ModelError(f"the model must return a tuple of {num_outputs} tensors, one per "
                         f"label column ({names}); it returns {describe(outputs)}")
    return outs


def tuple_hint(outputs) -> str:
    """For a tuple output: that a transformers model built with return_dict=False returns
    one (its loss and logits by position), and what to do."""
    if not isinstance(outputs, (tuple, list)):
        return ""
    return (" (a transformers model with return_dict=False returns a tuple: build it with "
            "return_dict=True, e.g. config.return_dict = True, so that its .logits and .loss "
            "are read by name)")


def as_tuple(outputs) -> tuple:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def describe(value) -> str:
    import torch

    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} of {list(value)}"[:200]
    return type(value).__name__
