"""A Ray address urllib cannot split (an unclosed IPv6 bracket, a port out of range) is one InputError, its credentials out."""

from __future__ import annotations

import pytest

from pipelines.errors import InputError
from pipelines.jobs.ray.address import check_address


@pytest.mark.parametrize("address", ["[::1:6379", "ray://user:secret@[::1", "head:99999", "ray://user:secret@head:6379/path"])
def test_an_address_urllib_refuses_is_one_input_error_without_credentials(address: str) -> None:
    with pytest.raises(InputError, match="not a Ray address") as caught:
        check_address(address)
    assert "secret" not in caught.value.one_line()
