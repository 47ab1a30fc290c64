"""Pearson's chi-square for sampler tests (tests/engines/test_cpu_sampler.py, test_engine.py)."""
from __future__ import annotations

import math

import torch


def chi2_bound(df: int, z: float = 5.0) -> float:
    """Chi-square quantile ~ z standard deviations up (Wilson-Hilferty): a correct sampler exceeds
    it with probability ~3e-7, and the tests fix their seeds, so their draws are the same every run."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic over categories expected >= 5 times, the rest lumped into one."""
    expected = probs / probs.sum() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1
