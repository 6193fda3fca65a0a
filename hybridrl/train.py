"""The torchrun entrypoint: ``torchrun --nproc-per-node N -m hybridrl.train --config a.yaml k=v``.

Contract: every rank parses ``--config-name`` (Hydra style, in ``--config-path``), ``--config``
files (in order) and ``key=value`` overrides (verl's keys translated: one notice line on rank 0),
loads and validates the config and checks it against the world size (``cfg.check_world``, and
verl's ``trainer.n_gpus_per_node * trainer.nnodes`` when given) BEFORE any collective, so a bad
config makes every rank exit with status 2 together (rank 0 prints the problem, or every bad
override one per line; no traceback, no hang; another rank prints its own error, with its rank,
only if it is still running 3 s later: one that rank 0 did not hit). Then it initializes
torch.distributed (gloo on CPU, NCCL on CUDA), builds the training and generation groups, builds
the ``PPOTrainer`` and runs it (``parallel.placement=split``: the last ``parallel.gen.world``
ranks serve generation instead, ``hybridrl.trainer.split_run``).
Start-up checks (``hybridrl.trainer.startup``: folders writable, model/tokenizer files, data
sources known) also run on every rank before any collective; the run's folder paths are made
absolute first (``hybridrl.trainer.startup.resolve_paths``); once the process groups are up,
rank 0 locks every folder the run writes (``startup.lock_run_folders``: a second run on any of
them exits 2, one line, before a model is built). Data with ``code`` rows where the code
reward's OS sandbox cannot start exits 2 too (``hybridrl.trainer.startup.code_sandbox_problems``).
Process groups time out after
``trainer.collective_timeout_s``; the line then names the ranks that did not arrive and their
phase (``hybridrl.parallel.phases``). Any exception is reported as one line
(``hybridrl.exits``): an error every rank shares once, one only rank N hit with its rank.
Exit status: 0 done, 1 training failed after it started (user code, the step guard gave up, a
timeout), 2 the run could not start (bad config, layout, input file, the checkpoint to resume),
130 interrupted, 143 terminated (SIGTERM: one line, like Ctrl-C, wherever it lands once the
start-up checks passed: process-group set-up, the build, a step, the teardown, the exit).
Under torchrun use ``python -m hybridrl.launch`` to get these statuses back.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings

from hybridrl.exits import (
    TERMINATED,
    FailureReporter,
    Terminated,
    die_with_parent,
    end_handled_region,
    handle_sigterm,
    one_line,
    sigterm_point,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybridrl.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", default=[], metavar="YAML",
                        help="config file (repeatable; later files override earlier ones)")
    parser.add_argument("--config-name", "-cn", default=None, metavar="NAME",
                        help="Hydra style: <config-path>/NAME.yaml, read before --config files; "
                             "verl's ppo_megatron_trainer / ppo_trainer mean hybridrl's defaults")
    parser.add_argument("--config-path", "-cp", default="configs", metavar="DIR",
                        help="folder of --config-name (default: configs)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. actor.lr=1e-4 parallel.tp=2")
    return parser.parse_args(argv)


RANK_ERROR_DELAY_S = 3.0


def _fail(rank: int, status: int, message: str) -> int:
    """Report ``message`` once and return ``status``. Rank 0 writes it at once (one write call,
    so concurrent output cannot split the line). The other ranks usually fail the same way (same
    config), and torchrun stops them as soon as rank 0 exits; so they wait RANK_ERROR_DELAY_S
    first and only then write theirs, with their rank: an error that only they hit is still shown,
    a shared one is shown once."""
    if rank == 0:
        sys.stderr.write(f"hybridrl.train: error: {message}\n")
    else:
        time.sleep(RANK_ERROR_DELAY_S)
        sys.stderr.write(f"hybridrl.train: error (rank {rank}): {message}\n")
    sys.stderr.flush()
    return status


def build_layout(cfg, world: int):
    """(TrainLayout, GenLayout or None) of the config for ``world`` ranks (pure): the public
    ``hybridrl.build_layout``, imported when called (the trainer package is heavy)."""
    from hybridrl.trainer.entry import build_layout as layouts

    return layouts(cfg, world)


def _check_kernels(use_compiled, on_cuda: bool) -> str | None:
    """Apply ``kernels.use_compiled`` before any kernel runs; a problem message or None."""
    from hybridrl.kernels import ops

    if use_compiled is False:
        os.environ[ops.FORCE_REFERENCE_ENV] = "reference"
        return None
    try:  # an extension that is built but cannot load is named now, not at the first kernel
        available = ops.compiled_available("gae", "cuda" if on_cuda else "cpu")
    except ops.ExtensionLoadError as exc:
        return f"{exc} (set kernels.use_compiled=false to run the reference kernels)"
    if use_compiled is True and not available:
        return ("kernels.use_compiled=true but the csrc extension is not built for this device; "
                "rebuild with `pip install --no-build-isolation -e .` or set kernels.use_compiled=auto")
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    for pattern in (".*Transformer Engine and Apex.*", ".*Apex is not installed.*",
                    ".*full scope is deprecated.*"):  # megatron-core's import-time notices
        warnings.filterwarnings("ignore", message=pattern)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    die_with_parent()  # a SIGKILLed torchrun takes its workers along
    try:
        from hybridrl.config.loader import load_config, resolve_config_name

        named = args.config_name and resolve_config_name(args.config_name, args.config_path)
        notices: list[str] = []
        cfg = load_config(([named] if named else []) + args.config, args.overrides,
                          world_size=world, notices=notices)
        if rank == 0 and notices:
            sys.stderr.write(f"hybridrl.train: {notices[0]}\n")
        from hybridrl.trainer.startup import check_startup, code_sandbox_problems, resolve_paths

        cfg = resolve_paths(cfg)
        cfg.check_world(world)
        train, gen = build_layout(cfg, world)

        problems = check_startup(cfg, rank)  # every rank, before any collective
    except Exception as err:  # config files, overrides, layout: bad input, one line
        listed = isinstance(err, ValueError) and " bad overrides:" in str(err).split("\n")[0]
        return _fail(rank, 2, str(err).strip() if listed else one_line(err))  # every bad one
    problems = problems or code_sandbox_problems(cfg)
    if problems:
        return _fail(rank, 2, problems[0] if len(problems) == 1 else
                     f"{len(problems)} problems: " + "; ".join(problems))
    locks: list = []  # rank 0: the run-folder locks, taken in _run before any model is built
    import torch
    import torch.distributed as dist

    from hybridrl.parallel.groups import build_groups, init_distributed

    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        return _fail(rank, 2, "trainer.device is 'cuda' but no GPU is visible")
    problem = _check_kernels(cfg.kernels.use_compiled, torch.cuda.is_available())
    if problem:
        return _fail(rank, 2, problem)
    if cfg.trainer.device == "cpu" and torch.cuda.is_available():  # models follow CUDA if visible
        return _fail(rank, 2, "trainer.device is 'cpu' but a GPU is visible; hide it with "
                              "CUDA_VISIBLE_DEVICES= or set trainer.device=auto")
    if "MASTER_ADDR" not in os.environ:  # plain `python -m hybridrl.train`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"),
                          RANK="0", WORLD_SIZE="1")
    timeout_s = cfg.trainer.collective_timeout_s
    # SIGTERM: one line and 143, like Ctrl-C, wherever it lands from the handler's installation
    # to the exit (hybridrl.exits); not earlier: a rank waiting to report a config error
    # (``_fail``) is then simply ended by torchrun, silently, as before
    try:
        handle_sigterm(rank)
        sigterm_point("installed")
        init_distributed("gloo" if cfg.trainer.device == "cpu" else None, timeout_s=timeout_s)
        torch.manual_seed(cfg.trainer.seed)
        status = _run(cfg, build_groups, train, gen, rank, timeout_s, locks)
        for lock in locks:  # held to here (the process's end would release them too; a
            lock.release()  # caller that runs main() in its own process goes on unlocked)
        if status == 0:
            sigterm_point("finished")
            try:
                dist.barrier()
                dist.destroy_process_group()  # after a failure a peer may be stuck: just exit
            except RuntimeError:  # a peer failed after this rank finished: it reported why
                status = 1
        elif dist.is_initialized():
            _release_groups(status)
        end_handled_region()  # a SIGTERM from here on exits at once, with the line
        sigterm_point("exiting")
    except Terminated:  # before the trainer's reporter (process group set-up) or after it
        status = FailureReporter(rank).report(TERMINATED, "terminated (SIGTERM)")
        if dist.is_initialized():
            _release_groups(status)
    return status


def _release_groups(status: int, wait_s: float = 10.0) -> None:
    """After a failure (reported already): free the process groups while the interpreter is
    alive, without waiting on any peer. Left to the interpreter's exit, gloo's worker threads can
    end the process with ``terminate called without an active exception`` (SIGABRT: the launcher
    then shows status 1 instead of this rank's 2 or 143; seen under load when rank 0, which hosts
    the store, left first). Destroying is local, but bounded anyway: a teardown that does not
    finish within ``wait_s`` leaves with ``status`` at once."""
    import threading

    import torch.distributed as dist

    done = threading.Event()

    def destroy():
        try:
            dist.destroy_process_group()
        except Exception:  # a group half torn down by the failure: nothing left to free
            pass
        done.set()

    threading.Thread(target=destroy, name="hybridrl-release-groups", daemon=True).start()
    if not done.wait(wait_s):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _agree_on_locks(cfg, rank: int, store, timeout_s: float, locks: list) -> None:
    """Rank 0 takes the run-folder locks (``lock_run_folders``) and posts the outcome in the
    job's store; every rank raises the same StartupError when they are held elsewhere (reported
    once, status 2), so no rank is left to be terminated mid-start-up."""
    from datetime import timedelta

    from hybridrl.checkpoint.run_identity import StartupError
    from hybridrl.trainer.startup import lock_run_folders

    key = f"hybridrl/run_locks/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        try:
            locks.extend(lock_run_folders(cfg))
            verdict = ""
        except (ValueError, OSError) as err:
            verdict = one_line(err)
        if store is None:
            if verdict:
                raise StartupError(verdict)
            return
        store.set(key, ("error:" + verdict) if verdict else "ok")
    elif store is not None:
        store.wait([key], timedelta(seconds=timeout_s))
        verdict = store.get(key).decode()
        verdict = "" if verdict == "ok" else verdict.removeprefix("error:")
    else:
        return
    if verdict:
        raise StartupError(verdict)


def _run(cfg, build_groups, train, gen, rank: int, timeout_s: float, locks: list) -> int:
    """Build the trainer and fit; any failure is one line (hybridrl.exits) and a status."""
    from hybridrl.exits import is_peer_loss, status_of
    from hybridrl.parallel.phases import PhaseBoard, is_timeout

    board = PhaseBoard.from_default_group()
    board.start_heartbeat()  # a stopped or dead rank is named (hybridrl.parallel.phases)
    reporter, started = FailureReporter(rank, board.store), False
    try:
        _agree_on_locks(cfg, rank, board.store, timeout_s, locks)  # before any model is built
        if cfg.parallel.split:  # generation ranks apart (hybridrl/trainer/split_run.py)
            from hybridrl.trainer.split_run import fit_split

            def on_started():  # this rank's trainer or engine is built (trainer/split_run.py)
                nonlocal started
                started = True

            fit_split(cfg, train, timeout_s, phases=board, on_started=on_started)
        else:
            from hybridrl.trainer.ppo import PPOTrainer

            trainer = PPOTrainer(cfg, build_groups(train, gen, timeout_s=timeout_s))
            trainer.phases, started = board, True
            trainer.fit()
        board.stop_heartbeat()
    except (Exception, KeyboardInterrupt) as err:  # the entrypoint reports all in one line
        sigterm_point("reporting")  # a second SIGTERM while the first is handled: raises nothing
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun stopping the others: report
        timeout, lost = is_timeout(err), is_peer_loss(err) and not is_timeout(err)
        lost = lost or isinstance(err, Terminated)  # torchrun ends the others when one died
        message = ((board.describe_peer_loss(rank, err) or "terminated (SIGTERM)")
                   if isinstance(err, Terminated) else
                   "interrupted" if isinstance(err, KeyboardInterrupt) else
                   board.describe_timeout(rank, timeout_s) if timeout else
                   (lost and board.describe_peer_loss(rank, err)) or one_line(err))
        board.stop_heartbeat()
        return reporter.report(status_of(err, started), message,  # shown only when no rank
                               peer_loss=lost or timeout)  # did
    return 0


if __name__ == "__main__":
    sys.exit(main())
