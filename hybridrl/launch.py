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
  own one-line errors (``hybridrl.exits``) are the report;
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
            _, failure = err.get_first_failure()
            status = status_of_exitcode(failure.exitcode)
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
