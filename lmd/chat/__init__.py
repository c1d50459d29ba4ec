"""Chat: the template registry (what MODEL_NAME means) and, later, the interactive chat command."""

from __future__ import annotations

from lmd.chat_templates import TEMPLATE_NAMES, ChatTemplate, get_chat_template

__all__ = ["TEMPLATE_NAMES", "ChatTemplate", "get_chat_template"]
