"""Runs `shardgather-bench reshard` (the command after --) and checks its JSON: every method
ran, moved every byte right (wrong 0), and the reshard's destinations received exactly their
boxes' bytes as the transport counted them.

usage: check_reshard_bench.py OUT.json METHODS -- COMMAND... (COMMAND writes OUT.json)"""

import json
import subprocess
import sys


def main():
    out, methods = sys.argv[1], sys.argv[2].split(",")
    command = sys.argv[sys.argv.index("--") + 1:]
    subprocess.run(command, check=True, timeout=240)
    with open(out) as f:
        doc = json.load(f)
    assert doc["op"] == "reshard" and doc["schema_version"] == 1, doc
    ran = [r["method"] for r in doc["results"]]
    assert ran == methods, (ran, methods)
    for r in doc["results"]:
        assert r["wrong"] == 0, r
        assert r["median_ms"] > 0 and len(r["times_ms"]) >= 1, r
    for r in doc["results"]:
        if r["method"].startswith("reshard"):
            assert r["received_over_wanted"] == 1.0, r
    # Across hosts: the fan-out sends fewer bytes between hosts than the flat plan, and the
    # link floor is the busiest host's.
    if doc["host_received"]:
        assert sum(doc["host_received"]) == sum(doc["host_sent"]) > 0, doc
        assert sum(doc["host_received"]) < sum(doc["host_received_flat"]), doc
    wanted = sum(doc["rank_received"])
    assert wanted > 0 and sum(doc["rank_sent"]) == wanted, doc
    assert all(0 <= local <= min(s, r) for local, s, r in
               zip(doc["rank_local"], doc["rank_sent"], doc["rank_received"])), doc
    print("reshard bench output ok: %s" % ", ".join(
        "%s %.1f ms" % (r["method"], r["median_ms"]) for r in doc["results"]))


if __name__ == "__main__":
    main()
