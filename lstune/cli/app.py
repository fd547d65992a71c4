"""The `lstune` command: a Typer app with one thin module per command.

User mistakes (lstune.errors.UserError) and usage errors (an unknown flag or command, a flag without
its value) print one message and exit with code 2; `--debug` adds the traceback. SIGTERM outside the
training steps (loading data or the model before them; the plot and summary after them) stops with code 130
and a message saying what was saved, like Ctrl-C. Heavy libraries are imported by the commands' work, never
here, so `--help` is instant.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import traceback

import typer

from lstune import __version__
from lstune.cli.help import HelpGroup
from lstune.errors import UserError
from lstune.parallel.lifetime import PARENT_ENV
from lstune.train.signals import STOP_SIGNALS, Terminated, on_sigterm

app = typer.Typer(
    name="lstune",
    help="Fine-tune Hugging Face causal LMs on very long sequences.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=HelpGroup,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lstune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors and log at debug level."),
    log_level: str = typer.Option(
        "warning", "--log-level", metavar="LEVEL", help="Log level on the terminal: debug, info, warning or error."
    ),
) -> None:
    """Fine-tune Hugging Face causal LMs on very long sequences."""
    from lstune.cli.logs import LEVELS, setup_logging

    if log_level.lower() not in LEVELS:
        raise UserError(f"--log-level {log_level!r} is not one of {', '.join(LEVELS)}.")
    setup_logging(log_level.lower(), debug=debug)


def _register_commands() -> None:
    from lstune.cli import bench, data, estimate, plot, presets, recipes, train

    train.register(app)
    estimate.register(app)
    data.register(app)
    presets.register(app)
    recipes.register(app)
    plot.register(app)
    bench.register(app)


_register_commands()


def _normalise_resume(argv: list[str]) -> list[str]:
    """`--resume` alone means `--resume latest` (click has no optional option values)."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("latest")
    return out


def _hoist_globals(args: list[str]) -> list[str]:
    """`--debug` and `--log-level LEVEL` are accepted anywhere on the line (`lstune train ... --debug` as
    well as `lstune --debug train`): move them before the command, where the root callback reads them."""
    front, rest, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--debug" or arg.startswith("--log-level="):
            front.append(arg)
        elif arg == "--log-level" and i + 1 < len(args):
            front += [arg, args[i + 1]]
            i += 1
        else:
            rest.append(arg)
        i += 1
    return front + rest


def _click_classes(name: str) -> tuple[type, ...]:
    """`name` from click and from typer's vendored copy of it (typer >= 0.2x raises its own classes)."""
    found = []
    for module in ("click.exceptions", "typer._click.exceptions", "typer.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def main(argv: list[str] | None = None) -> None:
    """The CLI's entry point (see the module doc). A rank of a launched run that ends with its process group still
    alive (an error, a signal) leaves through os._exit once its output is flushed: the interpreter's teardown
    with a live gloo/NCCL group can abort (SIGABRT) or wait on a peer, turning exit code 2 into a crash report;
    the group cannot be ended properly there, since the other ranks may never reach the barrier that needs."""
    if os.environ.get(PARENT_ENV):
        from lstune.parallel.lifetime import die_with_launcher

        die_with_launcher()  # a rank of lstune's launcher: it ends with the launcher, even one killed with -9
    try:
        _main(argv)
    except SystemExit as exc:
        if _launched_group_alive():
            _hard_exit(exc.code)
        raise
    except BaseException as exc:
        if _launched_group_alive():
            _lost_peer_exit(exc)
            traceback.print_exc()
            _hard_exit(1)
        raise


def entry() -> None:
    """The program's entry (the `lstune` script, `python -m lstune`): `main`, then, in a process that loaded torch,
    lstune.parallel.lifetime.quick_exit instead of the interpreter's teardown (2-20 s there, after the last line).
    `main` itself returns normally, for callers in-process."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if "torch" not in sys.modules:
        sys.exit(code)
    from lstune.parallel.lifetime import quick_exit

    if isinstance(code, str):
        print(code, file=sys.stderr)
    quick_exit(code if isinstance(code, int) else (0 if code is None else 1))


def _lost_peer_exit(exc: BaseException) -> None:
    """A rank whose collective failed because another process went away leaves quietly (LOST_PEER_EXIT): the
    launcher reports the process that went away in one line (lstune.parallel.agent). `--debug` keeps its trace."""
    from lstune.parallel.agent import LOST_PEER_EXIT, lost_a_peer

    if lost_a_peer(exc) and "--debug" not in sys.argv:
        _hard_exit(LOST_PEER_EXIT)


def _launched_group_alive() -> bool:
    """This process is one of several launched ranks and its process group is still up (torch never imported
    here for the answer)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return False
    return dist.is_available() and dist.is_initialized()


def _hard_exit(code) -> None:
    if isinstance(code, str):
        print(code, file=sys.stderr)
    logging.shutdown()  # OUTPUT_DIR/lstune.log's last lines
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _main(argv: list[str] | None) -> None:
    args = _hoist_globals(_normalise_resume(list(sys.argv[1:] if argv is None else argv)))
    debug = "--debug" in args
    # SIGHUP (the terminal or ssh session closed) stops a run as SIGTERM does: save, then exit.
    previous = {sig: signal.signal(sig, on_sigterm) for sig in STOP_SIGNALS} if _in_main_thread() else {}
    try:
        code = app(args=args, prog_name="lstune", standalone_mode=False)
    except UserError as exc:
        _report(exc, debug)
    except _click_classes("Exit") as exc:
        sys.exit(exc.exit_code)
    except _click_classes("ClickException") as exc:
        if debug:
            traceback.print_exc()
        exc.show()
        sys.exit(exc.exit_code)
    except Terminated as exc:
        interrupted = _user_error_under(exc)
        if interrupted is not None:
            _report(interrupted, debug)
        if _launched_group_alive():
            # The launcher's SIGTERM to the ranks left after one failed, while this one's collective was failing for
            # the same reason: the failed rank's message is the one the user reads, not "SIGTERM received".
            _lost_peer_exit(exc)
        typer.echo(f"lstune: {exc.args[0] if exc.args else 'SIGTERM'} received {_terminated_when()}", err=True)
        sys.exit(130)
    except (_click_classes("Abort") + (KeyboardInterrupt,)):
        typer.echo("lstune: interrupted", err=True)
        sys.exit(130)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.exit(code if isinstance(code, int) else 0)


def _report(exc: UserError, debug: bool) -> None:
    """Print a user error (with its traceback under --debug) and exit with its code. SIGTERM is ignored from here
    on: the other ranks of a launched run stop on this error as it is reported (`Runtime.main_first`), and the
    launcher (torchrun) then terminates the ranks still running — this one included, before its message was out
    (seen: a bad eval set under --gpus 2 said only "SIGTERM received before training started", exit 130)."""
    if _in_main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    if debug:
        traceback.print_exc()
    if debug or not exc.quiet:
        typer.echo(f"lstune: {exc}", err=True)
    sys.exit(exc.exit_code)


def _user_error_under(exc: BaseException) -> UserError | None:
    """The user error that was propagating when SIGTERM came (the signal's exception has it as its context), so
    that the error, not the launcher's signal, is what the user reads."""
    seen: set[int] = set()
    context = exc.__context__
    while context is not None and id(context) not in seen:
        if isinstance(context, UserError):
            return context
        seen.add(id(context))
        context = context.__context__
    return None


def _terminated_when() -> str:
    """Where a SIGTERM outside the training steps found the run: before them, or after its last checkpoint."""
    from lstune.train.signals import newest_checkpoint

    saved = newest_checkpoint()
    if saved is None:
        return "before training started; stopped without writing a checkpoint (nothing had been trained)."
    return (f"after the training steps; stopped. The newest checkpoint, {saved}, is complete (--resume continues "
            "from it).")


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
