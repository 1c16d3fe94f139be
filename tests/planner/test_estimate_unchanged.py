"""`shardwise estimate` and `shardwise plan` print, byte for byte, what was recorded before the
issue-15 refactor (estimate_cases.py lists the cases and re-records them on purpose)."""

import json

from estimate_cases import SAVED, outputs


def test_estimate_and_plan_outputs_are_unchanged():
    saved = json.loads(SAVED.read_text())
    now = outputs()
    assert now.keys() == saved.keys()
    changed = [key for key in saved if now[key] != saved[key]]
    assert not changed, f"{len(changed)} outputs changed, e.g. {changed[0]}:\n{now[changed[0]]}\nwas\n{saved[changed[0]]}"
