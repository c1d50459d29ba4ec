"""The evaluation text of a data set, joined the way GPTQ/llm-awq perplexity scripts join it.

wikitext2: "\\n\\n".join(rows); ptb: " ".join(sentences); c4 (validation): the first 1100 documents joined with " "
and, as GPTQ's `get_c4`, at most 256 windows (`max_windows`, i.e. the first 256 * seqlen tokens); pileval, pydoc and
user paths: "\\n\\n".join(rows).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmd.calib_data.sources import load_rows

C4_EVAL_DOCS = 1100
C4_EVAL_WINDOWS = 256


@dataclass(frozen=True)
class EvalText:
    text: str
    dataset: str
    split: str
    source: str
    max_windows: int | None = None  # a protocol cap (c4: 256), applied on top of the user's --max-windows


def load_eval_text(dataset: str, split: str = "test", data_dir: str | None = None) -> EvalText:
    if dataset == "c4" and split == "test":
        split = "validation"  # c4 has no test split; GPTQ evaluates on validation, so no fallback message
    rows = load_rows(dataset, split, data_dir)
    if rows.dataset == "c4":
        return EvalText(rows.joiner.join(rows.rows[:C4_EVAL_DOCS]), rows.dataset, rows.split, rows.source,
                        C4_EVAL_WINDOWS)
    return EvalText(rows.text, rows.dataset, rows.split, rows.source)
