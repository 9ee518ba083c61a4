"""A pooling model's texts as token ids, the way sentence-transformers tokenizes them, so that embeddings and scores
match its `encode` and `predict`: the default prompt applied, lowercased where the checkpoint says, and either
tokenized as they are (a pair with the tokenizer's pair template) or, for a checkpoint whose Transformer module takes
messages, rendered through the chat template as a user message (a pair as a query and a document message) after the
prompt as a system message.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping

from transformers import PreTrainedTokenizerBase

from heteroserve.model.layers.pooler import ChatTemplateInput, PoolerSpec

PAIR_ROLES = ("query", "document")  # the roles sentence-transformers gives a pair's two texts
# Two contents that tokenize apart, so the token suffix their renders share is the template's own closing tokens
# (sentence-transformers' fillers, so both find the same suffix).
_SUFFIX_FILLERS = ("0", "1 2 3 4")
# Pairs that differ in one side each: a template that renders a pair must change when either side does.
_PAIR_PROBES = (("river", "garden"), ("mountain", "garden"), ("river", "window"))


class PoolingTokenizer:
    """Tokenizes a pooling model's texts and text pairs as sentence-transformers does, truncated as asked.

    Truncating switches a setting inside a fast tokenizer, which must not happen while another thread encodes with
    it (the server tokenizes in threads of its own), so truncation runs on a private copy, one call at a time."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, spec: PoolerSpec | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.default_prompt = spec.default_prompt if spec is not None else None
        self.lowercase = spec is not None and spec.lowercase
        self.chat: ChatTemplateInput | None = spec.chat_template if spec is not None else None
        self.max_model_len = max_model_len
        self._truncating_tokenizer: PreTrainedTokenizerBase | None = None
        self._truncation_lock = threading.Lock()
        self._template_suffixes: dict[tuple[str, ...], list[int]] = {}  # roles of a conversation -> its suffix
        self._pair_roles_checked = False
        if self.chat is not None and tokenizer is not None and not _has_chat_template(tokenizer, self.chat):
            raise ValueError(
                "sentence_bert_config.json's modality_config has a message modality (texts go through the chat "
                "template), but the tokenizer has no chat template"
            )

    def text(self, text: str, truncate_prompt_tokens: int | None) -> Mapping[str, list[int]]:
        """One text's encoding ("input_ids", and "token_type_ids" where the tokenizer makes them)."""
        self._require_tokenizer()
        if self.chat is not None:
            return self._render([("user", text)], truncate_prompt_tokens)
        text = (self.default_prompt or "") + text
        return self._encode(text.lower() if self.lowercase else text, truncate_prompt_tokens=truncate_prompt_tokens)

    def pair(self, first: str, second: str, truncate_prompt_tokens: int | None) -> Mapping[str, list[int]]:
        """A cross-encoder's encoding of a (query, document) pair; the prompt goes before the query."""
        self._require_tokenizer()
        if self.chat is not None:
            self._check_pair_roles()
            return self._render(list(zip(PAIR_ROLES, (first, second), strict=True)), truncate_prompt_tokens)
        first = (self.default_prompt or "") + first
        if self.lowercase:
            first, second = first.lower(), second.lower()
        return self._encode(first, second, truncate_prompt_tokens=truncate_prompt_tokens)

    def cut(self, ids: list[int] | None, truncate_prompt_tokens: int | None) -> list[int] | None:
        """Token ids cut to truncate_prompt_tokens (-1: max_model_len) on the tokenizer's truncation side."""
        if ids is None or truncate_prompt_tokens is None:
            return ids
        limit = self._limit(truncate_prompt_tokens)
        left = self.tokenizer is not None and self.tokenizer.truncation_side == "left"
        return ids[-limit:] if left else ids[:limit]

    def _limit(self, truncate_prompt_tokens: int) -> int:
        return self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def _require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompt_token_ids")

    def _encode(self, *texts: str, truncate_prompt_tokens: int | None) -> Mapping[str, list[int]]:
        """The tokenizer's encoding of one text or a pair, truncated as the tokenizer truncates (its side, its
        special tokens kept)."""
        if truncate_prompt_tokens is None:
            return self.tokenizer(*texts)
        with self._truncation_lock:
            return self._truncating()(*texts, truncation=True, max_length=self._limit(truncate_prompt_tokens))

    def _render(self, turns: list[tuple[str, str]], truncate_prompt_tokens: int | None) -> Mapping[str, list[int]]:
        """A conversation's tokens through the chat template (the default prompt first, as a system message). Cut
        short, its last tokens become the template's closing ones again, as sentence-transformers restores them: a
        model pooling the last token reads the same marker after every text."""
        conversation = self._conversation(turns)
        if truncate_prompt_tokens is None:
            return self._apply_template(self.tokenizer, conversation)
        limit = self._limit(truncate_prompt_tokens)
        with self._truncation_lock:
            encoded = self._apply_template(self._truncating(), conversation, truncation=True, max_length=limit)
        ids = list(encoded["input_ids"])
        if not self.chat.restore_suffix or len(ids) < limit:
            return encoded
        suffix = self._template_suffix(conversation)
        keep = min(len(suffix), len(ids))
        if keep:
            ids[len(ids) - keep :] = suffix[len(suffix) - keep :]
        return {**encoded, "input_ids": ids}

    def _conversation(self, turns: list[tuple[str, str]]) -> list[dict]:
        """The messages of the turns, with the default prompt as a system message before them."""
        if self.default_prompt:
            turns = [("system", self.default_prompt), *turns]
        return [self._message(role, content) for role, content in turns]

    def _message(self, role: str, content: str) -> dict:
        if self.chat.structured:
            return {"role": role, "content": [{"type": "text", "text": content}]}
        return {"role": role, "content": content}

    def _apply_template(self, tokenizer: PreTrainedTokenizerBase, conversation: list[dict], **sizes) -> Mapping:
        """apply_chat_template as sentence-transformers calls it: rendered and tokenized at once, with the
        checkpoint's template arguments."""
        return tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=True, **sizes, **self.chat.template_kwargs
        )

    def _template_suffix(self, conversation: list[dict]) -> list[int]:
        """The tokens the template writes after the last content (an end of turn, a generation prompt): the token
        suffix two renders with different contents share. System messages are kept, other contents replaced."""
        key = tuple(message["role"] for message in conversation)
        if key not in self._template_suffixes:
            renders = []
            for filler in _SUFFIX_FILLERS:
                skeleton = [
                    message if message["role"] == "system" else self._message(message["role"], filler)
                    for message in conversation
                ]
                renders.append(list(self._apply_template(self.tokenizer, skeleton)["input_ids"]))
            first, second = renders
            shared = 0
            while shared < min(len(first), len(second)) and first[-1 - shared] == second[-1 - shared]:
                shared += 1
            # Renders equal to their end hold no content at all: nothing to tell the template's tail by.
            self._template_suffixes[key] = first[len(first) - shared :] if shared < min(map(len, renders)) else []
        return self._template_suffixes[key]

    def _check_pair_roles(self) -> None:
        """ValueError when the chat template drops a query or a document message (a template written for the user
        and assistant roles only): such a pair would be scored without its texts. sentence-transformers refuses
        these pairs too."""
        if self._pair_roles_checked:
            return
        renders = [
            self.tokenizer.apply_chat_template(
                [self._message(role, text) for role, text in zip(PAIR_ROLES, pair, strict=True)],
                tokenize=False,
                **self.chat.template_kwargs,
            )
            for pair in _PAIR_PROBES
        ]
        dropped = [role for role, render in zip(PAIR_ROLES, renders[1:], strict=True) if render == renders[0]]
        if dropped:
            raise ValueError(
                f"the chat template does not render the {' and '.join(dropped)} message of a pair (the roles "
                f"sentence-transformers gives a cross-encoder's texts are {PAIR_ROLES[0]!r} and {PAIR_ROLES[1]!r})"
            )
        self._pair_roles_checked = True

    def _truncating(self) -> PreTrainedTokenizerBase:
        if self._truncating_tokenizer is None:
            self._truncating_tokenizer = copy.deepcopy(self.tokenizer)
        return self._truncating_tokenizer


def _has_chat_template(tokenizer: PreTrainedTokenizerBase, chat: ChatTemplateInput) -> bool:
    return bool(getattr(tokenizer, "chat_template", None) or chat.template_kwargs.get("chat_template"))
