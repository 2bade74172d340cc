import pytest
import torch

import kvlessons


def test_device_defaults_to_cuda_when_present(monkeypatch):
    """Without the override, the device is CUDA exactly when torch sees one."""
    monkeypatch.delenv("KVLESSONS_DEVICE", raising=False)
    assert kvlessons.device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_env_var_overrides(monkeypatch):
    """KVLESSONS_DEVICE=cpu forces the CPU even where CUDA exists."""
    monkeypatch.setenv("KVLESSONS_DEVICE", "cpu")
    assert kvlessons.device() == torch.device("cpu")


def test_bad_env_var_is_a_clear_error(monkeypatch):
    """A device name torch does not know raises ValueError naming the variable."""
    monkeypatch.setenv("KVLESSONS_DEVICE", "warp-drive")
    with pytest.raises(ValueError, match="KVLESSONS_DEVICE"):
        kvlessons.device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda(monkeypatch):
    """Asking for CUDA on a CPU-only machine says so instead of failing later."""
    monkeypatch.setenv("KVLESSONS_DEVICE", "cuda")
    with pytest.raises(ValueError, match="no CUDA"):
        kvlessons.device()
