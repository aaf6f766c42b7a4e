"""`muninn-worker status`: the site's answer to GET /api/worker/me, as a few lines a person reads."""

from __future__ import annotations

from datetime import datetime, tzinfo

__all__ = ["format_status"]


def format_status(answer: dict, server: str, *, local: tzinfo | None = None, today: datetime | None = None) -> str:
    """The device, its reputation, today's results and the owner's earnings. `local` is the zone "today" is
    shown in (None: this machine's); `today` a moment of the local day (for tests)."""
    device = answer.get("device") or {}
    reputation = answer.get("reputation") or {}
    day = answer.get("today") or {}
    earnings = answer.get("earnings") or {}
    backends = ", ".join(device.get("backends") or []) or "none"
    lines = [f"device {device.get('id')} ({device.get('name')}) on {server}; backends: {backends}"]
    streak, total = reputation.get("verified_streak", 0), reputation.get("verified_total", 0)
    standing = f"reputation: {streak} verified in a row, {total} verified in all"
    if reputation.get("failures"):
        standing += f", {reputation['failures']} failed check(s)"
    if reputation.get("quarantined"):
        standing += f"; QUARANTINED (gets no work): {reputation.get('quarantine_reason') or 'no reason given'}"
    else:
        standing += "; not quarantined"
    lines.append(standing)
    lines.append(f"today{_since(day.get('since'), local, today)}: {day.get('accepted', 0)} unit(s) accepted, "
                 f"{day.get('pending', 0)} being checked, {day.get('rejected', 0)} refused; earned "
                 f"{day.get('earned', '0')}")
    lines.append(f"earnings (your account, all devices): {earnings.get('pending', '0')} pending, "
                 f"{earnings.get('held', '0')} held for review, {earnings.get('available', '0')} available")
    return "\n".join(lines)


def _since(stamp: object, local: tzinfo | None, today: datetime | None) -> str:
    """" (since 01:00)": the start of the site's day in local time, the date too when it is not today here."""
    try:
        moment = datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).astimezone(local)
    except ValueError:
        return ""
    now = (today or datetime.now(local)).astimezone(local)
    return f" (since {moment:%H:%M})" if moment.date() == now.date() else f" (since {moment:%Y-%m-%d %H:%M})"
