"""AWQ int4 weight quantization of a causal LM, one decoder block at a time (llm-awq / AutoAWQ semantics).

Per block, in order:
  1. run the float block over all calibration samples, gathering each linear input's statistics and samples
     (awq_inputs); its outputs become the next block's inputs (float outputs, before any change, as in AutoAWQ);
  2. search the scales of every scale group on the unmodified block, then fold all of them in (awq_search):
       attn_norm -> q, k, v   (loss on the attention output)
       v -> o                 (one to one; under GQA only with gqa_v_o: one scale per v channel, shared by the
                               query heads that read it; AutoAWQ skips the group under GQA)
       mlp_norm -> gate, up   (loss on the MLP output)
       up -> down             (loss on down's output)
  3. search and apply weight clipping for every linear except q and k, on the scaled inputs (awq_clip);
  4. quantize every linear (asymmetric, per group, int4) and put the dequantized weight back into the model, so the
     model that comes out is the fake-quantized one (for evaluation) and the codes are returned (for export).
With search_scale and clip both off this is plain round-to-nearest (the RTN baseline runs the same code).

Opt-in extensions beyond AWQ (same output format): asym_clip (awq_clip: top and bottom of the range shrunk
separately), refine_scale (awq_refine: each group's grid fitted to its input Gram matrix), gptq (gptq: error-feedback
rounding on the AWQ grid), quantized_inputs (each block calibrated on the outputs of the already-quantized blocks
before it, as GPTQ does, instead of the float ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from lmd.arch import ArchSpec, decoder_layers, get_arch, get_module
from lmd.errors import LmdError
from lmd.lite.autoround import SignRoundConfig, sign_round_block
from lmd.lite.awq_clip import apply_clip, apply_clip_range, search_clip, search_clip_asymmetric
from lmd.lite.awq_inputs import BlockInputs, collect_block_inputs
from lmd.lite.awq_round import Rounding, round_linear
from lmd.lite.awq_search import HeadTying, ScaleGroup, ScaleResult, fold_scales, search_scale
from lmd.lite.layerwise import LayerInputs, capture_layer0_inputs, layer_on, run_layer
from lmd.lite.quantizer import QuantizedWeight, fitting_group_sizes

GROUP_SIZES = (128, 64, 32)
DUO_MODES = {"on": (True,), "off": (False,), "auto": (False, True)}


@dataclass(frozen=True)
class AwqConfig:
    w_bits: int = 4
    group_size: int = 128
    search_scale: bool = True
    clip: bool = True
    duo_scaling: str = "on"  # on: AutoAWQ's x^a / w^(1-a); off: llm-awq's x^a; auto: both grids, best loss wins
    search_tokens: int = 4096  # token rows the scale search re-runs modules on (0 = all calibration tokens)
    clip_tokens: int = 512
    gqa_v_o: bool = False  # search v -> o scales under GQA too, tied across each KV head's query heads
    asym_clip: bool = False  # clip search over (low, high) pairs instead of a symmetric limit
    refine_scale: bool = False  # fit each group's scale and zero point to its input Gram matrix after clipping
    gptq: bool = False  # GPTQ error-feedback rounding on the AWQ grid
    quantized_inputs: bool = False  # calibrate each block on the quantized previous blocks' outputs
    sign_round: bool = False  # AutoRound: rounding and clipping learned against the float block's output
    sign_round_iters: int = SignRoundConfig.iters
    sign_round_batch: int = SignRoundConfig.batch  # calibration sequences per signed-gradient step
    batch_size: int = 16
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.w_bits != 4:
            raise LmdError(f"--w-bits {self.w_bits} is not supported; lmd awq writes int4 (AutoAWQ gemm): use --w-bits 4")
        if self.group_size not in GROUP_SIZES:
            raise LmdError(
                f"--w-group-size {self.group_size} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}"
            )
        if self.duo_scaling not in DUO_MODES:
            raise LmdError(f"--duo-scaling {self.duo_scaling!r} is not valid; use auto, on or off")
        if self.batch_size < 1:
            raise LmdError(f"--batch-size {self.batch_size} must be at least 1")
        if self.asym_clip and not self.clip:
            raise LmdError("--asym-clip changes the clip search, which --no-clip turns off; drop one of them")
        if self.sign_round and (self.clip or self.rounding.needs_hessian):
            raise LmdError("--method autoround learns its own clipping and rounding: it does not combine with the "
                           "clip search, --gptq or --refine-scale; drop them or use --method awq / awq-gptq")
        if self.sign_round_iters < 1 or self.sign_round_batch < 1:
            raise LmdError(f"--autoround-iters {self.sign_round_iters} and --autoround-batch "
                           f"{self.sign_round_batch} must be at least 1")
        if self.quantized_inputs and not self.calibrated:
            raise LmdError(
                "--quantized-inputs needs a calibrated method; drop --no-search-scale/--no-clip or add "
                "--gptq or --refine-scale"
            )

    @property
    def rounding(self) -> Rounding:
        return Rounding(refine=self.refine_scale, gptq=self.gptq)

    @property
    def method(self) -> str:
        if self.search_scale and self.clip:
            base = "awq"
        elif self.search_scale:
            base = "awq-scale"
        else:
            base = "rtn-clip" if self.clip else "rtn"
        if self.sign_round:
            return ("awq-scale" if self.search_scale else "") + ("+" if self.search_scale else "") + "autoround"
        return base + ("+refine" if self.refine_scale else "") + ("+gptq" if self.gptq else "")

    @property
    def calibrated(self) -> bool:
        """Whether the method reads activations (plain RTN does not)."""
        return self.search_scale or self.clip or self.rounding.needs_hessian or self.sign_round


@dataclass(frozen=True)
class LayerReport:
    index: int
    scales: tuple[ScaleResult, ...]


def check_group_size(model: nn.Module, arch: ArchSpec, group_size: int) -> None:
    """Every linear's input width must be a multiple of the group size (never change it silently)."""
    for i, layer in enumerate(decoder_layers(model, model.config)):
        for path in arch.linears:
            linear = get_module(layer, path)
            if linear.in_features % group_size:
                fits = fitting_group_sizes(linear.in_features, GROUP_SIZES)
                hint = f"use --w-group-size {' or '.join(map(str, fits))}" if fits else "no supported group size fits"
                raise LmdError(
                    f"--w-group-size {group_size}: {arch.layers}.{i}.{path} has {linear.in_features} "
                    f"input channels, not a multiple of {group_size}; {hint}"
                )
            if linear.out_features % 8:
                raise LmdError(
                    f"{arch.layers}.{i}.{path} has {linear.out_features} output channels, not a multiple "
                    "of 8; the AWQ gemm format packs 8 output channels per int32"
                )


def quantize_model(
    model: nn.Module, input_ids: torch.Tensor, config: AwqConfig, on_layer: Callable[[LayerReport], None] | None = None
) -> dict[str, QuantizedWeight]:
    """Quantize every decoder linear of `model` in place (fake-quantized weights) and return their int4 codes."""
    arch = get_arch(model.config)
    check_group_size(model, arch, config.group_size)
    layers = decoder_layers(model, model.config)
    if not config.calibrated:
        return _round_to_nearest(layers, arch, config.group_size, on_layer)
    offload = next(model.parameters()).device
    inputs = capture_layer0_inputs(model, input_ids, config.device, config.batch_size, offload)
    quantized: dict[str, QuantizedWeight] = {}
    for index, layer in enumerate(layers):
        with layer_on(layer, config.device):
            block = collect_block_inputs(
                layer,
                arch,
                inputs,
                config.device,
                config.search_tokens,
                config.clip_tokens,
                offload,
                keep_gram=config.rounding.needs_hessian,
            )
            results = _scale_block(layer, arch, block, config) if config.search_scale else ()
            # refine/gptq approximate the weights as they were before clipping (without clipping: the weights)
            targets = (
                {path: get_module(layer, path).weight.detach().clone() for path in arch.linears}
                if config.rounding.needs_hessian and config.clip
                else None
            )
            if config.clip:
                _clip_block(layer, arch, block, config.group_size, config.asym_clip)
            if config.sign_round:
                quantized.update(_sign_round_layer(layer, arch, index, inputs, block, config))
            else:
                quantized.update(
                    _quantize_layer(layer, arch, index, config.group_size, config.rounding, block, targets)
                )
            # GPTQ-style: the next block sees what this quantized block makes of the (already quantized) inputs
            inputs = run_layer(layer, inputs, config.device, offload) if config.quantized_inputs else block.outputs
        del block, targets
        if on_layer is not None:
            on_layer(LayerReport(index, tuple(results)))
    return quantized


def _round_to_nearest(
    layers: nn.ModuleList, arch: ArchSpec, group_size: int, on_layer: Callable[[LayerReport], None] | None
) -> dict[str, QuantizedWeight]:
    """Plain RTN needs no calibration data: quantize every linear where it lies."""
    quantized: dict[str, QuantizedWeight] = {}
    for index, layer in enumerate(layers):
        quantized.update(_quantize_layer(layer, arch, index, group_size))
        if on_layer is not None:
            on_layer(LayerReport(index, ()))
    return quantized


def _sign_round_layer(
    layer: nn.Module, arch: ArchSpec, index: int, inputs: LayerInputs, block: BlockInputs, config: AwqConfig
) -> dict[str, QuantizedWeight]:
    """AutoRound on the (scaled) block: codes learned against the float block's outputs on these inputs."""
    learned = sign_round_block(
        layer,
        arch.linears,
        config.group_size,
        inputs,
        block.outputs,
        SignRoundConfig(iters=config.sign_round_iters, batch=config.sign_round_batch),
        config.device,
    )
    quantized = {}
    for path, q in learned.items():
        linear = get_module(layer, path)
        linear.weight.data = q.dequantize(linear.weight.dtype)
        quantized[f"{arch.layers}.{index}.{path}"] = _to_host(q)
    return quantized


def _site_of(arch: ArchSpec) -> dict[str, str]:
    """Which collected input each linear reads."""
    return {
        arch.q: "qkv",
        arch.k: "qkv",
        arch.v: "qkv",
        arch.o: "o",
        arch.gate: "gate_up",
        arch.up: "gate_up",
        arch.down: "down",
    }


def _quantize_layer(
    layer: nn.Module,
    arch: ArchSpec,
    index: int,
    group_size: int,
    rounding: Rounding = Rounding(),
    block: BlockInputs | None = None,
    targets: dict[str, torch.Tensor] | None = None,
) -> dict[str, QuantizedWeight]:
    """Quantize each linear and leave its dequantized weight in the model (the fake-quantized model). `targets`: the
    weights before clipping, which refine/gptq rounding approximates."""
    quantized = {}
    site_of = _site_of(arch)
    for path in arch.linears:
        linear = get_module(layer, path)
        weight = linear.weight.detach()
        hessian = block.sites[site_of[path]].hessian if block is not None and rounding.needs_hessian else None
        q = round_linear(targets[path] if targets else weight, weight, group_size, rounding, hessian)
        linear.weight.data = q.dequantize(linear.weight.dtype)
        quantized[f"{arch.layers}.{index}.{path}"] = _to_host(q)
    return quantized


def scale_groups(layer: nn.Module, arch: ArchSpec, block: BlockInputs, gqa_v_o: bool = False) -> list[ScaleGroup]:
    def m(path: str) -> nn.Module:
        return get_module(layer, path)

    sites = block.sites
    attn = m(arch.attn)

    def run_attention() -> torch.Tensor:
        outs = []
        for args, kwargs in block.attn_calls:
            out = attn(*args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            outs.append(out.reshape(-1, out.shape[-1]))
        return torch.cat(outs)

    def run_on(module: nn.Module, rows: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: module(rows)

    q, k, v, o = m(arch.q), m(arch.k), m(arch.v), m(arch.o)
    groups = [
        ScaleGroup(f"{arch.attn_norm} -> q,k,v", m(arch.attn_norm), [q, k, v], "qkv", sites["qkv"].x_mean, run_attention)
    ]
    if v.out_features == o.in_features:
        groups.append(ScaleGroup("v -> o", v, [o], "o", sites["o"].x_mean, run_on(o, sites["o"].search_rows())))
    elif gqa_v_o and o.in_features % v.out_features == 0:
        head_dim = int(attn.head_dim)
        tying = HeadTying(v.out_features // head_dim, o.in_features // v.out_features, head_dim)
        groups.append(
            ScaleGroup("v -> o (GQA, tied)", v, [o], "o", sites["o"].x_mean, run_on(o, sites["o"].search_rows()), tying)
        )
    gate, up, down = m(arch.gate), m(arch.up), m(arch.down)
    groups.append(
        ScaleGroup(
            f"{arch.mlp_norm} -> gate,up",
            m(arch.mlp_norm),
            [gate, up],
            "gate_up",
            sites["gate_up"].x_mean,
            run_on(m(arch.mlp), sites["gate_up"].search_rows()),
        )
    )
    groups.append(
        ScaleGroup("up -> down", up, [down], "down", sites["down"].x_mean, run_on(down, sites["down"].search_rows()))
    )
    return groups


def _scale_block(layer: nn.Module, arch: ArchSpec, block: BlockInputs, config: AwqConfig) -> tuple[ScaleResult, ...]:
    groups = scale_groups(layer, arch, block, config.gqa_v_o)
    results = [search_scale(g, config.group_size, DUO_MODES[config.duo_scaling]) for g in groups]
    for group, result in zip(groups, results, strict=True):
        fold_scales(group.prev, group.linears, result.scales, result.prev_scales)
        block.sites[group.consumer].divide(result.scales)
    block.attn_calls.clear()
    return tuple(results)


def _clip_block(layer: nn.Module, arch: ArchSpec, block: BlockInputs, group_size: int, asymmetric: bool) -> None:
    for path, site in _site_of(arch).items():
        if path in (arch.q, arch.k):  # q and k are never clipped
            continue
        linear = get_module(layer, path)
        rows = block.sites[site].clip_rows()
        if asymmetric:
            apply_clip_range(linear, *search_clip_asymmetric(linear.weight.detach(), rows, group_size), group_size)
        else:
            apply_clip(linear, search_clip(linear.weight.detach(), rows, group_size), group_size)


def _to_host(q: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(q.codes.cpu(), q.zeros.cpu(), q.scales.cpu(), q.group_size)
