"""Single-process float64 references the kernels and transforms are checked against."""

from __future__ import annotations

import numpy as np


def adam_reference(p, g, m, v, *, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                   decoupled=True, grad_scale=1.0, max_norm=None, grad_sumsq=None):
    """One Adam/AdamW step in float64 (torch.optim semantics); returns new (p, m, v)."""
    p, g, m, v = (np.asarray(x, np.float64) for x in (p, g, m, v))
    b1, b2 = betas
    g = g * grad_scale
    if max_norm is not None:
        norm = np.sqrt(grad_sumsq) * grad_scale
        g = g * min(1.0, max_norm / (norm + 1e-6))
    if decoupled:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - b2**step) + eps
    p = p - lr / (1 - b1**step) * m / denom
    return p, m, v
