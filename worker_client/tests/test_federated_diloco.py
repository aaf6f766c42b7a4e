"""DiLoCo's outer Nesterov step on hand-made tensors."""
import torch

from muninn_worker.federated.aggregation import diloco_outer_step


def test_first_outer_step_applies_the_pseudo_gradient_with_nesterov():
    glob = {"w": torch.tensor([1.0, 2.0])}
    avg = {"w": torch.tensor([0.0, 2.5])}  # pseudo-gradient g = glob - avg = [1, -0.5]

    new, momentum = diloco_outer_step(glob, avg, None, lr=0.5, beta=0.9)

    # m = g; update = g + 0.9 m = 1.9 g; new = glob - 0.5 * 1.9 g
    assert torch.allclose(momentum["w"], torch.tensor([1.0, -0.5]))
    assert torch.allclose(new["w"], torch.tensor([1.0 - 0.95, 2.0 + 0.475]))


def test_momentum_carries_over_between_rounds():
    glob, avg = {"w": torch.tensor([0.0])}, {"w": torch.tensor([-1.0])}  # g = 1
    _, m1 = diloco_outer_step(glob, avg, None, lr=1.0, beta=0.5)
    new, m2 = diloco_outer_step(glob, avg, m1, lr=1.0, beta=0.5)
    assert m2["w"].item() == 1.5  # 0.5 * 1 + 1
    assert new["w"].item() == -(1 + 0.5 * 1.5)


def test_matches_torch_sgd_with_nesterov():
    g = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.randn(5, generator=g))
    opt = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    state, momentum = {"w": param.detach().clone()}, None
    for _ in range(3):
        avg = {"w": state["w"] - 0.1 * torch.randn(5, generator=g)}
        param.grad = param.detach() - avg["w"]
        opt.step()
        state, momentum = diloco_outer_step(state, avg, momentum, lr=0.7, beta=0.9)
        assert torch.allclose(state["w"], param.detach(), atol=1e-6)


def test_learning_rate_one_without_momentum_is_plain_averaging():
    glob, avg = {"w": torch.tensor([3.0, -1.0]), "n": torch.tensor([2])}, {"w": torch.tensor([1.0, 1.0]),
                                                                          "n": torch.tensor([5])}
    new, _ = diloco_outer_step(glob, avg, None, lr=1.0, beta=0.0)
    assert torch.equal(new["w"], avg["w"]) and torch.equal(new["n"], avg["n"])
