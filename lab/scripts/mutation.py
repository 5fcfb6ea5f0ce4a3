"""Mutation test of the core, module by module, each against its own unit tests (issue 18).

    python3 -m pip install -e '.[test]' -e 'lab[mutation]'
    python3 lab/scripts/mutation.py [routing/policy routing/crossover ...]   # default: all of MODULES

For each module, copies the working tree (tracked and untracked-not-ignored files) into a
scratch directory, runs mutmut 3 there on that one module with only its unit test files, and
prints killed / survived per module. A survivor whose change is listed in
lab/scripts/mutation_equivalent.txt (with the reason it cannot change behaviour) is counted as
equivalent and left out of the score: score = killed / (mutants - equivalent). Survivors are
keyed by function and the changed line, not by mutmut's numbering, so the list survives edits
elsewhere in the module.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EQUIVALENT = Path(__file__).resolve().parent / "mutation_equivalent.txt"

# module -> the unit test files that pin it (the files mirroring the package).
MODULES: dict[str, list[str]] = {
    # policy holds the flip's moves too (choose_moves: test_moves).
    "routing/policy": ["tests/routing/test_policy.py", "tests/routing/test_session_load.py",
                       "tests/routing/test_moves.py"],
    "routing/crossover": ["tests/routing/test_crossover.py"],
    "relay/inbound": ["tests/relay/test_inbound.py"],
    "apis/sse": ["tests/apis/test_sse.py"],
    "routing/backend": ["tests/routing/test_backend.py"],
    # The pool, split by the relay split (issue 18) into pool, sessions, lease, pair:
    # each against the pool's unit tests (test_load is the leases' oldest).
    "routing/pool": ["tests/routing/test_pool.py", "tests/test_load.py", "tests/routing/test_session_load.py",
                     "tests/turns/test_pool_gate.py"],
    "routing/sessions": ["tests/routing/test_sessions.py", "tests/routing/test_pool.py",
                         "tests/routing/test_session_load.py"],
    "routing/lease": ["tests/routing/test_lease.py", "tests/test_load.py", "tests/routing/test_pool.py"],
    "routing/pair": ["tests/routing/test_pair.py"],
    "continuation/rules": ["tests/continuation/test_rules.py"],
    "turns/decision": ["tests/turns/test_decision.py"],
    # The turns pair's memory state machine, split in three: its walks span all three.
    "turns/state": ["tests/turns/test_state.py", "tests/turns/test_discovery.py"],
    "turns/discovery": ["tests/turns/test_discovery.py", "tests/turns/test_state.py"],
    "turns/journal": ["tests/turns/test_journal.py", "tests/turns/test_state.py"],
    # The splicers, each through splice.splicer (the one entry the hand-off uses).
    "continuation/seam": ["tests/continuation/test_seam.py", "tests/continuation/test_same_api.py",
                          "tests/continuation/test_splice.py"],
    "continuation/same_api": ["tests/continuation/test_same_api.py",
                              "tests/continuation/test_splice.py"],
    "continuation/as_messages": ["tests/continuation/test_as_messages.py",
                                 "tests/continuation/test_seam.py",
                                 "tests/continuation/test_splice.py"],
    "continuation/as_responses": ["tests/continuation/test_as_responses.py",
                                  "tests/continuation/test_seam.py",
                                  "tests/continuation/test_splice.py"],
}

# A mutant whose tests never finish is caught too: the suite's pytest-timeout fails it in CI.
KILLED = ("killed", "timeout")

MUTMUT_CONFIG = """
[tool.mutmut]
source_paths = ["gateway"]
only_mutate = ["gateway/{module}.py"]
pytest_add_cli_args_test_selection = {tests}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q", "-n", "0"]  # no workers: mutmut runs many
max_children = {children}
"""


def copy_tree(dest: Path, at: str | None) -> None:
    if at is not None:  # a commit's tree instead of the working tree (a "before" score)
        archive = subprocess.run(["git", "archive", at, "gateway", "tests", "pyproject.toml"],
                                 cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file() and (name.startswith(("gateway/", "tests/")) or name == "pyproject.toml"):
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def mutmut(workdir: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=workdir, env=env,
                          capture_output=True, text=True)
    return done.stdout


def changed_line(diff: str) -> str:
    """`function: - old -> + new` from mutmut's diff of one mutant."""
    removed = [line[1:].strip() for line in diff.splitlines()
               if line.startswith("-") and not line.startswith("---")]
    added = [line[1:].strip() for line in diff.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return f"{' / '.join(removed)} -> {' / '.join(added)}"


def function_of(name: str) -> str:
    # gateway.routing.policy.xǁSnapshotǁagainst_crossover__mutmut_3 -> Snapshot.against_crossover
    short = name.rsplit(".", 1)[1].split("__mutmut_")[0]
    return short.replace("xǁ", "").replace("ǁ", ".").removeprefix("x_")


def equivalents() -> set[str]:
    if not EQUIVALENT.exists():
        return set()
    keys = set()
    for line in EQUIVALENT.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            keys.add(line.rsplit("  # ", 1)[0].strip())
    return keys


def run_module(module: str, tests: list[str], children: int, at: str | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix=f"mutation-{module.replace('/', '.')}-") as scratch:
        workdir = Path(scratch)
        copy_tree(workdir, at)
        with open(workdir / "pyproject.toml", "a", encoding="utf-8") as config:
            config.write(MUTMUT_CONFIG.format(module=module, tests=tests, children=children))
        mutmut(workdir, "run")
        results = re.findall(r"^\s*(\S+__mutmut_\d+): (.+)$", mutmut(workdir, "results", "--all", "true"),
                             re.MULTILINE)
        known = equivalents()
        survivors: list[str] = []
        equivalent: list[str] = []
        for name, status in results:
            if status.strip() in KILLED:
                continue
            key = f"{module}:{function_of(name)}: {changed_line(mutmut(workdir, 'show', name))}"
            (equivalent if key in known else survivors).append(f"{key}  [{status.strip()}]")
        killed = sum(1 for _, status in results if status.strip() in KILLED)
        counted = len(results) - len(equivalent)
        return {"module": module, "mutants": len(results), "killed": killed,
                "equivalent": len(equivalent), "score": killed / counted if counted else 1.0,
                "survivors": survivors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", default=list(MODULES))
    parser.add_argument("--tests", nargs="+", help="test files instead of MODULES' (one module)")
    parser.add_argument("--at", help="a commit to test instead of the working tree")
    parser.add_argument("--children", type=int, default=2, help="mutmut's parallel test runs")
    args = parser.parse_args()
    rows = []
    for module in args.modules:
        row = run_module(module, args.tests or MODULES[module], args.children, args.at)
        rows.append(row)
        print(f"\n## {module}: {row['killed']} killed of {row['mutants']} mutants, "
              f"{row['equivalent']} equivalent: {row['score']:.1%}")
        for survivor in row["survivors"]:  # type: ignore[attr-defined]
            print(f"  survived: {survivor}")
    width = max(len("module"), *(len(str(row["module"])) for row in rows))
    print(f"\n{'module':<{width}} mutants  killed  equivalent  score")
    for row in rows:
        print(f"{row['module']:<{width}} {row['mutants']:>7} {row['killed']:>7} {row['equivalent']:>11}"
              f"  {row['score']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
