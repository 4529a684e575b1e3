"""Python imports this at start-up in every process of a training-equivalence run (conftest.FLOAT64 puts
this folder on PYTHONPATH): the trainers then build their models and synthetic images in float64."""
import torch

torch.set_default_dtype(torch.float64)
