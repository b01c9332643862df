"""Failures that leave a process unfit for another test: its scope goes on in a fresh one.

Runs in the parent. A sticky CUDA error (an illegal memory access, a device-side assert)
breaks the CUDA context for the rest of the process's life; cuBLAS and NCCL errors
leave their handles and communicators in states nobody can vouch for. After a test that
failed with one of them, a scope's child is not given the next test.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest

#: Built in: what the CUDA runtime, cuBLAS, cuDNN and NCCL say of broken process state.
BUILTIN = (
    r"illegal memory access",
    r"device-side assert",
    r"unspecified launch failure",
    r"misaligned address",
    r"illegal instruction",
    r"CUDA error: (an )?(uncorrectable )?ECC error",
    r"CUBLAS_STATUS_(EXECUTION_FAILED|INTERNAL_ERROR|NOT_INITIALIZED)",
    r"CUDNN_STATUS_(EXECUTION_FAILED|INTERNAL_ERROR)",
    r"NCCL (error|WARN)",
    r"ncclUnhandledCudaError|ncclSystemError|ncclInternalError",
    r"cudaErrorIllegalAddress|cudaErrorLaunchFailure|cudaErrorAssert",
    r"CUDA driver error|CUDA error: (the )?launch timed out",
)


def patterns(extra: Iterable[str]) -> list[re.Pattern[str]]:
    return [re.compile(p, re.MULTILINE) for p in (*BUILTIN, *extra)]


def verdict(reports: Iterable[pytest.TestReport], found: list[re.Pattern[str]]) -> str:
    """Why a child that produced ``reports`` must not run another test ("": it may).

    Only the exceptions' own words count (each one's type and message, chained ones
    too), never the traceback's source lines: a test whose comment or assertion names
    an illegal memory access did not make one.
    """
    for report in reports:
        if not report.failed:
            continue
        text = "\n".join(_messages(report.longrepr))
        for pattern in found:
            match = pattern.search(text)
            if match:
                found_text = match.group(0)
                return f"its {report.when} failed with {found_text!r}, which breaks the process"
    return ""


def _messages(longrepr: object) -> list[str]:
    """The exceptions' "Type: message" texts of a failure (its text where it has none)."""
    chain = getattr(longrepr, "chain", None)
    if chain:
        return [crash.message for _, crash, _ in chain if crash is not None]
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return [crash.message]
    return [str(longrepr)]
