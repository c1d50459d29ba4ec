"""The engine's side of speculative decoding: proposals for the decoding speculating sequences before the step is
scheduled, their verification's sampling rows and samples, and the counters.

Order inside `Engine.step` (docs/engine.md): `propose` -> schedule (a chunk takes the sequence's last token and its
proposals, `ScheduledChunk.num_draft`) -> `run` (1 + k logits rows per verification) -> `launch` -> resolve, where
`accept` keeps the rows up to the first one whose token is not its proposal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lmd.turbomind.sampler import PendingSample, Sampler, SamplingRow, pending_sample
from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.speculative.tree import TokenTree, TreeProposal, draft_tree
from lmd.turbomind.speculative.tree_step import move_kept_kv, run_with_trees
from lmd.turbomind.speculative.tree_verify import choose as choose_tree
from lmd.turbomind.speculative.tree_verify import tree_rows
from lmd.turbomind.speculative.verify import SampledVerification, choose_with_verifications

if TYPE_CHECKING:
    from lmd.turbomind.block_manager import BlockManager
    from lmd.turbomind.forward_batch import InflightIds
    from lmd.turbomind.kv_cache import KVCache
    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.request_state import RequestState
    from lmd.turbomind.scheduler import SchedulerOutput
    from lmd.turbomind.sequence import Sequence
    from lmd.turbomind.speculative.draft import DraftProposer
    from lmd.turbomind.workspace import Workspace

COUNTERS = ("spec_verifications", "spec_proposed_tokens", "spec_accepted_tokens")
# the engine's: one verified token (state, token, logprob, top logprobs) accepted and streamed; True if it ended
_UNPREPARED = object()
AcceptNow = Callable[["RequestState", int, Any, Any], bool]


class Speculator:
    def __init__(self, config: SpeculativeConfig, target: Workspace, tokenizer: object, num_blocks: int) -> None:
        self.config = config
        self.drafter: DraftProposer | None = None
        if config.method == "draft":
            from lmd.turbomind.speculative.draft import DraftProposer

            self.drafter = DraftProposer(config.model, target, tokenizer, num_blocks)  # type: ignore[arg-type]
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._prepared: object = _UNPREPARED  # the runner's decode graphs the verification graphs were added to

    def prepare(self, runner: ModelRunner) -> None:
        """Capture the verification graphs of a chain (T = 1 + K tokens per sequence, `DecodeGraphs`) beside the
        runner's decode graphs; nothing where those are off, or for token trees (their batch is adjusted, so they run
        eagerly). Start-up: one more capture per batch bucket; memory: each graph keeps its logits, bucket x T x vocab
        fp32 (Llama-2's vocab, max_batch_size 64, K 4: 189 MB over the 11 buckets), activations share the decode
        graphs' pool. Called again after the decode graphs are replaced (`enable_decode_graphs`)."""
        if self.config.tree is None:
            runner.enable_verify_graphs(1 + self.config.num_speculative_tokens)
        self._prepared = runner.graphs

    def propose(self, running: list[Sequence], states: dict[int, RequestState], max_len: int,
                sampler: Sampler) -> list[Sequence]:
        """Proposals (`Sequence.draft_token_ids`: a chain, or a token tree's nodes parents first) for the decoding
        speculating sequences, from their known tokens only (their steps are not overlapped, so none has a token in
        flight); at most what max_tokens leave after the verification's own token, so no verification overshoots.
        The sequences that got some."""
        wanted = []
        for seq in running:
            state = states.get(seq.seq_id)
            if state is None or state.speculative is None or seq.num_inflight or seq.num_uncomputed != 1:
                continue
            state.speculative.tree = None
            room = min(seq.max_num_tokens, max_len) - len(seq.token_ids) - 1
            k = state.speculative.budget(room)
            if k:
                wanted.append((seq, k, state))
        branch = 1 if self.config.tree is None else self.config.tree[0]
        if self.drafter is not None:
            drafts = self.drafter.propose([(seq, k, state.sampling_row) for seq, k, state in wanted], sampler, branch)
            for seq, _, state in wanted:
                chain = drafts.get(seq.seq_id)
                spec = state.speculative
                if chain is None:
                    seq.draft_token_ids = []
                elif self.config.tree is None:
                    seq.draft_token_ids, spec.draft_probs = chain.tokens, chain.q()  # type: ignore[union-attr]
                else:
                    tree, trials, depth_of = draft_tree(chain.candidates)
                    spec.tree = TreeProposal(tree, trials, depth_of, chain.q())  # type: ignore[union-attr]
                    seq.draft_token_ids = list(tree.tokens)
        else:
            for seq, k, state in wanted:
                index = state.speculative.index  # type: ignore[union-attr]
                if self.config.tree is None:
                    seq.draft_token_ids = index.propose(seq.token_ids, k)
                    continue
                tree = TokenTree.from_chains(index.propose_many(seq.token_ids, k, branch))
                seq.draft_token_ids = list(tree.tokens)
                state.speculative.tree = TreeProposal(tree) if len(tree) else None  # type: ignore[union-attr]
        return [seq for seq, _, _ in wanted if seq.draft_token_ids]

    def run(self, runner: ModelRunner, output: SchedulerOutput, states: dict[int, RequestState],
            inflight: InflightIds | None) -> torch.Tensor:
        """The step's forward: with the tree mask where a chunk verifies a token tree (cut to what was scheduled);
        a chain's verification replays its graph (`prepare`, done here if the engine has not)."""
        if self._prepared is not runner.graphs:
            self.prepare(runner)
        trees = {}
        for chunk in output.chunks:
            state = states.get(chunk.seq_id)
            proposal = None if state is None or state.speculative is None else state.speculative.tree
            if chunk.num_draft and proposal is not None:
                proposal.cut(chunk.num_draft)
                trees[chunk.seq_id] = proposal.tree
        if not trees:
            return runner.run(output, inflight)
        return run_with_trees(runner, output, trees, inflight)

    def launch(self, sampler: Sampler, logits: torch.Tensor, states: list[RequestState],
               drafts: dict[int, tuple[int, ...]]) -> PendingSample:
        """The step's samples. A chain's row j sees the first j proposals as its context, and the rows of a sampled
        request's chain are decided by rejection sampling (`verify.py`); a tree's rows see their paths, and its
        path is decided here (`tree_verify.py`)."""
        rows: list[SamplingRow] = []
        verifications: list[SampledVerification] = []
        trees: list[tuple[int, TreeProposal]] = []
        i = 0
        while i < len(states):
            state = states[i]
            proposals = drafts.get(state.seq.seq_id, ())
            proposal = state.speculative.tree if state.speculative is not None else None
            if proposals and proposal is not None:
                trees.append((i, proposal))
                rows += tree_rows(state, proposal.tree)
            else:
                rows += [state.sampling_row(proposals[:j]) for j in range(len(proposals) + 1)]
                if proposals and not state.config.is_greedy:
                    verifications.append(SampledVerification(i, proposals, state.speculative.draft_probs))  # type: ignore[union-attr]
            i += 1 + len(proposals)
        raw = logits.float()
        skip = {first + j for first, proposal in trees for j in range(len(proposal.tree) + 1)}
        chosen = choose_with_verifications(sampler, raw, rows, verifications, skip)
        for first, proposal in trees:
            width = len(proposal.tree) + 1
            picked = choose_tree(sampler, raw[first:first + width], rows[first:first + width], proposal)
            chosen[first:first + width] = torch.tensor(picked, device=chosen.device)
        return pending_sample(raw, chosen, rows)

    def accept(self, state: RequestState, rows: list[tuple[Any, int, Any, Any]], drafts: tuple[int, ...],
               cache: KVCache, block_manager: BlockManager, accept_now: AcceptNow) -> None:
        """A verification's tokens: row j's token is kept while every earlier row's token equals the proposal that
        follows it (the longest matching prefix, then the target's own token; a tree: along its kept path, whose
        K/V first move after the root). Each goes through `accept_now` (stop checks, text) one at a time, so a stop
        token, stop string or length ends it exactly where plain decoding would; the blocks past the kept tokens,
        which hold only rejected proposals' K/V, are freed."""
        proposed = len(drafts)
        proposal = state.speculative.tree  # type: ignore[union-attr]
        if proposal is not None:
            kept = proposal.kept or []
            move_kept_kv(cache, state.seq.block_table, len(state.seq.token_ids) - 1, kept)
            rows = [rows[0]] + [rows[node + 1] for node in kept]
            drafts = tuple(proposal.tree.tokens[node] for node in kept)
        accepted = 0
        for j, (_, token, logprob, alternatives) in enumerate(rows):
            if j:
                state.seq.num_computed_tokens += 1  # proposal j - 1 was right: its K/V is the sequence's
            if accept_now(state, token, logprob, alternatives) or j == len(drafts) or token != drafts[j]:
                break
            accepted += 1
        self.record(state, proposed, accepted)
        if not state.finished:
            block_manager.trim(state.seq, len(state.seq.token_ids))

    def record(self, state: RequestState, proposed: int, accepted: int) -> None:
        self.counts["spec_verifications"] += 1
        self.counts["spec_proposed_tokens"] += proposed
        self.counts["spec_accepted_tokens"] += accepted
        state.speculative.record(proposed, accepted)  # type: ignore[union-attr]
        state.speculative.draft_probs = state.speculative.tree = None  # type: ignore[union-attr]

    def release(self, seq_id: int) -> None:
        if self.drafter is not None:
            self.drafter.release(seq_id)

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
