"""`report.expect`: the orderings a preset states and `dpbench-report --check` asserts, e.g.
"grape >= dpadam - 5" or "grape.per_sample_grad_mib < 0.5 * dpadam.per_sample_grad_mib".
A name is a method: the algorithm, with its per-example engine appended when that is not the
default (`dpadam` materialises per-example gradients, `dpadam_ghost`, `dpadam_bk`).

Expressions are parsed with `ast` and evaluated by a small walker that allows only algorithm
names, `.quantity`, numbers, + - * / and comparisons (never Python's eval: presets are data).
"""

from __future__ import annotations

import ast
import operator
from collections import defaultdict

from dpbench.errors import UserError
from dpbench.tools.report.formatting import fmt_eps
from dpbench.tools.report.groups import Group, cells
from dpbench.tools.report.load import MIB, method_name

QUANTITIES = {
    "accuracy": None,   # the chosen metric, in %
    "final": "final", "best": "best",
    "peak_mib": "peak_mib", "run_mib": "run_mib", "own_mib": "own_mib", "samples_per_s": "samples_per_s", "epsilon": "epsilon",
    "per_sample_grad_mib": "per_sample_grad_bytes", "optimizer_state_mib": "optimizer_state_bytes",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


def evaluate(expression: str, cell: list[Group], metric: str) -> tuple[bool, str]:
    """Evaluate e.g. 'grape >= dpadam - 5' or 'grape.per_sample_grad_mib < 0.5 * dpadam.per_sample_grad_mib'.
    A bare algorithm name is its mean accuracy (the report's metric, %)."""
    by_algo: dict[str, list[Group]] = defaultdict(list)
    for g in cell:
        by_algo[method_name(g.first)].append(g)
    shown: list[str] = []

    def value(algo: str, quantity: str) -> float:
        if algo not in by_algo:
            raise KeyError(algo)
        if len(by_algo[algo]) > 1:
            raise UserError(f"report.expect {expression!r}: {algo} has {len(by_algo[algo])} different settings here; make the grid unambiguous")
        g = by_algo[algo][0]
        if quantity not in QUANTITIES:
            raise UserError(f"report.expect {expression!r}: unknown quantity {quantity!r}; use {', '.join(QUANTITIES)}")
        name = QUANTITIES[quantity] or metric
        mean = g.mean(name)
        if mean is None:
            raise KeyError(f"{algo}.{quantity}")
        scaled = 100 * mean if name in ("final", "best") else (mean / MIB if name.endswith("_bytes") else mean)
        shown.append(f"{algo}.{quantity}={scaled:.4g}" if quantity != "accuracy" else f"{algo}={scaled:.4g}")
        return scaled

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name):
            return value(node.id, "accuracy")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return value(node.value.id, node.attr)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Compare) and all(type(op) in _OPS for op in node.ops):
            left, ok = walk(node.left), True
            for op, right_node in zip(node.ops, node.comparators):
                right = walk(right_node)
                ok, left = ok and _OPS[type(op)](left, right), right
            return ok
        raise UserError(f"report.expect {expression!r}: only algorithm names, .quantity, numbers, + - * / and comparisons are allowed")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise UserError(f"report.expect {expression!r} is not an expression: {error.msg}") from None
    outcome = walk(tree)
    if not isinstance(outcome, bool):
        raise UserError(f"report.expect {expression!r} must be a comparison, e.g. 'grape >= dpadam - 5'")
    return outcome, ", ".join(shown)


def check(groups: list[Group], metric: str) -> tuple[bool, list[str]]:
    """Every stated ordering in every cell where all its algorithms ran. Fails when none could be evaluated."""
    expectations = list(dict.fromkeys(e for g in groups for e in (g.first.report.get("expect") or [])))
    if not expectations:
        return False, ["no report.expect in these runs' configs: nothing to check (run a *_mini preset)"]
    lines, evaluated, passed = [], 0, True
    for where, cell in cells(groups).items():
        budget = "" if where[3] is None else f" compute budget {where[3]:g}"
        label = f"{where[0]}/{where[1]} batch {where[2]}{budget} ε={fmt_eps(where[4])}"
        for expression in expectations:
            try:
                ok, shown = evaluate(expression, cell, metric)
            except KeyError as missing:
                lines.append(f"  skipped  {expression}  [{label}]: no runs of {missing.args[0]} here")
                continue
            evaluated += 1
            passed &= ok
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {expression}  [{label}]: {shown}")
    if evaluated == 0:
        return False, lines + ["no stated ordering could be evaluated (missing algorithms?)"]
    return passed, lines
