"""What keeps the suite's pytest-xdist workers apart: the broker lock
(tests/broker_lock.py) and free_port's share of the ports (tests/machine.py)."""

from __future__ import annotations

import fcntl
import os
import re
import threading
from pathlib import Path

import pytest

from tests import broker_lock, machine, support

pytest_plugins = ["pytester"]


@pytest.fixture
def lock_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's own lock files, not the machine's."""
    monkeypatch.setattr(broker_lock, "LOCK", tmp_path / "broker.lock")
    monkeypatch.setattr(broker_lock, "TURNSTILE", tmp_path / "broker.turnstile")


def _take(exclusive: bool, taken: threading.Event, release: threading.Event) -> None:
    with broker_lock.held(exclusive=exclusive):
        taken.set()
        release.wait(30)


def test_shared_holders_overlap_and_an_exclusive_one_waits_for_them(lock_files: None) -> None:
    first, second, writer = threading.Event(), threading.Event(), threading.Event()
    done_first, done_second, done_writer = threading.Event(), threading.Event(), threading.Event()
    threads = [threading.Thread(target=_take, args=(False, first, done_first)),
               threading.Thread(target=_take, args=(False, second, done_second))]
    for t in threads:
        t.start()
    support.wait_for(lambda: first.is_set() and second.is_set(), 10, "two shared holders")
    exclusive = threading.Thread(target=_take, args=(True, writer, done_writer))
    exclusive.start()
    threads.append(exclusive)
    # A shared taker arriving now queues behind the waiting exclusive one: with
    # flock alone it would get in, and a busy run could starve the alarm test.
    late, done_late = threading.Event(), threading.Event()
    support.wait_for(_turnstile_shut, 10, "the exclusive taker at the turnstile")
    threads.append(threading.Thread(target=_take, args=(False, late, done_late)))
    threads[-1].start()
    done_first.set()
    assert not writer.wait(0.3) and not late.is_set()
    done_second.set()
    support.wait_for(writer.is_set, 10, "the exclusive holder once both shared ones left")
    assert not late.wait(0.3), "a shared holder got in beside the exclusive one"
    done_writer.set()
    support.wait_for(late.is_set, 10, "the late shared holder after the exclusive one")
    done_late.set()
    for t in threads:
        t.join(10)


def _turnstile_shut() -> bool:
    """Whether someone holds the turnstile (an exclusive taker waiting for the lock)."""
    fd = os.open(broker_lock.TURNSTILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_xdist_workers_get_disjoint_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    for worker in range(4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        ports = [support.free_port() for _ in range(20)]
        assert {p % 4 for p in ports} == {worker}
        assert len(set(ports)) == 20
        assert all(p < machine.ephemeral_low() for p in ports)


def test_a_files_tests_stay_on_one_worker_under_loadgroup(pytester: pytest.Pytester) -> None:
    """make test's --dist loadgroup keeps each group (tests/conftest.py makes every
    file outside PER_TEST_DIRS one) on one worker; with pytest 9.2 and
    pytest-xdist 3.8 the groups were silently dropped (pyproject.toml)."""
    pytester.makeconftest("""
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_collection_modifyitems(items):
            for item in items:
                item.add_marker(pytest.mark.xdist_group(item.path.name))
    """)
    body = "import os\n" + "".join(
        f"def test_{i}():\n    print('worker', os.environ['PYTEST_XDIST_WORKER'])\n"
        for i in range(6))
    pytester.makepyfile(test_a=body, test_b=body)
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadgroup", "-v",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=12)
    workers: dict[str, set[str]] = {}
    for line in result.outlines:
        ran = re.match(r"\[(gw\d+)\].* PASSED (test_\w+\.py)::", line)
        if ran:
            workers.setdefault(ran[2], set()).add(ran[1])
    assert set(workers) == {"test_a.py", "test_b.py"}, result.outlines
    assert all(len(w) == 1 for w in workers.values()), workers
