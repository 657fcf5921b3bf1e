# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The subcommands of `scripts/patchset`, one module each, as quilt and
git-buildpackage have one file per command. Each module's
`register(subparsers)` adds its parser, with its own options and help,
and sets its `run(args)` (which returns the exit status) as the handler."""

from . import (
    apply,
    bisect_run,
    build,
    check,
    ci_impact,
    env,
    export,
    gpu,
    rebase,
    refresh,
    report,
    run,
    setup,
    test,
    upstream_checks,
    verify_install,
    worktree,
)

COMMANDS = (
    setup,
    env,
    apply,
    run,
    check,
    worktree,
    refresh,
    rebase,
    bisect_run,
    export,
    test,
    upstream_checks,
    ci_impact,
    gpu,
    build,
    verify_install,
    report,
)
"""In the order `patchset --help` lists them."""
