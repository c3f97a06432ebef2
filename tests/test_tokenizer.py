"""Tokenizer and incremental detokenizer against the real SmolLM2 tokenizer."""

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.default_model import default_model_dir
from engine.stop_strings import StopMatcher
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def tokenizer():
    return Tokenizer(default_model_dir())


@pytest.fixture(scope="session")
def partial_character_ids(tokenizer):
    """Ids whose text alone is not whole characters: the tokens that split emoji and CJK."""
    return [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]


hypothesis_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Text a model may produce: ASCII, runs of spaces and newlines, accents, CJK, emoji (4-byte, ZWJ).
PIECES = st.sampled_from(
    list("ab xyZ.,!?\n\t  'éüñçÅ日本語中文한국어") + ["🎉", "👍🏽", "👨‍👩‍👧", "€", "\u0301", "hello", " the"]
)


def text(min_size=0, max_size=20):
    return st.lists(PIECES, min_size=min_size, max_size=max_size).map("".join)


TEXT = text()


def stream(detokenizer, token_ids, chunk_sizes):
    """Feed `token_ids` in chunks of the given sizes (cycled), then flush; the list of deltas."""
    deltas, i, k = [], 0, 0
    while i < len(token_ids):
        size = chunk_sizes[k % len(chunk_sizes)] if chunk_sizes else 1
        deltas.append(detokenizer.add(token_ids[i : i + size]))
        i, k = i + size, k + 1
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == detokenizer.text
    return deltas


def token_ids(tokenizer, partial_character_ids):
    special = st.integers(0, 16)
    return st.lists(
        st.one_of(special, st.integers(0, tokenizer.vocab_size - 1), st.sampled_from(partial_character_ids)),
        max_size=30,
    )


def test_basic_attributes(tokenizer):
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2
    assert im_end in tokenizer.eos_token_ids
    assert tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.decode(tokenizer.encode("héllo 日本 🎉")) == "héllo 日本 🎉"


def test_generation_config_eos_list_is_merged(tokenizer, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer(tmp_path).eos_token_ids == {0, 2}


def test_chat_template_ends_with_assistant_turn_and_round_trips(tokenizer):
    ids = tokenizer.apply_chat_template(CHAT)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert ids.count(1) == 3  # system, user, assistant: no doubled BOS
    assert not tokenizer.decode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=False), False).endswith(
        "assistant\n"
    )


def test_no_chat_template_is_a_clear_error(tmp_path):
    shutil.copy(default_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((default_model_dir() / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template(CHAT)


@hypothesis_settings
@given(data=st.data(), skip_special=st.booleans(), chunks=st.lists(st.integers(1, 4), max_size=5))
def test_random_token_ids_stream_to_the_full_decode(tokenizer, partial_character_ids, data, skip_special, chunks):
    ids = token_ids(tokenizer, partial_character_ids)
    prompt, output = data.draw(ids), data.draw(ids)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special)
    stream(detokenizer, output, chunks)
    assert detokenizer.text == tokenizer.decode(output, skip_special_tokens=skip_special)
    assert not detokenizer.stopped


@hypothesis_settings
@given(prompt=TEXT, answer=TEXT, chunks=st.lists(st.integers(1, 4), max_size=5))
def test_random_text_streams_back_exactly(tokenizer, prompt, answer, chunks):
    output = tokenizer.encode(answer, add_special_tokens=False)
    chat_prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    detokenizer = IncrementalDetokenizer(tokenizer, chat_prompt)
    deltas = stream(detokenizer, output, chunks)
    assert detokenizer.text == answer
    # Nothing emitted is ever a broken character.
    assert all("\ufffd" not in delta for delta in deltas)


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode(" 🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes span several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.add([i]) for i in ids] == [""] * (len(ids) - 1) + [" 🎉"]


@hypothesis_settings
@given(
    data=st.data(),
    before=TEXT,
    after=TEXT,
    stop=text(1, 3),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 4), max_size=5),
)
def test_stop_string_truncates_and_never_leaks(tokenizer, data, before, after, stop, include, chunks):
    full = before + stop + after
    output = tokenizer.encode(full, add_special_tokens=False)
    expected_end = full.find(stop) + (len(stop) if include else 0)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[stop], include_stop_str_in_output=include)
    deltas = stream(detokenizer, output, chunks)
    assert detokenizer.stopped and detokenizer.stop_string == stop
    assert detokenizer.text == full[:expected_end]
    # Every prefix a client saw is a prefix of the final text: nothing was shown, then cut.
    shown = ""
    for delta in deltas:
        shown += delta
        assert full[:expected_end].startswith(shown)
    assert detokenizer.add(output[:1]) == ""


@hypothesis_settings
@given(
    text=TEXT,
    stops=st.lists(text(1, 2), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=5),
)
def test_stop_strings_do_not_depend_on_chunking(tokenizer, text, stops, chunks):
    output = tokenizer.encode(text, add_special_tokens=False)
    one_by_one = IncrementalDetokenizer(tokenizer, [], stop=stops)
    chunked = IncrementalDetokenizer(tokenizer, [], stop=stops)
    stream(one_by_one, output, [1])
    stream(chunked, output, chunks)
    assert (chunked.text, chunked.stop_string) == (one_by_one.text, one_by_one.stop_string)
    if not one_by_one.stopped:
        assert one_by_one.text == text


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["world"])
    assert detokenizer.add(tokenizer.encode("Hello wor", add_special_tokens=False)) == "Hello "
    assert detokenizer.add(tokenizer.encode("k", add_special_tokens=False)) == "work"
    assert not detokenizer.stopped


def test_stop_that_ends_first_wins(tokenizer):
    ids = tokenizer.encode("say xabc now", add_special_tokens=False)
    for chunks in ([1], [len(ids)]):
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["xabc", "ab"])
        stream(detokenizer, ids, chunks)
        assert (detokenizer.text, detokenizer.stop_string) == ("say x", "ab")


def test_special_tokens_kept_when_asked(tokenizer):
    ids = tokenizer.encode("Paris.<|im_end|>", add_special_tokens=False)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, stop=["<|im_end|>"])
    stream(kept, ids, [1])
    assert (kept.text, kept.stop_string) == ("Paris.", "<|im_end|>")
    skipped = IncrementalDetokenizer(tokenizer, [])
    stream(skipped, ids, [1])
    assert skipped.text == "Paris."


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory):
    """A sentencepiece-style tokenizer (Metaspace: '▁' for spaces, the first one dropped, byte fallback),
    the family of Llama 2 and Mistral, trained here on a few lines."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizers.Replace(" ", "▁")
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    rust.train_from_iterator(["the cat sat on the mat", "héllo wörld 日本語", "a b c d e f"] * 20, trainer)
    # The byte tokens are ordinary vocabulary in such tokenizers, not special (skipped) tokens.
    spec = json.loads(rust.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    rust = RustTokenizer.from_str(json.dumps(spec))
    path = tmp_path_factory.mktemp("metaspace")
    PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return Tokenizer(path)


@hypothesis_settings
@given(data=st.data(), answer=TEXT, skip_special=st.booleans(), chunks=st.lists(st.integers(1, 4), max_size=5))
def test_stream_decoder_follows_the_prompt(metaspace_tokenizer, data, answer, skip_special, chunks):
    """On a tokenizer whose first token's leading space depends on context and which spells characters
    it lacks in byte tokens (an emoji is 4-8 of them), the streamed text is the output's text in the
    context of the prompt."""
    tok = metaspace_tokenizer
    prompt = data.draw(st.lists(st.integers(0, 2) | st.integers(259, tok.vocab_size - 1), max_size=8))
    output = tok.encode(answer, add_special_tokens=False) + data.draw(st.lists(st.integers(0, 2), max_size=2))
    detokenizer = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special)
    stream(detokenizer, output, chunks)
    before = tok.decode(prompt, skip_special_tokens=skip_special)
    full = tok.decode(prompt + output, skip_special_tokens=skip_special)
    assert full.startswith(before)
    assert detokenizer.text == full[len(before) :]


def _first_stop_reference(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string that ends first in `text` (at one end, the one that starts first), by brute force."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    return min(found)[1:] if found else None


@hypothesis_settings
@given(text=text(0, 30), stops=st.lists(text(1, 4), min_size=1, max_size=8), cut=st.integers(0, 30))
def test_stop_matcher_finds_the_stop_that_ends_first(text, stops, cut):
    matcher = StopMatcher(stops)
    # Fed in two parts, as a stream feeds it: the state carries what the first part may have begun.
    state, end = matcher.scan(0, text[:cut])
    if end is None:
        state, end = matcher.scan(state, text[cut:])
        end = None if end is None else end + len(text[:cut])
    expected = _first_stop_reference(text, stops)
    assert (None if end is None else (end - matcher.matched(state), text[end - matcher.matched(state) : end])) == (
        expected
    )


class _CountingList(list):
    reads = 0

    def __getitem__(self, index):
        type(self).reads += 1
        return super().__getitem__(index)


def test_stop_matching_work_per_character_does_not_grow_with_the_stop_strings(tokenizer):
    # Adversarial stop strings that all share the text's prefix "aaa...": a per-string search would redo
    # each of them at every token. The automaton follows at most one fail link per character fed, amortized.
    stops = ["a" * i + "b" for i in range(1, 65)]
    output = tokenizer.encode("a" * 2000, add_special_tokens=False)
    matcher = StopMatcher(stops)
    matcher._fail = _CountingList(matcher._fail)
    _CountingList.reads = 0
    detokenizers = [IncrementalDetokenizer(tokenizer, [], stop=matcher) for _ in range(4)]  # one request, n=4
    for detokenizer in detokenizers:
        stream(detokenizer, output, [1])
        assert detokenizer.text == "a" * 2000 and not detokenizer.stopped
    assert _CountingList.reads <= 4 * 2000


def test_stop_strings_are_bounded():
    from engine.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, InvalidParameter, SamplingParams

    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    SamplingParams(stop=["x" * MAX_STOP_LENGTH])
    for stop in ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], ["x" * (MAX_STOP_LENGTH + 1)]):
        with pytest.raises(InvalidParameter) as err:
            SamplingParams(stop=stop)
        assert err.value.param == "stop"
