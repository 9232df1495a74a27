"""`log_model="adapters"`: what trained, as files under the run's `adapters/` artifacts,
instead of the whole model. What is frozen is `model_fn`'s (the fit checked every replica
built the same), so the adapters and `model_fn` together are the trained model.

What trained is what the fit averaged (`averaging.flat_buffer.averaged_tensors`: parameters
that require gradients, floating buffers of modules in training mode) and the counted buffers
it carried (`counted_buffers`: BatchNorm's `num_batches_tracked`), named as in the model's
state dict (`trained_names`, taken before the result is put in eval mode, which would hide
the buffers).

- A PEFT model: its adapters as `save_pretrained` writes them (`adapter_config.json`,
  `adapter_model.safetensors`, PEFT's model card), which
  `peft.PeftModel.from_pretrained(base, folder)` loads onto the base model; and what trained
  that PEFT does not save (the base's BatchNorm statistics in training mode), by the PEFT
  model's names, in `not_in_adapters.safetensors`, which
  `peft_model.load_state_dict(safetensors.torch.load_file(path), strict=False)` loads.
- Any other model: what trained, by name, in `trainable.safetensors`, which
  `model.load_state_dict(safetensors.torch.load_file(path), strict=False)` loads into a model
  `model_fn` built.

Either way `sparkdl_avg.json` beside them says which, and how to load it.
"""

from __future__ import annotations

import json
import os
import tempfile

ARTIFACT_PATH = "adapters"
TRAINABLE_FILE = "trainable.safetensors"
NOT_IN_ADAPTERS_FILE = "not_in_adapters.safetensors"
INFO_FILE = "sparkdl_avg.json"

_LOADERS = {
    "peft": "peft.PeftModel.from_pretrained(base_model, folder)  # base_model: model_fn()'s "
            "base, before get_peft_model",
    "safetensors": f"model = model_fn(); model.load_state_dict(safetensors.torch.load_file("
                   f"folder + '/{TRAINABLE_FILE}'), strict=False)",
}
_NOT_IN_ADAPTERS_LOADER = (f"; then peft_model.load_state_dict(safetensors.torch.load_file("
                           f"folder + '/{NOT_IN_ADAPTERS_FILE}'), strict=False)")


def is_peft(model) -> bool:
    """A PEFT model (duck-typed: peft is an optional extra)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "save_pretrained", None))


def trained_names(model) -> tuple[str, ...]:
    """The names of what trained in `model` (see the module's docstring), in the training
    modes it trained in: call it before `model.eval()`."""
    from sparkdl_avg.averaging.flat_buffer import averaged_tensors, counted_buffers

    by_id = {id(t): name for name, t in _named_tensors(model).items()}
    return tuple(by_id[id(t)] for t in averaged_tensors(model)) + tuple(counted_buffers(model))


def save_adapters(model, folder: str, trained: tuple[str, ...]) -> dict:
    """Write `model`'s tensors named `trained` (`trained_names`) to `folder` (see the
    module's docstring); returns what `sparkdl_avg.json` says."""
    from safetensors.torch import save_file

    named = _named_tensors(model)
    tensors = {name: named[name].detach().cpu().contiguous() for name in trained}
    count = sum(named[name].numel() for name in trained if named[name].is_floating_point())
    info = {"trained_values": count}
    if is_peft(model):
        model.save_pretrained(folder)
        info.update(format="peft", load=_LOADERS["peft"])
        rest = _not_saved_by_peft(model, tensors)
        if rest:
            save_file(rest, os.path.join(folder, NOT_IN_ADAPTERS_FILE))
            info.update(not_in_adapters=sorted(rest),
                        load=_LOADERS["peft"] + _NOT_IN_ADAPTERS_LOADER)
    else:
        save_file(tensors, os.path.join(folder, TRAINABLE_FILE))
        info.update(format="safetensors", load=_LOADERS["safetensors"])
    with open(os.path.join(folder, INFO_FILE), "w") as f:
        json.dump(info, f, indent=1)
    return info


def log_adapters(client, run_id: str, model, trained: tuple[str, ...]) -> None:
    """`save_adapters` to a temporary folder, logged as the run's `adapters/` artifacts."""
    with tempfile.TemporaryDirectory(prefix="sparkdl-avg-adapters-") as folder:
        save_adapters(model, folder, trained)
        client.log_artifacts(run_id, folder, ARTIFACT_PATH)


def _named_tensors(model) -> dict:
    """Every parameter and buffer of `model` by its state-dict name (a shared one under its
    first name)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _not_saved_by_peft(model, tensors: dict) -> dict:
    """Those of `tensors` (trained, by name) whose values PEFT's state dict does not hold:
    compared by storage, as PEFT renames what it saves."""
    from peft import get_peft_model_state_dict

    def where(t):
        return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), \
            tuple(t.shape)

    named = _named_tensors(model)
    saved = {where(t) for t in get_peft_model_state_dict(model).values() if not t.is_meta}
    return {name: t for name, t in tensors.items() if where(named[name]) not in saved}
