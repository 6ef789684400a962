"""argparse value types that reject what makes no sense, and a help formatter that shows defaults.

A bad value becomes argparse's usage error (exit code 2), e.g.
`error: argument -b/--batch-size: expected a positive integer, got '0'`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def _checked(parse, ok, what: str):
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    convert.__name__ = what
    return convert


positive_int = _checked(int, lambda v: v > 0, "a positive integer")
nonnegative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
nonnegative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
fraction = _checked(float, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
step_count = _checked(int, lambda v: v > 0 or v == -1, "a positive number of steps, or -1 for one epoch")
FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
flag = _checked(lambda text: FLAGS.get(text.lower()), lambda v: v is not None, "1 or 0")
# a model or checkpoint argument: the path must exist (an hf: prefix is allowed)
existing_path = _checked(lambda text: text, lambda v: Path(v.removeprefix("hf:")).exists(),
                         "a file or folder that exists")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and each option's default; an option whose default is None
    states its default in its own help (e.g. one that depends on the device)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
