"""Tools hasten ships, by name in generation.tools: `calculator` and `python`.

calculator  arithmetic on numbers with + - * / // % ** and parentheses, read with
            Python's ast (never eval): anything else is an error string for the model.
python      runs the model's code in hasten's hardened sandbox (hasten/sandbox: its
            own namespaces, rlimits and seccomp, docs/sandbox.md), never in the
            trainer's process; returns what it printed, or the error it ended with.
"""

from __future__ import annotations

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT = 100  # 10**100 is fine; 9**9**9 would hold the trainer's thread for minutes


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "347 * 5821".

    Args:
        expression: Numbers with + - * / // % ** and parentheses.
    """
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError) as error:
        return f"error: {error}" if str(error) else "error: not an arithmetic expression"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError("not an arithmetic expression (numbers, + - * / // % ** and parentheses only)")


def python(code: str) -> str:
    """Run Python code in an isolated sandbox and return what it printed.

    Args:
        code: A Python program; use print() to see values.
    """
    from ..sandbox import assert_program, shared_sandbox

    result = shared_sandbox().run(code, assert_program(["pass"], where="the python tool"))
    output = (result.stdout + result.stderr).strip()
    if result.status in ("pass", "fail") and result.loaded:
        return output or "(no output)"
    return f"{output}\nerror: {result.reason or result.status}".strip()


BUILTIN_TOOLS = {"calculator": calculator, "python": python}
