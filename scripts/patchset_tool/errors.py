# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The exception types the tool raises: bad input, and a stopping signal."""


class PatchsetError(Exception):
    """A failure the user can act on; printed without a traceback.

    `exit_code` is what the process exits with (1 unless a subcommand has
    a documented code, such as 125 for `bisect-run`).
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program stands (as Ctrl-C raises
    KeyboardInterrupt) so that every clean-up on the way out runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
