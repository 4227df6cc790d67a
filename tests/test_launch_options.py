"""Programmatic dependent launch (PDL) is chosen per launch: on where the GPU has it, for steps of at most
PDL_MAX_TOKENS tokens; off on the CPU, above that size, inside ``programmatic_launch(False)``, and everywhere with
TWOGRID_PDL=0. (Whether PDL changes any output is checked on the GPU: tests/test_runtime.py compares graphs
captured with it against eager runs without it, bit for bit.)"""

import pytest

torch = pytest.importorskip("torch")

from models import fused  # noqa: E402

ON, OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}


def test_pdl_by_step_size_and_switch(monkeypatch):
    monkeypatch.setattr(fused, "pdl_available", lambda device: True)
    step = torch.empty(fused.PDL_MAX_TOKENS, 8)
    assert fused.launch_options(step) == ON
    assert fused.launch_options(torch.empty(fused.PDL_MAX_TOKENS + 1, 8)) == OFF
    with fused.programmatic_launch(False):
        assert fused.launch_options(step) == OFF
        with fused.programmatic_launch(True):
            assert fused.launch_options(step) == ON
        assert fused.launch_options(step) == OFF
    assert fused.launch_options(step) == ON


def test_pdl_off_on_the_cpu_and_by_environment(monkeypatch):
    assert fused.launch_options(torch.empty(1, 8)) == OFF
    assert not fused.pdl_available(torch.device("cpu"))
    monkeypatch.setenv("TWOGRID_PDL", "0")
    assert not fused.pdl_available(torch.device("cuda", 0))  # decided before any CUDA call
