"""Exit statuses and one-line failure reports of the training entrypoint.

Contract:
- ``OK, FAILED, BAD_INPUT, INTERRUPTED, TERMINATED = 0, 1, 2, 130, 143
TERM_GRACE_S = 10.0``: 2 = the run could not start (config,
  input files, the checkpoint to resume: found before step 1), 1 = training failed after it
  started (user code, non-finite giving up, a collective timeout, ...), 130 = Ctrl-C / SIGINT.
- ``one_line(err)``: the exception as one line; unless it is a ValueError or hybridrl's own
  (its messages name their key, file or rank) the type and the innermost frame
  (``file:line in fn``) are added, so a KeyError from user code says where it came from.
- ``status_of(err, started)``: BAD_INPUT for input-type errors (``INPUT_ERRORS``) before the run
  started and for ``StartupError`` at any time; INTERRUPTED for KeyboardInterrupt; else FAILED.
- ``FailureReporter(rank, store)``: ``report(status, message, peer_loss=False)`` writes
  ``hybridrl.train: error[ (rank N)]: message`` to stderr at once, in one write. Through the
  job's store (no collective) only the first failing rank's message is shown for an error every
  rank shares, an error only rank N hit is still shown (it is written before the rank exits, not
  after a delay torchrun may cut short), and a rank that failed only because a peer died
  (``peer_loss``) stays silent.
- ``Terminated`` (a ``KeyboardInterrupt``): what ``handle_sigterm()`` makes SIGTERM raise in
  the main thread, so a ``kill`` (or torchrun forwarding one) is handled like Ctrl-C: one line
  ``terminated (SIGTERM)`` and status ``TERMINATED`` (143, the shell's 128 + 15). It is raised
  once per process: a second SIGTERM (torchrun's after a ``kill`` of the whole group, the
  parent-death one) while the first is being handled raises nothing, so no except or cleanup
  path can be cut by a second ``Terminated``. The caller installs the handler inside the
  ``try`` that handles ``Terminated`` and calls ``end_handled_region()`` as that ``try``'s last
  statement: from then on a SIGTERM writes the line (unless this process already reported) and
  exits with 143 at once, so one arriving during the exit is no traceback either. When the
  main thread sits in a collective that does not return, a watchdog thread woken by the signal
  writes that line (unless this process already reported a failure: one line per process) and
  leaves with 143 after ``TERM_GRACE_S`` seconds.
- ``sigterm_point(name)``: a test hook. When ``$HYBRIDRL_TEST_SIGTERM_AT`` (comma separated)
  lists ``name``, the process sends itself SIGTERM there, so a test can land one at an exact
  point of hybridrl.train's start-up and exit (tests/distributed/test_sigterm_points.py);
  unset, it does nothing.
- The SIGTERM state and the final-line lock are module state on purpose: a signal's
  disposition and stderr are the process's, not an object's.
- ``die_with_parent()``: under torchrun (``TORCHELASTIC_RUN_ID`` set, Linux) the worker receives
  SIGTERM when the torchrun process dies, even by SIGKILL, instead of training on alone.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import threading
import traceback

OK, FAILED, BAD_INPUT, INTERRUPTED, TERMINATED = 0, 1, 2, 130, 143
TERM_GRACE_S = 10.0
INPUT_ERRORS = (ValueError, TypeError, OSError, EOFError, KeyError, ImportError,
                pickle.UnpicklingError)
FIRST_KEY, COUNT_KEY = "hybridrl/failure/first", "hybridrl/failure/count"
PEER_LOSS_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                   "socket closed", "recv from", "remote process exited")
SIGTERM_AT_ENV = "HYBRIDRL_TEST_SIGTERM_AT"
_LINE = threading.Lock()  # held while this process decides and writes a failure line
_SAID = threading.Event()  # this process has reported (written its line, or kept silent on purpose)


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    frames = traceback.extract_tb(err.__traceback__)
    ours = type(err).__module__.startswith("hybridrl") or (
        type(err) in (ValueError, RuntimeError) and frames
        and f"{os.sep}hybridrl{os.sep}" in frames[-1].filename)
    if text and (ours or isinstance(err, ValueError)):
        return text  # hybridrl's messages name their key, file or rank
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in " \
            f"{frames[-1].name})" if frames else ""
    return f"{type(err).__name__}{': ' + text if text else ''}{where}"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by ``handle_sigterm``'s handler."""


class _Sigterm:
    """This process's SIGTERM state (see the module docstring)."""

    rank = 0
    raised = False  # Terminated was raised: a later SIGTERM belongs to the same ending
    leaving = False  # past the handled region: a SIGTERM writes the line and exits


_TERM = _Sigterm()


def _say_terminated(wait_s: float) -> None:
    """Write this rank's ``terminated (SIGTERM)`` line unless the process already reported."""
    if not (_LINE.acquire(timeout=wait_s) if wait_s > 0 else _LINE.acquire(blocking=False)):
        return  # another thread is writing this process's line
    try:
        if not _SAID.is_set():
            _SAID.set()
            who = "" if _TERM.rank == 0 else f" (rank {_TERM.rank})"
            sys.stderr.write(f"hybridrl.train: error{who}: terminated (SIGTERM)\n")
            sys.stderr.flush()
    finally:
        _LINE.release()


def _on_sigterm(signum, frame):
    if _TERM.leaving:  # the handled region is over: no exception could be caught any more
        _say_terminated(0)
        os._exit(TERMINATED)
    if not _TERM.raised:
        _TERM.raised = True
        raise Terminated()


def handle_sigterm(rank: int) -> None:
    """SIGTERM raises ``Terminated`` (once); a watchdog ends a process stuck past the grace
    time. Call it inside the ``try`` that handles ``Terminated``: the handler is installed last,
    so a SIGTERM at once raises in the caller's ``try``."""
    import time

    _TERM.rank = rank
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch():
        while os.read(read_fd, 1) != bytes([int(signal.SIGTERM)]):
            pass
        time.sleep(TERM_GRACE_S)
        _say_terminated(5.0)
        os._exit(TERMINATED)

    threading.Thread(target=watch, name="hybridrl-sigterm", daemon=True).start()
    signal.set_wakeup_fd(write_fd)  # written by the C-level handler, even while blocked in C
    signal.signal(signal.SIGTERM, _on_sigterm)


def end_handled_region() -> None:
    """From now on a SIGTERM writes the line (unless this process reported) and exits 143."""
    _TERM.leaving = True


def sigterm_point(name: str) -> None:
    """Test hook: SIGTERM to this process here when ``$HYBRIDRL_TEST_SIGTERM_AT`` lists ``name``."""
    if name in os.environ.get(SIGTERM_AT_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGTERM)


def status_of(err: BaseException, started: bool) -> int:
    from hybridrl.checkpoint.run_identity import StartupError

    if isinstance(err, Terminated):
        return TERMINATED
    if isinstance(err, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(err, StartupError) or (not started and isinstance(err, INPUT_ERRORS)):
        return BAD_INPUT
    return FAILED


def is_peer_loss(err: BaseException) -> bool:
    """A collective failed because a peer process is gone (never hybridrl's own errors: a
    reward function's ``ConnectionResetError`` is that function's failure)."""
    if not isinstance(err, RuntimeError) or type(err).__module__.startswith("hybridrl"):
        return False
    text = str(err).lower()
    return any(w in text for w in PEER_LOSS_WORDS)


class FailureReporter:
    """One line per distinct failure over the job (see module docstring)."""

    def __init__(self, rank: int, store=None) -> None:
        self.rank, self.store = rank, store

    def report(self, status: int, message: str, peer_loss: bool = False) -> int:
        with _LINE:  # the SIGTERM watchdog then adds no second line of its own
            _SAID.set()
            first = None
            if self.store is not None:
                try:
                    self.store.set_timeout(datetime.timedelta(seconds=5))
                    if self.store.add(COUNT_KEY, 1) == 1:
                        self.store.set(FIRST_KEY, message)
                    else:
                        first = self.store.get(FIRST_KEY).decode()
                except Exception:  # the store's host is gone: report on our own
                    first = None
            if first is not None and (peer_loss or first == message):
                return status  # shown by the rank that failed first
            who = "" if self.rank == 0 else f" (rank {self.rank})"
            sys.stderr.write(f"hybridrl.train: error{who}: {message}\n")
            sys.stderr.flush()
        return status


def die_with_parent() -> None:
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except OSError:
        pass
