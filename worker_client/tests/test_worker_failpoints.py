"""Failpoints: off unless named, parsed strictly, counted; the upload body pauses exactly halfway."""
from __future__ import annotations

import pytest

from muninn_worker import failpoints
from muninn_worker.api import _UploadBody
from muninn_worker.failpoints import FailpointError, Failpoints


def test_a_failpoint_not_named_in_the_environment_does_nothing(capsys):
    points = Failpoints("X_FAILPOINTS", environ={})

    points.hit("upload.mid_body")

    assert capsys.readouterr().err == ""


def test_a_named_failpoint_says_it_was_reached_and_a_count_turns_it_off(capsys):
    points = Failpoints("X_FAILPOINTS", environ={"X_FAILPOINTS": "a.b=2*sleep:0; c.d=sleep:0"})

    for _ in range(3):
        points.hit("a.b")
    points.hit("c.d")
    points.hit("e.f")

    assert capsys.readouterr().err.splitlines() == ["failpoint a.b reached: sleep 0s"] * 2 + [
        "failpoint c.d reached: sleep 0s"]


@pytest.mark.parametrize("spec", ["a.b", "a.b=crash", "a.b=sleep:soon", "a.b=0*sleep:1", "=sleep:1", "a=x*sleep:1"])
def test_a_malformed_failpoint_variable_is_refused_at_start(spec):
    with pytest.raises(FailpointError):
        Failpoints("X_FAILPOINTS", environ={"X_FAILPOINTS": spec})


@pytest.mark.parametrize("block", [1, 7, 8192, -1])
def test_the_upload_body_is_sent_whole_and_pauses_once_at_its_half(monkeypatch, block):
    reached: list[int] = []
    body = _UploadBody(bytes(range(256)) * 41)
    monkeypatch.setattr(failpoints._worker, "hit", lambda name: reached.append((name, body._sent)))

    chunks = iter(lambda: body.read(block), b"")
    data = b"".join(chunks)

    assert data == bytes(range(256)) * 41 and len(body) == len(data)
    assert reached == [("upload.mid_body", len(data) // 2)]
