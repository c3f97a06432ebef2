"""Tokenizer, chat template, and the incremental detokenizer that streams text and finds stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

from engine.loader import ModelLoadError, first_line, read_json
from engine.stop_strings import StopMatcher

# The tokenizer's JSON files, parsed first so that a broken one is named (transformers' own error does not).
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")

# Previous tokens decoded together with the new ones. Decoding a token alone can differ from
# decoding it in context (sentencepiece drops the leading space of the first token, a multi-byte
# character can be split across tokens), so new text is always the difference between decoding
# the window with and without the new tokens. Five covers a 4-byte character plus one more token.
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 64

# What a decoder puts where bytes are not (yet) a whole UTF-8 character.
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """A model directory's Hugging Face tokenizer, read from local files only."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        for name in _TOKENIZER_JSON:
            if (model_dir / name).is_file():
                read_json(model_dir / name)
        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as exc:  # a missing vocabulary file, a class transformers does not know, ...
            raise ModelLoadError(model_dir, f"the tokenizer cannot be loaded: {first_line(exc)}") from None
        # len() counts added tokens; it can be smaller than the model's (padded) embedding.
        self.vocab_size: int = len(self.hf)
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(_eos_token_ids(self.hf, model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: that heuristic (" ." -> ".") depends on where decoding is cut,
        # so streamed text could never add up to the full decode.
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        **template_kwargs,
    ) -> list[int]:
        """The prompt token ids for a chat, rendered by the model's own template (or `chat_template`),
        with `tools` and any extra variables the template reads (e.g. enable_thinking)."""
        text = self.render_chat(messages, add_generation_prompt, tools, chat_template, **template_kwargs)
        # The template writes every special token itself (BOS included); adding them again would double them.
        return self.encode(text, add_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        **template_kwargs,
    ) -> str:
        """The prompt text of apply_chat_template(), before tokenizing (encode it without special tokens)."""
        if not (chat_template or self.hf.chat_template):
            raise ValueError(
                "this model has no chat template (none in its tokenizer files); "
                "use the completions API with a plain prompt instead"
            )
        return self.hf.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
            chat_template=chat_template,
            **template_kwargs,
        )


def _eos_token_ids(hf, model_dir: Path) -> set[int]:
    ids = set() if hf.eos_token_id is None else {hf.eos_token_id}
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = read_json(generation_config).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    return ids


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are safe to stream, and watches for stop strings.

    Every `add` decodes only a small window (a few context tokens plus the new ones), so its cost
    does not grow with the output. Text is held back while it ends inside an incomplete character,
    or in something that may be the start of a stop string; `flush` releases it at the end.

    With a fast (Rust) tokenizer the window is decoded by the `tokenizers` library's DecodeStream,
    one call per token (~1 us, against ~10 us for two decodes through transformers): this runs for
    every generated token on the engine thread.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | StopMatcher = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        """`stop`: the stop strings, or their StopMatcher (the engine builds one per request for its n
        sequences)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The prompt's last tokens give the first output token its context; none that end
        # inside a character, or the output's first bytes would complete a prompt character.
        start = max(0, len(prompt_token_ids) - _CONTEXT_TOKENS)
        # Skipped special tokens decode to nothing: reach further back (within a bound) until the
        # context has some text, which is what decides, e.g., a first word's leading space.
        while (
            start > 0
            and len(prompt_token_ids) - start < _MAX_CONTEXT_TOKENS
            and not self._decode(prompt_token_ids[start:])
        ):
            start -= 1
        self._window = list(prompt_token_ids[start:])
        while self._window and self._decode(self._window).endswith(_REPLACEMENT):
            self._window.pop()
        self._read = len(self._window)  # window[:_read] is context whose text was already emitted
        self._rust = getattr(tokenizer.hf, "_tokenizer", None)  # a fast tokenizer's own
        self._stream = None
        if self._rust is not None:
            from tokenizers.decoders import DecodeStream

            # The same window algorithm, primed with the same context.
            self._stream = DecodeStream(ids=list(self._window), skip_special_tokens=skip_special_tokens)
        matcher = stop if isinstance(stop, StopMatcher) else StopMatcher(stop)
        self._stops = matcher if matcher.stops else None
        self._state = 0  # the matcher's state for this text
        self._include_stop = include_stop_str_in_output
        self._pending = ""  # decoded text held back because it may be the start of a stop string
        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None

    def add(self, token_ids: list[int]) -> str:
        """Feed newly generated token ids; the new text that may be shown now."""
        if self.stopped or not token_ids:
            return ""
        if self._stream is None:
            self._window.extend(token_ids)
            return self._emit(self._take_text(final=False), final=False)
        pieces = []
        for token in token_ids:
            piece = self._stream.step(self._rust, token)  # None: held, it ends inside a character
            self._window.append(token)
            if piece is not None:
                pieces.append(piece)
                # All emitted: the window keeps only the context flush() decodes held tokens with.
                del self._window[:-_CONTEXT_TOKENS]
                self._read = len(self._window)
        return self._emit("".join(pieces), final=False)

    def flush(self) -> str:
        """At the end of generation: the text held back so far."""
        if self.stopped:
            return ""
        return self._emit(self._take_text(final=True), final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _take_text(self, final: bool) -> str:
        """The text of window[_read:], unless it ends inside a character and more tokens may follow."""
        text = self._decode(self._window)
        # A trailing U+FFFD usually means the last token ends partway through a multi-byte
        # character that the next token completes; the replacement would be wrong to emit.
        if not final and text.endswith(_REPLACEMENT):
            return ""
        new_text = text[len(self._decode(self._window[: self._read])) :]
        self._window = self._window[-_CONTEXT_TOKENS:]
        self._read = len(self._window)
        return new_text

    def _emit(self, new_text: str, final: bool) -> str:
        if self._stops is None:
            self.text += new_text
            return new_text
        # The held-back tail is what the matcher's state stands for (no stop string can begin in text
        # already emitted), so feeding it only the new text finds the stop string that ends first.
        buffer = self._pending + new_text
        self._state, end = self._stops.scan(self._state, new_text)
        if end is not None:
            end += len(self._pending)
            start = end - self._stops.matched(self._state)
            delta = buffer[:end] if self._include_stop else buffer[:start]
            self._pending = ""
            self.stopped, self.stop_string = True, buffer[start:end]
        else:
            hold = 0 if final else self._stops.pending(self._state)
            delta, self._pending = buffer[: len(buffer) - hold], buffer[len(buffer) - hold :]
        self.text += delta
        return delta
