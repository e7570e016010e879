"""tessera.log.env_level: the one reader of TESSERA_LOG_LEVEL (the daemons' setup and the
accuracy benchmark's quieter default both take it)."""

from __future__ import annotations

import logging

import pytest

from tessera.log import env_level


@pytest.mark.parametrize("value,default,expected", [
    (None, logging.INFO, logging.INFO), (None, logging.WARNING, logging.WARNING),
    ("debug", logging.WARNING, logging.DEBUG), ("Error", logging.INFO, logging.ERROR),
    ("nonsense", logging.WARNING, logging.WARNING), ("", logging.INFO, logging.INFO)])
def test_env_level_names_a_level_or_falls_back(monkeypatch, value, default, expected):
    if value is None:
        monkeypatch.delenv("TESSERA_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TESSERA_LOG_LEVEL", value)
    assert env_level(default) == expected
