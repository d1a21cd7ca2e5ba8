"""streamserve_kernels/launch.py: which devices the kernels launch with programmatic dependent launch on."""

from __future__ import annotations

import torch

from streamserve_kernels import launch


def test_pdl_only_on_a_cuda_device_of_hopper_or_later_while_enabled(monkeypatch):
    launch._supported.cache_clear()
    monkeypatch.setattr(launch, "_supported", launch._supported.__wrapped__)
    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    assert launch.pdl(torch.device("cuda", 0))
    assert not launch.pdl(torch.device("cuda", 1))  # an A100: no grid dependency control
    assert not launch.pdl(torch.device("cpu"))
    with launch.disabled():
        assert not launch.pdl(torch.device("cuda", 0))
    assert launch.pdl(torch.device("cuda", 0))  # as it was
    monkeypatch.setattr(launch, "ENABLED", False)
    assert not launch.pdl(torch.device("cuda", 0))
