"""--arch resnet_tiny: resnet18's stem and first block only, the CPU suite's model (conftest.TINY says why)."""
import torch.nn as nn
from torchvision.models import ResNet, _api, list_models
from torchvision.models.resnet import BasicBlock


class TinyResNet(ResNet):
    def __init__(self, num_classes=1000, norm_layer=None):
        super().__init__(BasicBlock, [1, 1, 1, 1], num_classes=num_classes, norm_layer=norm_layer)
        self.layer2 = self.layer3 = self.layer4 = nn.Identity()
        self.fc = nn.Linear(64, num_classes)


def resnet_tiny(**kwargs):
    return TinyResNet(**kwargs)


def register():
    """torchvision.models.get_model("resnet_tiny") builds it, list_models(module=torchvision.models) lists it.
    Called as torchvision.models finishes importing (sitecustomize), when torchvision has no .models yet."""
    if "resnet_tiny" not in list_models():
        resnet_tiny.__module__ = "torchvision.models.resnet"
        _api.register_model()(resnet_tiny)
