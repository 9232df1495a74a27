"""User callables travel to the executors: the user's own modules by value, installed packages
by reference (`_model.pickle_for_executors`). The natural PEFT factory, a module that does
`from peft import LoraConfig, get_peft_model` at its top (as docs/guide/fine-tuning.md's
example, run in a notebook, does), pickles and trains; the walk over what a callable names
reads only what `getattr` gives."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import textwrap

import cloudpickle
import pytest
import torch

from sparkdl_avg._model import _is_user_module, _modules_of, pickle_for_executors

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="needs the hf extra (transformers, peft)")

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
