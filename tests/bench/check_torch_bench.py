"""Smoke test of bench/python/bench_torch.py: runs it on a small preset at world 2 (it checks
every method bit for bit against the seed's algorithm before timing) and checks its JSON: every
method present once, with positive times and the limit's ratio 1."""

import json
import subprocess
import sys
import tempfile

EXPECTED = [
    "limit (group all_gather, prealloc)",
    "limit + split into new tensors",
    "group all_gather (list of outputs)",
    "plan direct (Gloo send/recv)",
    "plan direct, preflight off",
    "plan direct, header over Gloo",
    "plan direct, group allgather",
    "shardgather (hint)",
    "shardgather (no hint)",
    "shardgather (hint, preflight off)",
    "seed algorithm (shapes)",
    "seed algorithm (no shapes)",
    "full_tensors (DTensor list, one call)",
    "full_tensor() loop (DTensor)",
]


def main():
    script = sys.argv[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, script, "--world", "2", "--presets", "tiny-1000",
                        "--iters", "3", "--port", "29611", "--json", out.name], check=True,
                       timeout=300)
        doc = json.load(open(out.name))
    assert doc["schema_version"] == 1 and doc["world"] == 2, doc
    names = [r["method"] for r in doc["rows"]]
    assert len(names) == len(set(names)), names
    for want in EXPECTED:
        assert want in names, (want, names)
    assert any(n.startswith("plan auto (") for n in names), names
    for r in doc["rows"]:
        assert r["preset"] == "tiny-1000" and r["tensors"] == 1000, r
        assert r["median_ms"] > 0 and r["min_ms"] > 0 and r["ratio_to_limit"] > 0, r
        if r["method"] == EXPECTED[0]:
            assert r["ratio_to_limit"] == 1.0, r
    print("bench_torch: %d methods, JSON ok" % len(names))


if __name__ == "__main__":
    main()
