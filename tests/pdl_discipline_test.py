#!/usr/bin/env python3
"""The kernels keep the programmatic-dependent-launch rules of kernels/cuda/common.cuh:
- a kernel that calls AllowDependentsToLaunch() calls WaitForPrerequisites() before it, so that
  when a kernel starts, every kernel but the one before it has finished (what a kernel may read
  before its own wait rests on that);
- every kernel launched through Launch() (the programmatic launch), by name, through a
  `launch(Kernel<...>)` lambda that calls Launch(kernel, ...), or through LaunchForHeadDim,
  calls WaitForPrerequisites().
Scans kernels/cuda/**/*.cu and *.cuh and fails naming the file, the line and the kernel.
--self-test checks the scanner on sources that break each rule first."""
import argparse
import pathlib
import re
import sys

GLOBAL = re.compile(r"__global__")
BOUNDS = re.compile(r"__launch_bounds__\s*\([^)]*\)")
NAME = re.compile(r"([A-Za-z_]\w*)\s*\(")
DIRECT_LAUNCH = re.compile(r"(?<![\w.])Launch\(\s*([A-Za-z_]\w*)")
LAMBDA_LAUNCH = re.compile(r"auto\s+launch\s*=\s*\[[^\]]*\]\s*\(\s*auto\s+(\w+)\s*\)\s*\{\s*Launch\(\s*\1\b")
LAMBDA_CALL = re.compile(r"(?<![\w.])launch\(\s*([A-Za-z_]\w*)")
# attention_mma.cuh's LaunchForHeadDim launches, through Launch(), what its first lambda returns.
HEAD_DIM_LAUNCH = re.compile(
    r"LaunchForHeadDim\(\s*\[[^\]]*\]\s*\(\s*auto\s+\w+\s*\)\s*\{\s*return\s+([A-Za-z_]\w*)")
WAIT = "WaitForPrerequisites()"
TRIGGER = "AllowDependentsToLaunch()"


def matching(text, start, open_char, close_char):
    """The index of the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_char:
            depth += 1
        elif text[i] == close_char:
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def kernels(text):
    """(name, line, body) of each __global__ function defined in `text`."""
    for m in GLOBAL.finditer(text):
        head = BOUNDS.sub("", text[m.end():m.end() + 800])
        name = NAME.search(head)
        if not name:
            continue
        at = text.find(name.group(1) + "(", m.end())
        if at < 0:
            continue
        params_end = matching(text, text.find("(", at), "(", ")")
        after = text[params_end + 1:].lstrip()
        if not after.startswith("{"):
            continue  # a declaration
        body_start = text.find("{", params_end)
        body_end = matching(text, body_start, "{", "}")
        yield name.group(1), text.count("\n", 0, m.start()) + 1, text[body_start:body_end + 1]


def launched_programmatically(text):
    """Names passed to Launch() directly, through a `launch` lambda that calls Launch(), and
    through LaunchForHeadDim."""
    names = {m.group(1) for m in DIRECT_LAUNCH.finditer(text)}
    names |= {m.group(1) for m in HEAD_DIM_LAUNCH.finditer(text)}
    if LAMBDA_LAUNCH.search(text):
        names |= {m.group(1) for m in LAMBDA_CALL.finditer(text)}
    return names


def check(sources):
    """Violations over {path: text}, as 'path:line: message' strings."""
    problems, bodies, launched = [], {}, set()
    for path, text in sources.items():
        for name, line, body in kernels(text):
            bodies.setdefault(name, []).append((path, line, body))
            wait, trigger = body.find(WAIT), body.find(TRIGGER)
            if trigger >= 0 and (wait < 0 or trigger < wait):
                problems.append(f"{path}:{line}: {name} calls {TRIGGER} before {WAIT}")
        launched |= launched_programmatically(text)
    for name in sorted(launched):
        for path, line, body in bodies.get(name, []):
            if WAIT not in body:
                problems.append(f"{path}:{line}: {name} is launched through Launch() (programmatic "
                                f"dependent launch) but never calls {WAIT}")
        if name not in bodies and name.endswith("Kernel"):
            problems.append(f"{name}: launched through Launch() but no __global__ definition found")
    return problems


def self_test():
    good = """
__global__ void __launch_bounds__(128) Good(const float* x) {
  WaitForPrerequisites();
  AllowDependentsToLaunch();
}
__global__ void Plain(const float* x) { }
void Run() { Launch(Good, 1, 1, 0, s, x); LaunchPlain(Plain, 1, 1, 0, s, x); }
"""
    early_trigger = """
__global__ void Early(const float* x) {
  AllowDependentsToLaunch();
  WaitForPrerequisites();
}
"""
    no_wait = """
template <int N>
__global__ void NoWait(const float* x) { }
void Run() {
  auto launch = [&](auto kernel) { Launch(kernel, 1, 1, 0, s, x); };
  launch(NoWait<4>);
}
"""
    missing = "void Run() { Launch(GoneKernel, 1, 1, 0, s, x); }\n"
    head_dim = """
template <int D>
__global__ void ByHeadDim(const float* x) { }
void Run() { LaunchForHeadDim([](auto d) { return ByHeadDim<decltype(d)::value>; }, shape, 64); }
"""
    cases = [({"good.cu": good}, 0, None), ({"early.cu": early_trigger}, 1, "before"),
             ({"lambda.cu": no_wait}, 1, "never calls"), ({"gone.cu": missing}, 1, "no __global__"),
             ({"head_dim.cu": head_dim}, 1, "never calls")]
    for sources, count, word in cases:
        found = check(sources)
        if len(found) != count or (word and word not in found[0]):
            print(f"self-test failed on {list(sources)}: {found}")
            return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default=".")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if not self_test():
        return 1
    if args.self_test:
        print("self-test passed")
        return 0
    root = pathlib.Path(args.root)
    files = sorted(list(root.glob("kernels/cuda/**/*.cu")) + list(root.glob("kernels/cuda/**/*.cuh")))
    sources = {str(f.relative_to(root)): f.read_text() for f in files}
    problems = check(sources)
    for p in problems:
        print(p)
    count = sum(1 for text in sources.values() for _ in kernels(text))
    print(f"{len(files)} files, {count} kernels: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
