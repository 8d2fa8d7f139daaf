"""Adam with its moments reset at every step, stored nowhere (slime's ``--use-stateless-adam``).

With zero moments at the start of a step, Adam's bias-corrected first and second moments are ``g`` and ``g^2``, so the
step is ``-lr * g / (|g| + eps)`` (a sign-like step), plus AdamW's decoupled weight decay ``p *= 1 - lr * wd``. That
is exactly ``torch.optim.AdamW`` whose state is cleared before each step, without the two moment buffers per
parameter (a third of Adam's optimizer memory in float32 with master weights, all of it here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class StatelessAdamW(torch.optim.Optimizer):
    """AdamW whose moments start at zero at every step (``betas`` cancel out and are not taken). Keeps no state."""

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, eps: float = 1e-8, weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("StatelessAdamW does not take sparse gradients")
                if weight_decay:
                    param.mul_(1.0 - lr * weight_decay)
                param.addcdiv_(param.grad, param.grad.abs().add(eps), value=-lr)
        return loss
