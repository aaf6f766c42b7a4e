"""When the machine's owner lets the worker claim work: pure decisions over plain values, no I/O.

The owner's rules (working hours, a CPU-load threshold, "not on battery") are checked before every claim; a pause
stops claiming and never abandons a unit in hand. The readings (the clock, CPU counters, the power supply) are
taken elsewhere (muninn_worker.pause) and handed in, so every decision here is tested without waiting.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

__all__ = [
    "Window", "Rules", "Readings", "Pause", "PauseLog", "CpuTimes",
    "parse_schedule", "format_schedule", "within", "next_start", "window_end",
    "parse_proc_stat", "parse_proc_self_stat", "others_cpu_percent", "others_percent_from_load",
    "on_battery", "pause_for", "resumed_line",
]

DAY = 24 * 60  # minutes
_TIME = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$|^24:00$")


@dataclass(frozen=True)
class Window:
    """Daily working hours from `start` to `end`, in minutes after local midnight; end < start wraps midnight
    (22:00-07:00), end == start is the whole day."""

    start: int
    end: int

    def __str__(self) -> str:
        return f"{_hhmm(self.start)}-{_hhmm(self.end)}"

    def contains(self, minute: int) -> bool:
        if self.start == self.end:
            return True
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end


def parse_schedule(text: str) -> tuple[Window, ...]:
    """'22:00-07:00' or several ranges comma-separated ('12:00-13:00,22:00-07:00'). ValueError says what is wrong."""
    windows = []
    for part in (p.strip() for p in text.split(",")):
        start, sep, end = part.partition("-")
        if not sep or not _TIME.match(start.strip()) or not _TIME.match(end.strip()):
            raise ValueError(f"expected working hours as HH:MM-HH:MM (e.g. 22:00-07:00), comma-separated; got {part!r}")
        windows.append(Window(_minutes(start.strip()) % DAY, _minutes(end.strip()) % DAY))
    return tuple(windows)


def format_schedule(windows: Sequence[Window]) -> str:
    return ",".join(str(w) for w in windows)


def within(windows: Sequence[Window], now: datetime) -> bool:
    """Whether `now` (local wall-clock time) falls in one of the windows; no windows: always."""
    minute = now.hour * 60 + now.minute
    return not windows or any(w.contains(minute) for w in windows)


def next_start(windows: Sequence[Window], now: datetime) -> datetime:
    """The first moment after `now` when a window opens (within a day: every window opens daily)."""
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    starts = [midnight + timedelta(days=d, minutes=w.start) for d in (0, 1) for w in windows]
    return min(s for s in starts if s > now)


def window_end(windows: Sequence[Window], now: datetime) -> datetime | None:
    """When the working hours `now` is in end (windows that touch or overlap count as one stretch); None when
    they never end (no windows, or a whole day covered) or `now` is outside them."""
    if not windows or not within(windows, now):
        return None
    moment = now.replace(second=0, microsecond=0)
    for _ in range(DAY + 1):  # walk minute by minute: at most a day, and only when a claim is about to be made
        moment += timedelta(minutes=1)
        if not within(windows, moment):
            return moment
    return None


# ------------------------------------------------------------------------------------------------ CPU


@dataclass(frozen=True)
class CpuTimes:
    """Counters in clock ticks: the machine's total and idle time over all cores, and this process's own CPU."""

    total: int
    idle: int
    own: int


def parse_proc_stat(text: str) -> tuple[int, int]:
    """(total, idle) ticks from /proc/stat's aggregate `cpu` line. guest and guest_nice are already counted in
    user and nice, so they are left out; iowait counts as idle."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]]
            values += [0] * (8 - len(values))
            idle = values[3] + values[4]
            return sum(values), idle
    raise ValueError("/proc/stat has no aggregate cpu line")


def parse_proc_self_stat(text: str) -> int:
    """This process's utime + stime ticks from /proc/self/stat (fields 14 and 15; the name in parentheses may
    hold spaces, so count from after its closing parenthesis)."""
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def others_cpu_percent(before: CpuTimes, after: CpuTimes) -> float:
    """The share of the whole machine's CPU (all cores) that processes other than this one used between two
    readings, in percent."""
    total = after.total - before.total
    if total <= 0:
        return 0.0
    busy = total - (after.idle - before.idle)
    own = after.own - before.own
    return _clamp(100.0 * (busy - own) / total)


def others_percent_from_load(load1: float, cores: int, own_cores: float) -> float:
    """Where there is no /proc/stat: the 1-minute load average less the cores this process kept busy, as a share
    of the machine's cores, in percent (a rougher figure: the load average counts waiting processes too)."""
    return _clamp(100.0 * (load1 - own_cores) / max(1, cores))


# ---------------------------------------------------------------------------------------------- power


def on_battery(supplies: Iterable[tuple[str, str | None]]) -> bool | None:
    """From the machine's power supplies as (type, online) pairs (Linux: /sys/class/power_supply/*/type and
    /online): True when it has a battery and none of its external supplies (an AC adapter, "Mains", or a USB-C
    charger, "USB") is online; False when one is; None when it cannot tell (no battery, or no adapter that says
    whether it is plugged in), which never pauses the worker."""
    supplies = list(supplies)
    if not any(kind == "Battery" for kind, _ in supplies):
        return None
    adapters = [online for kind, online in supplies if kind in ("Mains", "USB") and online is not None]
    if not adapters:
        return None
    return not any(online.strip() == "1" for online in adapters)


# ---------------------------------------------------------------------------------------------- pause


@dataclass(frozen=True)
class Rules:
    """What the owner chose: working hours (none: any time), the CPU share of other processes above which the
    worker pauses (None: never), and whether it pauses on battery."""

    schedule: tuple[Window, ...] = ()
    busy_above: float | None = None
    pause_on_battery: bool = False

    @property
    def any(self) -> bool:
        return bool(self.schedule) or self.busy_above is not None or self.pause_on_battery


@dataclass(frozen=True)
class Readings:
    """The machine now: local wall-clock time, the CPU share of other processes (None: not measured or not
    measurable), and whether it runs on battery (None: unknown)."""

    now: datetime
    others_cpu: float | None = None
    battery: bool | None = None


@dataclass(frozen=True)
class Pause:
    """Why the worker does not claim now. `line` is what the log says; `recheck` is how many seconds to wait
    before looking again."""

    kind: str  # "schedule", "battery" or "busy"
    line: str
    recheck: float


RECHECK_SECONDS = 5.0  # busy or on battery: look again this often
SCHEDULE_RECHECK_MAX = 60.0  # outside the working hours: sleep until they start, waking at least this often


def pause_for(rules: Rules, readings: Readings) -> Pause | None:
    """The reason to pause now, or None to claim. Working hours first (they say when work resumes), then the
    battery, then the load: a later rule is only consulted (and its reading only needed) when the earlier pass."""
    if rules.schedule and not within(rules.schedule, readings.now):
        start = next_start(rules.schedule, readings.now)
        wait = (start - readings.now).total_seconds()
        return Pause("schedule", f"paused: outside the working hours {_hours(rules.schedule)}; resuming at "
                                 f"{start:%H:%M}", max(0.5, min(wait, SCHEDULE_RECHECK_MAX)))
    if rules.pause_on_battery and readings.battery:
        return Pause("battery", "paused: the machine runs on battery; resuming when it is plugged in",
                     RECHECK_SECONDS)
    if rules.busy_above is not None and readings.others_cpu is not None and readings.others_cpu > rules.busy_above:
        return Pause("busy", f"paused: the machine is busy (other processes use {readings.others_cpu:.0f}% CPU, "
                             f"above {rules.busy_above:g}%)", RECHECK_SECONDS)
    return None


def resumed_line(paused: Pause, rules: Rules, readings: Readings) -> str:
    """The one line that says the worker claims again, and why, after `paused`."""
    if paused.kind == "schedule":
        return f"resumed: within the working hours {_hours(rules.schedule)}"
    if paused.kind == "battery":
        return "resumed: the machine is plugged in again"
    if readings.others_cpu is None:
        return "resumed: the machine's load is no longer measured"
    return (f"resumed: the machine is no longer busy (other processes use {readings.others_cpu:.0f}% CPU, "
            f"at most {rules.busy_above:g}%)")


class PauseLog:
    """Turns each check's outcome into the line to log, if any: one when a pause starts or its reason changes,
    one when work resumes, nothing while the state holds (a worker paused all day logs two lines, not 8,000)."""

    def __init__(self) -> None:
        self.current: Pause | None = None

    def update(self, pause: Pause | None, rules: Rules, readings: Readings) -> str | None:
        previous, self.current = self.current, pause
        if pause is not None:
            return None if previous is not None and previous.kind == pause.kind else pause.line
        return None if previous is None else resumed_line(previous, rules, readings)


# -------------------------------------------------------------------------------------------- helpers


def _minutes(hhmm: str) -> int:
    hours, minutes = hhmm.split(":")
    return int(hours) * 60 + int(minutes)


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _hours(windows: Sequence[Window]) -> str:
    names = [str(w) for w in windows]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _clamp(percent: float) -> float:
    return min(100.0, max(0.0, percent))
