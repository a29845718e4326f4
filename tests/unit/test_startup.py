"""kdsweep.startup: a process's imports made with the garbage collector paused, then frozen out of later collections,
once per process. Each case runs in a fresh interpreter: the collector's state is the process's."""

import json
import subprocess
import sys

CHECK = """
import gc, json, sys
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
{before}
from kdsweep.startup import import_frozen
gc.collect(); collections.clear()
import_frozen(["decimal", "email.mime.multipart", "xml.dom.minidom", "argparse"])
during, frozen = list(collections), gc.get_freeze_count()
cycle = [None]; cycle[0] = cycle; del cycle  # garbage made after the freeze
import_frozen(["json"])  # a second call (a warm worker's next trial) freezes nothing more
refrozen = gc.get_freeze_count()
print(json.dumps({{"during": during, "frozen": frozen, "refrozen": refrozen, "enabled": gc.isenabled(),
                  "imported": "xml.dom.minidom" in sys.modules, "collected": gc.collect()}}))
"""


def check(before: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", CHECK.format(before=before)], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_imports_run_with_the_collector_paused_and_what_is_alive_is_frozen_once():
    seen = check()
    assert seen["imported"] and seen["during"] == []  # with the collector on, these imports run gen-0 collections
    assert seen["frozen"] > 1000 and seen["refrozen"] == seen["frozen"]
    assert seen["enabled"] and seen["collected"] >= 1  # the cycle made after the freeze is collected as before


def test_a_collector_the_process_had_turned_off_stays_off():
    seen = check(before="gc.disable()")
    assert seen["during"] == [] and not seen["enabled"] and seen["frozen"] > 1000
