"""`sloserve serve --config FILE.yaml`: a command's flags read from a YAML file, as vLLM's
`vllm serve --config` reads them.

The file is a mapping of flag names (`max-num-seqs`, or `max_num_seqs`) to values: a scalar is
the flag's value, a list its values (`served-model-name: [a, b]`), `true` turns a switch on
(`false` leaves it off). `model` is the model folder, as `sloserve serve MODEL` takes it. The
file's flags go before the command line's, so a flag given on the command line wins (argparse
keeps the last value). A key that names no flag of the command, a value a switch cannot take
and a file that is not a mapping are errors that name what is wrong.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    pass


def config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """The ``--config`` path in ``argv`` (``--config PATH`` or ``--config=PATH``), and ``argv``
    without it."""
    rest: list[str] = []
    path: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == CONFIG_FLAG:
            if i + 1 >= len(argv):
                raise ConfigFileError(f"{CONFIG_FLAG} needs a file")
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith(CONFIG_FLAG + "="):
            path = arg[len(CONFIG_FLAG) + 1:]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def flags_from_file(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line arguments the YAML file at ``path`` stands for, checked against
    ``parser``'s flags."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: {exc.strerror or exc}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{CONFIG_FLAG} {path} is not YAML: {exc}") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigFileError(f"{CONFIG_FLAG} {path} must hold a mapping of flag names to "
                              f"values, not a {type(values).__name__}")
    options = _options(parser)
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        action = options.get(flag)
        if action is None or flag == CONFIG_FLAG:
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: {key!r} is not a flag of this command "
                                  f"(see --help)")
        flags += _arguments(flag, value, action, path)
    return flags


def _arguments(flag: str, value: Any, action: argparse.Action, path: str) -> list[str]:
    if action.nargs == 0:  # a switch (store_true and the like)
        if not isinstance(value, bool):
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: {flag[2:]} is a switch: give true or "
                                  f"false, not {value!r}")
        return [flag] if value else []
    if value is None:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: {flag[2:]} has no value")
    if isinstance(value, list):
        if action.nargs in (None, "?"):  # one value: a list repeats an appending flag
            if not isinstance(action, argparse._AppendAction):
                raise ConfigFileError(f"{CONFIG_FLAG} {path}: {flag[2:]} takes one value, "
                                      f"not a list")
            return [part for item in value for part in (flag, _text(item))]
        return [flag, *map(_text, value)]
    return [flag, _text(value)]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        import json

        return json.dumps(value)
    return str(value)


def expand_config(argv: list[str], parser: argparse.ArgumentParser,
                  commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    """``argv`` with a ``--config FILE`` replaced by the flags the file holds, placed before
    the command line's own (which therefore win). Only the commands in ``commands`` take it."""
    if not argv or argv[0] not in commands:
        return argv
    path, rest = config_path(argv[1:])
    if path is None:
        return argv
    return [argv[0], *flags_from_file(path, commands[argv[0]]), *rest]
