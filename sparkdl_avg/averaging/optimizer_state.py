"""Which optimizer state is averaged with the parameters (`average_optimizer_state`).

The rule today: every floating state tensor shaped like its parameter (momentum buffers,
Adam's moments), per parameter, by key; scalars such as Adam's step are left alone. A new
rule for averaging optimizer state goes here."""

from __future__ import annotations

import torch


def averaged_state_tensors(optimizer: torch.optim.Optimizer,
                           dtype: torch.dtype) -> list[torch.Tensor]:
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if key != "step" and isinstance(value, torch.Tensor) and value.dtype == dtype \
                        and value.shape == p.shape:
                    out.append(value)
    return out
