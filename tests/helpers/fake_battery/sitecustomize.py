"""A battery for `vrl` processes on machines without one (this VM, most CI runners): put this
folder on PYTHONPATH with VRL_TEST_POWER_FILE naming a file that holds `battery` or `mains`,
and psutil.sensors_battery() reads that file (no file, or anything else in it: no sensor).
Python imports sitecustomize at start-up, before vrl reads the machine (volunteer.host), so
the process under test is the real one with only its power source faked."""
import os
from collections import namedtuple

POWER_FILE = os.environ.get("VRL_TEST_POWER_FILE")
Battery = namedtuple("Battery", "percent secsleft power_plugged")

if POWER_FILE:
    import psutil

    def sensors_battery():
        try:
            with open(POWER_FILE) as f:
                state = f.read().strip()
        except OSError:
            return None
        if state not in ("battery", "mains"):
            return None
        return Battery(50.0, psutil.POWER_TIME_UNKNOWN, state == "mains")

    psutil.sensors_battery = sensors_battery
