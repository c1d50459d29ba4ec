"""Log-likelihood backends for the task scorer: transformers (HF / AWQ / GGUF models) and the engine (workspaces).

Both tokenize with `encode_pair` and return, per (context, continuation), the summed log-softmax of the
continuation's tokens and whether each of them is the argmax. The engine backend scores context+continuation as a
prompt with `prompt_logprobs=1` (one top alternative gives the greedy check), so a workspace is scored by the same
kernels, weights and KV cache it serves with; such requests skip the prefix cache (docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lmd.eval.tasks.scoring import Request, encode_pair

HF_BATCH = 16
ENGINE_BATCH = 256  # requests in flight at once; the engine's scheduler batches them


class HfBackend:
    """An HF causal LM; batches of similar length, right-padded; log-softmax in fp32 whatever the model dtype."""

    def __init__(self, model: Any, tokenizer: Any, name: str, device: str = "cpu", batch_size: int = HF_BATCH) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.device, self.batch_size = device, batch_size

    def loglikelihood(self, requests: Sequence[Request],
                      advance: Callable[[int], None] = lambda n: None) -> list[tuple[float, bool]]:
        import torch

        pairs = [encode_pair(self.tokenizer, c, x) for c, x in requests]
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            seqs = [pairs[i][0] + pairs[i][1] for i in batch]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for row, seq in enumerate(seqs):
                ids[row, :len(seq)] = torch.tensor(seq)
                mask[row, :len(seq)] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    use_cache=False).logits.float()
            for row, i in enumerate(batch):
                n_ctx, cont = len(pairs[i][0]), pairs[i][1]
                logprobs = torch.log_softmax(logits[row, n_ctx - 1:n_ctx - 1 + len(cont)], dim=-1)
                target = torch.tensor(cont, device=logprobs.device)
                picked = logprobs.gather(1, target[:, None])[:, 0]
                out[i] = (float(picked.sum()), bool((logprobs.argmax(-1) == target).all()))
            advance(len(batch))
        return out


class EngineBackend:
    """A running `lmd.turbomind.engine.Engine`; every request reads its prompt logprobs."""

    def __init__(self, engine: Any, name: str, batch: int = ENGINE_BATCH) -> None:
        self.engine, self.name, self.batch = engine, name, batch
        self.tokenizer = engine.tokenizer

    def loglikelihood(self, requests: Sequence[Request],
                      advance: Callable[[int], None] = lambda n: None) -> list[tuple[float, bool]]:
        from lmd.turbomind.gen_config import GenerationConfig

        config = GenerationConfig(max_new_tokens=1, temperature=0, prompt_logprobs=1)
        pairs = [encode_pair(self.tokenizer, c, x) for c, x in requests]
        out: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), self.batch):
            chunk = pairs[start:start + self.batch]
            streams = [self.engine.generate(ctx + cont, config, apply_chat_template=False) for ctx, cont in chunk]
            for (ctx, cont), stream in zip(chunk, streams, strict=True):
                entries = stream.result().prompt_logprobs or []
                tail = entries[len(ctx):len(ctx) + len(cont)]
                if len(tail) != len(cont) or any(e is None for e in tail):
                    raise RuntimeError(f"the engine returned {len(entries)} prompt logprobs for a prompt of "
                                       f"{len(ctx) + len(cont)} tokens")
                total = sum(e[0] for e in tail)  # type: ignore[index]
                greedy = all(e[1] and e[1][0][0] == tok for e, tok in zip(tail, cont, strict=True))  # type: ignore[index]
                out.append((total, greedy))
            advance(len(chunk))
        return out
