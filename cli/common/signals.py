"""How every long-running command (`sim`, `serve`, `demo`, `up` and its gateway child) takes its stop signals."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

# What stops a long-running command: Ctrl-C, and `kill` (service managers, CI runners, `timeout`).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """While the context runs, SIGINT and SIGTERM raise KeyboardInterrupt, whatever the process inherited; the
    previous handlers are restored after (the command may run in-process, under a test runner).

    A background job of a non-interactive shell (`cmd &` in a script, nohup, a CI runner's step) starts with
    SIGINT ignored, and Python keeps an inherited SIG_IGN: Ctrl-C or `kill -INT` would then not stop the command.
    SIGTERM gets the same handler so that both stop it through its own clean-up (finally blocks, context
    managers), where SIGTERM's default action would end it at once. `asyncio.run` sees Python's own SIGINT
    handler and turns SIGINT into a cancellation of the main task. Outside the main thread (where no signal is
    delivered) it changes nothing.
    """
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not set from Python, nothing to put back
                signal.signal(sig, handler)
