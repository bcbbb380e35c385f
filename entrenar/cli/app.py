"""The ``entrenar`` command group, its error handling and its exit codes.

Exit codes: 0 success; 1 the run failed (an error while training, merging, writing
..., a checkpoint that cannot be written); 2 a usage or configuration error (bad
option, invalid config key or value, missing, unreadable or corrupt input file or
checkpoint). An error prints one line, ``error: <message>``, on stderr; ``--verbose``
(before or after the subcommand) adds the traceback. entrenar's log lines (INFO and
up, such as ``resuming from step N (checkpoint PATH)``) go to stderr too.

Shell completion (click's): ``entrenar --completion bash > ~/.entrenar-complete.bash``
then ``source`` it (``zsh`` and ``fish`` likewise), or
``eval "$(_ENTRENAR_COMPLETE=bash_source entrenar)"``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import click

from entrenar.errors import (
    CheckpointError,
    CompatibilityError,
    ConfigError,
    EntrenarError,
    FormatError,
    QuantizationError,
    TemplateError,
    UnsupportedError,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
USAGE_ERRORS = (
    ConfigError,
    FormatError,
    UnsupportedError,
    CompatibilityError,
    QuantizationError,
    TemplateError,
)
"""Errors in what the user asked for: exit code 2."""


def exit_code(error: BaseException) -> int:
    """The exit code of an error escaping a command (see the module docstring)."""
    usage = (*USAGE_ERRORS, click.UsageError, FileNotFoundError, IsADirectoryError)
    if isinstance(error, usage):
        return EXIT_USAGE
    if isinstance(error, CheckpointError):  # a corrupt input, or a failed write
        return EXIT_USAGE if error.corrupt else EXIT_FAILED
    return EXIT_FAILED


def one_line(error: BaseException) -> str:
    """``error: <message>`` on one line (the first line of a long message)."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, KeyError) and error.args:
        text = str(error.args[0])
    if not isinstance(error, (EntrenarError, click.ClickException)):
        text = f"{type(error).__name__}: {text}"
    return f"error: {text}"


def _set_verbose(ctx: click.Context, _: Any, value: bool) -> bool:
    if value:
        ctx.find_root().meta["entrenar.verbose"] = True
    return value


verbose_option = click.option(
    "-v",
    "--verbose",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_set_verbose,
    help="Print tracebacks and more progress detail.",
)


def is_verbose(ctx: click.Context | None = None) -> bool:
    """Whether ``--verbose`` was given anywhere on the command line."""
    ctx = ctx or click.get_current_context(silent=True)
    return bool(ctx and ctx.find_root().meta.get("entrenar.verbose"))


class _Echo(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        click.echo(record.getMessage(), err=True)


@contextlib.contextmanager
def echo_logs() -> Iterator[None]:
    """Show entrenar's log lines (INFO and up) on stderr while a command runs.

    Once: they do not also propagate to the root logger, where importing orbax
    installs a stderr handler that printed each again as ``INFO:entrenar...:``.
    """
    logger, handler = logging.getLogger("entrenar"), _Echo()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


class Group(click.Group):
    """A click group that turns every error into one line and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; errors become ``error: ...`` and exit 1 or 2."""
        try:
            with echo_logs():
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, click.ClickException):
            raise
        except BrokenPipeError:  # the reader left (`entrenar info ... | head`)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise click.exceptions.Exit(0) from None
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            raise click.exceptions.Exit(130) from None
        except Exception as e:
            if is_verbose(ctx):
                traceback.print_exc(file=sys.stderr)
            click.echo(one_line(e), err=True)
            raise click.exceptions.Exit(exit_code(e)) from None


def _print_completion(ctx: click.Context, _: Any, shell: str | None) -> None:
    if shell is None or ctx.resilient_parsing:
        return
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # click.Choice allows only known shells
    click.echo(cls(ctx.command, {}, "entrenar", "_ENTRENAR_COMPLETE").source())
    ctx.exit(0)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="entrenar", prog_name="entrenar")
@click.option(
    "--completion",
    "--generate-completion",
    type=click.Choice(["bash", "zsh", "fish"]),
    expose_value=False,
    is_eager=True,
    callback=_print_completion,
    help="Print the shell completion script for SHELL and exit.",
)
@verbose_option
def cli() -> None:
    """Entrenar: train, fine-tune, quantize and merge models from the command line.

    Exit codes: 0 ok, 1 the run failed, 2 usage or configuration error.
    """


def command(*args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Any]:
    """``cli.command`` with ``--verbose`` added (it works after the subcommand too)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        return cli.command(*args, **kwargs)(verbose_option(fn))

    return wrap


class ModelPath(click.Path):
    """An existing model file or folder, or a named model (``smollm2``)."""

    name = "model"

    def __init__(self) -> None:
        super().__init__(exists=True)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        """The path, with a named model replaced by its file."""
        from entrenar.config.spec import named_model

        if isinstance(value, str):
            try:
                found = named_model(value, param.name if param else "model")
            except ConfigError as e:
                self.fail(str(e), param, ctx)
            if found is not None:
                return found
        return super().convert(value, param, ctx)


def parse_sets(sets: tuple[str, ...]) -> dict[str, Any]:
    """``("lora.rank=16", ...)`` as overrides; each value is parsed as YAML.

    Values are read within `entrenar.io.bounded`'s limits (nesting, aliases), as
    config files are.
    """
    from entrenar.io.bounded import parse_yaml

    out: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--set")
        try:
            out[key.strip()] = parse_yaml(value, key.strip(), error=ConfigError)
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint="--set") from None
    return out


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``entrenar`` console script and ``python -m entrenar``."""
    cli.main(args=argv, prog_name="entrenar")


__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "ModelPath",
    "cli",
    "command",
    "echo_logs",
    "exit_code",
    "is_verbose",
    "main",
    "one_line",
]
