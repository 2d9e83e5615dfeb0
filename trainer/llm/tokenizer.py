"""Tokenizers for the models this project builds itself, and chat prompts for any tokenizer.

`char_tokenizer(alphabet)` builds a character-level tokenizer with the `tokenizers` library and
wraps it as a `transformers` fast tokenizer, with a chat template, so it saves and loads with
the checkpoint like any Hugging Face tokenizer (nothing is downloaded). `render_chat` turns
OpenAI chat messages into prompt token ids with the tokenizer's own chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Roles become special tokens; the assistant's turn ends with EOS, which ends generation.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer(alphabet: str) -> Any:
    """A character-level fast tokenizer over `alphabet` (plus PAD, EOS, UNK and the roles)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, EOS, UNK, *ROLE_TOKENS]
    chars = sorted(set(alphabet))
    vocab = {token: index for index, token in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Prompt token ids for OpenAI chat `messages`, ending where the assistant's reply starts."""
    plain = [{"role": m["role"], "content": _text(m.get("content"))} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return an encoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    # A tokenizer without a template: "role: content" lines, then "assistant:".
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
    return [int(i) for i in tokenizer(text)["input_ids"]]


def _text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ValueError("message content must be a string or a list of content parts")
