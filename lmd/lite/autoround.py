"""AutoRound-style rounding for one decoder block (Cheng et al., "Optimize Weight Rounding via Signed Gradient
Descent", 2023): every linear's rounding and clipping are learned against the float block's output.

Per linear W [out, in], per (row, group) of g input channels, three learned tensors:

    V      [out, in]     in [-0.5, 0.5]   offset added before rounding (round up or down)
    alpha  [out, in/g]   in [0.5, 1]      the group's max is shrunk to alpha * max
    beta   [out, in/g]   in [0.5, 1]      the group's min is shrunk to beta * min
    scale = (alpha·max − beta·min) / 15 (rounded to fp16),  zero = round(−beta·min / scale) ∈ 0..15
    W'    = (clamp(round(W / scale + V) + zero, 0, 15) − zero) · scale

round is a straight-through estimator. All tensors of the block are updated together by signed gradient descent,
p -= lr · sign(∂L/∂p) with lr decaying linearly from 1/iters to 0, on L = mean squared error between the block's
output with W' and the float block's output, over `batch` random calibration sequences per step. V = 0, alpha = beta
= 1 is exactly round-to-nearest on the min-max grid, the starting point. The result is the same per-group grid
(fp16 scale, integer zero point), so the AutoAWQ gemm format holds. The learned parameters are kept only when they
give a lower block-output error than the starting point on held-out calibration sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call

from lmd.lite.layerwise import LayerInputs
from lmd.lite.quantizer import MAX_CODE, SCALE_DTYPE, QuantizedWeight


@dataclass(frozen=True)
class SignRoundConfig:
    # 20 steps of one 512-token sequence: what fits a 2-core CPU (AutoRound's own: 200 steps of 8 x 2048 tokens)
    iters: int = 20
    batch: int = 1  # calibration sequences per step
    held_out: int = 4  # sequences kept out of training, on which the result must beat the start
    seed: int = 0


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


class _LearnedGrid:
    """V, alpha, beta of one linear, and the fake-quantized weight they give."""

    def __init__(self, weight: torch.Tensor, group_size: int) -> None:
        out, inp = weight.shape
        self.g, self.dtype = group_size, weight.dtype
        self.w = weight.detach().to(torch.float32).reshape(out, inp // group_size, group_size)
        self.wmax = self.w.amax(dim=-1, keepdim=True)
        self.wmin = self.w.amin(dim=-1, keepdim=True)
        self.v = torch.zeros_like(self.w, requires_grad=True)
        self.alpha = torch.ones_like(self.wmax, requires_grad=True)
        self.beta = torch.ones_like(self.wmin, requires_grad=True)

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.v, self.alpha, self.beta]

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        hi, lo = self.wmax * self.alpha, self.wmin * self.beta
        scale = ((hi - lo).clamp(min=1e-5) / MAX_CODE).to(SCALE_DTYPE).to(torch.float32)
        zero = torch.clamp(_round_ste(-lo / scale), 0, MAX_CODE)
        return scale, zero

    def fake_weight(self) -> torch.Tensor:
        scale, zero = self._grid()
        codes = torch.clamp(_round_ste(self.w / scale + self.v) + zero, 0, MAX_CODE)
        return ((codes - zero) * scale).reshape(self.w.shape[0], -1)

    def clamp_(self) -> None:
        with torch.no_grad():
            self.v.clamp_(-0.5, 0.5)
            self.alpha.clamp_(0.5, 1.0)
            self.beta.clamp_(0.5, 1.0)

    def quantized(self) -> QuantizedWeight:
        with torch.no_grad():
            scale, zero = self._grid()
            codes = torch.clamp(torch.round(self.w / scale + self.v) + zero, 0, MAX_CODE)
        out = self.w.shape[0]
        return QuantizedWeight(codes.reshape(out, -1).to(torch.uint8), zero.squeeze(-1).to(torch.uint8),
                               scale.squeeze(-1).to(SCALE_DTYPE), self.g)


def _sequences(inputs: LayerInputs) -> list[tuple[int, int]]:
    """(chunk, row) of every calibration sequence."""
    return [(c, r) for c, h in enumerate(inputs.hidden) for r in range(h.shape[0])]


def _batch_of(inputs: LayerInputs, targets: LayerInputs, picks: list[tuple[int, int]], device: str | torch.device
              ) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    """Hidden states, layer kwargs and float outputs of the picked sequences (all from one chunk's kwargs layout:
    tensors with the chunk's batch dimension are indexed, shared ones pass through)."""
    chunk = picks[0][0]
    rows = torch.tensor([r for _, r in picks])
    batch = inputs.hidden[chunk].shape[0]
    hidden = torch.cat([inputs.hidden[c][r:r + 1] for c, r in picks]).to(device)
    target = torch.cat([targets.hidden[c][r:r + 1] for c, r in picks]).to(device)

    def take(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[rows.to(value.device)].to(device) if value.dim() and value.shape[0] == batch > 1 \
                else value.to(device)
        if isinstance(value, dict):
            return {k: take(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(take(v) for v in value)
        return value

    return hidden, take(inputs.layer_kwargs[chunk]), target


def _block_loss(layer: nn.Module, weights: dict[str, torch.Tensor], batch: tuple) -> torch.Tensor:
    hidden, kwargs, target = batch
    out = functional_call(layer, weights, (hidden,), kwargs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return (out - target).pow(2).mean()


def sign_round_block(layer: nn.Module, paths: tuple[str, ...], group_size: int, inputs: LayerInputs,
                     targets: LayerInputs, config: SignRoundConfig, device: str | torch.device = "cpu"
                     ) -> dict[str, QuantizedWeight]:
    """Learn the rounding of every linear under `paths` of `layer` (already on `device`) so that the block maps
    `inputs` to `targets` (the float block's outputs); returns the codes, leaves the weights untouched."""
    grids = {p: _LearnedGrid(layer.get_submodule(p).weight, group_size) for p in paths}
    sequences = _sequences(inputs)
    generator = torch.Generator().manual_seed(config.seed)
    order = [sequences[i] for i in torch.randperm(len(sequences), generator=generator).tolist()]
    held = order[:config.held_out] if len(order) > config.held_out else order
    train = order[len(held):] or order
    by_chunk: dict[int, list[tuple[int, int]]] = {}
    for pick in train:
        by_chunk.setdefault(pick[0], []).append(pick)
    held_batches = [_batch_of(inputs, targets, [p], device) for p in held]
    frozen = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            start = _held_out_loss(layer, grids, held_batches)
            params = [t for grid in grids.values() for t in grid.params]
            for step in range(config.iters):
                chunk = list(by_chunk)[step % len(by_chunk)]
                rows = by_chunk[chunk]
                first = (step // len(by_chunk) * config.batch) % len(rows)
                picks = (rows[first:] + rows[:first])[:config.batch]
                loss = _block_loss(layer, _weights(grids), _batch_of(inputs, targets, picks, device))
                grads = torch.autograd.grad(loss, params)
                lr = (1 - step / config.iters) / config.iters
                with torch.no_grad():
                    for t, grad in zip(params, grads, strict=True):
                        t.sub_(lr * torch.sign(grad))
                for grid in grids.values():
                    grid.clamp_()
            learned = _held_out_loss(layer, grids, held_batches)
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    if learned >= start:  # never worse than round-to-nearest on the held-out sequences
        for grid in grids.values():
            with torch.no_grad():
                grid.v.zero_()
                grid.alpha.fill_(1.0)
                grid.beta.fill_(1.0)
    return {p: grid.quantized() for p, grid in grids.items()}


def _weights(grids: dict[str, _LearnedGrid]) -> dict[str, torch.Tensor]:
    return {f"{p}.weight": grid.fake_weight().to(grid.dtype) for p, grid in grids.items()}


def _held_out_loss(layer: nn.Module, grids: dict[str, _LearnedGrid], batches: list[tuple]) -> float:
    with torch.no_grad():
        weights = _weights(grids)
        return sum(float(_block_loss(layer, weights, b)) for b in batches) / len(batches)
