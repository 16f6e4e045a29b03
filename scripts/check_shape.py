#!/usr/bin/env python3
"""Checks the rules of the repository's shape that no compiler checks.

- No source file over its limit: 700 lines in src/, capi/src/ and
  tools/src/, 850 in vmm/src/.
- No two modules of a crate import each other, directly or around a loop:
  a module is a file or folder right under src/ (of each crate), and it
  imports another when its files name `crate::OTHER`.
- README.md at most 400 lines.
- Nothing points outside the repository (`../shared`, SPEC.md, MEASURED.md).
- Commit subjects since BASE (default: the last commit before these rules)
  at most 72 characters, in the form `area: what changed`.

    scripts/check_shape.py [--base REV]
"""

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"src": 700, "capi/src": 700, "tools/src": 700, "vmm/src": 850}
CRATES = ["src", "capi/src", "tools/src", "vmm/src"]
# The newest commit made before the subject rule; later ones must follow it.
RULE_BASE = "a126418"
OUTSIDE = re.compile(r"\.\./shared|SPEC\.md|MEASURED\.md")
SUBJECT = re.compile(r"^[A-Za-z0-9_./,+ -]+: \S")


def tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def rust_files(folder):
    for base, _, files in os.walk(os.path.join(ROOT, folder)):
        for f in files:
            if f.endswith(".rs"):
                yield os.path.join(base, f)


def check_sizes(problems):
    for folder, limit in LIMITS.items():
        for path in rust_files(folder):
            with open(path) as f:
                n = sum(1 for _ in f)
            if n > limit:
                problems.append(f"{os.path.relpath(path, ROOT)}: {n} lines, over {limit}")


def module_of(crate_dir, path):
    rel = os.path.relpath(path, crate_dir).split(os.sep)
    name = rel[0][:-3] if rel[0].endswith(".rs") else rel[0]
    return None if name in ("lib", "main", "bin") else name


def check_cycles(problems):
    for crate in CRATES:
        crate_dir = os.path.join(ROOT, crate)
        edges = {}
        for path in rust_files(crate):
            module = module_of(crate_dir, path)
            if module is None:
                continue
            with open(path) as f:
                # Code only: doc links in comments are not imports.
                text = "\n".join(line.split("//")[0] for line in f)
            names = set(re.findall(r"crate::([a-z_][a-z0-9_]*)", text))
            # `use crate::{a, b::C}` names several.
            for group in re.findall(r"crate::\{([^}]*)\}", text):
                names |= set(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group))
            edges.setdefault(module, set()).update(n for n in names if n != module)
        modules = set(edges)
        graph = {m: {n for n in edges[m] if n in modules} for m in modules}
        for loop in module_loops(graph):
            problems.append(f"{crate}: modules import each other: {' -> '.join(loop)}")


def module_loops(graph):
    """The loops a depth-first search of `graph` (module -> the modules it
    imports) meets, each as the modules along it."""
    state, loops = {}, []

    def visit(m, trail):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                loops.append(trail[trail.index(n) :] + [n])
            elif n not in state:
                visit(n, trail + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return loops


def check_readme(problems):
    with open(os.path.join(ROOT, "README.md")) as f:
        n = sum(1 for _ in f)
    if n > 400:
        problems.append(f"README.md: {n} lines, over 400")


def check_outside(problems):
    for rel in tracked():
        if rel == "scripts/check_shape.py" or not os.path.isfile(os.path.join(ROOT, rel)):
            continue
        try:
            with open(os.path.join(ROOT, rel)) as f:
                for i, line in enumerate(f, 1):
                    if OUTSIDE.search(line):
                        problems.append(f"{rel}:{i}: points outside the repository: {line.strip()[:80]}")
        except UnicodeDecodeError:
            continue


def check_subjects(problems, base):
    known = subprocess.run(["git", "cat-file", "-e", f"{base}^{{commit}}"], cwd=ROOT, capture_output=True)
    if known.returncode != 0:
        # A shallow clone without the base: nothing to compare against.
        print(f"commit subjects not checked: {base} is not in this clone")
        return
    out = subprocess.run(["git", "log", "--format=%h %s", f"{base}..HEAD"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        problems.append(f"git log {base}..HEAD failed: {out.stderr.strip()}")
        return
    for line in out.stdout.splitlines():
        sha, subject = line.split(" ", 1)
        if len(subject) > 72 or not SUBJECT.match(subject):
            problems.append(f"commit {sha}: subject not `area: what changed` in 72 characters: {subject[:80]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=RULE_BASE, help=f"check commit subjects after this (default {RULE_BASE})")
    args = p.parse_args()
    problems = []
    check_sizes(problems)
    check_cycles(problems)
    check_readme(problems)
    check_outside(problems)
    check_subjects(problems, args.base)
    for problem in problems:
        print(problem)
    if problems:
        sys.exit(f"{len(problems)} problems")
    print("shape: every rule holds")


if __name__ == "__main__":
    main()
