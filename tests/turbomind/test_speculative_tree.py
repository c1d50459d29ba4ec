"""Token trees: structure (trie of chains, depths, positions, visibility masks), the greedy path, and SpecInfer's
multi-branch rejection sampling keeping the target's distribution (many draws against the exact one)."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.sampler import draw
from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.speculative.layer_draft import first_layers_workspace
from lmd.turbomind.speculative.tree import TokenTree, greedy_path, sampled_path
from tests.turbomind.test_speculative import _greedy_configs, _run, _text, _tokens


def test_tree_from_chains_masks_and_positions():
    tree = TokenTree.from_chains([[5, 6, 7], [5, 8], [9]])
    assert tree.tokens == (5, 6, 7, 8, 9) and tree.parents == (-1, 0, 1, 0, -1)
    assert tree.depths == (1, 2, 3, 2, 1)
    assert tree.positions(10) == [10, 11, 12, 13, 12, 11]
    assert tree.children == ((0, 4), (1, 3), (2,), (), (), ())
    # row 3 (node 2: 5 -> 6 -> 7) sees the root, rows 1, 2 and itself; row 4 (node 3: 5 -> 8) not rows 2, 3
    assert tree.row_masks() == [0b1, 0b11, 0b111, 0b1111, 0b10011, 0b100001]
    assert tree.path(2) == [0, 1, 2] and tree.path(3) == [0, 3]
    with pytest.raises(LmdError, match="earlier node"):
        TokenTree((1, 2), (1, -1))


def test_greedy_path_follows_the_argmax():
    tree = TokenTree.from_chains([[5, 6, 7], [5, 8], [9]])
    # rows: root, node 0 (5), node 1 (6), node 2 (7), node 3 (8), node 4 (9)
    assert greedy_path(tree, [5, 8, 0, 0, 3, 0]) == ([0, 3], 3)  # 5 then 8 (not 6), then 8's argmax
    assert greedy_path(tree, [5, 6, 7, 4, 0, 0]) == ([0, 1, 2], 4)  # the whole chain, bonus from its leaf
    assert greedy_path(tree, [9, 0, 0, 0, 0, 1]) == ([4], 1)
    assert greedy_path(tree, [2, 0, 0, 0, 0, 0]) == ([], 2)  # no child matches: the root's own token


def _distributions(vocab: int, seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    """A random target (or draft) distribution after every prefix of up to one token, with zeros."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for prefix in [()] + [(a,) for a in range(vocab)]:
        w = torch.rand(vocab, generator=g) ** 3
        w[torch.randint(0, vocab, (1,), generator=g)] = 0
        out[prefix] = w / w.sum()
    return out


def _trials(tree: TokenTree, chains: list[list[int]]) -> dict[int, list[int]]:
    """Per chunk row, its children's nodes in the order the chains drew them (a child drawn twice: twice)."""
    out: dict[int, list[int]] = {}
    for chain in chains:
        row = 0
        for token in chain:
            node = next(c for c in tree.children[row] if tree.tokens[c] == token)
            out.setdefault(row, []).append(node)
            row = node + 1
    return out


@pytest.mark.parametrize("draft", [True, False])
def test_sampled_path_keeps_the_target_distribution(draft):
    """Two-level trees with two drawn children per node (a spread draft q, or n-gram-like fixed point masses): the
    first token is distributed as p after the root, the second (when the first was kept) as p after the first."""
    vocab, trials_n = 5, 12_000
    p, q = _distributions(vocab, 0), _distributions(vocab, 1)
    g = torch.Generator().manual_seed(2)

    def uniform() -> float:
        return float(torch.rand(1, generator=g, dtype=torch.float64))

    first, second = torch.zeros(vocab), torch.zeros(vocab, vocab)
    kept_any = 0
    for _ in range(trials_n):
        if draft:
            a = draw(q[()].expand(2, vocab), torch.rand(2, 1, generator=g, dtype=torch.float64)).tolist()
            chains = [[x, int(draw(q[(x,)][None], torch.rand(1, 1, generator=g, dtype=torch.float64)))] for x in a]
        else:
            chains = [[1, 2], [3, 0], [1, 4]]
        tree = TokenTree.from_chains(chains)
        rows = [()] + [tuple(tree.tokens[n] for n in tree.path(i)) for i in range(len(tree))]
        target = torch.stack([p[r] if len(r) < 2 else p[r[-1:]] for r in rows])
        order = _trials(tree, chains)

        def trials(row: int, order: dict = order) -> list[int]:
            return order.get(row, [])

        q_of = (lambda row, rows=rows: q[rows[row]]) if draft else None
        kept, token = sampled_path(tree, target, q_of, trials, uniform,
                                   lambda w: int(draw(w[None], torch.rand(1, 1, generator=g, dtype=torch.float64))))
        out = [tree.tokens[n] for n in kept] + [token]
        kept_any += bool(kept)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    assert 0.2 * trials_n < kept_any < trials_n  # proposals both kept and rejected
    assert 0.5 * (first / trials_n - p[()]).abs().sum() < 0.03  # sampling noise ~0.01
    for a in range(vocab):
        n = second[a].sum()
        if n > 1000:
            assert 0.5 * (second[a] / n - p[(a,)]).abs().sum() < 0.06, a


@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
def test_greedy_tree_streams_equal_plain_decoding(tiny_llama_ws, tmp_path, method):
    """Trees verified in one forward with the tree mask: the streams are plain greedy's (stop strings, logprobs,
    penalties, one at a time and batched) and the pools full again. The self-draft (the model itself) has every
    chain accepted, whose nodes sit after their depth's alternatives: each verification attends past siblings and
    moves the kept path's K/V, which the next step reads."""

    ws = tiny_llama_ws[1]
    if method == "ngram":
        spec = SpeculativeConfig("ngram", tree=(3, 3), prompt_lookup_min=1)
    else:
        layers = 1 if method == "draft" else 2
        spec = SpeculativeConfig("draft", model=str(first_layers_workspace(ws, layers, tmp_path / "draft")),
                                 tree=(3, 3))
    free, _ = _run(ws, _greedy_configs())
    configs = _greedy_configs([_text(d) for d in free])
    for one in (True, False):
        plain, _ = _run(ws, configs, one_at_a_time=one)
        ours, stats = _run(ws, configs, spec, one_at_a_time=one)
        assert [_tokens(d) for d in ours] == [_tokens(d) for d in plain]
        assert [_text(d) for d in ours] == [_text(d) for d in plain]
        lp_ours = [x for d in ours[1] for x in d[3]]
        lp_plain = [x for d in plain[1] for x in d[3]]
        assert lp_ours == pytest.approx(lp_plain, abs=1e-4)
        assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
        if method == "self-draft":  # the chains' nodes (3 of the 9 of a 3x3 tree), a penalised request aside
            assert stats.spec_accepted_tokens >= 0.25 * stats.spec_proposed_tokens


def test_tree_with_online_int8_kv(tiny_llama_ws, tmp_path):
    """quant_policy 4: the kept path's codes and their (scale, zero) move together; streams equal plain int8's."""
    ws = tiny_llama_ws[1]
    spec = SpeculativeConfig("draft", model=str(first_layers_workspace(ws, 2, tmp_path / "draft")), tree=(2, 3))
    configs = [GenerationConfig(max_new_tokens=14, temperature=0, ignore_eos=True) for _ in range(3)]
    plain, _ = _run(ws, configs, quant_policy=4)
    ours, stats = _run(ws, configs, spec, quant_policy=4)
    assert [_tokens(d) for d in ours] == [_tokens(d) for d in plain]
    assert stats.spec_accepted_tokens > 0


def test_tree_with_preemption_and_abort(tiny_llama_ws, tmp_path):

    ws = tiny_llama_ws[1]
    spec = SpeculativeConfig("draft", model=str(first_layers_workspace(ws, 2, tmp_path / "draft")), tree=(2, 3))
    configs = [GenerationConfig(max_new_tokens=18, temperature=0, ignore_eos=True) for _ in range(6)]
    small = dict(cache_max_entry_count=40)  # 160 tokens of KV for six requests of up to 57: preemption
    plain, _ = _run(ws, configs, **small)
    ours, stats = _run(ws, configs, spec, abort_at=4, **small)
    assert stats.preemptions > 0 and stats.spec_accepted_tokens > 0 and ours[2][-1][2] == "abort"
    assert _tokens(ours[2]) == _tokens(plain[2])[:len(_tokens(ours[2]))]
    assert all(_tokens(d) == _tokens(plain[i]) for i, d in enumerate(ours) if i != 2)


def test_tree_forward_logits_equal_each_path_run_alone(tiny_llama_ws):
    """One forward over a prefix's root and a 7-node tree gives, at every node's row, the logits of the root and
    that node's path computed as an ordinary chunk (positions by depth, the tree mask), to float rounding."""
    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.scheduler import ScheduledChunk, SchedulerOutput
    from lmd.turbomind.speculative.tree_step import run_with_trees
    from lmd.turbomind.workspace import open_workspace

    runner = ModelRunner(open_workspace(tiny_llama_ws[1], cache_block_seq_len=4, cache_max_entry_count=64))
    prompt = torch.randint(0, 49152, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    tree = TokenTree.from_chains([[11, 12, 13], [11, 14], [15, 16], [17]])
    table = list(range(8))
    runner.run_chunks([(prompt[:-1], 0, table)], [])
    runner.run_chunks([(prompt[:-1], 0, list(range(8, 16)))], [])  # the same prefix in other blocks, for the paths
    chunk = ScheduledChunk(0, (prompt[-1], *tree.tokens), 9, tuple(table), True, num_draft=len(tree))
    logits = run_with_trees(runner, SchedulerOutput((chunk,), ()), {0: tree}, None)
    assert logits.shape[0] == 1 + len(tree)
    for row in range(1 + len(tree)):
        path = [] if row == 0 else [tree.tokens[n] for n in tree.path(row - 1)]
        alone = runner.run_chunks([([prompt[-1], *path], 9, list(range(8, 16)))], [len(path)])  # overwrites 9..
        assert (logits[row] - alone[0]).abs().max() < 1e-4, row
