"""argparse value types that reject what makes no sense, a parser that hints at `--lr=-1e-3` where a
value starting with `-` was taken for an option, a help formatter that shows defaults, and the one-line
refusal of a program run where what it needs is missing (a package, a GPU).

A bad value becomes argparse's usage error (exit code 2), e.g.
`error: argument -b/--batch-size: expected a positive integer, got '0'`.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path
from typing import NoReturn

from .cuda import cuda_unavailable


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
# --resume's value: llm.c's -y 1 / 0, or auto (continue where there is a checkpoint, else start anew)
RESUME_FORMS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "auto": "auto"}
resume_mode = _checked(lambda text: RESUME_FORMS.get(text.lower()), lambda v: v is not None, "1, 0 or auto")
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


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser without its abbreviations (--resum is not --resume: an unknown option is an error);
    where an option's value starts with '-' (-l -1e-3) and was taken for an option, the error says how to
    write it (-l=-1e-3)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message):
        if message.startswith("argument ") and message.endswith(": expected one argument"):
            names = message.removeprefix("argument ").split(":")[0].split("/")  # "-l/--lr"
            for option, value in zip(self._argv, self._argv[1:]):
                if option in names and value.startswith("-"):
                    message += f" (if {value} is its value, write {option}={value})"
                    break
        super().error(message)


INSTALL = {"torch": "python3 -m pip install torch",
           "pycuda": 'python3 -m pip install -e ".[cuda]" on a machine with an NVIDIA GPU and the CUDA toolkit'}


def require(program: str, modules: tuple[str, ...] = (), gpu: bool = False) -> None:
    """Exit with code 2 and one line when `program` cannot run here: one of `modules` does not import, or
    (gpu) no CUDA GPU is usable through pycuda. Called after the arguments are parsed, so --help works anywhere."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            refuse(f"{program} needs {module}, which does not import here ({e}); install it with {INSTALL[module]}")
    why = cuda_unavailable() if gpu else None
    if why:
        refuse(f"{program} needs a CUDA GPU through pycuda, and none is usable here ({why}); for pycuda: "
               f"{INSTALL['pycuda']}")


def refuse(message: str) -> NoReturn:
    """One `error:` line on stderr and exit code 2, a user's or a machine's mistake as the trainer reports it."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
