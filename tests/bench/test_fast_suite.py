"""The fast suite's NSA function computes the same function as the plain-op NSA of the prefill suite."""

from __future__ import annotations

import pytest
import torch

from bench.suites import fast, prefill
from nsa.backends import triton_nsa
from tests.nsa.helpers import DEV

pytestmark = pytest.mark.skipif(triton_nsa.unavailable_reason("cpu") is not None and DEV == "cpu",
                                reason="triton backend unavailable (CPU needs triton and TRITON_INTERPRET=1)")


def test_fast_nsa_equals_plain_ops_nsa():
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(7)
    p = {"block": 8, "stride": 4, "sel_block": 16, "sel_count": 4, "window": 24}
    b, t, hq, hkv, d = 1, 90, 4, 2, 16
    q = torch.randn(b, t, hq, d, generator=g, device=dev)
    kv = {n: (torch.randn(b, t, hkv, d, generator=g, device=dev), torch.randn(b, t, hkv, d, generator=g, device=dev))
          for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(torch.randn(b, t, hq, 3, generator=g, device=dev))
    ours = fast.nsa_triton(q, kv, gates, p)
    ref = prefill._nsa_attention_only(q, kv, gates, p)
    assert (ours - ref).norm() / ref.norm() < 1e-5
