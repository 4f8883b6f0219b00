"""NSAAttention against the fp64 oracle; cached decode against prefill; read counters; budget."""

from __future__ import annotations

import pytest
import torch

from nsa import NSAAttention, NSAConfig, decode_read_budget, reference
from tests.nsa.helpers import assert_near_tie_flip, fp64_group_scores, rand, rel_err

SMALL = dict(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
             sel_block=16, sel_count=4, window=20)


def _module(**over) -> NSAAttention:
    m = NSAAttention(NSAConfig(**{**SMALL, **over}))
    with torch.no_grad():
        for p in m.parameters():       # non-trivial weights everywhere (biases too)
            p.normal_(0, 0.3)
    return m


@pytest.mark.parametrize("over", [
    {}, {"kv": "shared"}, {"phi": "mlp"}, {"n_heads": 16, "n_kv_heads": 1}, {"n_kv_heads": 4, "rope": False},
], ids=["separate-avg", "shared", "mlp", "gqa16", "gqa1-norope"])
@pytest.mark.parametrize("t", [1, 7, 53])
def test_module_matches_oracle_fp32(over, t, seed):
    m = _module(**over)
    x = rand(2, t, 32)
    with torch.no_grad():
        assert rel_err(m(x), reference.module_forward(m, x)) < 1e-5


def test_module_bf16_within_2x_of_sdpa_error(seed):
    m = _module()
    x = rand(1, 45, 32)
    with torch.no_grad():
        ref = reference.module_forward(m, x)
        err32 = rel_err(m(x), ref)
        err16 = rel_err(m.to(torch.bfloat16)(x.bfloat16()), ref)
    assert err32 < 1e-5
    assert err16 < 2e-2, f"bf16 module error {err16:.3g} is beyond bf16 rounding"


@pytest.mark.parametrize("over", [{}, {"kv": "shared"}, {"phi": "mlp"}], ids=["separate", "shared", "mlp"])
def test_decode_equals_prefill_every_position(over, seed):
    m = _module(**over)
    t_total = 75                  # crosses l=8, d=4, l'=16 and w=20 boundaries
    x = rand(2, t_total, 32)
    with torch.no_grad():
        full = m(x)
        for start in (0, 9, 33):
            if start:
                y0, cache = m.prefill(x[:, :start])
                assert rel_err(y0, full[:, :start]) < 1e-5
            else:
                cache = m.new_cache()
            for t in range(start, t_total):
                y = m.step(x[:, t:t + 1], cache)
                if rel_err(y, full[:, t:t + 1]) >= 1e-5:
                    _assert_near_tie_flip(m, x, t, cache.reads.sel_blocks)


def _assert_near_tie_flip(m: NSAAttention, x: torch.Tensor, t: int, decode_blocks: torch.Tensor) -> None:
    """fp32 cannot order two blocks whose scores differ by rounding: decode (one query) and prefill
    (a chunk of queries) may then pick different blocks. Accept a mismatch only if that happened
    (the block sets differ at t) and the score gap is at rounding level."""
    from nsa import ops

    c = m.config
    q, kv, _ = m.project(x)
    kc, _ = m.compress(*kv[m._kv_name("cmp")])
    idx = ops.select_blocks(q, kc, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block,
                            sel_count=c.sel_count, scale=c.softmax_scale)[:, t:t + 1]
    assert not torch.equal(idx, decode_blocks), f"position {t}: decode differs from prefill with the same blocks"
    assert_near_tie_flip(fp64_group_scores(q[:, t:t + 1], kc, c, t), idx, decode_blocks, f"position {t}")


def test_read_counters_match_spec(seed):
    m = _module()
    c = m.config
    x = rand(2, 70, 32)
    cache = m.new_cache()
    with torch.no_grad():
        for t in range(70):
            m.step(x[:, t:t + 1], cache)
            r = cache.reads
            n_cmp, sel, win = reference.decode_reads(t, r.sel_blocks[:, 0], c)
            assert (r.cmp, r.win) == (n_cmp, win), f"t={t}"
            assert r.sel.tolist() == sel, f"t={t}"
    # t = 69: forced 0, 4 (current), 3 (previous) + the best other: 3*16 + 6 tokens of block 4.
    assert cache.reads.sel.tolist() == [[54, 54], [54, 54]]
    assert (cache.reads.cmp, cache.reads.win) == (16, 20)


def test_one_branch_decode_reads_only_that_branch(seed):
    m = _module()
    cache = m.new_cache()
    x = rand(1, 40, 32)
    with torch.no_grad():
        full = m(x, branches=("win",))
        for t in range(40):
            y = m.step(x[:, t:t + 1], cache, branches=("win",))
        assert rel_err(y, full[:, -1:]) < 1e-5
    assert cache.reads.cmp == 0 and cache.reads.sel is None and cache.reads.win == 20


def test_paper_budget_table4():
    c = NSAConfig()
    assert [decode_read_budget(s, c) for s in (8192, 16384, 32768, 65536)] == [2048, 2560, 3584, 5632]


@pytest.mark.parametrize("kwargs, needle", [
    ({"n_heads": 6, "n_kv_heads": 4}, "multiple"),
    ({"cmp_stride": 40}, "cmp_stride"),
    ({"window": 0}, "window"),
    ({"phi": "max"}, "phi"),
    ({"kv": "tied"}, "kv"),
    ({"head_dim_qk": 15}, "even"),
    ({"sel_count": 2}, "sel_count"),
])
def test_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        NSAConfig(**{**SMALL, **kwargs})


def test_module_rejects_wrong_input():
    m = _module()
    with pytest.raises(ValueError, match="dim=32"):
        m(rand(1, 5, 31))
    with pytest.raises(ValueError, match="one token"):
        m.step(rand(1, 2, 32), m.new_cache())


@pytest.mark.parametrize("backend,branches", [
    ("auto", ("cmp", "sel", "win")), ({"win": "sdpa"}, ("cmp", "sel", "win")), ("auto", ("win",)),
    ("auto", ("sel",)),
], ids=["auto", "mapping", "win-only", "sel-only"])
def test_plan_is_what_attend_runs(backend, branches, seed):
    """`NSAAttention.plan` answers with the plan `attend` records for the same call (it once
    passed no compressed keys, and the compressed call's class lookup failed on them)."""
    from nsa import dispatch

    m = NSAAttention(NSAConfig(**SMALL), backend=backend)
    q = rand(1, 50, 4, 16)
    kv = {n: (rand(1, 50, 2, 16), rand(1, 50, 2, 8)) for n in ("cmp", "sel", "win")}
    planned = m.plan(q, kv, branches)
    with torch.no_grad(), dispatch.recording() as rec:
        m.attend(q, kv, torch.rand(1, 50, 4, 3), branches)
    ran = [r for r in rec if r["op"] == "nsa_plan"]
    assert len(ran) == 1 and ran[0]["backend"] == planned.label
    assert set(planned.branches) == set(branches)


# --- misuse gets the fix, never wrong output or an internal error (issue 34, item 10) ------------
def _small(**kw):
    base = dict(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=16, cmp_block=8, cmp_stride=4,
                sel_block=16, sel_count=3, window=16)
    return NSAConfig(**{**base, **kw})


@pytest.mark.parametrize("change", [dict(n_kv_heads=1), dict(window=32), dict(kv="shared"), dict(head_dim_v=8)])
def test_a_cache_of_another_layout_is_refused(change):
    torch.manual_seed(0)
    made_by = NSAAttention(_small())
    other = NSAAttention(_small(**change))
    x = torch.randn(1, 20, 32)
    with torch.no_grad():
        _, cache = made_by.prefill(x)
        key = next(iter(change))
        with pytest.raises(ValueError, match=rf"another layout \({key} .*new_cache\(\) or prefill\(\)"):
            other.step(x[:, :1], cache)
        with pytest.raises(ValueError, match="another layout"):
            other.decode_attend(torch.randn(1, 1, 4, 16), torch.rand(1, 1, 4, 3), cache)
        made_by.step(x[:, :1], cache)           # the layer that made it takes it


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -1.0, 0.0, True])
def test_config_refuses_a_scale_that_is_not_finite_and_positive(scale):
    with pytest.raises(ValueError, match="finite positive"):
        _small(scale=scale)


@pytest.mark.parametrize("shape", [(0, 5, 32), (1, 0, 32)])
def test_empty_batches_and_prompts_get_the_fix(shape):
    m = NSAAttention(_small())
    with pytest.raises(ValueError, match="at least one sequence of at least one token"):
        m(torch.randn(*shape))
    with pytest.raises(ValueError, match="at least one sequence of at least one token"):
        m.prefill(torch.randn(*shape))


@pytest.mark.parametrize("branches", [("foo",), "cmp", ("cmp", "window")])
def test_unknown_branches_get_the_fix(branches):
    m = NSAAttention(_small())
    x = torch.randn(1, 20, 32)
    with pytest.raises(ValueError, match="branches must be a sequence of names among"):
        m(x, branches=branches)
    with torch.no_grad():
        _, cache = m.prefill(x)
        with pytest.raises(ValueError, match="branches must be"):
            m.step(x[:, :1], cache, branches=branches)


@pytest.mark.parametrize("sel_count", [10**9, 2_000_000, 4097])
def test_a_selection_count_beyond_the_bound_is_refused(sel_count):
    """10**9 tried to allocate about 32 TB (the -1 padded [B, T, Hkv, n] indices) and 2_000_000 took
    7.6 GiB; refused before any allocation, in the config and in the op."""
    with pytest.raises(ValueError, match=rf"sel_count must be at most 4096, got {sel_count}: .*use the paper's 16"):
        _small(sel_count=sel_count)
    from nsa import ops

    with pytest.raises(ValueError, match="sel_count must be at most 4096"):
        ops.select_blocks(torch.randn(1, 20, 4, 16), torch.randn(1, 4, 2, 16), block=8, stride=4, sel_block=16,
                          sel_count=sel_count)


def test_the_largest_selection_count_keeps_the_selection(seed):
    """At the bound nothing is clamped: rows hold every candidate, -1 padded to n, as the oracle's."""
    m = _module(sel_count=4096)
    x = rand(1, 40, 32)
    with torch.no_grad():
        assert rel_err(m(x), reference.module_forward(m, x)) < 1e-5
        _, cache = m.prefill(x)
        m.step(x[:, :1], cache)
    assert cache.reads.sel_blocks.shape[-1] == 4096 and (cache.reads.sel_blocks[..., 3:] == -1).all()


def _projections(m: NSAAttention, t: int = 20):
    return m.project(torch.randn(1, t, 32))


@pytest.mark.parametrize("kv", ["separate", "shared"])
def test_projections_of_another_kv_mode_get_the_fix(kv):
    """The kv dict of a kv="shared" layer given to a kv="separate" one was `KeyError: 'cmp'` (and the
    other way round `KeyError: 'shared'`), in attend, plan and forward's path."""
    other = "shared" if kv == "separate" else "separate"
    m, theirs = NSAAttention(_small(kv=kv)), NSAAttention(_small(kv=other))
    q, _, gates = _projections(m)
    _, kv_theirs, _ = _projections(theirs)
    match = rf"kv must map .* for this kv='{kv}' layer, got .* \(the projections of a kv='{other}' layer\); .*kv='{other}'"
    with torch.no_grad():
        with pytest.raises(ValueError, match=match):
            m.attend(q, kv_theirs, gates)
        with pytest.raises(ValueError, match=match):
            m.plan(q, kv_theirs)
        with pytest.raises(ValueError, match="kv must map"):
            m.attend(q, {}, gates, branches=("win",))


@pytest.mark.parametrize("bad", ["v_dv", "k_heads", "q_dk", "gates", "v_len"])
def test_projections_of_another_shape_get_the_fix(bad):
    """A v of another dv was a torch broadcast error deep in the gated sum; K/V of another head count
    broadcast into finite wrong output. Every tensor is checked against the layer's config."""
    m = NSAAttention(_small())
    q, kv, gates = _projections(m)
    k, v = kv["sel"]
    if bad == "v_dv":
        kv["sel"], match = (k, v[..., :8]), r"kv\['sel'\] v must be \[B, T, n_kv_heads, head_dim_v\] = \[1, 20, 2, 16\]"
    elif bad == "k_heads":
        kv["sel"], match = (k[:, :, :1], v), r"kv\['sel'\] k must be .* got \[1, 20, 1, 16\]"
    elif bad == "q_dk":
        q, match = q[..., :8], r"q must be \[B, T, n_heads, head_dim_qk\]"
    elif bad == "gates":
        gates, match = gates[..., :2], r"gates must be \[B, T, n_heads, 3\] = \[1, 20, 4, 3\]"
    else:
        kv["sel"], match = (k[:, :10], v[:, :10]), r"kv\['sel'\] k must be .* got \[1, 10, 2, 16\]"
    with torch.no_grad(), pytest.raises(ValueError, match=match + ".*project\\(x\\) output"):
        m.attend(q, kv, gates)


def test_decode_misuse_gets_the_fix():
    """A hand-made NSACache() was `KeyError: 'cmp'` (kv="separate") or `'shared'`; a step of another
    batch size a torch expand error; decode_attend took a query of another head count or two tokens."""
    from nsa import NSACache

    m = NSAAttention(_small())
    x = torch.randn(1, 20, 32)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"records no layer layout .*new_cache\(\) or prefill\(\)"):
            m.step(x[:, :1], NSACache())
        with pytest.raises(ValueError, match="got an empty cache; call step"):
            m.decode_attend(torch.randn(1, 1, 4, 16), torch.rand(1, 1, 4, 3), m.new_cache())
        _, cache = m.prefill(x)
        with pytest.raises(ValueError, match=r"this cache holds B=1 sequences, got a step of B=2"):
            m.step(torch.randn(2, 1, 32), cache)
        assert cache.length == 20                   # refused before anything was appended
        with pytest.raises(ValueError, match=r"q must be .* = \[1, 1, 4, 16\] .*T=1\), got \[1, 2, 4, 16\]"):
            m.decode_attend(torch.randn(1, 2, 4, 16), torch.rand(1, 2, 4, 3), cache)
        with pytest.raises(ValueError, match=r"q must be .*got \[1, 1, 2, 16\]"):
            m.decode_attend(torch.randn(1, 1, 2, 16), torch.rand(1, 1, 2, 3), cache)
        with pytest.raises(ValueError, match=r"this cache holds B=1 sequences, got a step of B=2"):
            m.decode_attend(torch.randn(2, 1, 4, 16), torch.rand(2, 1, 4, 3), cache)
        m.step(x[:, :1], cache)                     # the right inputs still step
