"""``python -m hybridrl.launch [torchrun options] [--] [hybridrl.train arguments]``: torchrun
that exits with what the workers meant.

Contract: the arguments before the first ``hybridrl.train`` argument (``--config``,
``--config-name``/``-cn``, ``--config-path``/``-cp``, a ``key=value`` override, or everything
after ``--``) are torchrun's (``--standalone --nproc-per-node 2``, ``--nnodes``, ``--rdzv-*``,
...); the workers run ``-m hybridrl.train`` with the rest. The agent is torch's own
(``torch.distributed.run``), so rendezvous, restarts and signal forwarding are unchanged, but:
- the exit status is the root-cause worker's (the first that failed): 2 (it could not start:
  bad config or input), 1 (training failed), 130 (interrupted; also a worker killed by SIGINT
  and Ctrl-C on the launcher), 143 (SIGTERM: a worker or the launcher terminated); 0 when
  every worker finished;
- torchrun's ``ChildFailedError`` traceback and its failure log are not printed: the workers'
  own one-line errors (``hybridrl.exits``) are the report; a worker ended by a crash signal
  (SIGSEGV, SIGBUS, SIGILL, SIGFPE: it can print nothing) gets one line from the launcher
  naming its rank and the signal (status 1); a master port in use (the rendezvous store cannot
  listen) is one line and status 2, not torchrun's traceback;
- SIGTERM and SIGINT are the launcher's own (``TORCHELASTIC_SIGNALS_TO_HANDLE`` leaves torchrun
  SIGHUP and SIGQUIT): the first raises torchrun's ``SignalException`` (its agent stops the
  workers, which report), a second one while that is handled, or any once ``main`` has its
  outcome, exits at once with 143 / 130, so no signal ends the launcher with a traceback.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys

TRAIN_OPTIONS = ("--config", "--config-name", "-cn", "--config-path", "-cp")
_OVERRIDE = re.compile(r"^[A-Za-z_+~][\w.\[\]+~-]*=")
_SIGNALED = [False]  # a signal was raised, or main has its outcome: the next one exits at once


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun options, hybridrl.train arguments); see the module docstring."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg.split("=", 1)[0] in TRAIN_OPTIONS or _OVERRIDE.match(arg):
            return argv[:i], argv[i:]
    return list(argv), []


def status_of_exitcode(code: int) -> int:
    """A worker's exit code as the launcher's status (negative: killed by that signal)."""
    if code in (2, 130, 143):
        return code
    if code == -int(signal.SIGINT):
        return 130
    if code == -int(signal.SIGTERM):
        return 143
    return 0 if code == 0 else 1


CRASH_SIGNALS = {"SIGSEGV": "a segmentation fault", "SIGBUS": "a bus error",
                 "SIGILL": "an illegal instruction", "SIGFPE": "a floating-point exception"}


def crash_line(rank: int, exitcode: int) -> str | None:
    """The line for a worker a crash signal ended (it could print nothing itself), else None."""
    if exitcode >= 0:
        return None
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return None
    if name not in CRASH_SIGNALS:
        return None  # SIGKILL, SIGTERM, SIGINT: the peers or the worker said why
    return (f"hybridrl.launch: error: rank {rank} died of {name} ({CRASH_SIGNALS[name]} in native "
            "code: a compiled extension, or C/ctypes code in a reward function)")


def network_line(err: BaseException, args) -> str:
    """One line for a rendezvous store that could not start."""
    text = str(err)
    port = getattr(args, "master_port", None)
    if "EADDRINUSE" in text:
        return (f"hybridrl.launch: error: the master port {port} is already in use on this "
                "machine (another run or program holds it): pass another --master-port, or "
                "--standalone to pick a free one")
    return f"hybridrl.launch: error: the rendezvous failed: {text.splitlines()[0][:300]}"


def _on_signal(signum, frame):
    """SIGTERM / SIGINT: torchrun's SignalException once (module docstring), then exit."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if _SIGNALED[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if signum == signal.SIGINT else 128 + signum)
    _SIGNALED[0] = True
    raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum)!r}",
                          sigval=signal.Signals(signum))


def main(argv=None) -> int:
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    torch_args, train_args = split_argv(list(sys.argv[1:] if argv is None else argv))
    args = parse_args([*torch_args, "-m", "hybridrl.train", *train_args])
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGHUP,SIGQUIT")
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal)
        try:
            run(args)  # torchrun's own agent (standalone/static rendezvous set up as torchrun does)
            status = 0
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            status = status_of_exitcode(failure.exitcode)
            crash = crash_line(rank, failure.exitcode)
            if crash:
                sys.stderr.write(crash + "\n")
        except DistNetworkError as err:  # the rendezvous store could not listen / connect
            sys.stderr.write(network_line(err, args) + "\n")
            status = 2
        _SIGNALED[0] = True  # the outcome is known: a signal from here on exits at once
    except SignalException as err:
        status = 130 if err.sigval == signal.SIGINT else 128 + int(err.sigval)
    except KeyboardInterrupt:
        status = 130
    return status


if __name__ == "__main__":
    status = main()
    if status in (130, 143):  # interrupted: torchrun's C++ store threads may still be alive, and their
        sys.stdout.flush()  # teardown at interpreter exit can abort (SIGABRT, "terminate called
        sys.stderr.flush()  # without an active exception"); leave without it
        os._exit(status)
    sys.exit(status)
