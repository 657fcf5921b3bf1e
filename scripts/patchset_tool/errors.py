# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one exception type the tool raises for bad input."""


class PatchsetError(Exception):
    """A failure the user can act on; printed without a traceback.

    `exit_code` is what the process exits with (1 unless a subcommand has
    a documented code, such as 125 for `bisect-run`).
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
