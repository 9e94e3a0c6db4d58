"""Assertion test code judged outside the sandbox: the test's expected values stay here, only the
program's values come out.

Test code such as MBPP's ``assert add(1, 2) == 3`` used to run in the program's interpreter,
where the program decides what ``==``, ``abs`` or the driver's own functions do (an object
equal to everything, a frame walk to the driver's token, a shadowed ``abs``, a replaced
``traceback.print_exc``: each scored 1.0 against a failing test). :func:`assertion_checks` splits
such test code into :class:`Check`\\ s: the *value* side of each assertion (``add(1, 2)``), which
runs in the sandbox after the program, and the *expected* side (``3``), evaluated here from the
test's own text. The sandbox's driver (:data:`DRIVER`) prints each value as JSON of plain data
(:data:`ENCODER`); :func:`decode` turns it back into Python values of the builtin types and
:meth:`Check.passes` compares them here, with Python's own semantics (``(1, 2) != [1, 2]``,
``1 == 1.0``, ``{1, 2} == {2, 1}``).

What is understood (anything else returns None, and the caller runs the test code in the
program's interpreter as before, with the weaknesses ``docs/code-sandbox.md`` lists):

- statements: ``assert TEST[, message]``, ``import``/``from ... import``, docstrings, ``pass``,
  an assignment of a literal to an upper-case name (HumanEval's ``METADATA``), and HumanEval's
  ``def check(candidate): <those statements>`` followed by one ``check(name)``;
- ``TEST``: ``VALUE <op> EXPECTED`` or ``EXPECTED <op> VALUE`` for ``== != < <= > >= in not in``
  (``is``/``is not`` with ``True``, ``False``, ``None``); ``abs(VALUE - EXPECTED) < TOLERANCE``
  (``<=``, ``math.fabs``, either order of the subtraction); ``math.isclose(VALUE, EXPECTED, ...)``;
  ``VALUE`` and ``not VALUE``; ``A and B`` of those;
- ``EXPECTED``: literals, and the builtins of :data:`EXPECTED_BUILTINS`, arithmetic and ``math``
  constants applied to them: evaluated here without ``eval``;
- ``VALUE``: any expression without a comparison (a comparison inside would run in the
  program's interpreter again).
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

EXPECTED_BUILTINS: dict[str, Callable[..., Any]] = {
    function.__name__: function
    for function in (
        abs,
        bool,
        bytes,
        complex,
        dict,
        float,
        frozenset,
        int,
        len,
        list,
        max,
        min,
        range,
        round,
        set,
        sorted,
        str,
        sum,
        tuple,
    )
}
"""Functions an expected value may apply to literals (MBPP writes ``set((4, 5))``)."""

_COMPARISONS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda left, right: left in right,
    ast.NotIn: lambda left, right: left not in right,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_ARITHMETIC: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class _NotExpected(Exception):
    """The expression is not an expected value this module can evaluate."""


@dataclass(frozen=True)
class Check:
    """One assertion: ``expression`` (the value side) runs in the sandbox; the rest is here."""

    expression: str
    kind: str
    """``compare`` (``value <operation> expected``, or ``expected <operation> value`` when not
    ``value_first``), ``truth`` (``bool(value) == expected``), ``distance`` (``abs(value -
    expected) <operation> tolerance``) or ``isclose`` (``math.isclose(value, expected,
    **options)``)."""
    operation: Callable[[Any, Any], bool] = operator.eq
    expected: Any = None
    value_first: bool = True
    tolerance: Any = None
    options: dict[str, Any] = field(default_factory=dict)

    def passes(self, value: Any) -> bool:
        """Whether the assertion holds for ``value`` (plain data from :func:`decode`); an error
        comparing them (a type mismatch, a value too deep) is a failed assertion."""
        try:
            if self.kind == "compare":
                if self.value_first:
                    return bool(self.operation(value, self.expected))
                return bool(self.operation(self.expected, value))
            if self.kind == "truth":
                return bool(value) is self.expected
            if self.kind == "distance":
                return bool(self.operation(abs(value - self.expected), self.tolerance))
            if self.kind == "isclose":
                return math.isclose(value, self.expected, **self.options)
        except (ArithmeticError, TypeError, ValueError, RecursionError):
            return False
        raise AssertionError(f"unknown check kind {self.kind!r}")


@dataclass(frozen=True)
class AssertionTests:
    """Test code as :func:`assertion_checks` understood it."""

    setup: str
    """The test's import lines, run in the sandbox before the values are computed."""
    checks: list[Check]


def assertion_checks(test_code: str) -> Optional[AssertionTests]:
    """``test_code`` as checks judged outside (module docstring), or None when it holds anything
    this module does not understand (it then runs in the program's interpreter)."""
    try:
        module = ast.parse(test_code)
    except (SyntaxError, ValueError):
        return None
    statements = list(module.body)
    # HumanEval: def check(candidate): ... then check(entry_point), with candidate renamed.
    checkers = [node for node in statements if isinstance(node, ast.FunctionDef)]
    if checkers:
        body = _humaneval_body(statements, checkers)
        if body is None:
            return None
        statements = body
    setup: list[str] = []
    checks: list[Check] = []
    for statement in statements:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            setup.append(ast.unparse(statement))
        elif isinstance(statement, ast.Assert):
            found = _checks_of(statement.test)
            if found is None:
                return None
            checks += found
        elif not _ignorable(statement):
            return None
    if not checks:
        return None
    return AssertionTests(setup="\n".join(setup), checks=checks)


def _humaneval_body(
    statements: list[ast.stmt], checkers: list[ast.FunctionDef]
) -> Optional[list[ast.stmt]]:
    """The statements of HumanEval's ``def check(candidate)`` with ``candidate`` renamed to the
    function that the one top-level ``check(name)`` passes, plus the module's other
    statements; None for anything else."""
    if len(checkers) != 1:
        return None
    checker = checkers[0]
    arguments = checker.args
    if (
        len(arguments.args) != 1
        or arguments.vararg
        or arguments.kwarg
        or arguments.kwonlyargs
        or arguments.posonlyargs
        or checker.decorator_list
    ):
        return None
    calls = [
        node
        for node in statements
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == checker.name
    ]
    if len(calls) != 1:
        return None
    call = calls[0].value
    if len(call.args) != 1 or call.keywords or not isinstance(call.args[0], ast.Name):
        return None
    parameter, entry_point = arguments.args[0].arg, call.args[0].id

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:
            if node.id == parameter:
                return ast.copy_location(ast.Name(id=entry_point, ctx=node.ctx), node)
            return node

    body = [Rename().visit(statement) for statement in checker.body]
    rest = [node for node in statements if node is not checker and node is not calls[0]]
    return rest + body


def _ignorable(statement: ast.stmt) -> bool:
    """A docstring, ``pass``, or a literal assigned to an upper-case name (``METADATA``)."""
    if isinstance(statement, ast.Pass):
        return True
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return True
    if isinstance(statement, ast.Assign) and all(
        isinstance(target, ast.Name) and target.id.isupper() for target in statement.targets
    ):
        try:
            ast.literal_eval(statement.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False
        return True
    return False


def _checks_of(test: ast.expr) -> Optional[list[Check]]:
    """The checks of one assertion's test, or None."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        checks: list[Check] = []
        for value in test.values:
            found = _checks_of(value)
            if found is None:
                return None
            checks += found
        return checks
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        value = _value_source(test.operand)
        return None if value is None else [Check(value, "truth", expected=False)]
    if isinstance(test, ast.Compare):
        check = _comparison(test)
        return None if check is None else [check]
    if isinstance(test, ast.Call) and _is_isclose(test.func):
        check = _isclose(test)
        return None if check is None else [check]
    value = _value_source(test)
    return None if value is None else [Check(value, "truth", expected=True)]


def _comparison(test: ast.Compare) -> Optional[Check]:
    if len(test.ops) != 1:
        return None
    left, operation, right = test.left, test.ops[0], test.comparators[0]
    distance = _distance(left, operation, right)
    if distance is not None:
        return distance
    compare = _COMPARISONS.get(type(operation))
    if compare is None:
        return None
    for value_side, expected_side, value_first in ((left, right, True), (right, left, False)):
        try:
            expected = expected_value(expected_side)
        except _NotExpected:
            continue
        if isinstance(operation, (ast.Is, ast.IsNot)) and not isinstance(
            expected, (bool, type(None))
        ):
            return None  # identity with anything else cannot survive serialisation
        value = _value_source(value_side)
        if value is None:
            return None
        return Check(value, "compare", compare, expected, value_first=value_first)
    return None


def _distance(left: ast.expr, operation: ast.cmpop, right: ast.expr) -> Optional[Check]:
    """``abs(VALUE - EXPECTED) < TOLERANCE`` (``<=``; ``math.fabs``; either subtraction)."""
    if not isinstance(operation, (ast.Lt, ast.LtE)):
        return None
    if not (isinstance(left, ast.Call) and len(left.args) == 1 and not left.keywords):
        return None
    function = left.func
    is_abs = isinstance(function, ast.Name) and function.id == "abs"
    is_fabs = (
        isinstance(function, ast.Attribute)
        and function.attr == "fabs"
        and isinstance(function.value, ast.Name)
        and function.value.id == "math"
    )
    difference = left.args[0]
    if not (is_abs or is_fabs) or not (
        isinstance(difference, ast.BinOp) and isinstance(difference.op, ast.Sub)
    ):
        return None
    try:
        tolerance = expected_value(right)
    except _NotExpected:
        return None
    for value_side, expected_side in (
        (difference.left, difference.right),
        (difference.right, difference.left),
    ):
        try:
            expected = expected_value(expected_side)
        except _NotExpected:
            continue
        value = _value_source(value_side)
        if value is None:
            return None
        return Check(
            value, "distance", _COMPARISONS[type(operation)], expected, tolerance=tolerance
        )
    return None


def _is_isclose(function: ast.expr) -> bool:
    if isinstance(function, ast.Name):
        return function.id == "isclose"
    return (
        isinstance(function, ast.Attribute)
        and function.attr == "isclose"
        and isinstance(function.value, ast.Name)
        and function.value.id == "math"
    )


def _isclose(test: ast.Call) -> Optional[Check]:
    if len(test.args) != 2 or any(keyword.arg is None for keyword in test.keywords):
        return None
    try:
        options = {keyword.arg: expected_value(keyword.value) for keyword in test.keywords}
    except _NotExpected:
        return None
    if not set(options) <= {"rel_tol", "abs_tol"}:
        return None
    first, second = test.args
    for value_side, expected_side in ((first, second), (second, first)):
        try:
            expected = expected_value(expected_side)
        except _NotExpected:
            continue
        value = _value_source(value_side)
        if value is None:
            return None
        return Check(value, "isclose", expected=expected, options=options)
    return None


def _value_source(node: ast.expr) -> Optional[str]:
    """The source of a value side, or None if it compares inside (which would run in the
    program's interpreter) or is an expected value itself (nothing of the program in it)."""
    if any(isinstance(child, ast.Compare) for child in ast.walk(node)):
        return None
    try:
        expected_value(node)
    except _NotExpected:
        return ast.unparse(node)
    return None


def expected_value(node: ast.expr) -> Any:
    """The value of an expected side, evaluated here without ``eval``: literals, containers of
    expected values, :data:`EXPECTED_BUILTINS` and arithmetic applied to them, ``math``'s
    constants. Raises ``_NotExpected`` for anything else (a name of the program, a call of
    anything else)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [expected_value(item) for item in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {
            expected_value(key): expected_value(value) for key, value in zip(node.keys, node.values)
        }
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
        operand = expected_value(node.operand)
        return _evaluate(
            {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}[type(node.op)],
            operand,
        )
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _evaluate(
            _ARITHMETIC[type(node.op)], expected_value(node.left), expected_value(node.right)
        )
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "math"
        and node.attr in ("pi", "e", "tau", "inf", "nan")
    ):
        return getattr(math, node.attr)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in EXPECTED_BUILTINS
        and not any(isinstance(argument, ast.Starred) for argument in node.args)
        and all(keyword.arg is not None for keyword in node.keywords)
    ):
        arguments = [expected_value(argument) for argument in node.args]
        keywords = {keyword.arg: expected_value(keyword.value) for keyword in node.keywords}
        return _evaluate(EXPECTED_BUILTINS[node.func.id], *arguments, **keywords)
    raise _NotExpected(ast.unparse(node))


def _evaluate(function: Callable[..., Any], *arguments: Any, **keywords: Any) -> Any:
    if function is operator.pow and isinstance(arguments[1], int) and abs(arguments[1]) > 4096:
        # The tests are trusted, but an exponent like this would stall the trainer, not the
        # sandbox: leave it to the sandbox's interpreter.
        raise _NotExpected("exponent too large to evaluate outside the sandbox")
    try:
        return function(*arguments, **keywords)
    except (ArithmeticError, TypeError, ValueError) as error:
        raise _NotExpected(str(error)) from None


# --------------------------------------------------------------------------------------------
# The values' way out: encoded in the sandbox, decoded here
# --------------------------------------------------------------------------------------------

ENCODER = r"""
def _plain(value, depth=0):
    # JSON of plain data: lists and strings as JSON, the other containers tagged, subclasses of
    # the builtin types converted to them (their own __eq__ stays in here), nothing else.
    if depth > 200:
        raise ValueError("value nested too deeply")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, complex):
        value = complex(value)
        return {"complex": [value.real, value.imag]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, list):
        return [_plain(item, depth + 1) for item in list(value)]
    if isinstance(value, tuple):
        return {"tuple": [_plain(item, depth + 1) for item in tuple(value)]}
    if isinstance(value, frozenset):
        return {"frozenset": [_plain(item, depth + 1) for item in frozenset(value)]}
    if isinstance(value, set):
        return {"set": [_plain(item, depth + 1) for item in set(value)]}
    if isinstance(value, dict):
        return {"dict": [[_plain(k, depth + 1), _plain(v, depth + 1)] for k, v in dict(value).items()]}
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return _plain(value.tolist(), depth + 1)
    raise TypeError(f"a value of type {type(value).__name__} cannot be judged outside the sandbox")
"""
"""The driver's encoder (standard library only), the counterpart of :func:`decode`."""

_TAGS: dict[str, Callable[[Any], Any]] = {
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "dict": lambda pairs: {key: value for key, value in pairs},
    "bytes": bytes.fromhex,
    "complex": lambda parts: complex(*parts),
}


def _untag(document: dict[str, Any]) -> Any:
    if len(document) != 1:
        raise ValueError(f"not a tagged value: {sorted(document)}")
    ((tag, content),) = document.items()
    if tag not in _TAGS:
        raise ValueError(f"unknown tag {tag!r}")
    return _TAGS[tag](content)


def decode(text: str) -> Any:
    """A value printed by :data:`ENCODER`, as plain Python data; ValueError if it is not one."""
    try:
        return json.loads(text, object_hook=_untag)
    except (TypeError, RecursionError) as error:  # e.g. a list as a set's item
        raise ValueError(str(error)) from None


DRIVER = (
    r"""
import builtins, json, os, sys, traceback
"""
    + ENCODER
    + r"""
def _main(exec=exec, eval=eval, compile=compile, write=os.write, exit_now=os._exit, dict=dict):
    # argv: token. checks.json: {"setup": source, "expressions": [source, ...]}, none of it an
    # expected value: those stay outside, where each printed value is compared.
    token = sys.argv[1]
    with open("checks.json", encoding="utf-8") as handle:
        checks = json.load(handle)
    os.remove("checks.json")
    with open("solution.py", encoding="utf-8") as handle:
        program = compile(handle.read(), "solution.py", "exec")
    pristine_builtins = dict(vars(builtins))
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(program, namespace)
        # The tests see the program's names, and builtins as they were before it ran.
        scope = dict(namespace, __builtins__=pristine_builtins)
        exec(compile(checks["setup"], "tests.py", "exec"), scope)
    except BaseException:  # SystemExit included: exiting early answers nothing
        traceback.print_exc()
        sys.stderr.flush()
        exit_now(1)
    for index, source in enumerate(checks["expressions"]):
        try:
            line = json.dumps(_plain(eval(compile(source, "tests.py", "eval"), scope)))
        except BaseException:
            traceback.print_exc()
            line = "!"
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        write(1, ("\n" + token + " " + str(index) + " " + line + "\n").encode())
    exit_now(0)

_main()
"""
)
"""Runs as ``/sandbox/main.py`` with the program in ``solution.py`` and ``checks.json`` beside it;
prints ``<token> <index> <json>`` (``!`` for a value that raised or cannot be encoded) for each
check."""
