"""mixprec.distributed.preemption on its own: SIGTERM becomes a flag, and the handler is put back."""

from __future__ import annotations

import os
import signal

from mixprec.distributed.preemption import PREEMPTED_EXIT_CODE, Preemption


def test_a_real_sigterm_sets_the_flag_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with Preemption() as p:
            assert not p.requested() and p.received is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert p.requested() and p.received == signal.SIGTERM
            assert p.requested()  # once agreed, it stays so
        assert seen == []  # the context caught it, not the user's handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]  # the user's handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert PREEMPTED_EXIT_CODE == 75  # EX_TEMPFAIL, as documented


def test_other_signals_can_be_chosen():
    with Preemption(signals=(signal.SIGUSR1,)) as p:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert p.requested() and p.received == signal.SIGUSR1
