# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The meta-device reports on GLM-5.3-Flash: `coverage` (which layers online
quantization reaches) and `capacity` (KV-cache tokens per budget, BF16 vs
FP8), and their shared command line (`cli`).

They run inside a base's vLLM interpreter, as
`python -m patchset_tool.reports NAME [options]`, with the tree to inspect
first on sys.path and the verification suite's public helpers
(tests/models/glm5next/glm5next_verify.py) importable by name:
`scripts/patchset NAME` sets up both (`runner.run(..., suite=True)`).
"""
