"""The own Triton kernels of the `triton` backend, one module per kernel family (forward only).

    tiles        the launch parameters in force: the GPU profile's (nsa/profiles/) or an override
    common       host helpers shared by the families
    selection    group-centric selected attention (paper Fig. 3), its gated epilogue, decode split
    selection_blocks  block-centric selected attention for small groups (prefill): lists per key block
    cmp_tile     one compressed tile's work: logits, p @ Vc, the Eq. 9-10 block scores
    compressed   compressed attention + selection scores (routing; the two-pass prefill kernel for
                 other block geometries; the decode split kernel)
    scores       prefill: one-pass compressed output + log-sum-exp, then the scores kernel
    topn         top-n block indices (one pass, or chunks + merge for decode)
    sliding      sliding-window attention (band kernel) and decode's window through `selection`
    fa4_win      prefill window through FlashAttention-4 where the flash-attn-4 wheel is installed
    decode       a whole decode step (all three branches, top-n, gated sum) in four launches

Each family's host function takes its `Tiles` explicitly; `nsa.backends.triton_nsa` (the backend
module) validates inputs, looks the tiles up from the device and re-exports the public names.
Kernels are defined at import, so Triton's interpreter must be chosen (TRITON_INTERPRET=1) before.
"""
