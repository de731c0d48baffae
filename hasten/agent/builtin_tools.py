"""Tools hasten ships, by name in generation.tools: `calculator` and `python`.

calculator  arithmetic on numbers with + - * / // % ** and parentheses, read with
            Python's ast (never eval): anything else is an error string for the model.
            Its work is bounded before it is done: the expression's length bounds the
            number of operations, and no integer operand or result may pass MAX_BITS
            (a power's size is estimated from log2 of its base times its exponent, a
            product's from its factors' sizes), so `(((9**99)**99)**99)**4` is refused
            in microseconds instead of holding the GIL, and every trainer thread, for
            seconds. Both run in the trainer's process, whatever generation.tool_isolation
            says: they are bounded, and `python` already runs its code elsewhere.
python      runs the model's code in hasten's hardened sandbox (hasten/sandbox: its
            own namespaces, rlimits and seccomp, docs/sandbox.md), never in the
            trainer's process; returns what it printed (64 KiB per stream at most, the
            sandbox's output_bytes), or the error it ended with.
"""

from __future__ import annotations

import ast
import math
import operator
import threading

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPRESSION = 1000  # characters; with MAX_BITS it bounds a call's time (a few hundred small operations)
MAX_BITS = 4096  # any integer operand or result (about 1233 digits), checked before the operation runs


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "347 * 5821".

    Args:
        expression: Numbers with + - * / // % ** and parentheses.
    """
    if not isinstance(expression, str):
        return "error: the expression must be a string"
    if len(expression) > MAX_EXPRESSION:
        return f"error: the expression is longer than {MAX_EXPRESSION} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:  # a float past 1.8e308, or an integer too large to turn into one
        return "error: the result is too large"
    except RecursionError:
        return "error: the expression is nested too deeply"
    except (SyntaxError, ValueError, TypeError) as error:  # ValueError: a literal past Python's 4300 digits too
        return f"error: {error}" if str(error) else "error: not an arithmetic expression"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _check_size(node.op, left, right)
        return _bounded(OPERATORS[type(node.op)](left, right))
    raise ValueError("not an arithmetic expression (numbers, + - * / // % ** and parentheses only)")


def _check_size(op: ast.operator, left, right) -> None:
    """Refuse an operation whose integer result would pass MAX_BITS, before Python spends the time on it."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return  # a float result overflows (OverflowError) or saturates at once: no time spent
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > MAX_BITS:
        raise ValueError(f"the result would have more than {MAX_BITS} bits")
    if isinstance(op, ast.Mult) and left.bit_length() + right.bit_length() > MAX_BITS + 1:
        raise ValueError(f"the result would have more than {MAX_BITS} bits")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"a number has more than {MAX_BITS} bits")
    return value


# The deadline of the call running on this thread, set by tools.ToolRunner for hasten's own tools: the
# python tool's sandbox job ends with its call, instead of running on to its wall clock while holding a
# sandbox worker (and a trainer thread) after the model was told the call timed out.
_call = threading.local()


def set_call_deadline(deadline: float | None) -> None:
    """The running call's end (time.monotonic()) on this thread; None: no deadline."""
    _call.deadline = deadline


def python(code: str) -> str:
    """Run Python code in an isolated sandbox and return what it printed.

    Args:
        code: A Python program; use print() to see values.
    """
    from ..sandbox import assert_program, shared_sandbox

    result = shared_sandbox().run(code, assert_program(["pass"], where="the python tool"),
                                  deadline=getattr(_call, "deadline", None))
    output = (result.stdout + result.stderr).strip()
    if result.status in ("pass", "fail") and result.loaded:
        return output or "(no output)"
    return f"{output}\nerror: {result.reason or result.status}".strip()


BUILTIN_TOOLS = {"calculator": calculator, "python": python}
