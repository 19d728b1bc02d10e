#!/usr/bin/env python3
"""Code comments describe the code as it is; what changed when lives in git. Over the sources,
tests, benchmarks, scripts and CMake files this fails on a comment that names a session, an issue
or ticket number, a before->after pair of figures, "the old code" or "the fix", or that quotes a
measured figure (a time, rate or share next to "measured", "ncu", "took", ...): measured figures go
stale and belong in docs/PERFORMANCE.md. Napkin math (bytes, FLOPs, the time they take at the
device's bandwidth) is allowed. Prints every offending comment with its file and line number."""
import argparse
import pathlib
import re
import sys

FOLDERS = ["api", "core", "engine", "kernels", "harness", "agent", "coordinator", "storage", "cli",
           "proto", "tests", "testing", "bench", "scripts"]
SLASH_SUFFIXES = {".cc", ".h", ".cu", ".cuh", ".proto"}
HASH_SUFFIXES = {".py", ".sh", ".cmake"}
HASH_NAMES = {"CMakeLists.txt"}
# Generated inputs, and this file, whose comments spell out the patterns it looks for.
SKIP = {pathlib.PurePosixPath("tests/fixtures"),
        pathlib.PurePosixPath("tests/comment_history_test.py")}

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
            r"\d+(?:st|nd|rd|th)")
FIGURE = r"\d+(?:\.\d+)?(?: ?(?:us|ms|µs|%))?(?: ?/ ?\d+(?:\.\d+)?(?: ?(?:us|ms|µs|%))?)?"
# Per line of a comment.
PATTERNS = [
    (re.compile(rf"\b(?:{ORDINALS}|next|previous|last|this|that|earlier|later) sessions?\b", re.I),
     "a session"),
    (re.compile(r"\bsessions? \d+\b", re.I), "a session number"),
    (re.compile(r"\b(?:issues?|tickets?|PRs?|pull requests?) ?#?\d+\b", re.I), "an issue number"),
    (re.compile(r"(?<![\w$&{#])#\d+\b"), "an issue number"),
    # "A -> B ms", "A / A' -> B / B' ms", a line that starts "-> B ms" (A, B figures): a figure
    # and the figure it became. Napkin math ("N MB -> T us") has other units on the left and is
    # not matched, nor are bytes ("N -> M MB"), a comparison's value ("x == 0 -> 1") or a list
    # ("-> 1, 3, 5").
    (re.compile(rf"(?<![=<>] )(?<![\w.=<>]){FIGURE} ?(?:->|→) ?{FIGURE}(?![\d.])(?!, ?\d)"
                r"(?! ?[KMGT]?B\b)"), "a before->after figure"),
    (re.compile(rf"^(?://|#) *(?:->|→) ?{FIGURE}"), "a before->after figure"),
    (re.compile(r"\bbefore this change\b", re.I), "a before-this-change note"),
    (re.compile(r"\b(?:the|its) old code\b|\b(?:proving|before|after) the fix\b", re.I),
     "the code's history"),
    (re.compile(r"\bonce (?:ran|took|spent|hung|crashed|failed|returned|gave|measured)\b", re.I),
     "the code's history"),
]
# Per sentence of a comment block: a measured figure is a time, rate or share ...
MEASURED_FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)? ?"
    r"(?:ms|us|µs|ns|[KMGT]B/s|tok/s|[GT]FLOP/s|%(?! ?\d))(?![\w/])")
# ... in a sentence that says it was measured, or a share that one way was faster than another.
# "Napkin" marks the device's measured peak that napkin math divides by ("4.46 TB/s read,
# measured").
MEASURED_WORD = re.compile(
    r"\b(?:measured|ncu|nsys|took|timeline|profiled|clocked|benchmarked|observed|was|were|gave|"
    r"ran)\b|\d ?% (?:faster|slower|longer|shorter)\b", re.I)
NAPKIN = re.compile(r"\bnapkin\b", re.I)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])")


def comment_of(line: str, marker: str) -> str:
    """The comment part of a line: from the marker on ("//", or "#" at the start of the line or
    after a blank), or "" when there is none."""
    if marker == "//":
        at = line.find("//")
        return line[at:] if at >= 0 else ""
    match = re.search(r"(?:^|\s)#", line)
    return line[match.end() - 1:] if match else ""


def blocks(lines, marker):
    """Runs of whole-line comments (and each trailing comment alone) as (first line, text)."""
    start, parts = None, []
    for number, line in enumerate(lines, 1):
        comment = comment_of(line, marker)
        whole = comment and line.strip().startswith(marker)
        if whole:
            if start is None:
                start = number
            parts.append((number, comment[len(marker):].strip()))
            continue
        if parts:
            yield parts
            start, parts = None, []
        if comment:
            yield [(number, comment[len(marker):].strip())]
    if parts:
        yield parts


def measured_figures(parts):
    """(line, sentence) for each sentence of a comment block that quotes a measured figure."""
    text, starts = "", []
    for number, part in parts:
        starts.append((len(text), number))
        text += part + " "
    at = 0
    for sentence in SENTENCE_END.split(text):
        offset = text.index(sentence, at)
        at = offset + len(sentence)
        if NAPKIN.search(sentence) or not MEASURED_WORD.search(sentence):
            continue
        figure = MEASURED_FIGURE.search(sentence)
        if figure:
            line = max(n for o, n in starts if o <= offset + figure.start())
            yield line, sentence.strip()


def marker_of(path: pathlib.Path):
    if path.suffix in SLASH_SUFFIXES:
        return "//"
    if path.suffix in HASH_SUFFIXES or path.name in HASH_NAMES:
        return "#"
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    root = pathlib.Path(parser.parse_args().root)
    bad = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            relative = pathlib.PurePosixPath(path.relative_to(root).as_posix())
            marker = marker_of(path)
            if not marker or any(relative == s or s in relative.parents for s in SKIP):
                continue
            lines = path.read_text(errors="replace").splitlines()
            for number, line in enumerate(lines, 1):
                comment = comment_of(line, marker)
                for what in dict.fromkeys(w for p, w in PATTERNS if p.search(comment)):
                    bad.append(f"{relative}:{number}: {what}: {comment.strip()}")
            for parts in blocks(lines, marker):
                for number, sentence in measured_figures(parts):
                    bad.append(f"{relative}:{number}: a measured figure: {sentence}")
    for line in bad:
        print(line)
    if bad:
        print(f"{len(bad)} comment(s) narrate history or quote measured figures; say what the code "
              "does and why instead (figures: docs/PERFORMANCE.md)", file=sys.stderr)
        return 1
    print("comments: no sessions, issue numbers, before->after or measured figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
