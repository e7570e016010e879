"""e2e fixtures (helpers in _e2e.py): ``bed`` is a detached testbed shared by one module."""

from __future__ import annotations

import pytest

from _e2e import start_bed, stop_bed


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """A detached testbed with 2 agents x 2 CPU devices shared by one test module."""
    b = start_bed(tmp_path_factory.mktemp("bed"))
    try:
        yield b
    finally:
        if (b.dir / "testbed.json").exists():
            stop_bed(b)
