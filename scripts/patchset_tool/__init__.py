# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Machinery that applies the GLM-5.3-Flash series to a pinned vLLM."""
