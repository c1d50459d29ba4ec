"""A draft workspace cut from the target itself: its first N decoder layers and its head (LayerSkip-style early
exit), written as config.ini with fewer layers beside links to the target's weight files, so it costs no disk and
no conversion (the engine reads only the tensors config.ini names). A weak but free draft with the same tokenizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lmd.errors import LmdError


def first_layers_workspace(workspace: str | Path, layers: int, dst: str | Path) -> Path:
    from lmd.workspace_format.config_ini import read_workspace_config, write_workspace_config

    src, dst = Path(workspace), Path(dst)
    config = read_workspace_config(src)
    if not 1 <= layers <= config.num_layer:
        raise LmdError(f"a draft of the first {layers} layers: {src} has {config.num_layer}; use 1..{config.num_layer}")
    if (dst / "triton_models").exists():
        raise LmdError(f"{dst} already holds a workspace; give a new directory")
    (dst / "triton_models" / "weights").mkdir(parents=True)
    (dst / "triton_models" / "tokenizer").symlink_to((src / "triton_models" / "tokenizer").resolve())
    for f in (src / "triton_models" / "weights").iterdir():
        if f.name != "config.ini":
            (dst / "triton_models" / "weights" / f.name).symlink_to(f.resolve())
    write_workspace_config(dst, dataclasses.replace(config, num_layer=layers))
    return dst
