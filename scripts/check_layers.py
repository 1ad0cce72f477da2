#!/usr/bin/env python3
"""The include graph against docs/architecture.md's module table.

Every #include "..." of a source or header in a module is resolved to the
file it names (the module's own folders first, then every module's include
and source folders) and so to the module that owns it; the owner must be the
module itself or one that the table lets it stand on. Prints each arrow that
runs the wrong way and exits 1; prints the graph's edges with -v.

    python3 scripts/check_layers.py [-v]      (from the repository root)

--plant FILE=HEADER adds one include to FILE's text, as a test that an arrow
the wrong way is caught (ctest LayersTest.AnArrowUpIsCaught).
"""
import os
import re
import sys

# module: (its folders, the modules it may include)
MODULES = {
    "core": (["memory/core"], []),
    "memory": (["memory"], ["core"]),
    "loader": (["loader"], ["memory", "core"]),
    "device": (["trainer/device"], ["loader", "memory", "core"]),
    "launch": (["trainer/launch"], ["core"]),
    "comm": (["trainer/comm"], ["device", "launch", "memory", "core"]),
    "model": (["trainer/model"], ["device", "loader", "memory", "core"]),
    "trainer": (["trainer"], ["model", "comm", "launch", "device", "loader", "memory", "core"]),
    "tools": (["tools"], ["trainer", "model", "comm", "launch", "device", "loader", "memory", "core"]),
    "bench": (["bench"], ["tools", "trainer", "model", "comm", "launch", "device", "loader", "memory", "core"]),
    "capi": (["capi"], ["loader", "memory", "core"]),
    "python": (["python/src"], ["device", "loader", "memory", "core"]),
}
SOURCE = re.compile(r".*\.(cpp|hpp|cu|h|c)$")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def owner(path):
    """The module whose folder holds `path` most specifically."""
    best, depth = None, -1
    for name, (folders, _) in MODULES.items():
        for f in folders:
            if (path == f or path.startswith(f + "/")) and f.count("/") > depth:
                best, depth = name, f.count("/")
    return best


def search_dirs():
    dirs = []
    for folders, _ in MODULES.values():
        for f in folders:
            for sub in ("include", "src", ""):
                d = os.path.join(f, sub) if sub else f
                if os.path.isdir(d):
                    dirs.append(d)
    return dirs


def main():
    verbose = "-v" in sys.argv[1:]
    planted = {}
    for arg in sys.argv[1:]:
        if arg.startswith("--plant="):
            file, header = arg[len("--plant="):].split("=", 1)
            planted[file] = f'#include "{header}"\n'
    dirs = search_dirs()
    bad, edges, unresolved = [], set(), []
    for name, (folders, allowed) in MODULES.items():
        for top in folders:
            for root, _, files in os.walk(top):
                for fn in files:
                    path = os.path.join(root, fn)
                    if not SOURCE.match(fn) or owner(path) != name:
                        continue
                    with open(path, encoding="utf-8") as f:
                        text = f.read() + planted.get(path, "")
                    for inc in INCLUDE.findall(text):
                        local = os.path.join(root, inc)
                        target = local if os.path.isfile(local) else None
                        for d in [] if target else dirs:
                            cand = os.path.join(d, inc)
                            if os.path.isfile(cand):
                                target = cand
                                break
                        if target is None:
                            if inc.startswith("pinfeed/"):
                                unresolved.append(f"{path}: {inc}")
                            continue  # a third-party header under quotes
                        dep = owner(os.path.normpath(target))
                        if dep is None or dep == name:
                            continue
                        edges.add((name, dep))
                        if dep not in allowed:
                            bad.append(f"{path}: includes {inc} ({dep}), which {name} may not stand on")
    if verbose:
        for a, b in sorted(edges):
            print(f"{a} -> {b}")
    for line in unresolved:
        print(f"unresolved: {line}")
    for line in bad:
        print(line)
    if bad or unresolved:
        return 1
    print(f"{len(edges)} module edges, none against the table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
