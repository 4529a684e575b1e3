"""Python imports this at start-up in every process of a test run that puts this folder on PYTHONPATH
(conftest.FLOAT64 and conftest.fault_at do); environment variables pick what it changes:

COOKBOOK_FLOAT64=1       the trainers build their models and synthetic images in float64 (the
                         training-equivalence runs: conftest.FLOAT64 says why);
COOKBOOK_FAULT_STEP=N    the N-th optimizer step of each process raises, as a bug in the training step
                         would ("every": each step, on every attempt).
"""
import os

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
