"""Every trainer script carries distributed.py's shared helper block byte for byte.

The cookbook copies its helpers into each standalone script on purpose (one file to read and to
copy); this test is what keeps the copies from drifting apart.
"""
import ast
import difflib
import re

import pytest

from conftest import REPO, script_module

REFERENCE = "distributed.py"
SCRIPTS = ["dataparallel.py", "multiprocessing_distributed.py", "apex_distributed.py", "horovod_distributed.py",
           "distributed_slurm_main.py", "fsdp_distributed.py", "deepspeed_distributed.py"]
BEGIN = "# ---- helpers shared by every script: skip them on a first read ----\n"
END = "# ---- end of shared helpers ----\n"
# What the block holds. Moving a helper in or out of it is a decision for every script at once:
# make it here too. In any order: the block's section banners decide where each one stands.
SHARED_HELPERS = ["UsageError", "LocalError", "report", "log", "ArgumentParser", "number", "step_range",
                  "training_arguments", "seed_everything", "pick_device", "require_bf16", "check_no_gpu_left_out",
                  "check_slurm_step", "check_batch", "join_process_group", "check_output_dir", "claim_output_dir",
                  "common_seed", "build_datasets", "ListedFolder", "start_fork_server", "init_worker", "FileTable",
                  "open_image", "pick_decoder", "load_image", "SyntheticImages", "build_model", "build_loaders",
                  "SampleSeeded", "ResumableSampler", "shard_batches", "import_dali", "DaliLoader", "normalization",
                  "to_device", "val_batches", "lr_schedule", "Progress", "AverageMeter", "correct_counts",
                  "diverged", "check_finite", "rng_state", "to_cpu", "checkpoint_paths", "digest",
                  "write_atomically", "seal", "intact", "save_checkpoint", "choose_checkpoint", "load_checkpoint",
                  "resume_training", "report_start", "summary", "report_epoch", "open_metrics", "write_metrics",
                  "start_profile", "Stopped", "run", "stalled_ranks", "stop_on_signals", "supervise",
                  "state_digest"]
# The block's sections, each opened by a one-line banner `# ---- NAME: what it holds ----`, in the order
# main_worker meets them: a reader looking for a helper finds its section from the banners alone.
SECTIONS = ["flags and errors", "set-up", "data", "the training loop's bookkeeping", "checkpoints",
            "metrics and profiling", "exit"]


def shared_block(path):
    """The lines from the BEGIN marker to the END marker, both included; fails naming what is missing."""
    lines = path.read_text().splitlines(keepends=True)
    for marker in (BEGIN, END):
        if lines.count(marker) != 1:
            pytest.fail(f"{path.name}: needs the line {marker.strip()!r} exactly once, found {lines.count(marker)}")
    begin, end = lines.index(BEGIN), lines.index(END)
    if end < begin:
        pytest.fail(f"{path.name}: {END.strip()!r} comes before {BEGIN.strip()!r}")
    return lines[begin:end + 1]


def check_same_helpers(path, reference=REPO / REFERENCE):
    expected, actual = shared_block(reference), shared_block(path)
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected, actual, f"{reference.name} (shared helpers)",
                                            f"{path.name} (shared helpers)"))
        pytest.fail(f"{path.name}: its shared helper block differs from {reference.name}'s; copy the block "
                    f"from {reference.name} (or change both):\n{diff}", pytrace=False)


def test_reference_block_holds_the_shared_helpers():
    tree = ast.parse("".join(shared_block(REPO / REFERENCE)))
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert sorted(defined) == sorted(SHARED_HELPERS)


@pytest.mark.parametrize("script", [REFERENCE] + SCRIPTS)
def test_block_is_in_sections(script):
    block = shared_block(REPO / script)[1:-1]
    banners = [i for i, line in enumerate(block) if line.startswith("# ----")]
    malformed = [block[i] for i in banners if not re.fullmatch(r"# ---- [^:]+: \S.* ----\n", block[i])]
    assert not malformed, f"{script}: a section banner is one line `# ---- NAME: what it holds ----`: {malformed}"
    assert [block[i][len("# ---- "):block[i].index(":")] for i in banners] == SECTIONS
    first = ast.parse("".join(block)).body[0]
    assert banners and banners[0] < first.lineno - 1, f"{script}: helpers before the first section banner"


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_has_the_reference_helpers(script):
    check_same_helpers(REPO / script)


# Method-part functions each script keeps verbatim from distributed.py, so that `diff distributed.py X.py`
# shows only the method's lines: a change to one of them in distributed.py is made in these scripts too.
COMMUNICATION = ["all_reduce_sum", "all_gather_objects", "broadcast_buffers", "leave_process_group"]
SAME_AS_REFERENCE = {
    "multiprocessing_distributed.py": COMMUNICATION + ["gradient_sync", "main_worker", "train", "validate", "finish"],
    "distributed_slurm_main.py": COMMUNICATION + ["gradient_sync", "main_worker", "train", "validate", "finish"],
    "apex_distributed.py": COMMUNICATION + ["gradient_sync", "launcher_name", "main", "finish"],
    "dataparallel.py": COMMUNICATION + ["train", "validate", "finish"],
    "horovod_distributed.py": ["main", "validate", "finish"],
    "fsdp_distributed.py": COMMUNICATION + ["launcher_name", "main", "train", "finish"],
    "deepspeed_distributed.py": COMMUNICATION + ["main"],
}


def functions(path):
    source = path.read_text()
    return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_method_part_differs_only_in_the_method(script):
    reference, own = functions(REPO / REFERENCE), functions(REPO / script)
    differ = [name for name in SAME_AS_REFERENCE[script] if own.get(name) != reference[name]]
    assert not differ, f"{script}: {', '.join(differ)} differ(s) from {REFERENCE}'s"


# ---- the check itself fails when it should ----

def test_drift_is_reported_as_a_diff_naming_the_script(tmp_path):
    drifted = tmp_path / "drifted_trainer.py"
    text = (REPO / REFERENCE).read_text()
    drifted.write_text(text.replace('        print(*args, **kwargs, flush=True)', '        print(*args, **kwargs)', 1))
    with pytest.raises(pytest.fail.Exception) as failure:
        check_same_helpers(drifted)
    message = str(failure.value)
    assert "drifted_trainer.py: its shared helper block differs" in message
    assert "-        print(*args, **kwargs, flush=True)\n+        print(*args, **kwargs)\n" in message


@pytest.mark.parametrize("marker", [BEGIN, END])
def test_missing_marker_is_reported(tmp_path, marker):
    unmarked = tmp_path / "unmarked_trainer.py"
    unmarked.write_text((REPO / REFERENCE).read_text().replace(marker, ""))
    with pytest.raises(pytest.fail.Exception, match="unmarked_trainer.py: needs the line .*found 0"):
        check_same_helpers(unmarked)


# ---- every numeric flag of every script is range-checked, in one error line ----

@pytest.mark.parametrize("script", [REFERENCE] + SCRIPTS)
def test_every_numeric_flag_is_range_checked(script, capsys):
    """Each flag that takes a number parses it with the shared number(): a value out of its range
    is one line naming the flag, the value and the range, and exit 2. A flag added with a bare
    type=int (or a numeric default and no type) fails here."""
    parser = script_module(script).argument_parser()
    checked = 0
    for action in parser._actions:
        numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
        if action.type in (int, float) or (numeric_default and action.type is None):
            pytest.fail(f"{script}: {action.option_strings[0]} takes a number without a range: use type=number(...)")
        if not hasattr(action.type, "bounds"):
            continue
        low, high = action.type.bounds
        for bad in [low - 1] + ([high + 1] if high is not None else []):
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args([action.option_strings[0], str(bad)])
            lines = capsys.readouterr().err.splitlines()
            assert exit_.value.code == 2 and len(lines) == 1, lines
            assert lines[0].startswith(f"error: argument {action.option_strings[0]}") and f"{bad} is out of range" in \
                lines[0] and f"{low:g}" in lines[0], lines[0]
        checked += 1
    assert checked >= 15, f"{script}: only {checked} numeric flags found"
