"""Errors that are the user's to fix: printed as one line, exit status 2, no traceback."""


class UserError(Exception):
    """Bad input or missing files. The message names the problem and the fix."""


class DivergedError(Exception):
    """Training produced a non-finite loss; what was measured so far is still written.
    `mechanisms`: what the halted step released before it stopped (charged in the ledger)."""

    mechanisms: list = []
