"""A benchmark's requests from the model's own tokenizer and chat template: the engine's (`lmd bench throughput`),
or one read from disk for a server measured over HTTP (`lmd bench serve --tokenizer`), so both commands run the same
requests for the same flags and seed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmd.bench.dataset import RANDOM, Conversation, dataset_files, read_conversations
from lmd.bench.sampling import BenchRequest, SamplingConfig, random_requests, sample_requests
from lmd.errors import LmdError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmd.chat_templates import ChatTemplate
    from lmd.turbomind.engine import Engine


@dataclass(frozen=True)
class PromptCodec:
    tokenizer: PreTrainedTokenizerBase
    chat_template: ChatTemplate
    vocab_size: int  # the model's embedding rows (random prompts stay below it and below the tokenizer's size)
    end_ids: tuple[int, ...]  # EOS and stop ids: never drawn into random prompts

    def encode(self, text: str, chat: bool) -> list[int]:
        """`chat`: as one user turn through the chat template (what /v1/chat/completions does); else plain text."""
        if chat:
            return self.chat_template.encode([{"role": "user", "content": text}], self.tokenizer)
        return list(self.tokenizer(text)["input_ids"])

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(ids))

    def random_space(self) -> tuple[int, tuple[int, ...]]:
        """(vocabulary size, ids to avoid) for random prompts: ids the tokenizer knows, minus EOS and special tokens."""
        vocab = min(self.vocab_size, len(self.tokenizer))
        return vocab, tuple(sorted({*self.end_ids, *getattr(self.tokenizer, "all_special_ids", ())}))


def engine_codec(engine: Engine) -> PromptCodec:
    return PromptCodec(engine.tokenizer, engine.chat_template, engine.workspace.model.vocab_size, engine.eos_ids)


def tokenizer_codec(source: str) -> PromptCodec:
    """The tokenizer of a workspace (with its chat template, as `lmd serve` applies it), an HF directory, a .gguf
    file or a hub id (with the tokenizer's own chat template)."""
    from lmd.turbomind.workspace import is_workspace, open_workspace

    if is_workspace(source):
        ws = open_workspace(source)
        return PromptCodec(ws.load_tokenizer(), ws.chat_template(), ws.model.vocab_size, tuple(ws.model.end_ids))
    from lmd.chat_templates import get_chat_template
    from lmd.model_source import load_tokenizer, resolve_model

    if not Path(source).expanduser().exists() and source.count("/") != 1:
        raise LmdError(
            f"--tokenizer {source} is neither a path nor a hub id; give the served model's workspace, HF directory, "
            ".gguf file or hub id (org/name)"
        )
    tokenizer = load_tokenizer(resolve_model(source))
    ids = {getattr(tokenizer, "eos_token_id", None)}
    return PromptCodec(tokenizer, get_chat_template("hf"), len(tokenizer), tuple(i for i in ids if i is not None))


@dataclass(frozen=True)
class PromptSource:
    """What `--dataset` names: ShareGPT conversations, or (random) none and prompts of `random_input_len` ids."""

    dataset: str
    files: tuple[Path, ...]
    conversations: tuple[Conversation, ...]
    random_input_len: int


def read_prompt_source(dataset: str, data_dir: str | None, random_input_len: int) -> PromptSource:
    if dataset == RANDOM:
        if random_input_len < 1:
            raise LmdError(f"--random-input-len must be at least 1 (got {random_input_len})")
        return PromptSource(dataset, (), (), random_input_len)
    files = dataset_files(dataset, data_dir)
    return PromptSource(dataset, tuple(files), tuple(read_conversations(files)), random_input_len)


def build_requests(
    codec: PromptCodec, source: PromptSource, sampling: SamplingConfig, chat: bool, room: tuple[int, str] | None
) -> list[BenchRequest]:
    """Sampled dataset requests, or random ones when there are no conversations (--dataset random).

    `room`: (most prompt + output tokens per request, the flag that raises it), or None when unknown."""
    conversations, random_input_len = source.conversations, source.random_input_len
    if not conversations:
        output_len = sampling.fixed_output_len or sampling.max_output_len
        if room is not None and random_input_len + output_len > room[0]:
            raise LmdError(
                f"--random-input-len {random_input_len} + {output_len} output tokens exceeds the {room[0]} tokens "
                f"a request may hold; shorten them or raise {room[1]}"
            )
        vocab, banned = codec.random_space()
        return random_requests(sampling.num_prompts, random_input_len, output_len, vocab, sampling.seed, banned)
    limited = dataclasses.replace(sampling, max_total_len=None if room is None else room[0])
    return sample_requests(conversations, lambda text: codec.encode(text, chat), codec.count, limited)


def workload_settings(source: PromptSource, sampling: SamplingConfig, chat: bool, temperature: float) -> dict[str, Any]:
    """The report's record of what was asked for (the same keys in `throughput` and `serve`)."""
    settings: dict[str, Any] = {
        "dataset": source.dataset,
        "files": [str(f) for f in source.files],
        "num_prompts": sampling.num_prompts,
        "seed": sampling.seed,
        "min_input_len": sampling.min_input_len,
        "max_input_len": sampling.max_input_len,
        "max_output_len": sampling.max_output_len,
        "fixed_output_len": sampling.fixed_output_len,
        "chat_template": chat and source.dataset != RANDOM,
        "temperature": temperature,
    }
    if source.dataset == RANDOM:
        settings["random_input_len"] = source.random_input_len
    return settings


def prompt_text(codec: PromptCodec, request: BenchRequest) -> str:
    """The request's prompt as text (for chat messages): its conversation's first turn, or its random ids decoded."""
    return request.text if request.text is not None else codec.decode(request.prompt_ids)
