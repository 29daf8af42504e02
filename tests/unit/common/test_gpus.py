"""visible_gpus: CUDA_VISIBLE_DEVICES first, else nvidia-smi, never CUDA itself."""

from __future__ import annotations

from services.common.gpus import visible_gpus


def test_cuda_visible_devices_wins_over_nvidia_smi() -> None:
    def query() -> str:
        raise AssertionError("nvidia-smi must not be asked")

    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}, query) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-0f1a,GPU-77"}, query) == [
        "GPU-0f1a",
        "GPU-77",
    ]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, query) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, query) == ["0"]  # as CUDA reads it


def test_nvidia_smi_indices_or_nothing() -> None:
    assert visible_gpus({}, lambda: "0\n1\n2\n3\n") == ["0", "1", "2", "3"]
    assert visible_gpus({}, lambda: "") == []
