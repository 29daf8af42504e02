"""Markers by directory: tests under integration/ are `integration`, under gpu/ are `gpu`.

gpu tests are collected everywhere and skipped when CUDA is absent (they run on the device).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _cuda_available()
    for item in items:
        parts = Path(str(item.fspath)).relative_to(_HERE).parts
        if parts and parts[0] == "integration":
            item.add_marker(pytest.mark.integration)
        if parts and parts[0] == "gpu":
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (runs on the GPU device)"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
