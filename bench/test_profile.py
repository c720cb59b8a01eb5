"""Where a test run's CPU time goes, from a py-spy profile of every process it starts.

    pip install py-spy
    py-spy record --subprocesses --format raw --rate 10 -o slow.raw -- python -m pytest -m slow -q -p no:cacheprovider
    python bench/test_profile.py slow.raw --rate 10 > bench/results/slow-tier-profile.md

The samples are summed by the kind of process (pytest itself, a recipe's process, a launcher, a worker of the
reward or tool pool), by what it was doing (importing a module, or anything else), by the package an import spent
its time in, and by the first of this package's functions under which the rest ran. Only running threads are
sampled, so the sums are CPU seconds, not wall time: on 2 cores the wall time is between half and all of them.
"""

from __future__ import annotations

import argparse
import collections
import re

SITE = re.compile(r".*/site-packages/")


def process_kind(command: str) -> str:
    if "finetune.tasks.workers" in command:
        return "pool worker"
    if "accelerate.commands.launch" in command or "torch.distributed.run" in command:
        return "launcher"
    if match := re.search(r"recipes/(\w+)\.py", command):
        return f"recipe {match[1]}"
    return "pytest" if re.search(r"(-m |bin/)pytest ", command) else "other"  # not a path under /tmp/pytest-of-*


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy's --format raw output")
    parser.add_argument("--rate", type=float, default=10, help="the samples a second py-spy took (--rate)")
    parser.add_argument("--top", type=int, default=15, help="rows of each table")
    args = parser.parse_args()

    kinds, activity, packages, functions = (collections.Counter() for _ in range(4))
    started: dict[str, set[str]] = collections.defaultdict(set)
    for line in open(args.raw):
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        processes = [k for k, frame in enumerate(frames) if frame.startswith("process ")]
        own = frames[processes[-1] + 1:] if processes else frames
        kind = process_kind(frames[processes[-1]] if processes else "")
        seconds = int(count) / args.rate
        kinds[kind] += seconds
        if processes:
            started[kind].add(frames[processes[-1]].split(":", 1)[0])
        modules = [frame for frame in own if frame.startswith("<module> (")]
        if any("_find_and_load" in frame for frame in own) and modules:
            activity[(kind.split()[0], "importing")] += seconds
            packages[SITE.sub("", modules[-1].split("(", 1)[1]).split("/")[0].split(":")[0]] += seconds
            continue
        activity[(kind.split()[0], "the rest")] += seconds
        ours = [m for m in (re.match(r"(\w+) \(.*?(finetune/[\w/]+\.py)", frame) for frame in own) if m]
        # below the entry points: the function the training loop (or a test) called, else the loop's own code
        inner = [m for m in ours if m[1] not in {"main", "run_main", "run_recipe", "train"}] or ours[-1:]
        functions[f"{inner[0][2]}:{inner[0][1]}" if inner else "(outside this package's functions)"] += seconds

    def table(title: str, counter: collections.Counter, label) -> None:
        print(f"\n| {title} | CPU s |\n|---|---|")
        for key, seconds in counter.most_common(args.top):
            print(f"| {label(key)} | {seconds:.0f} |")

    print(f"{sum(kinds.values()):.0f} CPU seconds sampled in all")
    print("\n| process kind | processes sampled | CPU s |\n|---|---|---|")
    for kind, seconds in kinds.most_common(args.top):
        print(f"| {kind} | {len(started[kind])} | {seconds:.0f} |")
    table("process kind, doing", activity, lambda key: f"{key[0]}, {key[1]}")
    table("package an import spent its time in", packages, str)
    table("not importing: under this package's function", functions, lambda key: f"`{key}`")


if __name__ == "__main__":
    main()
