"""Python imports this at start-up in every process of a test run that puts this folder on PYTHONPATH
(conftest.FLOAT64 and conftest.fault_at do); environment variables pick what it changes:

COOKBOOK_FLOAT64=1       the trainers build their models and synthetic images in float64 (the
                         training-equivalence runs: conftest.FLOAT64 says why);
COOKBOOK_FAULT_STEP=N    the N-th optimizer step of each process raises, as a bug in the training step
                         would ("every": each step, on every attempt);
COOKBOOK_OVERFLOW_STEP=N the N-th GradScaler step of each process finds an inf gradient, as an fp16
                         overflow would;
COOKBOOK_SIGNAL_STEP=N   each process sends itself SIGTERM in its N-th optimizer step, as a launcher
                         stopping the job would;
COOKBOOK_RECORD_READS=D  each process appends the path of every file numpy.fromfile reads (the DALI
                         loader's reads) to D/rank<RANK>.txt;
COOKBOOK_RECORD_WORKERS=D each DataLoader worker writes the command line of its process (how it was
                         started: one forked by the fork server names forkserver's main) to D/<pid>.txt;
COOKBOOK_HIDE_DALI=1     nvidia.dali cannot be imported, as where it is not installed;
COOKBOOK_CUDA_REPORT=DIR each process writes DIR/<its pid>: whether it started CUDA, as it exits.
COOKBOOK_TINY_RESNET=1   --arch resnet_tiny exists (tiny_resnet.py), once the process imports torchvision.

conftest.environment() sets PYTHONPATH and COOKBOOK_TINY_RESNET for every process a test starts, launchers
and probes too: this module imports torch only for the hooks that need it.
"""
import os
import signal
import sys

if any(name in os.environ for name in ("COOKBOOK_FLOAT64", "COOKBOOK_FAULT_STEP", "COOKBOOK_OVERFLOW_STEP",
                                       "COOKBOOK_SIGNAL_STEP", "COOKBOOK_RECORD_WORKERS", "COOKBOOK_CUDA_REPORT")):
    import torch

if os.environ.get("COOKBOOK_FLOAT64") == "1":
    torch.set_default_dtype(torch.float64)

if "COOKBOOK_FAULT_STEP" in os.environ:
    fault_step, steps = os.environ["COOKBOOK_FAULT_STEP"], 0
    original_step = torch.optim.SGD.step

    def failing_step(self, closure=None):
        global steps
        steps += 1
        if fault_step in ("every", str(steps)):
            raise RuntimeError(f"injected fault: optimizer step {steps} fails")
        return original_step(self, closure)

    torch.optim.SGD.step = failing_step

if "COOKBOOK_OVERFLOW_STEP" in os.environ:
    # GradScaler checks the gradients for inf/NaN here once a step, whether it unscales them (unfused
    # optimizers) or hands the result to a fused step.
    overflow_step, checks = int(os.environ["COOKBOOK_OVERFLOW_STEP"]), 0
    original_check = torch.amp.GradScaler._unscale_grads_

    def overflowing_check(self, optimizer, *args, **kwargs):
        global checks
        checks += 1
        if checks == overflow_step:
            grad = next(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            grad[(0,) * grad.dim()] = float("inf")  # in place at any strides (channels_last on GPUs)
        return original_check(self, optimizer, *args, **kwargs)

    torch.amp.GradScaler._unscale_grads_ = overflowing_check

if "COOKBOOK_SIGNAL_STEP" in os.environ:
    signal_step, signalled_steps = int(os.environ["COOKBOOK_SIGNAL_STEP"]), 0
    step_before_signal = torch.optim.SGD.step

    def signalling_step(self, *args, **kwargs):
        global signalled_steps
        signalled_steps += 1
        if signalled_steps == signal_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_before_signal(self, *args, **kwargs)

    torch.optim.SGD.step = signalling_step

if "COOKBOOK_RECORD_READS" in os.environ:
    import numpy

    original_fromfile = numpy.fromfile

    def recording_fromfile(file, *args, **kwargs):
        with open(os.path.join(os.environ["COOKBOOK_RECORD_READS"], f"rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
            f.write(f"{file}\n")
        return original_fromfile(file, *args, **kwargs)

    numpy.fromfile = recording_fromfile

if "COOKBOOK_RECORD_WORKERS" in os.environ:
    import torch.utils.data._utils.worker as worker

    original_worker_loop = worker._worker_loop

    def recording_worker_loop(*args, **kwargs):
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as cmdline, \
                open(os.path.join(os.environ["COOKBOOK_RECORD_WORKERS"], f"{os.getpid()}.txt"), "wb") as record:
            record.write(cmdline.read().replace(b"\0", b" "))
        return original_worker_loop(*args, **kwargs)

    worker._worker_loop = recording_worker_loop

if os.environ.get("COOKBOOK_HIDE_DALI") == "1":
    class HideDali:
        def find_spec(self, name, path=None, target=None):
            if name == "nvidia.dali" or name.startswith("nvidia.dali."):
                raise ModuleNotFoundError(f"No module named '{name}'", name=name)

    sys.meta_path.insert(0, HideDali())

if "COOKBOOK_CUDA_REPORT" in os.environ:
    import atexit

    def report_cuda():
        # Whether this process started CUDA (torch's lazy init: a context on a GPU), written as it exits.
        with open(os.path.join(os.environ["COOKBOOK_CUDA_REPORT"], str(os.getpid())), "w") as f:
            f.write(str(torch.cuda.is_initialized()))

    atexit.register(report_cuda)

if os.environ.get("COOKBOOK_TINY_RESNET") == "1":
    import importlib.abc
    import importlib.util

    class RegisterTinyResNet(importlib.abc.MetaPathFinder):
        """Registers resnet_tiny right after torchvision.models is imported: importing torchvision here
        would cost every process (a launcher's too) 3 CPU seconds."""

        def find_spec(self, name, path=None, target=None):
            if name != "torchvision.models":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_register(module):
                exec_module(module)
                import tiny_resnet
                tiny_resnet.register()

            spec.loader.exec_module = exec_and_register
            return spec

    sys.meta_path.insert(0, RegisterTinyResNet())
