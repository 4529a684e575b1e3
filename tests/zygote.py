"""A Python that has imported torch and torchvision once, then forks a child per request that runs a script as
`python SCRIPT ARGS...` runs it (conftest.run with launcher="forked": the single-process bad-input cases).

Each trainer process spends ~4.5 CPU-s importing torch and torchvision before its first line can fail; a child
of this process starts there. The child runs the script as __main__ from its first line, with its own argv,
environment, working directory, stdin (/dev/null), stdout and stderr (files), and ends as the interpreter does:
SystemExit's status, a traceback and 1 for an uncaught exception, atexit handlers run. No torch op runs here
before a fork, so no thread of torch's is copied half-way through its work.

Protocol, one JSON line each way: {"script", "args", "env", "cwd", "stdout", "stderr", "hooks"} in (hooks: the
sitecustomize.py to run again in the child, for the run's own COOKBOOK_* variables, or null); {"pid"} as the
child starts, then {"returncode"} (negative: killed by that signal, as subprocess reports it) as it ends.
"""
import json
import os
import runpy
import sys

import torch  # noqa: F401  (what the fork saves each child)
import torchvision  # noqa: F401

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if request["hooks"]:  # tests/hooks/sitecustomize.py ran as this process started, without the run's variables
            runpy.run_path(request["hooks"])
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(request["script"])  # as python puts the script's folder first
        runpy.run_path(request["script"], run_name="__main__")
        sys.exit()  # the script returned: exit 0, as python does (SystemExit and errors propagate past the loop)
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
