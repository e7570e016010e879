"""tessera.log.env_level: the one reader of TESSERA_LOG_LEVEL (the daemons' setup and the
benchmarks' quieter default, tessera.log.quiet, both take it)."""

from __future__ import annotations

import logging

import pytest

from tessera.log import env_level, quiet, restore


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


def test_quiet_drops_info_lines_unless_the_level_is_set_and_restore_puts_it_back(monkeypatch, capsys):
    import structlog

    before = structlog.get_config()
    monkeypatch.delenv("TESSERA_LOG_LEVEL", raising=False)
    saved = quiet()
    try:
        structlog.get_logger().info("joined")
        structlog.get_logger().warning("slow")
        out = capsys.readouterr().out
        assert "joined" not in out and "slow" in out
        monkeypatch.setenv("TESSERA_LOG_LEVEL", "info")
        quiet()
        structlog.get_logger().info("joined")
        assert "joined" in capsys.readouterr().out
    finally:
        restore(saved)
    assert structlog.get_config() == before
