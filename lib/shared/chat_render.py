"""How an episode's tokens are rendered by the chat template, one new piece at a time: the runner builds episodes with
it (lib/rollout/episodes.py) and the trainer's audit replays a participant's episode with it (lib/train/audit_tasks.py),
so both must render alike: one class for both."""
from __future__ import annotations


class Renderer:
    """The chat template, one new piece at a time. `after_turn(messages, eos_ended)` gives the tokens that
    follow a model turn: the end-of-turn text the template writes after an assistant message (less the
    EOS token the model sampled itself), the new messages, and the header of the next assistant turn.
    Found by rendering a reference conversation with and without them and taking the difference, so it
    works for any template that renders a conversation as the concatenation of its messages (and says so
    when one does not)."""

    def __init__(self, tok, eos_ids: set[int]):
        self.tok, self.eos_ids = tok, eos_ids
        self.ref = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
        rendered = self.text(self.ref)
        if "A" not in rendered:
            raise ValueError("the chat template does not render an assistant message's content as is")
        self.base = rendered
        self.closing = rendered[rendered.rindex("A") + 1:]       # e.g. "<|im_end|>\n"
        self.eos_text = {e: tok.decode([e]) for e in eos_ids}

    def text(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def ids(self, messages: list[dict], generation_prompt: bool = True) -> list[int]:
        out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def after_turn(self, messages: list[dict], last_token: int | None) -> list[int]:
        closing = self.closing
        eos = self.eos_text.get(last_token) if last_token is not None else None
        if eos and closing.startswith(eos):
            closing = closing[len(eos):]  # the model ended its turn with the template's own end-of-turn token
        full = self.text(self.ref + messages, generation_prompt=True)
        if not full.startswith(self.base):
            raise ValueError("the chat template renders earlier messages differently once more follow: "
                             "new messages cannot be appended without re-tokenising the history")
        return self.tok.encode(closing + full[len(self.base):], add_special_tokens=False)

    def drift(self, history: list[dict], have: list[int]) -> str | None:
        """None when rendering `history` (then the next assistant header) gives exactly the tokens `have`;
        else where they part."""
        want = self.ids(history)
        if want == have:
            return None
        i = next((k for k, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        return (f"the environment's history renders to {len(want)} tokens, the episode has {len(have)}; they part at "
                f"token {i}: {self.tok.decode(want[i:i + 8])!r} vs {self.tok.decode(have[i:i + 8])!r}")


