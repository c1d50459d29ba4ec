"""Calibration and evaluation data: wikitext2, ptb, c4, pileval, pydoc, or user files (see `sources` for the order)."""

from __future__ import annotations

from lmd.calib_data.eval_text import EvalText, load_eval_text
from lmd.calib_data.sampling import DEFAULT_CALIB_SPLIT, CalibSet, get_calib_samples
from lmd.calib_data.sources import DATASETS, SPLITS

__all__ = ["DATASETS", "DEFAULT_CALIB_SPLIT", "SPLITS", "CalibSet", "EvalText", "get_calib_samples",
           "load_eval_text"]
