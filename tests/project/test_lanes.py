"""`make test`'s workers (tests/helpers/lanes.py): how many, and whose cores."""
import socket

from helpers import launch
from helpers.lanes import PORTS_FROM, WORKER_GIB, auto_num_workers, port_slice, worker_cores


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


def test_port_slices_are_disjoint_and_below_the_ephemeral_range():
    for count in (1, 2, 3, 8):
        slices = [port_slice(i, count, 32768) for i in range(count)]
        assert all(PORTS_FROM <= lo < hi <= 32768 and hi - lo >= 100 for lo, hi in slices), slices
        assert all(a[1] <= b[0] for a, b in zip(slices, slices[1:])), slices
    assert port_slice(0, 2, PORTS_FROM + 150) is None         # too narrow a gap: free_port binds port 0


def test_free_port_gives_a_bindable_port_from_this_workers_slice(monkeypatch):
    eph = launch._ephemeral_range()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    ports = {launch.free_port() for _ in range(5)}
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))                       # free: a server can take it
        if eph is not None:
            lo, hi = port_slice(1, 2, eph[0])
            assert lo <= port < hi <= eph[0], (port, lo, hi, eph)
    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (1024, 65535))   # no gap below the range
    with socket.socket() as s:
        s.bind(("127.0.0.1", launch.free_port()))             # port 0's pick: still a free port
