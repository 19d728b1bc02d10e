#!/usr/bin/env python3
"""Every repository path the docs name exists. Scans README.md and docs/*.md for paths under the
repository's top-level folders (`api/backend_config.h`, `tests/`, `scripts/gpu.sh`, in code spans,
code blocks, links or prose; from the repository root) and for relative link targets (from the
doc's folder), and fails naming the doc, the line and each path that is not there.
`kernels/cuda/quant.{h,cu}` names both files; a placeholder (`tests/<name>_test.cc`, `deploy/*`)
names the folder it is in. Paths the root .gitignore covers (build output, local secrets) are
made by following the docs, so they are not checked. --self-test checks the scanner first."""
import argparse
import fnmatch
import pathlib
import re
import sys

# Top-level folders that are outputs or local state, not the repository's: never checked.
NOT_SOURCE = re.compile(r"^(?:build.*|data|out|\..*)$")
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def source_folders(root: pathlib.Path):
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not NOT_SOURCE.match(p.name))


def path_pattern(folders):
    # A path starts at a folder name that no word, dot, slash or dash runs into ("./x" is fine,
    # ".carry/x" and "a-tests/x" are not) and takes path characters; a trailing dot or dash is
    # the sentence's. Placeholders (<name>, {a,b}, *) end the path at the folder above them.
    names = "|".join(re.escape(f) for f in folders)
    return re.compile(rf"(?:(?<=^)|(?<=[^\w.\-/])|(?<=[^\w.]\./))((?:{names})/[\w.\-/]*)")


def paths_in(line: str, pattern):
    for match in pattern.finditer(line):
        path, rest = match.group(1), line[match.end(1):]
        braces = re.match(r"\{([\w.,\-]+)\}([\w.\-/]*)", rest)
        if braces:  # quant.{h,cu}: quant.h and quant.cu
            for choice in braces.group(1).split(","):
                yield (path + choice + braces.group(2)).rstrip(".-")
        elif rest[:1] in ("<", "{", "*"):  # a placeholder: the folder that holds it
            yield path[:path.rfind("/") + 1]
        else:
            yield path.rstrip(".-")


def ignored_by(root: pathlib.Path):
    """Whether the root .gitignore covers a path (a simple reading: its patterns, anchored or
    not, matched against the path and each folder above it)."""
    gitignore = root / ".gitignore"
    patterns = []
    if gitignore.exists():
        for line in gitignore.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "!")):
                patterns.append(line)

    def ignored(path: str) -> bool:
        parts = path.strip("/").split("/")
        for n in range(1, len(parts) + 1):
            prefix = "/".join(parts[:n])
            for pattern in patterns:
                body = pattern.strip("/")
                anchored = "/" in body or pattern.startswith("/")
                if fnmatch.fnmatch(prefix if anchored else parts[n - 1], body):
                    return True
        return False

    return ignored


def links_in(line: str):
    for match in LINK.finditer(line):
        target = match.group(1).split("#", 1)[0]
        if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            yield target


def missing(root: pathlib.Path, doc: pathlib.Path, pattern, ignored):
    """(line number, path) for every path a doc names that does not exist."""
    bad = []
    for number, line in enumerate(doc.read_text(errors="replace").splitlines(), 1):
        for path in dict.fromkeys(paths_in(line, pattern)):
            if not (root / path).exists() and not ignored(path):
                bad.append((number, path))
        for target in dict.fromkeys(links_in(line)):
            if not (doc.parent / target).exists():
                bad.append((number, target))
    return bad


def self_test() -> None:
    pattern = path_pattern(["engine", "tests", "scripts", "docs"])
    line = ("`engine/backend_config.h`, [x](../tests/foo_test.cc) and `./scripts/x.sh --y` in "
            "scripts/gpu.sh. Not .carry/engine/a.h, a-tests/b.cc, https://h/engine/c.h; "
            "`tests/<name>_test.cc`, `engine/cuda/*.cu`, engine/quant.{h,cu}; docs/")
    got = list(paths_in(line, pattern))
    want = ["engine/backend_config.h", "scripts/x.sh", "scripts/gpu.sh", "tests/", "engine/cuda/",
            "engine/quant.h", "engine/quant.cu", "docs/"]
    assert got == want, got
    assert list(links_in("[a](METRICS.md#x) [b](https://x.org/y) [c](#z) [d](../README.md)")) == [
        "METRICS.md", "../README.md"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        self_test()
    root = pathlib.Path(args.root)
    pattern = path_pattern(source_folders(root))
    ignored = ignored_by(root)
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    bad = []
    for doc in docs:
        for number, path in missing(root, doc, pattern, ignored):
            bad.append(f"{doc.relative_to(root)}:{number}: no such path: {path}")
    for line in bad:
        print(line)
    if bad:
        print(f"{len(bad)} path(s) named in the docs do not exist", file=sys.stderr)
        return 1
    print(f"docs: every path named in {len(docs)} docs exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
