"""Jupyter's interrupt while a request runs: counted by the latch, held over lock sections, delivered
to whatever handler was in place.  Real SIGINTs sent to this process (pytest runs tests on the main
thread, where Python delivers signals)."""

from __future__ import annotations

import signal
import threading

import pytest

from mnb.controller.guards import InterruptLatch, interrupts_held


@pytest.fixture(autouse=True)
def kernel_handler():
    """Python's own SIGINT handler in place, as in a kernel: a process started in the background (CI's
    ``nohup ... &``) inherits SIGINT ignored, and Python then installs no handler at all."""
    saved = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


def send_sigint() -> None:
    """A Kernel -> Interrupt: a real SIGINT, raised on this (the main) thread, whose Python handler has run
    when this returns (``raise_signal`` checks signals before returning; ``os.kill`` of the process may be
    taken by another thread, and the handler then runs when the main thread next checks)."""
    signal.raise_signal(signal.SIGINT)


def test_the_latch_counts_interrupts_instead_of_raising_and_each_is_taken_once():
    before = signal.getsignal(signal.SIGINT)
    with InterruptLatch() as latch:
        assert not latch.take()
        send_sigint()
        send_sigint()
        assert latch.count == 2
        assert latch.take()        # both arrived since the last take: one stop
        assert not latch.take()    # and only once
        send_sigint()
        assert latch.take()
    assert signal.getsignal(signal.SIGINT) is before  # the kernel's handler is back
    with pytest.raises(KeyboardInterrupt):  # and interrupts raise again outside the request
        send_sigint()


def test_the_latch_restores_pythons_default_when_no_handler_was_installed():
    saved = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        with InterruptLatch():
            pass
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, saved)


def test_the_latch_counts_nothing_off_the_main_thread_and_cancel_reaches_it():
    latch = InterruptLatch()
    seen: list[object] = []

    def worker() -> None:
        with latch:
            seen.append(signal.getsignal(signal.SIGINT))
    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert seen == [before]  # no handler installed from another thread
    latch.cancel("the pool was stopped")
    assert latch.cancelled == "the pool was stopped" and not latch.take()


def test_an_interrupt_inside_a_held_section_arrives_at_its_end():
    with InterruptLatch() as latch:
        with interrupts_held():
            send_sigint()
            assert latch.count == 0  # held: the section's lock work is not cut in half
        assert latch.count == 1      # delivered to the latch at the section's end
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            send_sigint()
            reached_the_end = True
    assert reached_the_end  # the section ran to its end; KeyboardInterrupt came after it
