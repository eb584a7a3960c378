"""What SGLang 0.5.19's ``launch_server`` parser makes of a server's arguments.

``python -m sglang.launch_server`` reads its flags with a standard argparse parser built by
``ServerArgs.add_cli_args`` (``prepare_server_args``): any unambiguous prefix of a flag
counts (``--use-ra`` is ``--use-ray``), and ``--config FILE`` expands a YAML file into
flags (``ConfigArgumentMerger``). Checking argument strings alone misses both, so the
checks ask the same parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["flags_set"]


class _Parser(argparse.ArgumentParser):
    """SGLang's parser, raising instead of exiting on arguments it refuses."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def flags_set(extra: Sequence[str], flags: Sequence[str]) -> list[str]:
    """The boolean ``flags`` (``--use-ray``...) SGLang's parser sets from the server
    arguments ``extra``: spelled out, abbreviated or from a ``--config`` file. None where
    SGLang cannot parse them (its own start reports that)."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang serve", add_help=False)
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "-", *extra]
    try:
        if "--config" in argv:
            from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        parsed: Any
        parsed, _ = parser.parse_known_args(argv)
    except (ValueError, OSError, argparse.ArgumentError):
        return []
    return [f for f in flags if getattr(parsed, f.removeprefix("--").replace("-", "_"), False)]
