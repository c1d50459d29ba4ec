"""Turns the scheduler's plain-data output into tensors, runs the model over the paged cache, returns logits.

The runner owns everything on the device: the model's weights and the KV cache pool, sized here once from
`cache_max_entry_count` after the weights are loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from lmd.errors import LmdError
from lmd.turbomind.config import EngineConfig, ModelConfig
from lmd.turbomind.decode_graph import CaptureFailed, DecodeGraphs
from lmd.turbomind.forward_batch import ForwardBatch, InflightIds, patch_inflight
from lmd.turbomind.kv_cache import KVCache, block_bytes, plan_num_blocks
from lmd.turbomind.kv_int8 import StaticKVParams
from lmd.turbomind.model import LlamaModel, Reduce
from lmd.turbomind.pipeline_stage import StageLink, layout_lines, micro_batches, stage_layers
from lmd.turbomind.scheduler import SchedulerOutput
from lmd.turbomind.torchrun_env import check_world, join_torchrun_group, torchrun_env
from lmd.turbomind.torchrun_workers import TorchrunWorkers
from lmd.turbomind.tp_group import (
    all_reduce_min,
    all_reduce_sum,
    await_replay,
    check_no_tp_group,
    free_port,
    join_tp_group,
    leave_tp_group,
    timeout_s,
)
from lmd.turbomind.tp_workers import TPWorkers
from lmd.turbomind.weight_offload import linear_weight_names, plan_offload
from lmd.turbomind.workspace import Workspace

_ROW_SPLIT_BIASES = ("attention.wo.bias", "feed_forward.w2.bias")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_log = logging.getLogger("lmd.engine")


def resolve_device(name: str, tp_rank: int | None = None) -> torch.device:
    """`tp_rank` set (tensor parallelism): a CUDA device becomes cuda:tp_rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LmdError(f"device={name!r} but CUDA is not available; use device='cpu'")
    if device.type == "cuda" and tp_rank is not None:
        if tp_rank >= torch.cuda.device_count():
            raise LmdError(f"tensor-parallel rank {tp_rank} needs cuda:{tp_rank} but {torch.cuda.device_count()} "
                           "GPU(s) are visible; lower tp or use tp=1")
        device = torch.device("cuda", tp_rank)
    return device


class ModelRunner:
    """One rank's runner. tp = pp = 1: the whole model here (a tp > 1 workspace merged). Otherwise this process is
    global rank pp_rank * tp + tp_rank of tp * pp; rank 0 (the driver) spawns the others and sends them every batch
    it runs (`tp_port` is given to the workers only). pp > 1: this rank holds its stage's layers and their KV cache
    (`pipeline_stage.py`)."""

    def __init__(self, ws: Workspace, tp_port: int | None = None) -> None:
        model_cfg, engine_cfg = ws.rank_model, ws.engine
        self.tp, self.pp = engine_cfg.tp, engine_cfg.pp
        self.world = self.tp * self.pp  # processes that run the model
        rank = engine_cfg.pp_rank * self.tp + engine_cfg.tp_rank  # global
        self.rank = rank
        if self.pp > model_cfg.num_layer:
            raise LmdError(f"pp={self.pp} stages but the model has {model_cfg.num_layer} layers; use at most "
                           f"pp={model_cfg.num_layer}")
        if self.pp > 1 and engine_cfg.offload_weights_gb > 0:
            raise LmdError("--offload-weights runs with pp=1; drop one of them")
        self.stage = StageLink(rank, self.tp, self.pp) if self.pp > 1 else None
        launch = torchrun_env() if self.world > 1 else None  # started by torchrun: its ranks, nothing spawned
        if launch is not None:
            check_world(launch, self.tp, self.pp)
            if launch.rank != rank:
                raise LmdError(f"torchrun's RANK={launch.rank} but this process was given tp_rank "
                               f"{engine_cfg.tp_rank}, pp_rank {engine_cfg.pp_rank}")
        device_index = rank if launch is None else launch.local_rank
        self.device = resolve_device(engine_cfg.device, device_index if self.world > 1 else None)
        self.dtype = DTYPES[model_cfg.float_dtype if engine_cfg.dtype == "auto" else engine_cfg.dtype]
        self.workers: TPWorkers | TorchrunWorkers | None = None
        self.joined = None  # torchrun: the launcher's store and the control group
        self._joined = False
        reduce = None
        if self.world > 1 and rank == 0 and tp_port is None:  # the driver says which rank holds what
            for line in layout_lines(model_cfg.num_layer, self.tp, self.pp):
                _log.info("%s", line)
        if launch is not None:
            self.joined = join_torchrun_group(launch, self.device, self.tp, timeout_s())
            self._joined = True
            if rank == 0:
                self.workers = TorchrunWorkers(launch, self.joined)
            if self.tp > 1:
                reduce = all_reduce_sum
        elif self.world > 1:
            if tp_port is None:
                if rank != 0:
                    raise LmdError(f"tp_rank={engine_cfg.tp_rank}, pp_rank={engine_cfg.pp_rank}: the engine sets "
                                   "each worker's ranks itself; leave them out")
                check_no_tp_group()
                tp_port = free_port()
                self.workers = TPWorkers(ws, tp_port, ModelRunner)
            try:
                join_tp_group(rank, self.world, tp_port, self.device, tp=self.tp)
                self._joined = True
            except BaseException:
                self.close()
                raise
            if self.tp > 1:
                reduce = all_reduce_sum
        try:
            with self._guard():
                self._build(ws, model_cfg, engine_cfg, reduce)
        except BaseException:
            self.close()
            raise

    def _build(self, ws: Workspace, model_cfg: ModelConfig, engine_cfg: EngineConfig, reduce: Reduce | None) -> None:
        offload = engine_cfg.offload_weights_gb > 0
        # this rank's part, whatever TP the workspace was deployed with; offload: on the host first, then every tensor
        # but the offloaded layers' linears to the device
        weights = ws.load_weights("cpu" if offload else str(self.device))
        if engine_cfg.tp_rank > 0:  # a row-split linear's bias is added once, by rank 0
            weights = {k: v for k, v in weights.items() if not k.endswith(_ROW_SPLIT_BIASES)}
        options: dict = {} if reduce is None else {"reduce": reduce}
        layers = stage_layers(model_cfg.num_layer, self.pp, engine_cfg.pp_rank)
        if self.pp > 1:  # this stage's layers only (and what the model needs of the rest)
            options["layers"] = layers
            weights = {k: v for k, v in weights.items()
                       if not k.startswith("layers.") or int(k.split(".")[1]) in layers}
        self.offload_plan = None
        if offload:
            layer_bytes = sum(v.numel() * v.element_size() for k, v in weights.items()
                              if k.startswith(linear_weight_names(0)))
            self.offload_plan = plan_offload(engine_cfg.offload_weights_gb, model_cfg.num_layer, layer_bytes)
            hosted = tuple(name for i in self.offload_plan.layers for name in linear_weight_names(i))
            weights = {k: v if k.startswith(hosted) else v.to(self.device) for k, v in weights.items()}
            options["offload"] = self.offload_plan
        self.model = LlamaModel(model_cfg, weights, self.dtype, self.device, engine_cfg.use_context_fmha, **options)
        del weights
        self.block_size = engine_cfg.cache_block_seq_len
        kv_heads = model_cfg.kv_head_num // model_cfg.tensor_para_size
        int8 = engine_cfg.quant_policy == 4
        static = None
        if int8:
            tensors = ws.load_kv_qparams(str(self.device))
            if tensors is not None:
                if self.pp > 1:  # this stage's layers, numbered as its cache numbers them
                    tensors = {f"layers.{int(k.split('.')[1]) - layers.start}.{k.split('.', 2)[2]}": v
                               for k, v in tensors.items() if int(k.split(".")[1]) in layers}
                static = StaticKVParams.from_tensors(tensors, len(layers), kv_heads, model_cfg.size_per_head,
                                                     str(ws.kv_qparams_file()))
        self.kv_int8_static = static is not None
        dims = (len(layers), self.block_size, kv_heads, model_cfg.size_per_head)
        self.bytes_per_block = block_bytes(*dims, self.dtype, int8, static is not None)
        max_useful = engine_cfg.max_batch_size * -(-engine_cfg.session_len // self.block_size)
        num_blocks = plan_num_blocks(engine_cfg.cache_max_entry_count, self.bytes_per_block, self.device, max_useful)
        if self.world > 1:  # every rank must hold every block the driver hands out
            num_blocks = all_reduce_min(num_blocks, self.device)
        # decode graphs pad batches with rows that write into one scratch block past the ones handed out (on every
        # rank: a graph step is one on all of them)
        self._scratch = 1 if engine_cfg.cuda_graph and self.pp == 1 else 0
        self.cache = KVCache(len(layers), num_blocks + self._scratch, self.block_size, kv_heads,
                             model_cfg.size_per_head, self.dtype, self.device, int8, static)
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: dict[int, DecodeGraphs] = {}  # T -> graphs of steps of up to T tokens per sequence
        self._max_batch, self._session_len = engine_cfg.max_batch_size, engine_cfg.session_len
        self.pad_eager = self.device.type == "cuda"  # `_padded`; tests turn it on for the CPU
        if self._scratch and self.device.type == "cuda":
            self._start_decode_graphs(engine_cfg)

    def _start_decode_graphs(self, engine_cfg: EngineConfig) -> None:
        """Capture the decode graphs. With tp > 1 each rank captures its own, NCCL's all-reduces inside, in the same
        order, and a step replays them on every rank or on none: the ranks first agree that every one can capture
        (the Triton attention), then after each bucket that every capture succeeded (`DecodeGraphs.capture_all`); a
        failed capture anywhere leaves all of them decoding eagerly. A failure in the warm-up forward before a capture
        is an error, as in any step."""
        supported = self._graphs_supported(engine_cfg)
        if self.world > 1:
            everywhere = all_reduce_min(int(supported), self.device)
            if everywhere != -all_reduce_min(-int(supported), self.device):
                _log.warning("decode CUDA graphs off at tp=%d: the Triton attention runs on some ranks only", self.tp)
            if not everywhere:
                return
        if not supported:
            return
        agree = None if self.world == 1 else (lambda ok: bool(all_reduce_min(int(ok), self.device)))
        try:
            self.enable_decode_graphs(capture=True, agree=agree)
        except CaptureFailed as exc:  # raised on every rank at the same bucket
            self.graphs = None
            _log.warning("decode CUDA graphs off at tp=%d: %s; steps run eagerly", self.tp, exc)

    def _graphs_supported(self, engine_cfg: EngineConfig) -> bool:
        """Captured steps must run the Triton attention (the reference path loops over host-side lengths)."""
        from lmd.turbomind.paged_attention import triton_attention_runs

        heads = self.model.layers[0].attention.q_heads
        q = torch.empty(1, heads, self.model.cfg.size_per_head, dtype=self.dtype, device=self.device)
        return triton_attention_runs(q, self.cache, engine_cfg.use_context_fmha)

    def enable_decode_graphs(self, capture: bool, agree: Callable[[bool], bool] | None = None) -> None:
        """Run decode steps on the static buffers of `DecodeGraphs` (capture=False: eagerly, e.g. on CPU); verification
        graphs are dropped (`enable_verify_graphs` adds them again, in the new mode). A worker rank's graphs stop at
        the final norm. `agree`: tp > 1, see `_start_decode_graphs`."""
        if not self._scratch:
            raise LmdError("decode graphs need the scratch block: cuda_graph=True and pp=1")
        if self.world > 1 and agree is None:  # every rank captures together, at start (_start_decode_graphs)
            raise LmdError(f"decode graphs at tp={self.tp} are captured when the engine starts, on every rank")
        self.graphs = DecodeGraphs(self.model, self.cache, self.cache.num_blocks - 1, self._max_batch,
                                   self._session_len, self.device, capture, logits=self.rank == 0)
        self.verify_graphs = {}
        self.graphs.capture_all(agree)  # at start, as vLLM does: the first step of each batch size is not slowed

    def enable_verify_graphs(self, tokens: int) -> None:
        """Graphs of steps of up to `tokens` tokens per sequence (a speculative chain's 1 + K), beside the decode
        graphs: their mode, scratch block and memory pool. Nothing while decode graphs are off (CPU, eager), nor
        with tp > 1 (the workers replay the decode graphs only: `worker_step`)."""
        if self.graphs is None or self.world > 1 or tokens <= 1 or tokens in self.verify_graphs:
            return
        graphs = DecodeGraphs(self.model, self.cache, self.cache.num_blocks - 1, self._max_batch, self._session_len,
                              self.device, self.graphs.capture, tokens, self.graphs.pool())
        graphs.capture_all()
        self.verify_graphs[tokens] = graphs

    def _graphs_for(self, chunks: list[tuple[list[int], int, list[int]]]) -> DecodeGraphs | None:
        """The graphs of the smallest T that holds every chunk of the step, if any."""
        if self.graphs is None:
            return None
        candidates = [self.graphs, *(self.verify_graphs[t] for t in sorted(self.verify_graphs))]
        return next((g for g in candidates if g.fits(chunks)), None)

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks - self._scratch

    def run(self, output: SchedulerOutput, inflight: InflightIds | None = None,
            adjust: Callable[[ForwardBatch], ForwardBatch] | None = None) -> torch.Tensor:
        """fp32 logits in chunk order: every position of an `all_logits` chunk, the last position of any other chunk
        that needs logits. `inflight`: where the INFLIGHT ids of the chunks are (the previous step's samples, still on
        the device); nothing here waits for the GPU. `adjust`: changes the built batch before the forward (token
        trees: positions and the tree mask); such a step runs eagerly, on one rank. Any other step whose chunks are
        all at most T tokens long replays the graphs of the smallest such T (`DecodeGraphs`: decode, T = 1; a
        speculative chain's verification, T = 1 + K, `enable_verify_graphs`); the rest runs eagerly."""
        chunks, rows, end = [], [], 0
        for chunk in output.chunks:
            chunks.append((list(chunk.token_ids), chunk.start, list(chunk.block_table)))
            if chunk.all_logits:
                rows.extend(range(end, end + len(chunk.token_ids)))
            end += len(chunk.token_ids)
            if chunk.needs_logits and not chunk.all_logits:
                rows.extend(range(end - 1 - chunk.num_draft, end))  # a verification: every proposal's position too
        sources = None if inflight is None else inflight.sources([(c.seq_id, c.token_ids) for c in output.chunks])
        if sources is not None and self.world > 1:
            raise LmdError("overlapped steps (in-flight token ids) need tp=pp=1")
        patch = None if sources is None else (sources, inflight.token_ids)  # type: ignore[union-attr]
        if adjust is not None and self.world > 1:
            raise LmdError("an adjusted batch (token trees) runs with tp=pp=1")
        graphs = None if adjust is not None else self._graphs_for(chunks)
        if graphs is not None:
            if self.workers is not None:
                self.workers.send((chunks, rows, True))
            with self._guard():
                logits = graphs.run(chunks, patch, rows)
                if self.world > 1:
                    await_replay(self.workers.check_alive if self.workers is not None else None)
                return logits
        if self.stage is not None:
            return self.run_chunks(chunks, rows)
        if adjust is None:
            chunks = self._padded(chunks)
        batch = self._batch(chunks, rows)
        if adjust is not None:
            batch = adjust(batch)
        if patch is not None:
            patch_inflight(batch.input_ids, *patch)
        return self._forward(batch)

    def _padded(self, chunks: list[tuple[list[int], int, list[int]]]) -> list[tuple[list[int], int, list[int]]]:
        """An eager step's chunks and, when `pad_eager` is on, one more chunk of filler tokens in the scratch block
        (as the decode graphs pad their batches), so that the step's token count is a multiple of 16 (up to 256
        tokens) or 64. cuBLAS picks a GEMM algorithm per new shape, ~0.2 ms of host time per linear on the H200
        (docs/benchmarks.md), and mixed steps of a serving run have a new token count nearly every step; rounded,
        the shapes repeat. The filler's rows come after every real one: logit rows and in-flight positions stay."""
        if not self.pad_eager or not self._scratch:
            return chunks
        tokens = sum(len(c[0]) for c in chunks)
        step = min(16 if tokens <= 256 else 64, self.block_size)  # the filler fits the one scratch block
        pad = -tokens % step
        return chunks + [([0] * pad, 0, [self.cache.num_blocks - 1])] if pad else chunks

    def run_chunks(self, chunks: list[tuple[list[int], int, list[int]]], rows: list[int]) -> torch.Tensor:
        """Logits of `rows` of the flat batch of `chunks` (token ids, start, block table); on a worker rank the
        layers only (its part of the all-reduces), and the result is empty."""
        if self.stage is not None:
            if self.workers is not None:
                self.workers.send((chunks, rows, False))
            return self._stage_forward(chunks, rows)
        return self._forward(self._batch(chunks, rows))

    def worker_step(self, chunks: list[tuple[list[int], int, list[int]]], rows: list[int], graphed: bool) -> None:
        """A worker rank's part of one driver step (`run`): the replay of its decode graph for the same chunks
        (`graphed`: every rank captured the same buckets, so the chunks fill the same graph) or the eager layers."""
        if not graphed:
            self.run_chunks(chunks, rows)
            return
        if self.graphs is None:
            raise LmdError(f"rank {self.rank}: the driver replays a decode graph, but this rank has none")
        self.graphs.run(chunks, None, rows)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with self._guard():
            if self.world > 1 and self.workers is None:
                self._worker_forward(batch)
                return torch.empty(0)
            return self.model.forward(batch, self.cache)

    def _stage_forward(self, chunks: list[tuple[list[int], int, list[int]]], rows: list[int]) -> torch.Tensor:
        """pp > 1, every rank: this stage's part of each micro-batch, the carries passed on as they are done; the
        driver then gathers the logits from the last stage (empty on the other ranks)."""
        stage, model = self.stage, self.model
        assert stage is not None
        parts = micro_batches(chunks, rows, self.pp)
        hidden = self.model.cfg.hidden_units
        with self._guard(), torch.inference_mode():
            for part in parts:
                batch = ForwardBatch.build(part.chunks, self.block_size, part.rows, self.device)
                tokens = len(batch.input_ids)
                carry = None if stage.first else stage.recv_carry(tokens, hidden, self.dtype, self.device)
                h, delta = model.run_layers(batch, self.cache, carry)
                if not stage.last:
                    stage.send_carry(h, delta)
                elif stage.sends_logits:
                    normed = model.final_norm(h, delta)[batch.logit_indices]
                    stage.send_logits(model.logits(normed))
            logits = torch.empty(0)
            if self.rank == 0:
                vocab = self.model.cfg.vocab_size
                logits = torch.cat([stage.recv_logits(len(p.rows), vocab, self.device) for p in parts])
            stage.wait_sends()
        return logits

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int], start: int, block_table: list[int]) -> torch.Tensor:
        """Every token's final hidden state [n, H] for one chunk of one sequence (its KV goes into the cache)."""
        if self.stage is not None:
            raise LmdError("scoring hidden states through the engine (eval, draft models) runs with pp=1; use tp")
        batch = self._batch([(token_ids, start, block_table)], [])
        with self._guard():
            return self.model.hidden_states(batch, self.cache)

    def close(self) -> None:
        """Stop the workers, release the CUDA graphs and leave the process group (tp > 1); idempotent."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        # before leaving: NCCL waits for the graphs that captured its collectives (none yet if __init__ failed)
        for graphs in (getattr(self, "graphs", None), *getattr(self, "verify_graphs", {}).values()):
            if graphs is not None:
                graphs.release()
        self.graphs, self.verify_graphs = None, {}
        if self._joined:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            leave_tp_group()
            self._joined = False

    @torch.inference_mode()
    def _worker_forward(self, batch: ForwardBatch) -> None:
        self.model.hidden_states(batch, self.cache)

    def _batch(self, chunks: list[tuple[list[int], int, list[int]]], rows: list[int]) -> ForwardBatch:
        if self.workers is not None:
            self.workers.send((chunks, rows, False))
        return ForwardBatch.build(chunks, self.block_size, rows, self.device)

    def _guard(self) -> AbstractContextManager[None]:
        return self.workers.guard() if self.workers is not None else nullcontext()
