#!/usr/bin/env python3
"""Code comments describe the code as it is: no session numbers, no ordinal-session words and no
before->after timings in the engine, kernels, harness, agent, coordinator or API sources (that
history lives in git). Prints every offending line with its file and line number."""
import argparse
import pathlib
import re
import sys

FOLDERS = ["api", "core", "engine", "kernels", "harness", "agent", "coordinator", "storage", "cli"]
SUFFIXES = {".cc", ".h", ".cu", ".cuh"}
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
            r"\d+(?:st|nd|rd|th)")
FIGURE = r"\d+(?:\.\d+)?(?: ?(?:us|ms|µs|%))?(?: ?/ ?\d+(?:\.\d+)?(?: ?(?:us|ms|µs|%))?)?"
PATTERNS = [
    (re.compile(rf"\b(?:{ORDINALS}|next|previous|last|this|that|earlier|later) sessions?\b", re.I),
     "a session"),
    (re.compile(r"\bsessions? \d+\b", re.I), "a session number"),
    # "A -> B ms", "A / A' -> B / B' ms", a line that starts "-> B ms" (A, B figures): a figure
    # and the figure it became. Napkin math ("N MB -> T us") has other units on the left and is
    # not matched, nor are bytes ("N -> M MB").
    (re.compile(rf"(?<![\w.]){FIGURE} ?(?:->|→) ?{FIGURE}(?![\d.])(?! ?[KMGT]?B\b)"),
     "a before->after figure"),
    (re.compile(rf"^// *(?:->|→) ?{FIGURE}"), "a before->after figure"),
    (re.compile(r"\bbefore this change\b", re.I), "a before-this-change note"),
]


def comment_of(line: str) -> str:
    at = line.find("//")
    return line[at:] if at >= 0 else ""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    root = pathlib.Path(parser.parse_args().root)
    bad = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                comment = comment_of(line)
                for pattern, what in PATTERNS:
                    if pattern.search(comment):
                        bad.append(f"{path.relative_to(root)}:{number}: {what}: {comment.strip()}")
    for line in bad:
        print(line)
    if bad:
        print(f"{len(bad)} comment(s) narrate history; say what the code does and why instead",
              file=sys.stderr)
        return 1
    print("comments: no session numbers or before->after figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
