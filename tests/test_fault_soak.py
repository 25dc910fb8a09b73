"""tools/fault_soak.py: its flag checks and what it reads from a faulty run's round records
(the soak itself runs in examples/benchmark/faults.sh; the fault paths in test_cluster_jobs.py)."""
import pytest

import tools.fault_soak as soak


def _round(iteration, participants, comm_s=0.1):
    return dict(outer_step=iteration // 5, iteration=iteration, participants=participants, comm_s=comm_s)


def test_a_failure_is_timed_and_its_lost_rounds_counted():
    # Rounds every 5 iterations; cluster 2 killed after iteration 12: the round at 15 takes 5.2 s
    # and averages 2 clusters, so do 20 and 25; from 30 on cluster 2 is back.
    survivors = [_round(5, 3), _round(10, 3), _round(15, 2, comm_s=5.2), _round(20, 2), _round(25, 2),
                 _round(30, 3), _round(35, 3)]
    restarted = [_round(5, 3), _round(10, 3), _round(25, 2), _round(30, 3), _round(35, 3)]  # its join at 25
    faulty = dict(records=[survivors, survivors, restarted], kills=[dict(cluster=2, iteration=12, t=100.0)],
                  joins=[dict(cluster=2, t=131.5)])
    got = soak.analyze(faulty, clusters=3)
    assert got["rounds_applied"] == 7 and got["cluster_rounds_lost"] == 3
    assert got["failures"] == [dict(cluster=2, killed_after_iteration=12, round_hit=15, detection_s=5.2,
                                    rounds_missing=3, cluster_rounds_lost=3, back_at_iteration=30, rejoin_s=31.5)]
    assert got["fault_free_comm_s"] == pytest.approx(0.1)


@pytest.mark.parametrize("argv, message", [
    (["--out", "x", "--", "--train-iters", "10", "--dilocox-local-steps", "5"], "must hold --dilocox"),
    (["--out", "x", "--", "--dilocox", "--train-iters", "10"], "must hold --dilocox-local-steps N"),
    (["--out", "x", "--", "--dilocox", "--train-iters", "10", "--dilocox-local-steps", "5", "--metrics-file", "m"],
     "leave --metrics-file and --dilocox-clusters out"),
    (["--out", "x", "--clusters", "1", "--", "--dilocox", "--train-iters", "10", "--dilocox-local-steps", "5"],
     "--clusters must be >= 2"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    parser = soak.build_parser()
    with pytest.raises(SystemExit):
        soak.check_args(parser, parser.parse_args(argv))
    assert message in capsys.readouterr().err
