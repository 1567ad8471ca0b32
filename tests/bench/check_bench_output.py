#!/usr/bin/env python3
"""Runs shardgather-bench and pins its output formats (after google/benchmark's output tests).

usage: check_bench_output.py JSON_PATH -- COMMAND...
Checks the '#' table header and rows on stdout, and the JSON document's schema and values.
"""
import json
import re
import subprocess
import sys

OPS = {"limit", "foreach_all_gather", "unshard", "per_tensor", "overlap", "stream"}
FIELDS = {"preset", "backend", "world_size", "dtype", "tensors", "bytes_per_rank", "op",
          "strategy", "time_us", "algbw_gbps", "busbw_gbps", "wrong",
          "metadata_collectives", "allocations"}


def main():
    json_path = sys.argv[1]
    cmd = sys.argv[sys.argv.index("--") + 1:]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    print(out)
    print(proc.stderr, file=sys.stderr)
    assert proc.returncode == 0, f"bench exited {proc.returncode}"
    header = re.search(r"^#\s+op\s+strategy\s+bytes/rank\s+tensors\s+time\(us\)\s+min\(us\)\s+"
                       r"algbw\(GB/s\)\s+busbw\(GB/s\)\s+#wrong\s+vs_limit\s+meta\s+allocs$",
                       out, re.M)
    assert header, "table header missing"
    rows = [line.split() for line in out.splitlines()
            if line and not line.startswith("#") and line.split()[0] in OPS]
    assert rows, "no result rows"
    for row in rows:
        assert len(row) == 12, row
        assert int(row[6 + 2]) == 0, f"wrong elements in {row}"
    assert re.search(r"^# Out of bounds values : 0 OK$", out, re.M)

    if json_path == "-":
        return
    with open(json_path) as f:
        doc = json.load(f)
    assert doc["schema_version"] == 1
    for key in ("host", "num_cpus", "library_version", "build_type", "backend"):
        assert key in doc["context"], key
    results = doc["results"]
    assert len(results) == len(rows)
    seen_ops = set()
    for r in results:
        missing = FIELDS - set(r)
        assert not missing, f"missing {missing}"
        assert r["op"] in OPS
        seen_ops.add(r["op"])
        assert r["wrong"] == 0
        assert r["time_us"] > 0 and r["algbw_gbps"] > 0
        if r["op"] in ("foreach_all_gather", "unshard"):
            # Planned executions: no metadata collective, no allocation in steady state.
            assert r["metadata_collectives"] == 0, r
            assert r["allocations"] == 0, r
    if "overlap" in seen_ops:
        # The overlap op: its three rows, and the ratio on the "both" row (no bar here: tests
        # never assert on time; docs/benchmarking.md has the measured figures).
        rows_by = {r["strategy"]: r for r in results if r["op"] == "overlap"}
        assert {"gather", "compute", "both"} <= set(rows_by), rows_by.keys()
        assert rows_by["both"]["overlap_ratio"] > 0, rows_by["both"]
        assert re.search(r"^# overlap: time\(both\) / max\(time\(gather\), time\(compute\)\) = "
                         r"[0-9.]+", out, re.M)
    elif "stream" in seen_ops:
        # The stream op: its three rows, each a whole model verified bucket by bucket.
        kinds = {r["strategy"] for r in results if r["op"] == "stream"}
        assert {"serial", "prefetch1", "to_rank0"} <= kinds, kinds
    else:
        assert {"limit", "foreach_all_gather", "unshard", "per_tensor"} <= seen_ops
    print(f"check_bench_output: {len(results)} results OK")


if __name__ == "__main__":
    main()
