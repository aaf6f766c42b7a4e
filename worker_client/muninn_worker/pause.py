"""The owner's rules (muninn_worker.owner) applied to this machine: readings of the clock, the CPU and the power
supply, and the gate the work loop passes before every claim.

The CPU share of other processes is the machine's busy time from /proc/stat less this process's own from
/proc/self/stat, over a one-second sample; where there is no /proc (macOS), the load average less this process's
own cores. Testing hook: when MUNINN_WORKER_FAKE_LOAD_FILE names a file, the reading is the number in that file
(a test writes 90, then 10), and nothing is measured.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from muninn_worker.owner import (CpuTimes, Pause, PauseLog, Readings, Rules, on_battery, others_cpu_percent,
                                 others_percent_from_load, parse_proc_self_stat, parse_proc_stat, pause_for,
                                 window_end)

__all__ = ["Gate", "CpuLoad", "battery_now", "ENV_FAKE_LOAD"]

log = logging.getLogger("muninn_worker")

ENV_FAKE_LOAD = "MUNINN_WORKER_FAKE_LOAD_FILE"
POWER_SUPPLY = Path("/sys/class/power_supply")
SAMPLE_SECONDS = 1.0  # how long one CPU reading watches the counters


class CpuLoad:
    """The share of the machine's CPU that other processes use now, in percent; None where it cannot be told."""

    def __init__(self, *, sleep: Callable[[float], Any] = time.sleep, env: Mapping[str, str] = os.environ,
                 proc: Path = Path("/proc"), sample_seconds: float = SAMPLE_SECONDS) -> None:
        self._sleep = sleep
        self._env = env
        self._proc = proc
        self._sample = sample_seconds
        self._has_proc = (proc / "stat").exists() and (proc / "self" / "stat").exists()
        self._own = (time.process_time(), time.monotonic())  # for the load-average fallback

    def measurable(self) -> bool:
        return bool(self._env.get(ENV_FAKE_LOAD)) or self._has_proc or hasattr(os, "getloadavg")

    def percent(self) -> float | None:
        fake = self._env.get(ENV_FAKE_LOAD)
        if fake:
            return _number_in(Path(fake))
        if self._has_proc:
            try:
                before = self._times()
                self._sleep(self._sample)
                return others_cpu_percent(before, self._times())
            except (OSError, ValueError, IndexError):
                self._has_proc = False  # an unusual /proc: use the load average from now on
        return self._from_load_average()

    def _times(self) -> CpuTimes:
        total, idle = parse_proc_stat((self._proc / "stat").read_text())
        return CpuTimes(total, idle, parse_proc_self_stat((self._proc / "self" / "stat").read_text()))

    def _from_load_average(self) -> float | None:
        try:
            load1 = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
        cpu, wall = time.process_time(), time.monotonic()
        own_cores = (cpu - self._own[0]) / max(1e-6, wall - self._own[1])  # this process, since the last reading
        self._own = (cpu, wall)
        return others_percent_from_load(load1, os.cpu_count() or 1, own_cores)


def battery_now(root: Path = POWER_SUPPLY) -> bool | None:
    """Whether the machine runs on battery (Linux: its power supplies' type and online files); None when it cannot
    tell (no such folder, no battery, an adapter that does not say), which never pauses the worker."""
    supplies = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return None
    for entry in entries:
        kind = _text(entry / "type")
        if kind is not None:
            supplies.append((kind, _text(entry / "online")))
    return on_battery(supplies)


class Gate:
    """Passed before every claim: returns at once when the owner's rules allow work, else waits (logging one line
    when a pause starts or changes and one when work resumes) until they do."""

    def __init__(self, rules: Rules, *, cpu: CpuLoad | None = None,
                 battery: Callable[[], bool | None] = battery_now,
                 now: Callable[[], datetime] = datetime.now, sleep: Callable[[float], Any] = time.sleep,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.rules = rules
        self._cpu = cpu if cpu is not None else CpuLoad(sleep=sleep)
        self._battery = battery
        self._now = now
        self._sleep = sleep
        self._monotonic = monotonic
        self._log = PauseLog()

    def warnings(self) -> list[str]:
        """What the owner should know at start: a rule this machine cannot honour."""
        notes = []
        if self.rules.busy_above is not None and not self._cpu.measurable():
            notes.append("--pause-when-busy: this system reports no CPU load, so the worker never pauses for it")
        if self.rules.pause_on_battery and self._battery() is None:
            notes.append("--pause-on-battery: this machine reports no battery, so the worker never pauses for it")
        return notes

    def check(self) -> Pause | None:
        """The pause in force now (None: claim), logging a line when the state changes. A reading is only taken
        when the rules before it allow work (no CPU sample while outside the working hours)."""
        readings = Readings(self._now())
        pause = pause_for(self.rules, readings)
        if pause is None and self.rules.pause_on_battery:
            readings = replace(readings, battery=self._battery())
            pause = pause_for(self.rules, readings)
        if pause is None and self.rules.busy_above is not None:
            readings = replace(readings, others_cpu=self._cpu.percent())
            pause = pause_for(self.rules, readings)
        line = self._log.update(pause, self.rules, readings)
        if line:
            log.info("%s", line)
        return pause

    def wait_until_allowed(self, budget: float | None = None) -> bool:
        """Block while paused; True once work is allowed, False when still paused after `budget` seconds."""
        started = self._monotonic()
        while True:
            pause = self.check()
            if pause is None:
                return True
            left = None if budget is None else budget - (self._monotonic() - started)
            if left is not None and left <= 0:
                return False
            self._sleep(pause.recheck if left is None else min(pause.recheck, left))

    def open_for(self) -> float | None:
        """Seconds until the working hours end (None: they do not): a claim may be held no longer than that."""
        if not self.rules.schedule:
            return None
        now = self._now()
        end = window_end(self.rules.schedule, now)
        return None if end is None else max(0.0, (end - now).total_seconds())


def _number_in(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
