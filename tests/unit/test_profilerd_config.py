"""profilerd's configuration: the buffer's byte bound (flag > env > file, checked)."""

from __future__ import annotations

import re

import pytest

from profilerd.config import MAX_MEASUREMENT_BYTES, ProfilerdConfig
from tessera import config
from tessera.errors import SpecError

PREFIX = "TESSERA_PROFILERD_"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith(PREFIX):
            monkeypatch.delenv(k)


def load(argv):
    return config.load(ProfilerdConfig, argv, PREFIX)


def test_buffer_bytes_default_is_64_mib(tmp_path):
    assert load(["--node", "n1"]).buffer_bytes == 64 << 20


def test_buffer_bytes_flag_over_env_over_file(tmp_path, monkeypatch):
    f = tmp_path / "p.yaml"
    f.write_text("node: n1\nbuffer_bytes: 1048576\n", encoding="utf-8")
    assert load(["--config", str(f)]).buffer_bytes == 1 << 20
    monkeypatch.setenv(PREFIX + "BUFFER_BYTES", str(2 << 20))
    assert load(["--config", str(f)]).buffer_bytes == 2 << 20
    assert load(["--config", str(f), "--buffer-bytes", str(3 << 20)]).buffer_bytes == 3 << 20


@pytest.mark.parametrize("raw,why", [("0", "at least"), ("-1", "at least"), (str(MAX_MEASUREMENT_BYTES - 1), "at least"),
                                     ("64MiB", "expected int"), ("1.5", "expected int")])
def test_invalid_buffer_bytes_is_an_error_naming_the_field(raw, why):
    """Named as it was given: --buffer-bytes (flag), TESSERA_PROFILERD_BUFFER_BYTES
    (env), buffer_bytes (file key, and the field checks after parsing)."""
    with pytest.raises(SpecError, match=why) as e:
        load(["--node", "n1", "--buffer-bytes", raw])
    assert re.search(r"buffer[-_]bytes", str(e.value), re.I)


def test_smallest_buffer_bytes_holds_the_largest_report_step():
    from profilerd import api

    assert api.MAX_MEASUREMENT_BYTES == MAX_MEASUREMENT_BYTES
    assert load(["--node", "n1", "--buffer-bytes", str(MAX_MEASUREMENT_BYTES)]).buffer_bytes == MAX_MEASUREMENT_BYTES


def test_invalid_buffer_bytes_from_env_and_file_name_the_field(tmp_path, monkeypatch):
    f = tmp_path / "p.yaml"
    f.write_text("node: n1\nbuffer_bytes: 1000\n", encoding="utf-8")
    with pytest.raises(SpecError, match="buffer_bytes.*at least"):
        load(["--config", str(f)])
    monkeypatch.setenv(PREFIX + "BUFFER_BYTES", "lots")
    with pytest.raises(SpecError, match="BUFFER_BYTES.*expected int"):
        load(["--node", "n1"])
