"""What every megalite command line shares: a parser whose mistakes are one-line UserErrors, the
wrapper that turns a tool's UserError into one ``error: ...`` line and exit code 1, and the value types
its flags use (finite, range-checked when parsed)."""
from __future__ import annotations

import argparse
import ast
import functools
import math
import sys
from typing import Callable

from megalite.errors import UserError


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises UserError (one line) instead of printing usage and exiting 2.
    pretrain_gpt.py and the tools/ command lines all use it, so every entry point reports mistakes the
    same way."""

    def error(self, message: str):
        raise UserError(f"{' '.join(message.split())} (see python {self.prog} --help)")


def one_line_errors(main: Callable[..., int]) -> Callable[..., int]:
    """A tool's ``main(argv=None) -> exit code``, with every UserError it raises (a bad, missing or unknown
    flag, a missing input file) printed as one line ``error: ...`` on stderr and exit code 1."""
    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return 1
    return run


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def number(text: str) -> float:
    """A finite number: nan and inf would slip through every later range check (nan > 0 is False)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_int(text: str) -> int:
    value = integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def moe_layer_pattern(text: str):
    """--moe-layer-freq: an int N (every N-th layer), or a 0/1 list written as Megatron's Python expression
    of list literals, * and + (e.g. "([0]*3+[1]*29)"), evaluated without eval."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            left, right = value(node.left), value(node.right)
            return left * right if isinstance(node.op, ast.Mult) else left + right
        raise ValueError(text)
    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f'expected an int or a list such as "([0]*3+[1]*29)", got {text!r}') from None
    if isinstance(result, int) and result > 0:
        return result
    if isinstance(result, list) and result and all(v in (0, 1) for v in result):
        return result
    raise argparse.ArgumentTypeError(f"expected a positive int or a list of 0/1 per layer, got {text!r}")


def window_pair(text: str) -> list[int]:
    """--window-size as Megatron writes it: "LEFT,RIGHT" (or "(LEFT,RIGHT)"), each >= 0 or -1 (unbounded);
    [LEFT, RIGHT], a list as a checkpoint's JSON metadata gives it back."""
    try:
        left, right = (int(v) for v in text.strip().strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected "LEFT,RIGHT" such as "4095,0", got {text!r}') from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"each side must be >= 0, or -1 for unbounded; got {text!r}")
    return [left, right]
