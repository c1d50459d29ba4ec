"""The workspace format (docs/workspace.md) that `lmd deploy` writes and the engine reads: config.ini, the file
layout and how tensors are laid out across tensor-parallel ranks. It depends on nothing else in lmd but errors."""
