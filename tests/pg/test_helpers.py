"""The helper threads of the backend waits (``ftc10d.pg.helpers``): reused when idle, never
blocked by a stuck wait, bounded, and gone in a forked child."""

from __future__ import annotations

import os
import threading

from ftc10d.pg.helpers import MAX_IDLE, HelperPool


def test_an_idle_helper_takes_the_next_job_and_a_stuck_one_never_delays_others() -> None:
    pool = HelperPool("test-helper")
    threads: list[int] = []
    done = threading.Event()
    pool.submit(lambda: (threads.append(threading.get_ident()), done.set()))
    assert done.wait(5)
    for _ in range(50):  # the job returns before park(): wait until the helper is idle
        if pool.idle() == 1:
            break
        threading.Event().wait(0.01)
    again = threading.Event()
    pool.submit(lambda: (threads.append(threading.get_ident()), again.set()))
    assert again.wait(5) and threads[0] == threads[1], "an idle helper is reused"
    stuck, release = threading.Event(), threading.Event()
    pool.submit(lambda: (stuck.set(), release.wait(30)))
    assert stuck.wait(5)
    other = threading.Event()
    pool.submit(other.set)  # the stuck helper is busy: another one runs this at once
    assert other.wait(5)
    release.set()


def test_idle_helpers_are_bounded_and_a_raising_job_keeps_its_helper() -> None:
    pool = HelperPool("test-helper")
    gate = threading.Event()
    started = [threading.Event() for _ in range(MAX_IDLE + 4)]
    for ev in started:
        pool.submit(lambda ev=ev: (ev.set(), gate.wait(30)))
    assert all(ev.wait(5) for ev in started)
    gate.set()
    for _ in range(200):
        if pool.idle() == MAX_IDLE:
            break
        threading.Event().wait(0.01)
    assert pool.idle() == MAX_IDLE
    ran = threading.Event()
    pool.submit(lambda: 1 / 0)  # logged; the helper goes on
    pool.submit(ran.set)
    assert ran.wait(5)


def test_a_forked_child_starts_with_no_idle_helper() -> None:
    from ftc10d.pg.helpers import BACKEND_WAITS

    done = threading.Event()
    BACKEND_WAITS.submit(done.set)
    assert done.wait(5)
    for _ in range(500):  # parked: without the reset, the child would hand its job to this dead helper
        if BACKEND_WAITS.idle() >= 1:
            break
        threading.Event().wait(0.01)
    assert BACKEND_WAITS.idle() >= 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's idle helper does not exist here
        ok = threading.Event()
        BACKEND_WAITS.submit(ok.set)
        os.write(w, b"1" if ok.wait(5) else b"0")  # a dead parent helper would never run it
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
