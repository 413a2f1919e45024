"""The optimizer of qarl train and of the warm start (MuonAdamW) and the learning-rate schedule (lr_lambda):
Muon's orthogonalized update checked against an SVD and against its formula, the AdamW part against
torch.optim.AdamW, the schedule against values worked out by hand."""

import math

import pytest
import torch

from qarl_cli.optim import MuonAdamW, build_optimizer, is_hidden_matrix, lr_lambda, orthogonalize


def test_orthogonalize_flattens_the_spectrum():
    torch.manual_seed(0)
    for shape in [(64, 192), (192, 64)]:  # (a random square matrix has singular values near 0: too slow to lift)
        g = torch.randn(*shape) @ torch.diag(torch.logspace(-1, 1, shape[1]))  # singular values over ~2 decades
        before = torch.linalg.svdvals(g)
        assert before.max() / before.min() > 10
        s = torch.linalg.svdvals(orthogonalize(g))
        # Five quintic Newton-Schulz steps leave singular values in roughly [0.7, 1.2] (not exactly 1, by design).
        assert s.min() > 0.5 and s.max() < 1.3, (shape, s.min(), s.max())
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        cos = (orthogonalize(g) * (u @ vh)).sum() / (u @ vh).norm() / orthogonalize(g).norm()
        assert cos > 0.9  # it points where U V^T points


def _net():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 8), "proj": torch.nn.Linear(8, 16),
                                "lm_head": torch.nn.Linear(16, 10, bias=False)})


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_parameter_groups_and_their_learning_rates():
    model = _net()
    opt = MuonAdamW(model, lr=1e-2, adamw_lr_ratio=0.2, betas=(0.9, 0.99))
    muon, adamw = opt.param_groups
    assert muon["muon"] and [p.shape for p in muon["params"]] == [torch.Size([16, 8])]  # proj.weight only
    assert not adamw["muon"] and len(adamw["params"]) == 3  # embedding, bias, head
    assert muon["lr"] == 1e-2 and adamw["lr"] == pytest.approx(2e-3, rel=1e-15)
    assert not is_hidden_matrix("lm_head.weight", model["lm_head"].weight)
    assert not is_hidden_matrix("embed_tokens.weight", model["embed_tokens"].weight)
    train = build_optimizer(model, "muon", 1e-2, (0.9, 0.95), 0.0)  # qarl train's: AdamW part at lr / 5
    assert isinstance(train, MuonAdamW) and train.param_groups[1]["lr"] == pytest.approx(2e-3, rel=1e-15)
    assert train.param_groups[1]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_part_computes_what_torch_adamw_computes(weight_decay):
    """Bit for bit: the warm start's recipe (and so the default model) was built with torch.optim.AdamW."""
    ours, ref = _net(), _net()
    opt = MuonAdamW(ours, lr=3e-3, adamw_lr_ratio=0.5, betas=(0.8, 0.95), weight_decay=weight_decay, eps=1e-6)
    rest = [p for n, p in ref.named_parameters() if not is_hidden_matrix(n, p)]
    torch_opt = torch.optim.AdamW(rest, lr=1.5e-3, betas=(0.8, 0.95), weight_decay=weight_decay, eps=1e-6)
    for step in range(4):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
    moved = False
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if not is_hidden_matrix(name, a):
            assert torch.equal(a, b), name
            moved = moved or not torch.equal(a, _net().get_parameter(name))
    assert moved


def test_muon_part_is_orthogonalized_nesterov_momentum():
    """W <- W - lr * 0.2 * sqrt(max(rows, cols)) * orth(g + mu * buf), buf <- mu * buf + g, worked out here for
    two steps with weight decay (W first shrunk by 1 - lr * wd)."""
    model = _net()
    w0 = model["proj"].weight.detach().clone()
    lr, mu, wd = 0.02, 0.9, 0.5
    opt = MuonAdamW(model, lr=lr, adamw_lr_ratio=1.0, betas=(0.9, 0.98), momentum=mu, weight_decay=wd)
    scale = lr * 0.2 * math.sqrt(16)
    expected, buf = w0, torch.zeros_like(w0)
    for step in range(2):
        _grads(model, step)
        g = model["proj"].weight.grad.clone()
        opt.step()
        buf = mu * buf + g
        expected = expected * (1 - lr * wd) - scale * orthogonalize(g + mu * buf)
    torch.testing.assert_close(model["proj"].weight.detach(), expected, rtol=0, atol=1e-6)
    assert (model["proj"].weight.detach() - w0).abs().max() > 1e-2  # it moved


def test_muon_step_has_the_rms_of_an_adamw_step():
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 16, bias=False)})  # weight [16, 64]
    torch.nn.init.zeros_(model["proj"].weight)
    model["proj"].weight.grad = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    MuonAdamW(model, lr=0.01, adamw_lr_ratio=1.0, betas=(0.9, 0.98), momentum=0.0).step()
    # update = O * 0.2 * sqrt(64) * lr, O with singular values near 1: ||O||_F = sqrt(16) over 16 * 64 entries
    rms = model["proj"].weight.detach().pow(2).mean().sqrt().item()
    expected = 0.01 * 0.2 * 64 ** 0.5 * (16 / (16 * 64)) ** 0.5
    assert 0.6 * expected < rms < 1.3 * expected


def test_state_dict_resumes_exactly():
    """What a checkpoint relies on: 2 steps, save, a fresh optimizer loads the state, 2 more = 4 in one go."""
    straight, resumed = _net(), _net()
    kw = dict(lr=1e-2, adamw_lr_ratio=0.2, betas=(0.9, 0.99))
    opt = MuonAdamW(straight, **kw)
    first = MuonAdamW(resumed, **kw)
    for step in range(2):
        _grads(straight, step), _grads(resumed, step)
        opt.step(), first.step()
    second = MuonAdamW(resumed, **kw)
    second.load_state_dict(first.state_dict())
    for step in range(2, 4):
        _grads(straight, step), _grads(resumed, step)
        opt.step(), second.step()
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def test_lr_lambda_warmup_then_cosine_to_its_final_fraction():
    f = lr_lambda(warmup=4, total=14, schedule="cosine")  # cosine over steps 4..14, to 10 %
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-12)  # half way: cos(pi / 2) = 0
    assert f(14) == pytest.approx(0.1, rel=1e-12) and f(1000) == pytest.approx(0.1, rel=1e-12)
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.3)), rel=1e-12)
    g = lr_lambda(warmup=4, total=14, schedule="cosine", final=0.5)
    assert g(14) == pytest.approx(0.5, rel=1e-12) and g(9) == pytest.approx(0.75, rel=1e-12)
    const = lr_lambda(warmup=2, total=10, schedule="constant")
    assert [const(s) for s in (0, 1, 2, 9, 50)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    flat = lr_lambda(warmup=2, total=10, schedule="cosine", final=1.0)  # the warm start's default: no annealing
    assert [flat(s) for s in (0, 1, 2, 5, 9, 50)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_lr_lambda_drives_both_groups_through_lambdalr():
    model = _net()
    opt = MuonAdamW(model, lr=1e-2, adamw_lr_ratio=0.2, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(2, 6, "cosine"))
    seen = []
    for step in range(7):
        seen.append([g["lr"] for g in opt.param_groups])
        _grads(model, step)
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx([5e-3, 1e-3]) and seen[1] == pytest.approx([1e-2, 2e-3])
    assert seen[4] == pytest.approx([1e-2 * 0.55, 2e-3 * 0.55]) and seen[6] == pytest.approx([1e-3, 2e-4])
