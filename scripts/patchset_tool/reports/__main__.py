# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`python -m patchset_tool.reports NAME [options]`: see cli.py."""

from .cli import exit_without_teardown, main

exit_without_teardown(main())
