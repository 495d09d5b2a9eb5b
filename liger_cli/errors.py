"""Errors a user can act on.

A `UserError` is a mistake in what the user gave us (recipe, data, arguments, paths). The CLI
prints its message on one line to stderr and exits 2, with no traceback. Everything else is a
runtime failure (exit 1); a `RunFailed` is one the run itself detected and explains in one line
(no traceback either), such as a diverged loss or a backend that did not do what the plan says.
"""


class UserError(Exception):
    """A problem in the user's input; the message names the problem and the fix."""

    exit_code = 2


class RunFailed(RuntimeError):
    """The run stopped for a reason it names (exit 1): a diverged loss, a silent downgrade refused."""
