"""Muon's orthogonalized update, checked against an SVD."""

import torch

from qarl_cli.optim import Muon, is_hidden_matrix, muon_with_adamw, orthogonalize


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


def test_muon_step_is_scaled_like_adamw():
    p = torch.nn.Parameter(torch.zeros(16, 64))
    p.grad = torch.randn(16, 64)
    Muon([p], lr=0.01, momentum=0.0).step()
    # update = O * 0.2 * sqrt(64) * lr, with O's singular values near 1: RMS about 0.2 * 8 * 0.01 / sqrt(64) * 4
    rms = p.detach().pow(2).mean().sqrt().item()
    expected = 0.01 * 0.2 * 64 ** 0.5 * (16 / (16 * 64)) ** 0.5  # ||O||_F = sqrt(16) spread over 16*64 entries
    assert 0.6 * expected < rms < 1.3 * expected


def test_parameter_split():
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 8), "proj": torch.nn.Linear(8, 8),
                                 "lm_head": torch.nn.Linear(8, 10, bias=False)})
    muon, adamw = muon_with_adamw(model, lr=1e-3)
    assert [p.shape for g in muon.param_groups for p in g["params"]] == [torch.Size([8, 8])]
    assert len([p for g in adamw.param_groups for p in g["params"]]) == 3  # embedding, bias, head
    assert not is_hidden_matrix("lm_head.weight", model["lm_head"].weight)
