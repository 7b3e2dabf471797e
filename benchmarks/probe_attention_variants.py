"""GPU microbenchmark: the probe's attention (64 query rows over ~1.6K context + query keys,
32 heads over 8 KV heads, head dim 128, bf16) in the variants a CUDA graph could replay:
SDPA with a boolean mask (what the probe runs), SDPA with an additive mask, and plain
matmul + fp32 softmax. Device time per call from CUDA events over a captured graph of 100
calls; max abs difference to an fp32 reference.

    python3 benchmarks/probe_attention_variants.py
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = "cuda"
S, N, H, Hkv, D = 64, 1536, 32, 8, 128
q = torch.randn(1, H, S, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, Hkv, N + S, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(1, Hkv, N + S, D, device=dev, dtype=torch.bfloat16)
vis = torch.ones(S, N + S, dtype=torch.bool, device=dev)
vis[:, N - 200 : N] = False  # padding entries
vis[:, N:] = torch.tril(torch.ones(S, S, dtype=torch.bool, device=dev))
add = torch.zeros(S, N + S, device=dev, dtype=torch.bfloat16).masked_fill_(~vis, float("-inf"))
scale = D ** -0.5


def sdpa_bool():
    return F.scaled_dot_product_attention(q, k, v, attn_mask=vis[None, None], scale=scale, enable_gqa=True)


def sdpa_add():
    return F.scaled_dot_product_attention(q, k, v, attn_mask=add[None, None], scale=scale, enable_gqa=True)


def math():
    qg = q.view(Hkv, H // Hkv * S, D)
    s_ = torch.matmul(qg, k[0].transpose(1, 2)).float().view(Hkv, H // Hkv, S, N + S) * scale
    p = torch.softmax(s_.masked_fill(~vis, float("-inf")), -1).to(torch.bfloat16).view(Hkv, H // Hkv * S, N + S)
    return torch.matmul(p, v[0]).view(1, H, S, D)


def ref():
    kf = k.float().repeat_interleave(H // Hkv, 1)
    vf = v.float().repeat_interleave(H // Hkv, 1)
    s_ = (q.float() @ kf.transpose(-1, -2)) * scale
    return torch.softmax(s_.masked_fill(~vis, float("-inf")), -1) @ vf


want = ref()
for name, fn in (("sdpa bool mask", sdpa_bool), ("sdpa additive mask", sdpa_add), ("matmul + softmax", math)):
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        for _ in range(100):
            out = fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    a.record()
    g.replay()
    b.record()
    torch.cuda.synchronize()
    err = (fn().float() - want).abs().max().item()
    print(f"{name:22s} {a.elapsed_time(b) * 10:7.1f} us/call  max abs err {err:.4f}", flush=True)
