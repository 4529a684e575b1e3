#!/usr/bin/env python
"""README.md's table of methods, computed: the column "lines of `diff distributed.py X.py`".

    python tools/readme_table.py           # rewrite that column of README.md in place
    python tools/readme_table.py --check   # compare only: exit 1, listing each row that differs
    python tools/readme_table.py --readme COPY.md [--check]   # another copy of the README

It also keeps README's count of the shared block's lines, the sentence "The block is **N lines**": the
lines below the banner in distributed.py, what `wc -l` gives minus the banner's line number.

A script's count is what `diff distributed.py X.py | grep -c '^[<>]'` prints: the lines it removes
from distributed.py or adds. Both print, for each script, that count and how many lines it has above
the shared helper block's banner (`# ---- helpers shared by every script ...`).

check_snippets() checks README's code snippets (tests/test_tools.py runs it): a fenced ```python
block right after a line `<!-- snippet: X.py -->` must be lines of X.py, verbatim and contiguous up
to a common indentation; a line `...` in it separates runs of lines that are each checked alone.

Both also check every flag that README.md and docs/*.md give a trainer (check_flags), so that a flag renamed or
removed cannot stay in the docs: it must be an option string of that trainer's argument parser, read from its
source (ast: the strings starting with "-" of its add_argument calls). A flag is the trainer's when it follows
the trainer's name in a command (a fenced shell block's line, a `code span`: `torchrun ... apex_distributed.py
--compile`), up to the command's end; when a code span starts with it under a heading naming one trainer in
backticks (README's method sections); when README's table of methods names it in the trainer's row; and in the
first column of a table headed "flag", whose trainer is the one the page's title names (else distributed.py).
"""
import argparse
import ast
import functools
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE = "distributed.py"
HEADER = "lines of `diff distributed.py X.py`"
BANNER = "# ---- helpers shared by every script"
SNIPPET = re.compile(r"<!-- snippet: (\S+) -->")
BLOCK_COUNT = re.compile(r"The block is \*\*([\d,]+) lines\*\*")


def diff_count(script):
    """`diff distributed.py SCRIPT | grep -c '^[<>]'`."""
    r = subprocess.run(["diff", REFERENCE, script], cwd=REPO, capture_output=True)
    if r.returncode > 1:
        sys.exit(f"error: diff {REFERENCE} {script}: {r.stderr.decode().strip()}")
    return sum(line.startswith((b"<", b">")) for line in r.stdout.split(b"\n"))


def lines_above_banner(script):
    lines = (REPO / script).read_text().splitlines()
    return next((i for i, line in enumerate(lines) if line.startswith(BANNER)), None)


def cells(row):
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def table_rows(text):
    """The table of methods: (line index, script, cells, index of the diff column) for each row."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("|") and HEADER in line), None)
    if header is None:
        sys.exit(f"error: the README has no table with a column {HEADER!r}")
    column = cells(lines[header]).index(HEADER)
    rows = []
    for i in range(header + 2, len(lines)):
        if not lines[i].startswith("|"):
            break
        row = cells(lines[i])
        rows.append((i, row[0].strip("`"), row, column))
    return rows


def snippets(text):
    """(README line number of the block's first line, script, the block's lines) for each marked block;
    a marker with no ```python block right after it gives an empty block."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        marker = SNIPPET.fullmatch(line.strip())
        if not marker:
            continue
        block = []
        if i + 1 < len(lines) and lines[i + 1].strip() == "```python":
            end = next((k for k in range(i + 2, len(lines)) if lines[k].strip() == "```"), len(lines))
            block = lines[i + 2:end]
        found.append((i + 3, marker.group(1), block))
    return found


def check_snippets(text, readme="README.md"):
    """Problems with README's snippets, one line each: a snippet line not where it should be in its
    script (naming both lines), a script of the table without a snippet."""
    problems, shown = [], set()
    for first, script, block in snippets(text):
        shown.add(script)
        if not block:
            problems.append(f"{readme}:{first - 2}: the marker needs a ```python block right after it")
            continue
        if not (REPO / script).is_file():
            problems.append(f"{readme}:{first - 2}: no script {script}")
            continue
        source = (REPO / script).read_text().splitlines()
        runs, start = [], 0
        for k, line in enumerate(block + ["..."]):
            if line.strip() == "...":
                if k > start:
                    runs.append((first + start, block[start:k]))
                start = k + 1
        for number, run in runs:
            want = dedented(run)
            # Where the script matches the most of the run's first lines: the first line after those differs.
            starts = [i for i, line in enumerate(source) if line.strip() == run[0].strip()]
            matched, at = max(((prefix_match(want, dedented(source[i:i + len(run)])), i) for i in starts),
                              default=(0, 0))
            if matched < len(run):
                near = f" (after {script}:{at + matched})" if matched else ""
                problems.append(f"{readme}:{number + matched}: not a line of {script} where the snippet puts it"
                                f"{near}: {run[matched].strip()!r}")
    for _, script, _, _ in table_rows(text):
        if script not in shown:
            problems.append(f"{readme}: {script} has no snippet (a ```python block after <!-- snippet: {script} -->)")
    return problems


@functools.cache
def trainer_options(script):
    """Every option string (`-j`, `--workers`) SCRIPT's argument parser accepts: the string arguments that start
    with "-" of its add_argument calls (training_arguments calls it `add`), plus argparse's own --help."""
    options = {"-h", "--help"}
    for node in ast.walk(ast.parse((REPO / script).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "add_argument", "add"):
            options.update(arg.value for arg in node.args
                           if isinstance(arg, ast.Constant) and str(arg.value).startswith("-"))
    return options


FLAG = re.compile(r"-{1,2}[A-Za-z][\w-]*")
COMMAND_END = {"|", "||", "&&", ";", "&", ">", "2>&1"}  # a token after which the trainer's flags stop
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}


def shell_and_prose(text):
    """The commands of the fenced shell blocks, (line number, command): a line ending in a backslash is joined
    with the next, a comment cut off; Python blocks are no commands. And the text outside fenced blocks, their
    lines blanked so that offsets still give line numbers."""
    found, fence, prose, joined = [], None, [], False
    for number, line in enumerate(text.splitlines(), 1):
        prose.append("")
        if line.lstrip().startswith("```"):
            fence, joined = line.strip().strip("`").strip() if fence is None else None, False
        elif fence is None:
            prose[-1] = line
        elif fence in SHELL_FENCES:
            line = re.sub(r"(^|\s)#.*", "", line)
            if joined:
                found[-1] = (found[-1][0], found[-1][1] + " " + line)
            else:
                found.append((number, line))
            joined = line.endswith("\\")
    return found, "\n".join(prose)


def flag_uses(text, title_script):
    """(line number, trainer, flag) for each flag the text gives a trainer: in a command, after the trainer's name;
    in a `code span` that starts with a flag, under a heading naming one trainer in backticks (README's sections);
    in the method column of README's table of methods, its row's; in the first column of a table headed "flag",
    title_script's."""
    trainers = {path.name for path in REPO.glob("*.py")}
    fenced, prose = shell_and_prose(text)
    spans = [(prose.count("\n", 0, span.start()) + 1, span[1].replace("\\|", "|"))
             for span in re.finditer(r"`([^`]+)`", prose)]
    uses = []
    for number, command in fenced + spans:
        script = None
        for token in command.split():
            token = token.strip("[](),")
            if token in trainers:
                script = token
            elif token in COMMAND_END or token.endswith((".py", ".sh")):
                script = None
            elif script and FLAG.fullmatch(token.split("=")[0]):
                uses.append((number, script, token.split("=")[0]))
    lines, section, script = prose.splitlines(), {}, None
    for number, line in enumerate(lines, 1):
        if re.match(r"#+ ", line):
            named = {name for name in re.findall(r"`([\w.]+\.py)`", line) if name in trainers}
            script = named.pop() if len(named) == 1 else None
        section[number] = script
    uses += [(number, section[number], token.split("=")[0]) for number, span in spans
             if section[number] and FLAG.fullmatch(span.split()[0].split("=")[0])
             for token in span.split() if FLAG.fullmatch(token.split("=")[0])]
    rows = table_rows(text) if any(line.startswith("|") and HEADER in line for line in lines) else []
    uses += [(i + 1, script, token) for i, script, row, _ in rows for span in re.findall(r"`([^`]+)`", row[1])
             for token in re.split(r"[\s/]", span) if FLAG.fullmatch(token)]
    header = None
    for number, line in enumerate(lines, 1):
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells(line)[0] == "flag"
        elif header:
            uses += [(number, title_script, token) for span in re.findall(r"`([^`]+)`", cells(line)[0])
                     for token in span.replace("\\|", "|").split() if FLAG.fullmatch(token)]
    return uses


def check_flags(text, name):
    """Problems, one line each: a flag that NAME's text gives a trainer whose argument parser has no such option.
    A table of flags is the trainer's of the page's title (its first line), else distributed.py's."""
    title = re.findall(r"[\w.]+\.py", next(iter(text.splitlines()), ""))
    title_script = next((script for script in title if (REPO / script).is_file()), REFERENCE)
    return [f"{name}:{number}: {flag} is not a flag of {script}"
            for number, script, flag in sorted(flag_uses(text, title_script)) if flag not in trainer_options(script)]


def dedented(lines):
    return textwrap.dedent("\n".join(lines)).splitlines()


def prefix_match(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare the column with the counts: exit 1 if any differs")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md", help="the README to check or rewrite")
    args = parser.parse_args(argv)
    readme = args.readme
    lines = readme.read_text().splitlines(keepends=True)
    rows = table_rows("".join(lines))
    mismatches = []
    print(f"{'script':32} {'diff lines':>10} {'lines above the banner':>22}")
    for i, script, row, column in rows:
        count = diff_count(script)
        print(f"{script:32} {count:10} {lines_above_banner(script)!s:>22}")
        if row[column] != str(count):
            mismatches.append(f"{readme.name}:{i + 1}: {script}: the table says {row[column]}, diff gives {count}")
            row[column] = str(count)
            lines[i] = "| " + " | ".join(row) + " |\n"
    text, block = "".join(lines), len((REPO / REFERENCE).read_text().splitlines()) - lines_above_banner(REFERENCE) - 1
    print(f"shared block: {block} lines")
    stated = BLOCK_COUNT.search(text)
    if not stated:
        sys.exit(f'error: {readme.name} has no sentence "The block is **N lines**"')
    if stated[1].replace(",", "") != str(block):
        line = text.count("\n", 0, stated.start()) + 1
        mismatches.append(f"{readme.name}:{line}: the shared block: README says {stated[1]} lines, it has {block:,}")
        lines = (text[:stated.start(1)] + f"{block:,}" + text[stated.end(1):]).splitlines(keepends=True)
    missing = sorted({p.name for p in REPO.glob("*.py")} - {script for _, script, _, _ in rows})
    problems = [f"{readme.name}: {script} has no row in the table" for script in missing] + check_flags(text, readme.name)
    for page in sorted((REPO / "docs").glob("*.md")):
        problems += check_flags(page.read_text(), page.relative_to(REPO).as_posix())
    if args.check:
        problems = mismatches + problems
    elif mismatches:
        readme.write_text("".join(lines))
        print(f"{readme.name}: {len(mismatches)} row(s) updated")
    if problems:
        print("\n".join(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
