"""Whom the watchdog blames: one rank of a 2-process job (2 CPU devices each, ``sc.fit`` with checkpoints, watchdog
timeout 4 s) stalls forever, in a ``jax.debug.callback`` inside its step or in its data source; the script counts
how often the watchdog's report names that rank alone, both ranks, or the healthy rank alone.

Every stall is one attempt of one job restarted by ``spmdcomm-launch --max-restarts`` (``tests/workers/blame_job.py``,
also run by ``tests/test_watchdog.py``):
the scenarios (kind x rank) are interleaved and the stalled step varies from attempt to attempt.

Usage: python benchmarks/watchdog_blame.py [--reps 10] [--json results/watchdog_blame.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = Path(__file__).resolve().parents[1] / "tests" / "workers" / "blame_job.py"
SCENARIOS = [("callback", 1), ("callback", 0), ("data", 1), ("data", 0)]
HEADLINE = re.compile(r"^\[rank (\d)\] spmdcomm\.Watchdog: .*?Stuck: (.*?)\. (?:Every process|Process \d)", re.M)


def plan(reps: int) -> list[str]:
    """``KIND:RANK:STEP`` per attempt: the scenarios interleaved, the stalled step cycling over 5..9."""
    return [f"{kind}:{rank}:{5 + (r + i) % 5}" for r in range(reps) for i, (kind, rank) in enumerate(SCENARIOS)]


def verdicts(err: str) -> list[tuple[str, list[set[int]]]]:
    """Per attempt, ``(plan entry, [the set of processes each rank's report names])``, from the job's stderr."""
    found: list[tuple[str, list[set[int]]]] = []
    for line in err.splitlines():
        started = re.match(r"^\[rank 0\] PLAN \d+ (\S+)$", line)
        if started:
            found.append((started.group(1), []))
            continue
        named = HEADLINE.match(line)
        if named and found:
            found[-1][1].append({int(q) for q in re.findall(r"process (\d+)", named.group(2))})
    return found


def outcome(entry: str, named: list[set[int]]) -> str:
    culprit = int(entry.split(":")[1])
    if not named:
        return "no report"
    if any(n != named[0] for n in named):
        return "ranks disagree"
    if named[0] == {culprit}:
        return "culprit alone"
    return "both" if culprit in named[0] else "healthy alone"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    entries = plan(args.reps)
    with tempfile.TemporaryDirectory() as ckpt:
        command = [sys.executable, "-m", "spmdcomm.launch", "-n", "2", "--devices-per-process", "2"]
        command += ["--max-restarts", str(len(entries) - 1), "--timeout", "120", "--grace", "2"]
        command += [str(JOB), ckpt, "--plan", ",".join(entries)]
        job = subprocess.run(command, capture_output=True, text=True, timeout=60 * len(entries), env=os.environ)
    results = verdicts(job.stderr)
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for entry, named in results:
        kind, rank, _ = entry.split(":")
        table[f"{kind} stall on rank {rank}"][outcome(entry, named)] += 1
    for scenario, counts in sorted(table.items()):
        print(f"{scenario}: {dict(counts)}")
    if args.json is not None:
        args.json.write_text(json.dumps({k: dict(v) for k, v in table.items()}, indent=1) + "\n")
    if len(results) != len(entries):
        sys.exit(f"{len(results)} attempts of {len(entries)} reported; stderr tail:\n{job.stderr[-3000:]}")


if __name__ == "__main__":
    main()
