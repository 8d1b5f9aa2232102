"""Fixtures the model tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def verified_triton(monkeypatch):
    """Every Pallas Triton module lowered while the test runs is checked by MLIR's verifier,
    as XLA:GPU checks it when it parses the kernel. Lowering for CUDA from this CPU otherwise
    accepts modules a GPU rejects (a loop whose bounds differ in type, say): with this, such a
    kernel fails here rather than on a lent GPU. Returns the names of the kernels verified."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    verified: list[str] = []

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the op and the kernel's line
        kernel = result.module.body.operations[0]  # the module's one function
        verified.append(str(kernel.attributes["sym_name"]).strip('"'))
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return verified
