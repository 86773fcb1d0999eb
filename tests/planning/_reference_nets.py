"""Module trees equivalent to the planner's presets and to the blocks its FLOP counts are checked on.

Built from the architectures' published shapes (He et al. 2016, Simonyan & Zisserman 2015,
Radford et al. 2019; Sandler et al. 2018 for MobileNetV2's inverted residual, Xie et al. 2017 for
ResNeXt's grouped bottleneck), so that the preset counts (parameters, modules, ops) can be checked
without torchvision or transformers.
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck (stride on the 3x3, as torchvision's v1.5); ``groups`` > 1: ResNeXt's."""

    def __init__(self, cin: int, width: int, stride: int = 1, groups: int = 1, expansion: int = 4) -> None:
        super().__init__()
        cout = width * expansion if groups == 1 else cin
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, ...], classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], 64
        for i, (blocks, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            stage = []
            for j in range(blocks):
                stage.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = width * 4
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50() -> nn.Module:
    return ResNet((3, 4, 6, 3))


def resnet101() -> nn.Module:
    return ResNet((3, 4, 23, 3))


def vgg16() -> nn.Module:
    layers: list[nn.Module] = []
    cin = 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            cin = int(v)
    classifier = [nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(True)]
    return nn.Sequential(
        nn.Sequential(*layers),
        nn.AdaptiveAvgPool2d(7),
        nn.Flatten(),
        nn.Sequential(*classifier, nn.Dropout(), nn.Linear(4096, 1000)),
    )


class _GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gelu = nn.GELU(approximate="tanh")
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.c_proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x)))))


class GPT2(nn.Module):
    """GPT-2 small's shapes (124,439,808 parameters, LM head tied to the token embedding)."""

    def __init__(self, vocab: int = 50257, seq: int = 1024, d: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(_GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def inverted_residual(cin: int = 32, expand: int = 6) -> nn.Module:
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project (no bias, BatchNorm after each)."""
    hidden = cin * expand
    return nn.Sequential(
        nn.Conv2d(cin, hidden, 1, bias=False),
        nn.BatchNorm2d(hidden),
        nn.ReLU6(inplace=True),
        nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False),
        nn.BatchNorm2d(hidden),
        nn.ReLU6(inplace=True),
        nn.Conv2d(hidden, cin, 1, bias=False),
        nn.BatchNorm2d(cin),
    )


def resnext_block(channels: int = 256, width: int = 128, groups: int = 32) -> nn.Module:
    """ResNeXt's 32x4d bottleneck: 1x1 reduce, 3x3 grouped (32 groups), 1x1 expand."""
    return Bottleneck(channels, width, 1, groups=groups)


def conv_macs(cin: int, cout: int, kernel: int, groups: int, out_hw: int) -> int:
    """Multiply-accumulates of one convolution per sample (analytic: each output element sums cin/groups * k * k)."""
    return cout * (cin // groups) * kernel * kernel * out_hw * out_hw


def small_cnn() -> nn.Module:
    """benchmarks/planner_accuracy.py's CNN: three conv-BatchNorm-ReLU blocks on 3x32x32 images, 57 k parameters."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for cin, cout, stride in ((3, 32, 1), (32, 64, 2), (64, 64, 2)):
        layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
