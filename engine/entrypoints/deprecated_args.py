"""Old spellings of renamed command-line flags, kept working for one release.

Each old flag is a hidden argument with the new flag's destination, type and choices: it parses
exactly as the new one does, and using it logs a deprecation warning that names the new flag.
The flags and the release that drops them are listed in README.md ("Deprecated names").
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger(__name__)


class _DeprecatedStore(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, *, new_flag: str,
                 **kwargs: Any) -> None:
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        logger.warning("%s is deprecated and will be removed in the next release; use %s",
                       option_string, self.new_flag)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(group: Any, old_flag: str, new: argparse.Action) -> None:
    """Registers ``old_flag`` as a hidden, deprecated spelling of the argument ``new`` (the
    object ``add_argument`` returned for the new flag)."""
    group.add_argument(old_flag, dest=new.dest, type=new.type, choices=new.choices,
                       metavar=new.metavar, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                       action=_DeprecatedStore, new_flag=new.option_strings[0])


# `LLM(...)` keyword arguments renamed (old -> new), kept working for one release.
RENAMED_ENGINE_KWARGS = {
    "mid_forward_preemption": "slo_preemption",
    "preempt_policy": "slo_preempt_policy",
    "preempt_margin": "slo_preempt_margin",
    "preempt_min_tokens": "slo_preempt_min_tokens",
}


def rename_deprecated_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each old keyword replaced by its new name (a warning logged for each);
    giving both spellings of one argument is an error."""
    out = dict(kwargs)
    for old, new in RENAMED_ENGINE_KWARGS.items():
        if old in out:
            if new in out:
                raise TypeError(f"got both {old!r} (deprecated) and {new!r}")
            logger.warning("the engine argument %r is deprecated and will be removed in the "
                           "next release; use %r", old, new)
            out[new] = out.pop(old)
    return out
