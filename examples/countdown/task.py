"""The countdown task: numbers (3–4 of 1..100) and a target; answer an arithmetic expression in ``<answer>…</answer>``.

Reward (``docs/design.md`` §7, as in the public Countdown-Tasks-3to4 setups): 0 with no answer tag; 0.1 when the
tag is there but the expression is invalid, uses other numbers, or misses the target; 1.0 when it uses each given
number exactly once and evaluates to the target within 1e-5. The generator is seeded and only emits solvable problems
(checked by the exhaustive solver), which also writes the SFT warm-start answers.
"""

from __future__ import annotations

import ast
import itertools
import operator
import random
import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Problem", "format_prompt", "generate_problems", "reward", "solve"]

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]
    target: int
    solution: str


def solve(numbers: tuple[int, ...], target: int) -> str | None:
    """An expression using every number once with + - * / that equals ``target`` (exact rationals), or ``None``."""

    def rec(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, ea), (b, eb) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            for sym, fn in _OPS.items():
                if sym in "+*" and i > j:
                    continue
                if sym == "/" and b == 0:
                    continue
                found = rec(rest + [(fn(a, b), f"({ea}{sym}{eb})")])
                if found:
                    return found
        return None

    expr = rec([(Fraction(n), str(n)) for n in numbers])
    return expr[1:-1] if expr and expr.startswith("(") and expr.endswith(")") else expr


def _random_expression(nums: list[int], rng: random.Random, ops: str = "+-*/") -> tuple[int, str] | None:
    """Combine all numbers with random ops (from ``ops``), keeping every intermediate a positive integer."""
    items = [(n, str(n)) for n in nums]
    rng.shuffle(items)
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ea), (b, eb) = items[i], items[j]
        op = rng.choice(ops)
        if op == "-" and a <= b or op == "/" and a % b != 0:
            op = "+"
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        items = [items[k] for k in range(len(items)) if k not in (i, j)] + [(value, f"({ea}{op}{eb})")]
    value, expr = items[0]
    return (value, expr[1:-1]) if 1 <= value <= 100 else None


def generate_problems(
    n: int,
    seed: int,
    max_number: int = 100,
    counts: tuple[int, ...] = (3, 4),
    ops: str = "+-*/",
    exclude: set[tuple[tuple[int, ...], int]] | frozenset = frozenset(),
) -> list[Problem]:
    """``n`` problems, deterministic for a seed: ``counts`` numbers (one of them, uniformly) in ``1..max_number`` and a
    target in ``1..100`` reached by a random expression over all of them with ``ops`` (``-`` and ``/`` only where the
    result stays a positive integer, else ``+``), so every problem is solvable; that expression is the SFT answer.
    ``exclude``: ``(numbers, target)`` pairs never emitted (a held-out set's)."""
    rng = random.Random(seed)
    out: list[Problem] = []
    while len(out) < n:
        nums = [rng.randint(1, max_number) for _ in range(rng.choice(counts))]
        made = _random_expression(list(nums), rng, ops)
        if made is not None and (tuple(nums), made[0]) not in exclude:
            out.append(Problem(tuple(nums), made[0], made[1]))
    return out


def format_prompt(p: Problem) -> str:
    """The text the model continues: numbers, target, then the opening of its answer."""
    return f"{' '.join(map(str, p.numbers))}={p.target}:"


def _eval(expr: str) -> Fraction:
    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
            a, b = ev(node.left), ev(node.right)
            return (
                {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(node.op))
                if not isinstance(node.op, ast.Div)
                else a / b
            )
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        raise ValueError("not an arithmetic expression")

    return ev(ast.parse(expr, mode="eval"))


def _numbers_in(expr: str) -> list[int]:
    return sorted(int(x) for x in re.findall(r"\d+", expr))


def reward(completion: str, p: Problem) -> float:
    """0 / 0.1 / 1.0 as described in the module docstring."""
    m = _ANSWER.search(completion)
    if not m:
        return 0.0
    expr = m.group(1).strip()
    if not re.fullmatch(r"[\d+\-*/() ]+", expr) or _numbers_in(expr) != sorted(p.numbers):
        return 0.1
    try:
        value = _eval(expr)
    except (ValueError, ZeroDivisionError, SyntaxError, RecursionError):
        return 0.1
    return 1.0 if abs(float(value) - p.target) < 1e-5 else 0.1
