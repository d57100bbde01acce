"""The one exception type the CLI turns into a clear one-line error (exit code 2), and the checks of a value's
type that validated options share."""

import numbers


class SparseSpecError(Exception):
    """A user-facing error: bad input, missing weights, unsupported model. The message is one line."""


def whole(x) -> bool:
    """A whole number given as a value: an int (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def number(x) -> bool:
    """A number given as a value: an int or a float (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
