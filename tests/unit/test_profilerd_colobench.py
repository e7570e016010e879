"""profilerd.colobench's pure parts: which of X's steps ran alone and which beside its
twin, the checks of the command line and of the ranks mode. (The benchmark itself runs in
tests/integration/test_profiler_stream.py::test_colocation_benchmark_reaches_the_estimator_model.)"""

from __future__ import annotations

import pytest

from profilerd import colobench


def test_steps_are_alone_before_the_twin_starts_or_after_it_ends_and_together_inside_its_measured_steps():
    # X's steps: (end, step time). Y started at 1.0; its warm-up ended at 2.0, its last step at 3.0,
    # its process exited at 3.7.
    x = [(0.1, 0.1), (0.2, 0.1), (0.3, 0.1),      # warm-up: never counted
         (0.5, 0.2), (0.9, 0.2),                  # alone, before the twin started
         (1.2, 0.2), (1.9, 0.2),                  # the twin is starting (importing, warming up): neither
         (2.1, 0.2),                              # began before the twin's measured steps: neither
         (2.5, 0.4), (2.9, 0.4),                  # together
         (3.1, 0.4),                              # straddles the twin's last step: neither
         (3.6, 0.4),                              # the twin's process is exiting (until 3.7): neither
         (4.0, 0.2), (4.2, 0.2)]                  # alone again
    alone, together = colobench.classify(x, warmup=3, go_at=1.0, y_first=2.0, y_last=3.0, y_gone=3.7)
    assert alone == [0.2, 0.2, 0.2, 0.2] and together == [0.4, 0.4]


def test_a_mode_must_be_known_and_the_counts_enough():
    with pytest.raises(ValueError, match="mode"):
        colobench.pair("mixed", (0, 1))
    with pytest.raises(ValueError, match="together >= 2"):
        colobench.pair("split", (0, 1), together=1)


def test_the_ranks_mode_needs_two_cores_and_enough_steps_and_one_core_leaves_it_out():
    with pytest.raises(ValueError, match="two distinct cores"):
        colobench.ranks((0, 0))
    with pytest.raises(ValueError, match="measured >= 2"):
        colobench.ranks((0, 1), measured=1)
    assert colobench.table((0,), modes=("ranks",)) == ([], 0)
    assert set(colobench.ALL_MODES) == {"split", "shared", "ranks"}


def test_cores_must_be_one_or_two_ids_this_process_may_use(capsys):
    assert colobench._cores("0,1") == (0, 1)
    for bad in ("a,b", "0,1,2", "-1"):
        with pytest.raises(Exception, match="--cores"):
            colobench._cores(bad)
    assert colobench.main(["--cores", "100000"]) == 2
    assert "not all in this process's cores" in capsys.readouterr().err


def test_the_rows_name_the_measured_modules_shape():
    assert colobench.shape() == {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "rows": 8, "seq": 64}
