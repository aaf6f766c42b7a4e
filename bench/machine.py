"""The machine's speed, for comparing benchmark runs taken at different times.

The dev VM's speed swings by up to 2.5x from hour to hour (other tenants on the same host), so a figure from one
hour cannot be compared with a figure from another. `yardstick_s` times a fixed piece of pure-Python work, best
of five, before a benchmark starts its stack: the earlier READMEs' `sum(range(10**7))` (0.13-0.15 s in this VM's
fast hours, 0.30-0.37 s in its slow ones). Each benchmark prints it and puts it in its last JSON line.

`new_file_ms` times the disk the same way: the CPU a new file costs in the folder a benchmark writes its blobs to.
On this VM's ext4 (mounted with `discard`) it is 0.04-0.3 ms, but 0.6-1.8 ms for 20-60 s after many files were
deleted nearby (measured 2026-11-29: the last run's clean-up of its world and its DROP DATABASE, pip's of a build), and
every result the site accepts creates two such files, so bench/load.py and bench/api_profile.py wait for a slow spell to
pass (`settled_disk_ms`) and print the figure.

`wake_us` times the other thing a paced server does a lot of: a thread that blocks and is woken. Two threads of one
process pass a byte back and forth over a socket pair; the CPU a round trip costs (two wakes) is timed with the
threads kept busy and after the machine sat idle for 10 ms. On this VM (a Firecracker guest) the idle one cost
~95 µs against ~31 µs busy, and a `time.sleep(0.002)` alone ~36 µs (2026-11-29, a slow hour): a request that
finds its threads asleep pays that for every hand-off, which is why bench/load.py's paced ops cost more CPU than
its saturated ones (the README, the load benchmark's fourteenth session)."""
from __future__ import annotations

import os
import socket
import threading
import time

WORK = 10**7


def yardstick_s(repeats: int = 5) -> float:
    """Seconds (wall clock, best of `repeats`) to sum range(10**7) on one core of this machine now."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        sum(range(WORK))
        best = min(best, time.perf_counter() - start)
    return round(best, 3)


def new_file_ms(folder, files: int = 200, size: int = 40_000) -> float:
    """CPU milliseconds (this process's, user and system) to create one new file of `size` bytes in `folder`, as
    jobs.storage writes a blob (256 sub-folders, a file created exclusively). The files are left in `folder`: deleting
    them here would slow the disk for what the benchmark writes next."""
    data = os.urandom(size)
    start = time.process_time()
    for _ in range(files):
        sub = os.path.join(folder, os.urandom(1).hex())
        os.makedirs(sub, exist_ok=True)
        fd = os.open(os.path.join(sub, os.urandom(32).hex()), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    return round((time.process_time() - start) / files * 1e3, 3)


SLOW_NEW_FILE_MS = 0.3  # settled, this VM's disk takes 0.04-0.3 ms


def settled_disk_ms(folder, *, wait_s: float = 120.0, every_s: float = 10.0) -> float:
    """new_file_ms in `folder`, after waiting (up to `wait_s`, saying so) for a slow spell of the disk to pass: a
    benchmark run straight after another meets the disk still slow from the other's clean-up, which is not the site's
    cost."""
    waited = 0.0
    ms = new_file_ms(folder)
    while ms > SLOW_NEW_FILE_MS and waited < wait_s:
        print(f"the disk is slow now: a new file costs {ms:.2f} ms of CPU (files were deleted nearby lately); "
              f"waiting for it to settle ({waited:.0f} of {wait_s:.0f} s)", flush=True)
        time.sleep(every_s)
        waited += every_s
        ms = new_file_ms(folder)
    return ms


def disk_note(ms: float) -> str:
    """The probe's figure as a benchmark prints it, with a warning when the disk is still in its slow spell."""
    note = f"a new 40 KB file costs {ms:.2f} ms of CPU where the blobs go (bench/machine.py)"
    if ms > SLOW_NEW_FILE_MS:
        note += "; THE DISK IS SLOW: each result pays that twice, so this run's CPU per op is not the site's alone"
    return note


def wake_us(idle_round_trips: int = 200, busy_round_trips: int = 5000, idle_s: float = 0.01) -> dict[str, float]:
    """CPU microseconds (this process's) a round trip between two of its threads costs: {"busy": back to back,
    "idle": each after `idle_s` asleep}. Each round trip is two wakes: the echo thread's and this one's."""
    a, b = socket.socketpair()

    def echo():
        while data := b.recv(1):
            b.send(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        a.send(b"x")
        a.recv(1)
        start = time.process_time()
        for _ in range(busy_round_trips):
            a.send(b"x")
            a.recv(1)
        busy = (time.process_time() - start) / busy_round_trips
        idle = 0.0
        for _ in range(idle_round_trips):
            time.sleep(idle_s)
            start = time.process_time()
            a.send(b"x")
            a.recv(1)
            idle += time.process_time() - start
    finally:
        a.close()
        thread.join(5)
        b.close()
    return {"busy": round(busy * 1e6, 1), "idle": round(idle / idle_round_trips * 1e6, 1)}
