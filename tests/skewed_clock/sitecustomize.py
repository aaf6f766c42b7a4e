"""Put this directory first on PYTHONPATH to run a Python process whose wall clock is off by
MUNINN_CLOCK_OFFSET_SECONDS (e.g. 3600 or -3600): a device with a wrong clock, without libfaketime.

time.time(), time.time_ns() and datetime.now()/utcnow()/today() are shifted; the monotonic clocks are not, as
on a real machine whose clock is wrong. Python imports `sitecustomize` at start-up, before anything else."""
import datetime as _datetime
import os
import time as _time

_offset = float(os.environ.get("MUNINN_CLOCK_OFFSET_SECONDS", "0"))

if _offset:
    _real_time, _real_time_ns = _time.time, _time.time_ns
    _time.time = lambda: _real_time() + _offset
    _time.time_ns = lambda: _real_time_ns() + int(_offset * 1e9)
    _shift = _datetime.timedelta(seconds=_offset)
    _real_datetime = _datetime.datetime

    class _SkewedDatetime(_real_datetime):
        @classmethod
        def now(cls, tz=None):
            return _real_datetime.now(tz) + _shift

        @classmethod
        def utcnow(cls):
            return _real_datetime.utcnow() + _shift

        @classmethod
        def today(cls):
            return _real_datetime.today() + _shift

    _datetime.datetime = _SkewedDatetime
