"""The request body's idle deadline (gateway.relay.admission.read_body): none of the body for
`timeouts.idle_s` ends the request with a 408 (tests/test_bad_input.py, live); it is looked at
by the loop's shared timer, so it is never early, counts from the body's last piece, and
interrupts the request's task once. Here on a clock the test moves."""

from __future__ import annotations

from gateway.relay.admission import _Arriving


class _Task:
    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> None:
        self.cancels += 1


def test_a_body_silent_for_idle_s_interrupts_its_task_once_never_before() -> None:
    task = _Task()
    arriving = _Arriving(task, 2.0, now=10.0)  # type: ignore[arg-type]
    arriving.look(11.99)
    assert (task.cancels, arriving.expired) == (0, False)
    arriving.look(12.0)
    arriving.look(12.5)  # a later look while the task unwinds: no second cancel
    assert (task.cancels, arriving.expired) == (1, True)


def test_each_piece_of_the_body_starts_its_idle_time_again() -> None:
    task = _Task()
    arriving = _Arriving(task, 2.0, now=10.0)  # type: ignore[arg-type]
    arriving.last = 11.5  # a piece came (read_body dates it)
    arriving.look(13.0)  # 3 s since the request began, 1.5 s since the piece
    assert task.cancels == 0
    arriving.look(13.5)
    assert task.cancels == 1
