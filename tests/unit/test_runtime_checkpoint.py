"""Atomic checkpoint files."""

from __future__ import annotations

import os

import pytest
import torch

from agent.runtime import checkpoint


def test_save_then_load_roundtrip(tmp_path):
    d = str(tmp_path / "ck")
    assert checkpoint.load(d) is None
    assert checkpoint.load(None) is None
    p = checkpoint.save({"step": 3, "t": torch.arange(4)}, d)
    assert p == checkpoint.path_in(d)
    got = checkpoint.load(d)
    assert got["step"] == 3 and torch.equal(got["t"], torch.arange(4))
    checkpoint.save({"step": 4}, d)
    assert checkpoint.load(d)["step"] == 4
    assert os.listdir(d) == [checkpoint.FILENAME]  # no temp files left behind


def test_failed_save_keeps_previous_and_leaves_no_temp(tmp_path):
    d = str(tmp_path)
    checkpoint.save({"step": 1}, d)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        checkpoint.save({"step": 2, "bad": Boom()}, d)
    assert checkpoint.load(d)["step"] == 1
    assert os.listdir(d) == [checkpoint.FILENAME]
