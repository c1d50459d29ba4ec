"""Programmatic dependent launch is requested only where it can run: never on CPU or under the interpreter (the
kernels then compile without griddepcontrol, which the interpreter cannot execute)."""

from __future__ import annotations

import torch

from lmd.turbomind.kernels.pdl import pdl_options


def test_no_pdl_off_cuda() -> None:
    assert pdl_options(torch.device("cpu")) == {"USE_PDL": False}
