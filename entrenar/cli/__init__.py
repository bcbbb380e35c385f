"""The ``entrenar`` command: a thin click layer over `entrenar.runs` and the library.

Subcommands: ``train``, ``validate``, ``info``, ``quantize``, ``merge``, ``generate``,
``chat``, ``serve``, ``eval``, ``plot`` (``entrenar COMMAND --help`` for each). Exit
codes: 0 ok, 1 the run failed, 2 usage or configuration error; errors print one line
unless ``--verbose``.
Not imported by ``import entrenar``.
"""

from entrenar.cli import decode_cmds as _decode_cmds  # generate, chat, serve
from entrenar.cli import inspect as _inspect  # registers validate, info
from entrenar.cli import model_cmds as _model_cmds  # quantize, merge
from entrenar.cli import run_cmds as _run_cmds  # registers train, eval, plot
from entrenar.cli.app import EXIT_FAILED, EXIT_OK, EXIT_USAGE, cli, main

del _decode_cmds, _inspect, _model_cmds, _run_cmds

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "cli", "main"]
