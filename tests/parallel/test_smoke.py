import torch
from torch import nn

import multigpu


def test_two_cpu_replicas_match_one_device() -> None:
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(10, 8), torch.randint(0, 3, (10,))
    nn.functional.cross_entropy(multigpu.DataParallel(net, devices="cpu:2")(x), y).backward()
    nn.functional.cross_entropy(ref(x), y).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
