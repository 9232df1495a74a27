"""`log_model="adapters"`: what trained, as files under the run's `adapters/` artifacts,
instead of the whole model. What is frozen is `model_fn`'s (the fit checked every replica
built the same), so the adapters and `model_fn` together are the trained model.

- A PEFT model: its adapters as `save_pretrained` writes them (`adapter_config.json`,
  `adapter_model.safetensors`, PEFT's model card), which
  `peft.PeftModel.from_pretrained(base, folder)` loads onto the base model.
- Any other model: the parameters that require gradients, by name, in
  `trainable.safetensors`, which `model.load_state_dict(safetensors.torch.load_file(path),
  strict=False)` loads into a model `model_fn` built.

Either way `sparkdl_avg.json` beside them says which, and how to load it.
"""

from __future__ import annotations

import json
import os
import tempfile

ARTIFACT_PATH = "adapters"
TRAINABLE_FILE = "trainable.safetensors"
INFO_FILE = "sparkdl_avg.json"

_LOADERS = {
    "peft": "peft.PeftModel.from_pretrained(base_model, folder)  # base_model: model_fn()'s "
            "base, before get_peft_model",
    "safetensors": f"model = model_fn(); model.load_state_dict(safetensors.torch.load_file("
                   f"folder + '/{TRAINABLE_FILE}'), strict=False)",
}


def is_peft(model) -> bool:
    """A PEFT model (duck-typed: peft is an optional extra)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "save_pretrained", None))


def save_adapters(model, folder: str) -> dict:
    """Write `model`'s trained tensors to `folder` (see the module's docstring); returns what
    `sparkdl_avg.json` says."""
    if is_peft(model):
        model.save_pretrained(folder)
        kind = "peft"
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    else:
        from safetensors.torch import save_file

        tensors = {name: p.detach().cpu().contiguous()
                   for name, p in model.named_parameters() if p.requires_grad}
        save_file(tensors, os.path.join(folder, TRAINABLE_FILE))
        kind, count = "safetensors", sum(t.numel() for t in tensors.values())
    info = {"format": kind, "trainable_parameters": count, "load": _LOADERS[kind]}
    with open(os.path.join(folder, INFO_FILE), "w") as f:
        json.dump(info, f, indent=1)
    return info


def log_adapters(client, run_id: str, model) -> None:
    """`save_adapters` to a temporary folder, logged as the run's `adapters/` artifacts."""
    with tempfile.TemporaryDirectory(prefix="sparkdl-avg-adapters-") as folder:
        save_adapters(model, folder)
        client.log_artifacts(run_id, folder, ARTIFACT_PATH)
