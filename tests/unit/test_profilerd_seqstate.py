"""profilerd's seq reservation file: written through tessera.fsutil.atomic_write, so a
write that fails (here a real one: the file-size limit of a child process) leaves the old
reservation, no temp file, and the in-memory reservation unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from profilerd.seqstate import SeqReservation

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
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
