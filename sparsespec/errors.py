"""The one exception type the CLI turns into a clear one-line error (exit code 2)."""


class SparseSpecError(Exception):
    """A user-facing error: bad input, missing weights, unsupported model. The message is one line."""
