"""Values inside rows that Python or a tokenizer cannot take, found before anything else meets them.

    value = load_json(line)                            # or RowValueError(reason)
    reason = bad_value(row["messages"], "messages")    # None, or why the value is unusable

JSON is valid with a lone UTF-16 surrogate (`"\\ud800"`: a writer that cut an emoji in half),
nested a thousand levels deep, or holding an integer of ten thousand digits; Python's json
gives a str no tokenizer encodes, a RecursionError, a ValueError. Each is one row's problem,
named with the field it is in, and never a whole plan's (docs/design/planning.md).
"""

from __future__ import annotations

import json
import sys
from typing import Any

# Deeper values are refused: real tool schemas nest a few levels, and every consumer (the chat
# template's tojson, a processor, our own walks) recurses through them.
MAX_NESTING = 64


class RowValueError(ValueError):
    """A row's JSON text that cannot be a value; its message is the reject reason."""


def load_json(text: str | bytes) -> Any:
    """`json.loads(text)`, its failures as RowValueError reasons."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RowValueError(str(exc)) from None
    except RecursionError:
        raise RowValueError(
            f"nested too deep for Python's parser (a row may nest {MAX_NESTING} levels)"
        ) from None
    except ValueError as exc:  # an integer beyond sys.get_int_max_str_digits()
        limit = sys.get_int_max_str_digits()
        raise RowValueError(f"an integer of more than {limit} digits ({exc})") from None


def bad_value(value: Any, where: str) -> str | None:
    """Why `value` (as JSON gives it, at `where`) is unusable: nested deeper than MAX_NESTING,
    or a string (or key) holding a lone surrogate; None: it is fine. The path to a problem is
    found only once there is one."""
    return None if _fine(value, 0) else _problem(value, where)


def _fine(item: Any, depth: int) -> bool:
    """Recursive, and fast, for it stops at MAX_NESTING: the stack cannot run out here."""
    if isinstance(item, str):
        return item.isascii() or _surrogate(item) is None  # isascii: constant time in CPython
    if isinstance(item, dict):
        if depth >= MAX_NESTING:
            return False
        for key, member in item.items():
            if not (_fine(key, depth) and _fine(member, depth + 1)):
                return False
    elif isinstance(item, list):
        if depth >= MAX_NESTING:
            return False
        for member in item:
            if not _fine(member, depth + 1):
                return False
    return True


def _problem(value: Any, where: str) -> str:
    """The first problem of `value`, where it is (`messages[2].tool_calls[0].function...`)."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, at, depth = stack.pop()
        if isinstance(item, str):
            if reason := _surrogate(item):
                return f"{at} {reason}"
        elif isinstance(item, dict | list):
            if depth >= MAX_NESTING:
                return f"{at} is nested deeper than {MAX_NESTING} levels"
            if isinstance(item, dict):
                for key in item:
                    if isinstance(key, str) and (reason := _surrogate(key)):
                        return f"{at} has a key that {reason}"
                members = [(m, f"{at}.{k}", depth + 1) for k, m in item.items()]
            else:
                members = [(m, f"{at}[{k}]", depth + 1) for k, m in enumerate(item)]
            stack.extend(reversed(members))
    raise AssertionError("bad_value found a problem _problem does not")


def _surrogate(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return (
            f"holds a lone UTF-16 surrogate (U+{code:04X} at character {exc.start}): not "
            "Unicode text (a writer cut a character in half)"
        )
    return None
