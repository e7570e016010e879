"""FileTask: how local files become samples (encoding edges)."""

from __future__ import annotations

import pytest

from agent.runtime.peft.data import FileTask

BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("kind,body", [
    ("jsonl", b'{"text": "hello world"}\n{"text": "second"}\n'),
    ("text", b"hello world\nsecond\n"),
])
def test_leading_utf8_bom_is_skipped_not_content(tmp_path, kind, body):
    plain, marked = tmp_path / "plain", tmp_path / "bom"
    plain.write_bytes(body)
    marked.write_bytes(BOM + body)
    a = FileTask(str(plain), kind, 256, 2, 64, 0)
    b = FileTask(str(marked), kind, 256, 2, 64, 0)
    assert [s.tolist() for s in b.samples] == [s.tolist() for s in a.samples]
    assert bytes(a.samples[0].tolist()) == b"hello world"


def test_crlf_line_ends_are_not_content(tmp_path):
    p = tmp_path / "crlf.txt"
    p.write_bytes(b"hello world\r\nsecond\r\n")
    assert [bytes(s.tolist()) for s in FileTask(str(p), "text", 256, 2, 64, 0).samples] == [b"hello world", b"second"]
