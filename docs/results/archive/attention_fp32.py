"""torch's CPU attention in bf16 against the same sums in fp32 (inputs converted once), for
SmolLM2-135M's heads (9 query, 3 key/value, head_dim 64): decode steps (one query position),
prefills, and forward + backward (the trainer's). Prints ms per call and each one's largest error
against float64. Behind trainer.dtypes._fp32_attention.

    python docs/results/archive/attention_fp32.py
"""
import time

import torch
import torch.nn.functional as F

H, KV, D = 9, 3, 64


def bench(f, n):
    for _ in range(10):
        f()
    t = time.perf_counter()
    for _ in range(n):
        out = f()
    return (time.perf_counter() - t) / n * 1e3, out


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    for B, Q, T in ((16, 1, 136), (16, 1, 300), (8, 1, 600), (1, 1, 300), (16, 136, 136), (8, 300, 300)):
        q = torch.randn(B, H, Q, D, dtype=torch.bfloat16)
        k, v = torch.randn(B, KV, T, D, dtype=torch.bfloat16), torch.randn(B, KV, T, D, dtype=torch.bfloat16)
        mask = torch.ones(B, 1, Q, T, dtype=torch.bool)
        mask[::2, :, :, :20] = False                                   # left padding
        if Q > 1:
            mask &= torch.ones(Q, T, dtype=torch.bool).tril(T - Q)    # causal
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
        n = 200 if Q == 1 else 20
        a, oa = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), n)
        b, ob = bench(lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                             enable_gqa=True).to(torch.bfloat16), n)
        ea, eb = ((o.double() - ref).abs().max().item() for o in (oa, ob))
        print(f"rows {B} queries {Q} keys {T}: bf16 {a:.3f} ms (err {ea:.4f}), fp32 {b:.3f} ms (err {eb:.4f}); ratio {b / a:.2f}")
    for B, T in ((16, 136), (8, 300)):
        q0 = torch.randn(B, H, T, D, dtype=torch.bfloat16)
        k0, v0 = torch.randn(B, KV, T, D, dtype=torch.bfloat16), torch.randn(B, KV, T, D, dtype=torch.bfloat16)
        mask = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
        mask[::2, :, :, :20] = False
        mask[::2, :, :20, 0] = True                                    # padded rows attend somewhere

        def step(fp32):
            q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
            qq, kk, vv = (x.float() for x in (q, k, v)) if fp32 else (q, k, v)
            F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True).to(torch.bfloat16).float().sum().backward()
        a, _ = bench(lambda: step(False), 10)
        b, _ = bench(lambda: step(True), 10)
        print(f"forward + backward, rows {B} tokens {T}: bf16 {a:.2f} ms, fp32 {b:.2f} ms; ratio {b / a:.2f}")


if __name__ == "__main__":
    main()
