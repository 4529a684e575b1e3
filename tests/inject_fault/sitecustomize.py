"""Python imports this at start-up in every process of test_distributed.py's restart test (it puts this
folder on PYTHONPATH): every optimizer step raises, as a bug in the training step would, on every attempt."""
import torch


def failing_step(self, closure=None):
    raise RuntimeError("injected fault: optimizer.step always fails")


torch.optim.SGD.step = failing_step
