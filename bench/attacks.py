"""The attacks of :mod:`bench.leakage`: what an honest-but-curious trunk server fits on what it sees.

* labels from the gradients a client sends back: the norm and direction attacks of Li et al., "Label Leakage
  and Protection in Two-party Split Learning" (:func:`label_attacks`);
* inputs from the cut's activations: a decoder (images, :func:`invert_images`) or a per-position probe (token
  ids, :func:`invert_tokens`) trained on public data and scored on the private data's activations.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn


def auc(scores: np.ndarray, positives: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties averaged)."""
    from scipy.stats import rankdata

    positives = positives.astype(bool)
    n1, n0 = int(positives.sum()), int((~positives).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[positives].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def label_attacks(grads: torch.Tensor, labels: torch.Tensor, generator: torch.Generator,
                  max_points: int = 600) -> dict[str, float]:
    """Norm and direction attacks on per-example gradients (rows) with integer labels."""
    g = grads.flatten(1).double()
    y = labels.numpy()
    if len(y) > max_points:
        keep = torch.randperm(len(y), generator=generator)[:max_points].numpy()
        g, y = g[keep], y[keep]
    norms = g.norm(dim=1).numpy()
    classes = [c for c in np.unique(y) if 0 < (y == c).sum() < len(y)]
    frequent = [c for c in classes if (y == c).sum() >= 10] or classes  # AUCs of rarer labels are noise
    norm_auc = float(np.mean([auc(norms, y == c) for c in frequent]))
    unit = g / g.norm(dim=1, keepdim=True).clamp_min(1e-30)
    cos = (unit @ unit.T).numpy()
    iu = np.triu_indices(len(y), k=1)
    cos_auc = auc(cos[iu], (y[:, None] == y[None, :])[iu])
    # The server knows the label of one example of each class and labels the others like the most similar one.
    refs = [int(np.flatnonzero(y == c)[0]) for c in classes]
    others = np.setdiff1d(np.arange(len(y)), refs)
    guess = np.asarray(classes)[cos[np.ix_(others, refs)].argmax(1)]
    return {"label-norm-auc": norm_auc, "label-cosine-auc": cos_auc,
            "label-1-shot-acc": float((guess == y[others]).mean())}


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 7) -> float:
    """Mean structural similarity of two batches of images in [0, 1] (uniform 7x7 window)."""
    pool = nn.AvgPool2d(window, stride=1)
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mu_a, mu_b = pool(a), pool(b)
    var_a = pool(a * a) - mu_a ** 2
    var_b = pool(b * b) - mu_b ** 2
    cov = pool(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return float(s.mean())


def _standardize(public: torch.Tensor, private: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Scale both by the public data's per-feature mean and std (what any attacker does first)."""
    mean, std = public.mean(dims, keepdim=True), public.std(dims, keepdim=True).clamp_min(1e-8)
    return (public - mean) / std, (private - mean) / std


def _fit(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
         steps: int, batch: int, generator: torch.Generator, lr: float = 2e-3) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(inputs), (batch,), generator=generator)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(inputs[idx]), targets[idx]).backward()
        opt.step()
    return model.eval()


def invert_images(public_act: torch.Tensor, public_x: torch.Tensor, private_act: torch.Tensor,
                  private_x: torch.Tensor, steps: int, generator: torch.Generator) -> dict[str, float]:
    """Train a decoder activation -> image on public data; score it on the private activations."""
    channels = public_act.shape[1]
    public_act, private_act = _standardize(public_act, private_act, (0, 2, 3))
    decoder = nn.Sequential(nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
                            nn.ConvTranspose2d(32, 1, 4, stride=2, padding=1), nn.Sigmoid())
    _fit(decoder, public_act, public_x, nn.functional.mse_loss, steps, 64, generator)
    with torch.no_grad():
        recon = decoder(private_act)
    mean_image = public_x.mean(0, keepdim=True).expand_as(private_x)
    return {"inversion-mse": float(nn.functional.mse_loss(recon, private_x)),
            "inversion-ssim": ssim(recon, private_x),
            "baseline-mse": float(nn.functional.mse_loss(mean_image, private_x)),
            "baseline-ssim": ssim(mean_image, private_x)}


def invert_tokens(public_act: torch.Tensor, public_ids: torch.Tensor, private_act: torch.Tensor,
                  private_ids: torch.Tensor, vocab: int, steps: int, generator: torch.Generator) -> dict[str, float]:
    """Train a per-position probe hidden state -> token id on public windows; accuracy on private ones."""
    hidden = public_act.shape[-1]
    public_act, private_act = _standardize(public_act, private_act, (0, 1))
    probe = nn.Sequential(nn.Linear(hidden, 256), nn.ReLU(), nn.Linear(256, vocab))
    _fit(probe, public_act.reshape(-1, hidden), public_ids.reshape(-1), nn.functional.cross_entropy, steps, 512,
         generator)
    with torch.no_grad():
        pred = probe(private_act.reshape(-1, hidden)).argmax(-1)
    majority = torch.bincount(public_ids.reshape(-1), minlength=vocab).argmax()
    return {"token-recovery-acc": float((pred == private_ids.reshape(-1)).float().mean()),
            "baseline-token-acc": float((private_ids.reshape(-1) == majority).float().mean())}
