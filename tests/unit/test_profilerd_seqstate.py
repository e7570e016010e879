"""profilerd's seq reservation file: written through tessera.fsutil.atomic_write, so a
write that fails (here a real one: the file-size limit of a child process) leaves the old
reservation, no temp file, and the in-memory reservation unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from profilerd.seqstate import SeqReservation

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
import pytest

from profilerd.seqstate import SeqReservation
r = SeqReservation(sys.argv[1], block=10)
resource.setrlimit(resource.RLIMIT_FSIZE, (2, 2))  # "20\\n" (3 bytes) cannot be written
try:
    r.ensure(11)
except OSError as e:
    print("failed", e.errno, r.reserved)
    sys.exit(0)
print("wrote", r.reserved)
sys.exit(1)
"""


def test_reservation_file_is_replaced_whole(tmp_path):
    r = SeqReservation(tmp_path, block=10)
    assert r.first_seq() == 1
    assert (tmp_path / "seq").read_text() == "10\n"
    r.ensure(11)
    assert (tmp_path / "seq").read_text() == "20\n" and r.reserved == 20
    assert sorted(os.listdir(tmp_path)) == ["seq"]  # no temp file left next to it


def test_failed_write_keeps_old_reservation_and_leaves_no_temp_file(tmp_path):
    SeqReservation(tmp_path, block=10).first_seq()  # "10\n"
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split()[0] == "failed" and out.stdout.split()[2] == "10"  # reserved unchanged in memory
    assert (tmp_path / "seq").read_text() == "10\n"
    assert sorted(os.listdir(tmp_path)) == ["seq"]  # the failed write's temp file was removed
    assert SeqReservation(tmp_path, block=10).first_seq() == 11  # a restart starts past the old block


@pytest.mark.parametrize("text", ["12ab\n", "-5\n", "\x00\x01"])
def test_corrupt_seq_file_is_a_one_line_error_and_exit_2(tmp_path, capsys, monkeypatch, text):
    """A corrupt seq file: SeqStateError naming the file and what to do; the daemon's main
    prints it on one line and exits 2 (no traceback), the file left as it was."""
    from profilerd import main as pmain
    from profilerd.seqstate import SeqStateError

    # main's process-wide logging setup would outlive this test (and capsys's stream)
    monkeypatch.setattr(pmain.log, "setup", lambda *a, **kw: pmain.log.get(component="profilerd"))
    monkeypatch.setattr(pmain.structlog.contextvars, "bind_contextvars", lambda **kw: None)
    (tmp_path / "seq").write_text(text)
    with pytest.raises(SeqStateError, match="seq: corrupt seq state"):
        SeqReservation(tmp_path)
    rc = pmain.main(["--node", "n1", "--state-dir", str(tmp_path), "--listen", "127.0.0.1:0",
                     "--sample-interval-s", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("tessera-profilerd:")]
    assert len(line) == 1 and str(tmp_path / "seq") in line[0] and "remove the file" in line[0]
    assert (tmp_path / "seq").read_text() == text
