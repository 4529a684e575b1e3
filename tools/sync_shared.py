#!/usr/bin/env python
"""Copy distributed.py's shared helper block into every other trainer script.

The helpers are copy-pasted on purpose (each script stands alone); tests/test_consistency.py fails
when a copy drifts. After changing a helper in distributed.py, run this to carry the change over:

    python tools/sync_shared.py            # rewrites the block in each script that has drifted
    python tools/sync_shared.py --check    # only lists them (exit 1 if any)
"""
import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN = "# ---- helpers shared by every script"
END = "# ---- end of shared helpers ----"
SCRIPTS = ["dataparallel.py", "multiprocessing_distributed.py", "apex_distributed.py", "horovod_distributed.py",
           "distributed_slurm_main.py", "fsdp_distributed.py", "deepspeed_distributed.py"]


def split(text, name):
    """(before, block, after) around the marker lines, the markers belonging to the block."""
    lines = text.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.startswith(BEGIN)]
    ends = [i for i, line in enumerate(lines) if line.startswith(END)]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        sys.exit(f"error: {name} needs one '{BEGIN} ...' line and one '{END}' line after it")
    return "".join(lines[:begins[0]]), "".join(lines[begins[0]:ends[0] + 1]), "".join(lines[ends[0] + 1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="list drifted scripts, change nothing")
    args = parser.parse_args()
    _, reference, _ = split((REPO / "distributed.py").read_text(), "distributed.py")
    drifted = []
    for name in SCRIPTS:
        path = REPO / name
        if not path.exists():
            continue
        before, block, after = split(path.read_text(), name)
        if block != reference:
            drifted.append(name)
            if not args.check:
                path.write_text(before + reference + after)
    verb = "drifted" if args.check else "updated"
    print(f"{verb}: {', '.join(drifted)}" if drifted else "every script has distributed.py's shared helpers")
    sys.exit(1 if args.check and drifted else 0)


if __name__ == "__main__":
    main()
