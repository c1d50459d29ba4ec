"""Turns the scheduler's plain-data output into tensors, runs the model over the paged cache, returns logits.

The runner owns everything on the device: the model's weights and the KV cache pool, sized here once from
`cache_max_entry_count` after the weights are loaded.
"""

from __future__ import annotations

import dataclasses

import torch

from lmd.errors import LmdError
from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kv_cache import KVCache, block_bytes, plan_num_blocks
from lmd.turbomind.kv_int8 import StaticKVParams
from lmd.turbomind.model import LlamaModel
from lmd.turbomind.scheduler import SchedulerOutput
from lmd.turbomind.weights import check_weights
from lmd.turbomind.workspace import Workspace

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LmdError(f"device={name!r} but CUDA is not available; use device='cpu'")
    return device


class ModelRunner:
    def __init__(self, ws: Workspace) -> None:
        model_cfg, engine_cfg = ws.model, ws.engine
        self.device = resolve_device(engine_cfg.device)
        self.dtype = DTYPES[model_cfg.float_dtype if engine_cfg.dtype == "auto" else engine_cfg.dtype]
        if model_cfg.tensor_para_size == 1:
            weights = ws.load_weights(str(self.device))
            check_weights(model_cfg, weights, str(ws.weights_file()))
        else:  # all ranks in this one process: the rank files merged back into the whole model
            weights = ws.load_merged_weights(str(self.device))
            model_cfg = dataclasses.replace(model_cfg, tensor_para_size=1)
        self.model = LlamaModel(model_cfg, weights, self.dtype, self.device, engine_cfg.use_context_fmha)
        del weights
        self.block_size = engine_cfg.cache_block_seq_len
        int8 = engine_cfg.quant_policy == 4
        static = None
        if int8:
            tensors = ws.load_kv_qparams(str(self.device))
            if tensors is not None:
                static = StaticKVParams.from_tensors(tensors, model_cfg.num_layer, model_cfg.kv_head_num,
                                                     model_cfg.size_per_head,
                                                     str(ws.kv_qparams_file()))
        self.kv_int8_static = static is not None
        dims = (model_cfg.num_layer, self.block_size, model_cfg.kv_head_num, model_cfg.size_per_head)
        self.bytes_per_block = block_bytes(*dims, self.dtype, int8, static is not None)
        max_useful = engine_cfg.max_batch_size * -(-engine_cfg.session_len // self.block_size)
        num_blocks = plan_num_blocks(engine_cfg.cache_max_entry_count, self.bytes_per_block, self.device, max_useful)
        self.cache = KVCache(model_cfg.num_layer, num_blocks, self.block_size, model_cfg.kv_head_num,
                             model_cfg.size_per_head, self.dtype, self.device, int8, static)

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def run(self, output: SchedulerOutput) -> torch.Tensor:
        """fp32 logits [number of chunks that need logits, vocab], in chunk order."""
        chunks, rows, end = [], [], 0
        for chunk in output.chunks:
            chunks.append((list(chunk.token_ids), chunk.start, list(chunk.block_table)))
            end += len(chunk.token_ids)
            if chunk.needs_logits:
                rows.append(end - 1)
        batch = ForwardBatch.build(chunks, self.block_size, rows, self.device)
        return self.model.forward(batch, self.cache)

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int], start: int, block_table: list[int]) -> torch.Tensor:
        """Every token's final hidden state [n, H] for one chunk of one sequence (its KV goes into the cache)."""
        batch = ForwardBatch.build([(token_ids, start, block_table)], self.block_size, [], self.device)
        return self.model.hidden_states(batch, self.cache)
