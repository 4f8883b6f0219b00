import sys, torch
from nsa import NSAAttention, NSAConfig
from nsa.serving import PagedCache
sys.path.insert(0, ".")
from tests.nsa.test_serving import _alone
for forks in (True, False):
    torch.manual_seed(1)
    cfg = NSAConfig(dim=256, n_heads=16, n_kv_heads=2, head_dim_qk=64, head_dim_v=64)
    layer = NSAAttention(cfg, backend="triton").to("cuda", torch.float32)
    prompts = [1, 500, 1000, 2020]; steps = 40
    xs = [torch.randn(1, p + steps, 256, device="cuda") for p in prompts]
    cache = PagedCache(layer, max_seqs=5, max_len=4096, page_size=128)
    with torch.no_grad():
        alone = [_alone(layer, x, p)[0] for x, p in zip(xs, prompts)]
        for x, p in zip(xs, prompts): cache.prefill(x[:, :p], cache.add())
        first = {}
        for i in range(steps):
            x_t = torch.zeros(5, 1, 256, device="cuda")
            for s, (x, p) in enumerate(zip(xs, prompts)): x_t[s] = x[0, p + i]
            o = cache.step(x_t)
            for s in range(4):
                e = ((o[s, 0] - alone[s][i]).norm() / alone[s][i].norm()).item()
                if e > 1e-4 and s not in first: first[s] = (i, prompts[s] + i, e, cache.pages[s][-3:], cache.free_pages[-3:])
            if forks and i == 10: cache.fork(1)
            if forks and i == 20: cache.free(4)
        print("forks", forks, "first divergence per slot:", first, flush=True)
