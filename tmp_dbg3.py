import torch
from nsa import NSAAttention, NSAConfig
from nsa.serving import PagedCache
torch.manual_seed(0)
cfg = NSAConfig(dim=256, n_heads=16, n_kv_heads=2, head_dim_qk=64, head_dim_v=64)
layer = NSAAttention(cfg, backend="sdpa").cuda()
fusedl = NSAAttention(cfg, backend="triton").cuda(); fusedl.load_state_dict(layer.state_dict())
p = 2020
x = torch.randn(1, p + 40, 256, device="cuda")
caches = [PagedCache(layer, max_seqs=1, max_len=4096, page_size=128) for _ in range(2)]
caches[1].fused = False
with torch.no_grad():
    for c in caches: c.prefill(x[:, :p], c.add())
    _, dense = layer.prefill(x[:, :p])
    for i in range(40):
        o = [c.step(x[:, p + i:p + i + 1]) for c in caches] + [fusedl.step(x[:, p + i:p + i + 1], dense)]
        d1 = (o[0] - o[1]).abs().max().item(); d2 = (o[1] - o[2]).abs().max().item()
        if d1 > 1e-5 or d2 > 1e-5 or i % 10 == 0:
            print(i, p + i, f"fused-unfused {d1:.2e} unfused-contig {d2:.2e}",
                  torch.equal(caches[0].last_blocks, caches[1].last_blocks), flush=True)
