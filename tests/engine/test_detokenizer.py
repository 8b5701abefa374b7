"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE) and a small
SentencePiece-style BPE with byte fallback."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from atom_anyio.engine.detokenizer import IncrementalDetokenizer

SAMPLES = [
    "Hello, world!",
    " héllo wörld café naïve",
    " 😀🎉👍🏽 🇫🇷",
    " 世界你好，日本語です。",
    " Ελληνικά и русский",
    "\n\tdef f(x):\n\t\treturn x  # ok",
    "  spaced   out  ",
]
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.fixture(scope="module")
def id_pools(tok):
    """Token ids to draw from: pieces of real multilingual text, single bytes, special tokens."""
    segments = [tok.encode(s, add_special_tokens=False) for s in SAMPLES]
    byte_ids = sorted(i for t, i in tok.get_vocab().items() if len(t) == 1)
    return {
        "segments": segments,
        "pieces": sorted({i for seg in segments for i in seg}),
        "bytes": byte_ids,
        "special": sorted(tok.added_tokens_decoder),
        "any": list(range(len(tok))),
    }


def token_ids(pools, max_size):
    """Concatenated text segments mixed with loose pieces, bytes, special and arbitrary ids."""
    loose = st.one_of(
        st.sampled_from(pools["pieces"]),
        st.sampled_from(pools["bytes"]),
        st.sampled_from(pools["special"]),
        st.sampled_from(pools["any"]),
    )
    chunk = st.one_of(st.sampled_from(pools["segments"]), st.lists(loose, max_size=4))
    return st.lists(chunk, max_size=max_size).map(lambda chunks: [i for c in chunks for i in c])


def stream(detok, output_ids):
    deltas = [detok.add_token(i) for i in output_ids]
    return deltas, detok.flush()


def decode(tok, ids, skip_special_tokens=True):
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


# --- exact and UTF-8 safe ---------------------------------------------------------------


@PROPERTY_SETTINGS
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_deltas_join_to_decode_of_output_ids(tok, id_pools, data, skip_special_tokens):
    prompt = data.draw(token_ids(id_pools, 3), label="prompt")
    output = data.draw(token_ids(id_pools, 8), label="output")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    shown = ""
    for k, token_id in enumerate(output, 1):
        delta = detok.add_token(token_id)
        shown += delta
        so_far = decode(tok, output[:k], skip_special_tokens)
        # nothing is shown early, and nothing is held once the text ends on a whole character
        assert so_far.startswith(shown)
        if not so_far.endswith("\ufffd"):
            assert shown == so_far
    shown += detok.flush()
    full = decode(tok, output, skip_special_tokens)
    assert shown == full
    assert detok.text == full
    assert detok.stop_matched is None


@PROPERTY_SETTINGS
@given(data=st.data())
def test_no_delta_breaks_a_character(tok, id_pools, data):
    output = data.draw(token_ids(id_pools, 8).filter(lambda ids: "\ufffd" not in decode(tok, ids)))
    deltas, rest = stream(IncrementalDetokenizer(tok, []), output)
    assert all("\ufffd" not in d for d in [*deltas, rest])
    assert "".join(deltas) + rest == decode(tok, output)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_raw_byte_streams_decode_exactly(tok, id_pools, data):
    """Long runs of lone UTF-8 bytes: the held window is cut while characters stay open."""
    pool = id_pools["bytes"] + id_pools["pieces"] + id_pools["special"]
    output = data.draw(st.lists(st.sampled_from(pool), max_size=60))
    deltas, rest = stream(IncrementalDetokenizer(tok, []), output)
    assert "".join(deltas) + rest == decode(tok, output)


@pytest.mark.parametrize("num_lead_bytes", range(14))
@pytest.mark.parametrize("num_special", [1, 3, 4])
def test_character_open_across_skipped_special_tokens_still_completes(tok, num_lead_bytes, num_special):
    lead, *rest_of_emoji = tok.convert_tokens_to_ids(["ð", "Ł", "ĺ", "Ģ"])
    output = [lead] * num_lead_bytes + [lead] + [1] * num_special + rest_of_emoji
    deltas, rest = stream(IncrementalDetokenizer(tok, []), output)
    assert "".join(deltas) + rest == decode(tok, output)


@pytest.fixture(scope="module")
def crossing_tok():
    """A byte-level BPE with a token that ends one character and starts the next (0x80 0xF0)."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["Ģð"] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("Ģ", "ð")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


@pytest.mark.parametrize("num_lead_bytes", range(14))
def test_token_that_completes_a_character_and_opens_the_next(crossing_tok, num_lead_bytes):
    lead, *emoji_end = crossing_tok.convert_tokens_to_ids(["ð", "Ł", "ĺ", "Ģð", "Ł"])
    output = [lead] * num_lead_bytes + emoji_end
    deltas, rest = stream(IncrementalDetokenizer(crossing_tok, []), output)
    assert "".join(deltas) + rest == decode(crossing_tok, output)


@PROPERTY_SETTINGS
@given(output=st.lists(st.integers(0, 256), max_size=60))
def test_byte_streams_with_boundary_crossing_tokens_decode_exactly(crossing_tok, output):
    deltas, rest = stream(IncrementalDetokenizer(crossing_tok, []), output)
    assert "".join(deltas) + rest == decode(crossing_tok, output)


def test_first_token_after_a_prompt_cut_inside_a_character_decodes_on_its_own(tok):
    emoji = tok.encode(" 😀 ok", add_special_tokens=False)  # ĠðŁĺ, Ģ, Ġok
    detok = IncrementalDetokenizer(tok, emoji[:1])
    deltas, rest = stream(detok, emoji[1:])
    assert "".join(deltas) + rest == decode(tok, emoji[1:]) == "\ufffd ok"


def test_skip_special_tokens_covers_every_special_added_token(tok):
    # <repo_name> is special in the tokenizer but not in tok.all_special_ids
    output = [3, *tok.encode(" hi", add_special_tokens=False), 2]
    assert "".join(stream(IncrementalDetokenizer(tok, []), output)[0]) == " hi"
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(kept, output)[0]) == "<repo_name> hi<|im_end|>"


class RecordingTokenizer:
    """Passes decode through to the real tokenizer, noting the longest window decoded."""

    def __init__(self, tok):
        self._tok = tok
        self.max_window = 0

    def decode(self, ids, **kwargs):
        self.max_window = max(self.max_window, len(ids))
        return self._tok.decode(ids, **kwargs)


@pytest.mark.parametrize(
    "kind", ["text", "repeated lead byte", "skipped special tokens", "lead and continuation bytes"]
)
def test_decode_window_stays_bounded_as_output_grows(tok, kind):
    lead, cont = tok.convert_tokens_to_ids(["ð", "Ł"])
    output = {
        "text": tok.encode(" The quick brown fox, 世界 😀." * 40, add_special_tokens=False),
        "repeated lead byte": [lead] * 400,
        "skipped special tokens": [1] * 400,
        "lead and continuation bytes": [lead, cont] * 200,
    }[kind]
    recorder = RecordingTokenizer(tok)
    deltas, rest = stream(IncrementalDetokenizer(recorder, tok.encode("Hi there")), output)
    assert "".join(deltas) + rest == decode(tok, output)
    assert len(output) >= 400
    assert recorder.max_window <= 24


# --- stop strings -----------------------------------------------------------------------

STOP_ALPHABET = "ab \n😀é世"


def expected_stop_output(text, stop, include):
    """Reference: read ``text`` one character at a time and stop at the first completed stop string."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


@PROPERTY_SETTINGS
@given(
    before=st.text(STOP_ALPHABET + "xyz", max_size=30),
    after=st.text(STOP_ALPHABET + "xyz", max_size=15),
    stop=st.lists(st.text(STOP_ALPHABET, min_size=1, max_size=5), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_output_ends_at_first_stop_string(tok, before, after, stop, include):
    output = tok.encode(before + stop[0] + after, add_special_tokens=False)
    full = decode(tok, output)
    expected, matched = expected_stop_output(full, stop, include)
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    shown = ""
    for token_id in output:
        shown += detok.add_token(token_id)
        # a partial stop string is never shown unless the final output keeps it
        assert expected.startswith(shown)
    shown += detok.flush()
    assert shown == expected
    assert detok.text == expected
    assert matched is not None
    assert detok.stop_matched == matched


@PROPERTY_SETTINGS
@given(
    text=st.text(STOP_ALPHABET + "xyz", max_size=30),
    stop=st.lists(st.text(STOP_ALPHABET, min_size=2, max_size=5), min_size=1, max_size=3),
)
def test_flush_releases_held_text_when_no_stop_string_completes(tok, text, stop):
    output = tok.encode(text, add_special_tokens=False)
    full = decode(tok, output)
    if any(s in full for s in stop):
        return
    deltas, rest = stream(IncrementalDetokenizer(tok, [], stop=stop), output)
    assert "".join(deltas) + rest == full


def test_stop_string_split_across_tokens_never_leaks(tok):
    output = tok.encode("Sure.\n\nUser: next", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["\n\nUser:"])
    deltas = [detok.add_token(i) for i in output]
    assert deltas[0] == "Sure"  # text that cannot start the stop string is not held
    assert "".join(deltas) + detok.flush() == "Sure."
    assert all("\n" not in d for d in deltas)
    assert detok.stop_matched == "\n\nUser:"


def test_nothing_after_a_stop_string_is_returned(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    shown = "".join(detok.add_token(i) for i in tok.encode("go STOP and more", add_special_tokens=False))
    assert shown == "go STOP"
    assert detok.add_token(tok.encode(" more", add_special_tokens=False)[0]) == ""
    assert detok.flush() == ""
    assert detok.text == "go STOP"


def test_stop_string_in_the_prompt_does_not_stop_the_output(tok):
    prompt = tok.encode("say END", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=["END"])
    deltas, rest = stream(detok, tok.encode(" fine", add_special_tokens=False))
    assert "".join(deltas) + rest == " fine"
    assert detok.stop_matched is None


def test_stop_string_completing_first_wins(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["abc", "b"])
    deltas, rest = stream(detok, tok.encode("xabc", add_special_tokens=False))
    assert ("".join(deltas) + rest, detok.stop_matched) == ("xa", "b")


# --- a SentencePiece-style tokenizer ----------------------------------------------------


@pytest.fixture(scope="module")
def sp_tok():
    """Llama-2 style: '▁' for spaces, byte fallback, and a decoder that strips the first space."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    bpe.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld, the café is open", "how are you?"]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>", "</s>"]))
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="</s>")


def test_sentencepiece_first_output_token_keeps_its_space_after_the_prompt(sp_tok):
    prompt = sp_tok.encode("the", add_special_tokens=False)
    output = sp_tok.encode("the café 😀", add_special_tokens=False)  # ▁the ▁café ▁ <0xF0>...
    deltas, rest = stream(IncrementalDetokenizer(sp_tok, prompt), output[1:])
    assert "".join(deltas) + rest == " café 😀"
    assert decode(sp_tok, output[1:]) == "café 😀"


@PROPERTY_SETTINGS
@given(
    prompt=st.lists(st.sampled_from(SAMPLES + ["the", " fox"]), max_size=2).map("".join),
    output=st.lists(st.sampled_from(SAMPLES + [" the", "fox", "</s>"]), max_size=4).map("".join),
)
def test_sentencepiece_deltas_join_to_output_as_read_after_prompt(sp_tok, prompt, output):
    prompt_ids = sp_tok.encode(prompt, add_special_tokens=False)
    output_ids = sp_tok.encode(prompt + output, add_special_tokens=False)[len(prompt_ids) :]
    deltas, rest = stream(IncrementalDetokenizer(sp_tok, prompt_ids), output_ids)
    whole = decode(sp_tok, prompt_ids + output_ids)
    assert whole.startswith(decode(sp_tok, prompt_ids))
    assert "".join(deltas) + rest == whole[len(decode(sp_tok, prompt_ids)) :]
    assert all("\ufffd" not in d for d in deltas)
