"""The GPU variant of bench.estimator_accuracy, the parts that need no GPU: its grid is
held out from its profiles, spans MPS quotas 10-100 %, and refuses to run without CUDA."""

from __future__ import annotations

import pytest

from bench import estimator_accuracy as ea


def test_gpu_grid_is_held_out_and_spans_quotas():
    grid = ea.gpu_grid()
    profiled = {(m, b, s, q, mb) for m, b, s, q, mb in ea.GPU_PROFILE}
    quotas = set()
    for pt in grid:
        for j in pt["jobs"]:
            assert (j["model"], j["batch"], j["seq"], j["q"], j["m"]) not in profiled
            assert 10 <= j["q"] <= 100
            quotas.add(j["q"])
            c = ea.gpu_candidate(j)
            assert c.device_type == "gpu" and 0 < c.quota <= 1 and c.hidden % c.heads == 0
    assert min(quotas) == 10 and max(quotas) == 100
    assert {pt["category"] for pt in grid} >= {"gpu_single_quota", "gpu_colocate_split", "gpu_colocate_shared"}
    for pt in grid:  # split pairs fit on the GPU, shared ones oversubscribe it
        total = sum(j["q"] for j in pt["jobs"])
        if pt["category"] == "gpu_colocate_split":
            assert total <= 100
        if pt["category"] == "gpu_colocate_shared":
            assert total > 100
    assert len({q for *_, q, _ in ea.GPU_PROFILE}) == 3  # three quota levels: room for a saturation point


def test_cuda_variant_refuses_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    # In this process (the bench's own probe still runs in a child): an interpreter and a
    # torch import fewer than `python -m bench.estimator_accuracy --device cuda`.
    assert ea.main(["--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
