"""The owner's rules as pure decisions (muninn_worker.owner) and the gate that applies them before each claim
(muninn_worker.pause), with the clock and the readings handed in: nothing here waits."""

from __future__ import annotations

import logging
from datetime import datetime

import pytest

from muninn_worker.owner import (CpuTimes, PauseLog, Readings, Rules, Window, format_schedule, next_start,
                                 on_battery, others_cpu_percent, others_percent_from_load, parse_proc_self_stat,
                                 parse_proc_stat, parse_schedule, pause_for, window_end, within)
from muninn_worker.pause import CpuLoad, Gate, battery_now

NIGHT = parse_schedule("22:00-07:00")


def at(hhmm: str, day: int = 21) -> datetime:
    hours, minutes = hhmm.split(":")
    return datetime(2026, 11, day, int(hours), int(minutes))


# ------------------------------------------------------------------------------------------- schedule


def test_schedule_parses_ranges_and_says_them_back():
    assert parse_schedule("22:00-07:00") == (Window(22 * 60, 7 * 60),)
    assert parse_schedule(" 12:00-13:30 , 22:00-24:00 ") == (Window(720, 810), Window(1320, 0))
    assert format_schedule(parse_schedule("9:05-17:00,22:00-07:00")) == "09:05-17:00,22:00-07:00"


@pytest.mark.parametrize("text", ["", "22:00", "22-07", "25:00-07:00", "22:60-07:00", "22:00-07:00,", "night"])
def test_a_schedule_that_is_not_hh_mm_ranges_is_refused_with_a_sentence(text):
    with pytest.raises(ValueError, match="HH:MM-HH:MM"):
        parse_schedule(text)


@pytest.mark.parametrize("now, inside", [("21:59", False), ("22:00", True), ("23:59", True), ("00:00", True),
                                         ("06:59", True), ("07:00", False), ("12:00", False)])
def test_a_window_wraps_midnight(now, inside):
    assert within(NIGHT, at(now)) is inside


def test_several_windows_and_the_whole_day():
    lunch_and_night = parse_schedule("12:00-13:00,22:00-07:00")

    assert within(lunch_and_night, at("12:30")) and not within(lunch_and_night, at("13:00"))
    assert within(parse_schedule("00:00-24:00"), at("15:00")) and within((), at("15:00"))


def test_next_start_is_today_or_tomorrow():
    assert next_start(NIGHT, at("08:00")) == at("22:00")
    assert next_start(parse_schedule("06:00-07:00"), at("08:00")) == at("06:00", day=22)
    assert next_start(parse_schedule("12:00-13:00,22:00-07:00"), at("08:00")) == at("12:00")


def test_window_end_is_when_the_working_hours_close():
    assert window_end(NIGHT, at("23:30")) == at("07:00", day=22)
    assert window_end(NIGHT, at("06:59")) == at("07:00")
    assert window_end(parse_schedule("20:00-23:00,23:00-07:00"), at("21:00")) == at("07:00", day=22)  # one stretch
    assert window_end(NIGHT, at("12:00")) is None and window_end(parse_schedule("00:00-24:00"), at("12:00")) is None


# ------------------------------------------------------------------------------------------------ CPU


def test_cpu_counters_are_read_from_proc_text():
    stat = "cpu  100 5 50 800 40 3 2 0 7 0\ncpu0 50 2 25 400 20 1 1 0 0 0\nintr 1\n"
    own = "4242 (python3 -m muninn worker) S 1 2 3 4 5 6 7 8 9 10 31 9 0 0 20 0 4\n"

    assert parse_proc_stat(stat) == (1000, 840)
    assert parse_proc_self_stat(own) == 40


def test_other_processes_share_leaves_out_this_process_and_idle_time():
    before, after = CpuTimes(total=1000, idle=800, own=50), CpuTimes(total=2000, idle=1300, own=250)

    # 1000 ticks passed, 500 busy, of which 200 ours: others used 30 % of the machine
    assert others_cpu_percent(before, after) == pytest.approx(30.0)
    assert others_cpu_percent(after, after) == 0.0


def test_load_average_fallback_subtracts_our_own_cores():
    assert others_percent_from_load(load1=6.0, cores=8, own_cores=2.0) == pytest.approx(50.0)
    assert others_percent_from_load(load1=1.0, cores=4, own_cores=3.0) == 0.0
    assert others_percent_from_load(load1=40.0, cores=4, own_cores=0.0) == 100.0


# ---------------------------------------------------------------------------------------------- power


def test_battery_is_told_from_the_ac_adapter():
    assert on_battery([("Battery", None), ("Mains", "0")]) is True
    assert on_battery([("Battery", None), ("Mains", "1")]) is False
    assert on_battery([("Battery", None), ("Mains", "0"), ("USB", "1")]) is False  # a USB-C charger
    assert on_battery([("Mains", "0")]) is None  # no battery: a desktop
    assert on_battery([("Battery", None)]) is None  # no adapter that says: never paused
    assert on_battery([]) is None


def test_battery_reading_from_a_power_supply_folder(tmp_path):
    (tmp_path / "BAT0").mkdir()
    (tmp_path / "BAT0" / "type").write_text("Battery\n")
    (tmp_path / "AC").mkdir()
    (tmp_path / "AC" / "type").write_text("Mains\n")
    (tmp_path / "AC" / "online").write_text("0\n")

    assert battery_now(tmp_path) is True
    (tmp_path / "AC" / "online").write_text("1\n")
    assert battery_now(tmp_path) is False
    assert battery_now(tmp_path / "missing") is None


# ---------------------------------------------------------------------------------------------- pause


def test_outside_the_working_hours_the_pause_says_when_work_resumes():
    pause = pause_for(Rules(schedule=NIGHT), Readings(at("08:00")))

    assert pause.kind == "schedule"
    assert pause.line == "paused: outside the working hours 22:00-07:00; resuming at 22:00"
    assert pause.recheck == 60.0  # sleeps until then, looking again every minute
    assert pause_for(Rules(schedule=NIGHT), Readings(datetime(2026, 11, 21, 21, 59, 30))).recheck == 30.0
    assert pause_for(Rules(schedule=NIGHT), Readings(at("23:00"))) is None


def test_busy_and_battery_pauses_say_why():
    rules = Rules(busy_above=50, pause_on_battery=True)

    busy = pause_for(rules, Readings(at("12:00"), others_cpu=85.4, battery=False))
    assert busy.line == "paused: the machine is busy (other processes use 85% CPU, above 50%)"
    assert pause_for(rules, Readings(at("12:00"), others_cpu=50.0, battery=False)) is None  # at the limit: works
    assert pause_for(rules, Readings(at("12:00"), others_cpu=None, battery=None)) is None  # cannot tell: works
    assert pause_for(rules, Readings(at("12:00"), others_cpu=10, battery=True)).kind == "battery"
    assert pause_for(Rules(busy_above=50), Readings(at("12:00"), others_cpu=90, battery=True)).kind == "busy"


def test_the_pause_log_says_each_pause_and_resume_once():
    rules = Rules(schedule=NIGHT, busy_above=50)
    log = PauseLog()
    steps = [Readings(at("08:00")), Readings(at("09:00")), Readings(at("22:00"), others_cpu=90),
             Readings(at("22:05"), others_cpu=95), Readings(at("22:10"), others_cpu=10),
             Readings(at("22:15"), others_cpu=12)]

    lines = [log.update(pause_for(rules, r), rules, r) for r in steps]

    assert lines == ["paused: outside the working hours 22:00-07:00; resuming at 22:00", None,
                     "paused: the machine is busy (other processes use 90% CPU, above 50%)", None,
                     "resumed: the machine is no longer busy (other processes use 10% CPU, at most 50%)", None]


class _Clock:
    """A clock that moves only when the gate sleeps."""

    def __init__(self, start: datetime) -> None:
        self.now = start
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        from datetime import timedelta

        self.slept.append(seconds)
        self.now += timedelta(seconds=seconds)

    def monotonic(self) -> float:
        return self.now.timestamp()


def test_the_gate_sleeps_until_the_working_hours_start_and_logs_two_lines(caplog):
    clock = _Clock(at("21:57"))
    gate = Gate(Rules(schedule=NIGHT), now=lambda: clock.now, sleep=clock.sleep, monotonic=clock.monotonic)
    caplog.set_level(logging.INFO, logger="muninn_worker")

    assert gate.wait_until_allowed() is True

    assert clock.now == at("22:00") and clock.slept == [60.0, 60.0, 60.0]
    assert [r.message for r in caplog.records] == ["paused: outside the working hours 22:00-07:00; resuming at 22:00",
                                                   "resumed: within the working hours 22:00-07:00"]
    assert gate.open_for() == 9 * 3600


def test_the_gate_gives_up_after_its_budget_while_still_paused():
    clock = _Clock(at("12:00"))
    gate = Gate(Rules(schedule=NIGHT), now=lambda: clock.now, sleep=clock.sleep, monotonic=clock.monotonic)

    assert gate.wait_until_allowed(budget=90) is False
    assert sum(clock.slept) == 90


def test_the_gate_reads_the_fake_load_file_and_measures_nothing_else(tmp_path, caplog):
    load = tmp_path / "load"
    load.write_text("90\n")
    clock = _Clock(at("12:00"))
    cpu = CpuLoad(env={"MUNINN_WORKER_FAKE_LOAD_FILE": str(load)}, sleep=clock.sleep)
    gate = Gate(Rules(busy_above=50), cpu=cpu, now=lambda: clock.now, sleep=clock.sleep, monotonic=clock.monotonic)
    caplog.set_level(logging.INFO, logger="muninn_worker")

    assert gate.check().kind == "busy"
    load.write_text("10")
    assert gate.check() is None

    assert [r.message for r in caplog.records] == [
        "paused: the machine is busy (other processes use 90% CPU, above 50%)",
        "resumed: the machine is no longer busy (other processes use 10% CPU, at most 50%)"]
    assert clock.slept == []  # the fake reading takes no sample


def test_cpu_load_from_proc_files(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    readings = iter([("cpu 100 0 100 800 0 0 0 0 0 0", 10), ("cpu 400 0 400 1200 0 0 0 0 0 0", 110)])

    def advance(seconds: float) -> None:
        write(*next(readings))

    def write(stat: str, own: int) -> None:
        (proc / "stat").write_text(stat + "\n")
        (proc / "self" / "stat").write_text(f"1 (worker) R 0 0 0 0 0 0 0 0 0 0 {own} 0 0 0\n")

    write(*next(readings))
    cpu = CpuLoad(env={}, proc=proc, sleep=advance)

    # 1000 ticks: 600 busy, 100 of them ours
    assert cpu.percent() == pytest.approx(50.0)
