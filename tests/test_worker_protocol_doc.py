"""docs/worker-protocol.md and the code say the same: every error code a device can be sent is documented, and
every "<status> `code`" the document states is one the site sends with that status.

The codes are read from the source, where the site names them: `code="..."` on the exception it raises (or a
class's `code = "..."`), a cheap check's `ResultRejected("...")` and the codec's `BadUpdate(..., code="...")`."""
from __future__ import annotations

import re
from pathlib import Path

from muninn.errors import MuninnError

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "worker-protocol.md"
SOURCES = [*(ROOT / "contributors").glob("*.py"), *(ROOT / "platform" / "muninn").glob("*.py"),
           ROOT / "worker_client" / "muninn_worker" / "codec.py"]

# Codes the site has that never reach a device through the worker API, and why.
NOT_FOR_DEVICES = {
    "error", "invalid", "conflict", "not_found",  # muninn.errors' defaults (404 not_found is documented anyway)
    "quarantined", "not_quarantined", "nothing_held", "reason_required",  # staff lifting or forfeiting a device
    "not_finite", "update_too_large", "loss_not_improved",  # evidence for a segment check, never a refusal
}
# The status of each exception a code is raised with; ResultRejected and BadUpdate become 400s at the upload.
STATUS = {"InvalidInput": 400, "ResultRejected": 400, "BadUpdate": 400, "NotFound": 404, "Conflict": 409,
          "TooLarge": 413}


def _source_codes() -> dict[str, set[int]]:
    """Each code in the source with the statuses it is raised with (empty: not raised with a known status)."""
    codes: dict[str, set[int]] = {}
    for path in SOURCES:
        text = path.read_text()
        for m in re.finditer(r"""(?:code\s*=\s*|ResultRejected\(\s*)["']([a-z][a-z0-9_]+)["']""", text):
            codes.setdefault(m.group(1), set())
        for m in re.finditer(r"""(\w+)\((?:(?!\braise\b|\bdef\b).){0,500}?code=["']([a-z][a-z0-9_]+)["']""", text,
                             re.DOTALL):
            if m.group(1) in STATUS:
                codes[m.group(2)].add(STATUS[m.group(1)])
        for m in re.finditer(r"""ResultRejected\(\s*["']([a-z][a-z0-9_]+)["']""", text):
            codes[m.group(1)].add(400)
    import contributors.services  # noqa: F401  the exception classes that carry their own code and status
    pending = [MuninnError]
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if cls.__module__.startswith(("contributors.", "muninn.")):  # not billing's or jobs' own
            codes.setdefault(cls.code, set()).add(cls.status)
    codes.setdefault("throttled", set()).add(429)  # DRF's Throttled, from the throttles of muninn/throttles.py
    versions = (ROOT / "contributors" / "versions.py").read_text()  # its middleware answers before any view
    for code, status in re.findall(r'error_body\(\s*"([a-z_]+)".*?status=(\d+)\)', versions, re.DOTALL):
        codes.setdefault(code, set()).add(int(status))
    return codes


def _documented() -> str:
    return " ".join(DOC.read_text().split())  # one line: a status and its code may sit on two


def test_every_code_a_device_can_be_sent_is_documented():
    doc = _documented()
    codes = _source_codes()

    undocumented = sorted(code for code in codes if code not in NOT_FOR_DEVICES and f"`{code}`" not in doc)

    assert len(codes) > 30 and undocumented == []


def test_every_status_and_code_the_document_states_is_sent_with_that_status():
    stated = set(re.findall(r"\b(4\d\d)\s+\(?`([a-z][a-z0-9_]*)`", _documented()))
    codes = _source_codes()

    wrong = sorted((status, code) for status, code in stated if int(status) not in codes.get(code, set()))

    assert {("409", "lease_limit"), ("403", "device_quarantined"), ("409", "public_key_taken")} <= stated
    assert wrong == []


def test_too_large_is_documented_with_both_of_its_statuses():
    """413 when the upload as sent is over its limit; 400 when it inflates past the bound after it was read."""
    assert _source_codes()["too_large"] == {400, 413}
    assert re.search(r"`too_large` comes with either status: 413 .* 400 ", _documented())
