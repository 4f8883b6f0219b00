"""cpu: CPU tensors, and Triton's interpreter whatever the tensors' device (it runs the kernels on
the CPU). The interpreter is slow per element, so the smallest tiles `tl.dot` takes keep the CPU
tests quick; no GPU feature. Dispatch sends CPU tensors to masked SDPA whatever the thresholds."""

from __future__ import annotations

from nsa.profiles import Features, Profile, Tiles

PROFILE = Profile(
    name="cpu",
    thresholds="cpu",
    tiles=Tiles(cmp_rows=16, cmp_bc=16, win_rows=16, win_bn=16, lse_rows=16, lse_bc=16, scr_bq=16, scr_bk=64,
                scr_qt=2, dec_chunk=64, topn_ctas=3, trn_bm=16, trn_bn=16, trn_sel_rows=16, trn_sel_chunk=8),
    features=Features(),
)
