"""Chat prompts: conversations rendered with the tokenizer's chat template (``transformers``'
``apply_chat_template``, which renders Jinja in a sandboxed environment, so a template from a
file runs no code of its own), as ``LLM.chat``, ``pagedpack generate`` and the server use them.
"""
from __future__ import annotations

from pagedpack.inputs import Prompt


def conversations(messages) -> tuple[list[list[dict]], bool]:
    """``(conversations, batched)``: ``messages`` as a list of conversations (one conversation is a
    list of ``{"role": str, "content": str, ...}`` dicts; a list of those is several);
    ``ValueError`` naming the message otherwise."""
    batched = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
    convs = list(messages) if batched else [messages]
    for i, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ValueError(f"messages[{i}]: expected a non-empty list of messages, got {conv!r:.80}")
        for j, message in enumerate(conv):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content", ""), (str, list))):
                raise ValueError(f"messages[{i}][{j}]: expected a dict with a 'role' string and a 'content' "
                                 f"string, got {message!r:.80}")
    return [list(c) for c in convs], batched


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_text(tokenizer, conversation: list[dict], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """The conversation rendered by the chat template (``chat_template`` or the tokenizer's), as
    text; ``tools`` (OpenAI's function tools) are the template's ``tools`` (a template that does
    not read them renders without them). ``ValueError`` for a tokenizer with no template, or a
    template that fails on the conversation."""
    if tokenizer is None:
        raise ValueError("messages: chat needs a tokenizer and the model has none")
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError("chat_template: the tokenizer has no chat template; pass chat_template= "
                         "(--chat-template) or give raw prompts")
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt and not continue_final_message,
                                             continue_final_message=continue_final_message, tools=tools,
                                             **(chat_template_kwargs or {}))
    except Exception as err:  # a Jinja error, a template that raises on this conversation
        raise ValueError(f"messages: the chat template does not render this conversation "
                         f"({type(err).__name__}: {err})") from err


def render(tokenizer, conversation: list[dict], **options) -> tuple[str, Prompt]:
    """``(text, prompt)``: :func:`render_text` (``options`` as it takes them) and the text's token
    ids as a :class:`~pagedpack.inputs.Prompt`, tokenized without adding special tokens (the
    template writes them, as ``apply_chat_template`` does)."""
    text = render_text(tokenizer, conversation, **options)
    return text, Prompt(tokenizer(text, add_special_tokens=False).input_ids)
