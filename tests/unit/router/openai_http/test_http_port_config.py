"""The router's `--http-port` flag: off by default, a port in range when given."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.router.config import RouterConfig


def test_http_port_is_off_by_default_and_read_from_the_flag() -> None:
    assert RouterConfig.from_argv([]).http_port is None
    assert RouterConfig.from_argv(["--http-port", "8000"]).http_port == 8000


def test_http_port_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="http_port"):
        RouterConfig(http_port=70000)
