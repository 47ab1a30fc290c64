"""`make test`'s workers (tests/helpers/lanes.py): how many, and whose cores."""
from helpers.lanes import WORKER_GIB, auto_num_workers, worker_cores


def test_workers_are_bounded_by_cores_and_by_memory():
    assert auto_num_workers(2, 23.4) == 2                    # the 2-core 24 GiB box
    assert auto_num_workers(8, 23.4) == 2                    # memory bounds it
    assert auto_num_workers(2, WORKER_GIB * 1.5) == 1        # one worker: a plain run on every core
    assert auto_num_workers(1, 64) == 1 and auto_num_workers(4, 2) == 1


def test_worker_cores_are_disjoint_and_cover_the_machine():
    for cores in ([0, 1], [0, 1, 2, 3], [2, 5, 7], list(range(8))):
        for count in range(1, len(cores) + 1):
            shares = [worker_cores(i, count, cores) for i in range(count)]
            assert all(shares), shares
            assert sorted(c for s in shares for c in s) == cores, (cores, count, shares)
    assert worker_cores(2, 3, [0, 1]) == [0]                 # more workers than cores: round-robin
