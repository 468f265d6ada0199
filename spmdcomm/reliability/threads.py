"""What this process's threads are doing, for the watchdog's report: host callbacks in flight and thread stacks.

A host callback (``jax.debug.callback``, ``jax.pure_callback``, ``io_callback``) is user code that runs in the
middle of a compiled step, in a thread of the runtime (on XLA:CPU sometimes in the thread that dispatched the
step). While it runs, the step cannot finish, and the other processes wait for this one at the step's next
collective: so a callback that does not return makes this process the culprit even though its training thread
only waits for its devices. No phase of the training loop can say so (the loop's thread is elsewhere), so
:class:`HostCallbacks` looks for JAX's callback frames in every thread's Python stack (``sys._current_frames``),
which works on every backend: the callbacks of all of them enter Python through the same JAX functions
(:func:`spmdcomm._jax_compat.is_host_callback_code`, which names them).

>>> watch = HostCallbacks()
>>> watch.sample() is None  # no callback runs in this process now
True
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from types import FrameType
from typing import NamedTuple

from spmdcomm._jax_compat import is_host_callback_code

__all__ = ["HostCallbacks", "InFlight", "stack_of"]

_STACK_FRAMES = 12


class InFlight(NamedTuple):
    """The oldest host callback running in this process."""

    began: float  # when it was first seen, on time.monotonic (a lower bound of its run time: seen once per sample)
    began_wall: float  # the same moment as time.time(), comparable across processes
    thread: int  # threading.get_ident() of the thread it runs in


class HostCallbacks:
    """Finds the host callbacks running in this process and remembers since when each one runs.

    A callback is first seen at a :meth:`sample`, so its time is known to within the period of the samples. Any
    thread may call :meth:`sample`; a call walks every thread's stack (tens of microseconds for a few threads).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (thread, id of the callback's frame) -> when first seen, and the frame itself: held until the next sample,
        # so that a later call's frame cannot take its address and pass for the same callback.
        self._seen: dict[tuple[int, int], tuple[InFlight, FrameType]] = {}

    def sample(self) -> InFlight | None:
        """The oldest host callback running now, or None when none runs."""
        now, wall = time.monotonic(), time.time()
        running = {
            (thread, id(frame)): (thread, frame)
            for thread, top in sys._current_frames().items()
            if (frame := _callback_frame(top)) is not None
        }
        with self._lock:
            # A running call keeps its frame object, so the key names one callback for as long as it runs.
            self._seen = {
                key: self._seen.get(key) or (InFlight(now, wall, thread), frame)
                for key, (thread, frame) in running.items()
            }
            return min((seen for seen, _ in self._seen.values()), default=None)


def stack_of(thread: int) -> str:
    """The last frames of ``thread``'s Python stack, indented, as the watchdog prints them."""
    frame = sys._current_frames().get(thread)
    if frame is None:
        return "  (the thread has ended)"
    return "".join(traceback.format_stack(frame)[-_STACK_FRAMES:]).rstrip()


def _callback_frame(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of a JAX host-callback function in the stack that ends at ``frame``, if any."""
    found = None
    while frame is not None:
        if is_host_callback_code(frame.f_code):
            found = frame
        frame = frame.f_back
    return found
