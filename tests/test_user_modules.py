"""model_fn as users write it. It travels to the executors: the user's own modules by value,
installed packages by reference (`_model.pickle_for_executors`). The natural PEFT factory, a
module that does `from peft import LoraConfig, get_peft_model` at its top (as
docs/guide/fine-tuning.md's example, run in a notebook, does), pickles and trains; the walk
over what a callable names reads only what `getattr` gives. What its libraries warn of while
it builds is shown once, by the driver's build, not again by every executor's."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import textwrap
from functools import partial

import cloudpickle
import pytest
import torch
from test_hf import needs_hf

from sparkdl_avg._model import _is_user_module, _modules_of, pickle_for_executors

FACTORY = textwrap.dedent("""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    CONFIG = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                        bos_token_id=0, eos_token_id=0)

    def make():
        torch.manual_seed(0)
        return get_peft_model(GPT2LMHeadModel(CONFIG),
                              LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
""")


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    """FACTORY as a module of the user's own (a file beside the job, not installed)."""
    (tmp_path / "lora_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("lora_factory")
    yield module
    sys.modules.pop("lora_factory", None)


def _rebuilt_without(module, blob: bytes):
    """`blob` unpickled where `module` cannot be imported (as on an executor)."""
    folder = os.path.dirname(module.__file__)
    saved = sys.modules.pop(module.__name__)
    path = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != folder]
    try:
        with pytest.raises(ImportError):
            importlib.import_module(module.__name__)
        return cloudpickle.loads(blob)()
    finally:
        sys.path[:] = path
        sys.modules[module.__name__] = saved


@needs_hf
def test_a_factory_whose_module_imports_lora_config_travels_by_value(factory_module):
    from peft import PeftModel

    found = _modules_of(factory_module.make)
    assert factory_module in found and _is_user_module(factory_module)
    assert not any(_is_user_module(m) for m in found - {factory_module})  # peft: by reference
    model = _rebuilt_without(factory_module, pickle_for_executors("model_fn",
                                                                  factory_module.make))
    assert isinstance(model, PeftModel)


@needs_hf
def test_a_factory_defined_in_main_with_lora_config_imported_pickles():
    """The same code run as `__main__` (a notebook cell, `python job.py`)."""
    from peft import PeftModel

    namespace = {"__name__": "__main__"}
    exec(compile(FACTORY, "<notebook cell>", "exec"), namespace)
    make = namespace["make"]
    assert make.__module__ == "__main__"
    assert isinstance(cloudpickle.loads(pickle_for_executors("model_fn", make))(), PeftModel)


@dataclasses.dataclass
class _Options:
    """A dataclass with a field of a default_factory (absent from the class, as
    LoraConfig's `rank_pattern`), a field no instance set, and a callable."""

    pattern: dict = dataclasses.field(default_factory=dict)
    unset: int = dataclasses.field(init=False)
    hook: object = None


class _Refusing:
    """Raises on every attribute it does not have (a proxy, a lazy module)."""

    def __getattr__(self, name):
        raise RuntimeError(f"no {name} here")

    def __call__(self):
        return torch.nn.Linear(1, 1)

    @property
    def broken(self):
        raise ValueError("a property that fails")


def _helper():
    return 0


def test_the_walk_reads_only_what_getattr_gives():
    module = sys.modules[__name__]
    assert _modules_of(_Options) >= {module}  # the type: its fields hold no values
    held = _Options(hook=_helper)
    assert module in _modules_of(held)  # an instance: its callables walked
    assert module in _modules_of(_Refusing())
    assert isinstance(cloudpickle.loads(pickle_for_executors("model_fn", _Refusing()))(),
                      torch.nn.Linear)

    def factory():  # names the dataclass type and the refusing class
        return _Options, _Refusing

    assert module in _modules_of(factory)


@needs_hf
@pytest.mark.spark
def test_a_fit_trains_the_lora_factory_of_a_users_module(spark, factory_module):
    """The docs' PEFT example, end to end: fit() used to fail pickling this factory with
    AttributeError: type object 'LoraConfig' has no attribute 'rank_pattern'."""
    from peft import PeftModel

    from sparkdl_avg import TrainConfig, fit

    rows = [([(i + k) % 32 for k in range(8)],) for i in range(16)]
    df = spark.createDataFrame(rows, "tokens array<int>")
    result = fit(df, factory_module.make,
                 TrainConfig(num_workers=2, epochs=1, batch_size=4, averaging_frequency=1,
                             lr=0.1, log_model=False, experiment_name="user-modules"),
                 inputs={"input_ids": "tokens"}, label_col="tokens", loss="model")
    assert isinstance(result.model, PeftModel)
    start = factory_module.make()
    moved = {n for n, p in result.model.named_parameters()
             if not torch.equal(p, start.get_parameter(n))}
    assert moved and all("lora_" in n for n in moved)


def noisy_model(folder: str, tag: str) -> torch.nn.Module:
    """A model whose build warns as transformers and PEFT do: a Python warning and a record
    on transformers' logger, and in a task a record only executors give. A task builds it
    with its stderr (fd 2) sent to a file of its own: what the build prints lands there."""
    import logging
    import warnings

    from pyspark import TaskContext
    from transformers.utils import logging as hf_logging

    task = TaskContext.get()
    if task is not None:
        sys.stderr.flush()
        saved = os.dup(2)
        name = f"stderr-{task.partitionId()}-{task.attemptNumber()}-{os.getpid()}"
        out = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(out, 2)
    try:
        warnings.warn(f"python warning {tag}", UserWarning, stacklevel=1)
        hf_logging.get_logger("transformers.sparkdl_test").warning("transformers record %s",
                                                                   tag)
        if task is not None:
            logging.getLogger("peft.sparkdl_test").warning("executors only %s", tag)
        torch.manual_seed(0)
        return torch.nn.Linear(2, 2).double()
    finally:
        if task is not None:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            os.close(out)


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@needs_hf
@pytest.mark.spark
def test_what_model_fn_warns_of_is_shown_once_by_the_driver(spark, tmp_path, recwarn, caplog):
    """The driver's build shows each warning once (the Python warning through `warnings`,
    the record through transformers' handlers); the tasks' builds print neither, and what
    only the executors said reaches the driver's log, one line a partition."""
    from transformers.utils import logging as hf_logging

    from sparkdl_avg import TrainConfig, fit

    tag = tmp_path.name  # new to every process's once-a-location registry
    shown = _Count()
    hf_logging.get_logger().addHandler(shown)  # beside transformers' own handler
    try:
        df = spark.createDataFrame([([float(i), 1.0], i % 2) for i in range(16)],
                                   "features array<double>, label int")
        fit(df, partial(noisy_model, str(tmp_path), tag),
            TrainConfig(num_workers=2, epochs=1, batch_size=4, log_model=False,
                        experiment_name="user-modules"))
    finally:
        hf_logging.get_logger().removeHandler(shown)
    assert shown.messages.count(f"transformers record {tag}") == 1
    assert [str(w.message) for w in recwarn].count(f"python warning {tag}") == 1
    printed = {p.name: p.read_text() for p in tmp_path.glob("stderr-*")}
    assert {n.split("-")[1] for n in printed} == {"0", "1"}, printed  # both tasks built it
    assert not any(tag in text for text in printed.values()), printed
    said = [r.getMessage() for r in caplog.records if f"executors only {tag}" in r.getMessage()]
    assert sorted(m.split(":")[0] for m in said) == ["partition 0", "partition 1"], said
