"""An access-log line whose figures no nginx writes (a negative or non-finite duration or time) is not read as a request."""

from __future__ import annotations

import json

import pytest

from pipelines.fleet.traffic import parse_access_line

LINE = {"t": 1_765_000_000.0, "uri": "/v1/completions", "status": 200, "route": "route0", "upstreams": "", "upstream_status": "",
        "time": 0.25}


def test_a_plain_line_is_a_request() -> None:
    request = parse_access_line(json.dumps(LINE), 9)
    assert request is not None and request.time_s == 0.25


@pytest.mark.parametrize(("key", "value"), [("time", -1.0), ("time", "1e999"), ("time", "nan"), ("t", -5.0), ("t", "inf")])
def test_a_figure_no_nginx_writes_leaves_the_line_unread(key: str, value: object) -> None:
    assert parse_access_line(json.dumps({**LINE, key: value}), 9) is None
