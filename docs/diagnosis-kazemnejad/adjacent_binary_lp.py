# Is there a bilinear score f(i,j) = b_i^T W b_j + v^T b_j on 4-bit codes (positions 0..15) under which,
# for every query i, the target positions score above every other position j != i by a margin 1?
# Convex (hinge on linear margins): loss 0 is reachable iff such a score exists; 4000 Adam steps
# approximate the optimum.
# Run from the repository root: .venv/bin/python docs/diagnosis-kazemnejad/adjacent_binary_lp.py

import torch

torch.manual_seed(0)
L = 16


def codes(kind):
    t = torch.arange(L)
    if kind == "binary":
        return ((t[:, None] >> torch.arange(4)) & 1).double()
    if kind == "sinusoidal":
        d = 64
        i = torch.arange(0, d, 2).double()
        ang = t[:, None].double() / 10000 ** (i / d)
        return torch.cat([ang.sin(), ang.cos()], 1)


def pairs(target):
    P = []
    for i in range(L):
        pos = [j for j in range(L) if target(i, j)]
        neg = [j for j in range(L) if j != i and not target(i, j)]
        P += [(i, n, m) for n in pos for m in neg]
    return torch.tensor(P)


for kind in ("binary", "sinusoidal"):
    b = codes(kind)
    D = b.shape[1]
    for name, target in (
        ("adjacent |i-j|=1", lambda i, j: abs(i - j) == 1),
        ("next j=i+1", lambda i, j: j == i + 1),
        ("previous j=i-1", lambda i, j: j == i - 1),
    ):
        P = pairs(target)
        W = torch.zeros(D, D, dtype=torch.double, requires_grad=True)
        v = torch.zeros(D, dtype=torch.double, requires_grad=True)
        opt = torch.optim.Adam([W, v], lr=0.05)
        for _ in range(4000):
            f = b @ W @ b.T + (b @ v)[None, :]
            margin = f[P[:, 0], P[:, 1]] - f[P[:, 0], P[:, 2]]
            loss = torch.relu(1 - margin).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        f = (b @ W @ b.T + (b @ v)[None, :]).detach()
        margin = f[P[:, 0], P[:, 1]] - f[P[:, 0], P[:, 2]]
        bad = sorted({int(i) for i in P[margin <= 0, 0]})
        wrong = (margin <= 0).sum().item()
        print(f"{kind:10s} {name:18s} hinge {loss.item():.4f}  violated pairs {wrong}/{len(P)}  queries failing {bad}")
