#!/usr/bin/env python3
"""The include graph against docs/architecture.md's module table.

The table (the first code block under "## Modules and the direction of
dependencies": module, the modules it stands on, its folder) is read from
the doc itself. Every #include "..." of a source or header is resolved to the
file it names (beside the including file first, then every module's
include/, src/ and top folder) and so to the module whose folder holds it
(the deepest folder wins); that module must be the includer itself or one
its row names. Also an error: a module with no source file, and a folder
under memory/, loader/ or trainer/ with sources that no row names. Prints each violation and
exits 1; with -v, prints the graph's edges.

    python3 scripts/check_layers.py [-v]

--plant FILE=HEADER adds one include to FILE's text, as a test that an arrow
the wrong way is caught (ctest LayersTest.AnArrowUpIsCaught).
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join("docs", "architecture.md")
SOURCE = re.compile(r".*\.(cpp|hpp|cu|h|c)$")
# Modules whose folder holds other modules' folders (rooms): a folder under
# one of them with sources must have a row of its own.
ROOMED = ("memory", "loader", "trainer")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def read_table():
    """{module: (folder, [modules it stands on])} from the doc's code block."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Modules and the direction of dependencies"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    table = {}
    for line in block.splitlines()[1:]:  # the first line is the header
        name, rest = line.split(None, 1)
        deps, folder = rest.rsplit(None, 1)
        deps = [] if deps.strip() == "-" else [d.strip() for d in deps.split(",")]
        table[name] = (folder, deps)
    for name, (_, deps) in table.items():
        for d in deps:
            if d not in table:
                raise SystemExit(f"{DOC}: {name} stands on {d!r}, which has no row")
    return table


def owner(path, table):
    """The module whose folder holds `path` most specifically."""
    best, depth = None, -1
    for name, (folder, _) in table.items():
        if (path == folder or path.startswith(folder + "/")) and folder.count("/") > depth:
            best, depth = name, folder.count("/")
    return best


def main():
    os.chdir(ROOT)
    verbose = "-v" in sys.argv[1:]
    planted = {}
    for arg in sys.argv[1:]:
        if arg.startswith("--plant="):
            file, header = arg[len("--plant="):].split("=", 1)
            planted[file] = f'#include "{header}"\n'
    table = read_table()
    dirs = [d for folder, _ in table.values() for d in (os.path.join(folder, "include"), os.path.join(folder, "src"),
                                                         folder) if os.path.isdir(d)]
    errors, edges, scanned = [], set(), {name: 0 for name in table}
    for name, (top, allowed) in table.items():
        if not os.path.isdir(top):
            errors.append(f"{DOC}: {name}'s folder {top} does not exist")
            continue
        for root, _, files in os.walk(top):
            for fn in files:
                path = os.path.join(root, fn)
                if not SOURCE.match(fn) or owner(path, table) != name:
                    continue
                scanned[name] += 1
                with open(path, encoding="utf-8") as f:
                    text = f.read() + planted.get(path, "")
                for inc in INCLUDE.findall(text):
                    local = os.path.join(root, inc)
                    target = local if os.path.isfile(local) else None
                    for d in [] if target else dirs:
                        if os.path.isfile(os.path.join(d, inc)):
                            target = os.path.join(d, inc)
                            break
                    if target is None:
                        if inc.startswith("pinfeed/"):
                            errors.append(f"{path}: {inc} is in no module's folder")
                        continue  # a third-party header under quotes
                    dep = owner(os.path.normpath(target), table)
                    if dep is None or dep == name:
                        continue
                    edges.add((name, dep))
                    if dep not in allowed:
                        errors.append(f"{path}: includes {inc} ({dep}), which {name} may not stand on")
    for name, count in scanned.items():
        if count == 0:
            errors.append(f"{name}: no source file under {table[name][0]}")
    for top in ROOMED:
        for sub in sorted(os.listdir(top)):
            folder = os.path.join(top, sub)
            if os.path.isdir(folder) and sub not in ("include", "src") and owner(folder, table) == top:
                if any(SOURCE.match(fn) for _, _, files in os.walk(folder) for fn in files):
                    errors.append(f"{folder}: sources in a folder no row of {DOC} names")
    if verbose:
        for a, b in sorted(edges):
            print(f"{a} -> {b}")
    for line in errors:
        print(line)
    if errors:
        return 1
    print(f"{sum(scanned.values())} files, {len(edges)} module edges, none against {DOC}'s table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
