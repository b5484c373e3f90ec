"""The renderer verifiers' train client gets for a model it has no renderer of its own for (SmolLM2, any fine-tune):
its default renderer (the model's chat template), which renders each later turn's prompt from the conversation's
text, so a turn whose sampled token ids are not its text's own tokenisation (4-14% of SmolLM2's turns) comes back
as other ids and the episode drifts. This one renders the first prompt as verifiers' default renderer does and every
later one as the OpenEnv path does (chat_render.Renderer.after_turn): the previous prompt and the ids sampled, as
they were, then the template's rendering of the new messages alone. Verifiers asks for that
(`bridge_to_next_turn`) whenever a turn only adds user or tool messages after a sampled one; otherwise (the
environment rewrote the history) it renders the whole conversation again, which the worker checks (drift).

Imported by verifiers' renderer pool by name (`renderers`' CustomRendererConfig import_path), in the worker's own
process, so it needs the envs venv only.

    .venv-envs/bin/python -m pytest -q tests/test_env_libraries.py -k bridge
"""
from __future__ import annotations

from renderers.base import RenderedTokens, reject_assistant_in_extension
from renderers.configs import CustomRendererConfig, DefaultRendererConfig
from renderers.default import DefaultRenderer

from chat_render import Renderer

IMPORT_PATH = "vf_renderer.TokenBridgeRenderer"


class TokenBridgeRenderer(DefaultRenderer):
    """verifiers' DefaultRenderer (the model's chat template; `tool_parser` and the other fields as its own), whose
    later turns extend the sampled tokens instead of re-rendering the history from text."""

    config_class = DefaultRendererConfig  # (renderers' custom renderers name the config they take)

    def __init__(self, tokenizer, config: DefaultRendererConfig | None = None):
        super().__init__(tokenizer, config)
        self.template = Renderer(tokenizer, set(self.get_stop_token_ids()))

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list, *, tools: list | None = None) -> RenderedTokens | None:
        """previous prompt + sampled ids + the template's end of the assistant turn (less the EOS sampled), the new
        messages and the next assistant header. None (verifiers renders the whole conversation again) for an
        assistant message among the new ones: that would replace sampled tokens with the template's text."""
        if not previous_prompt_ids or not new_messages or reject_assistant_in_extension(new_messages):
            return None
        previous = list(previous_prompt_ids) + list(previous_completion_ids)
        ext = self.template.after_turn([dict(m) for m in new_messages],
                                       previous_completion_ids[-1] if previous_completion_ids else None)
        return RenderedTokens(token_ids=previous + ext, message_indices=[-1] * (len(previous) + len(ext)),
                              message_roles=[m.get("role") or "" for m in new_messages])


def bridge_config(given: DefaultRendererConfig | None = None) -> CustomRendererConfig:
    """The train client's renderer config for TokenBridgeRenderer, with the default renderer's fields `given`."""
    fields = given.model_dump(exclude={"name"}, exclude_none=True) if given is not None else {}
    return CustomRendererConfig(import_path=IMPORT_PATH, **fields)
