"""FlintTokenizer: special tokens, GGUF metadata round trip, incremental detokenization, clear errors."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from flint_jax.chat import FLINT_CHAT_TEMPLATE, FLINT_SPECIAL_TOKENS, FlintTokenizer, IncrementalDecoder, render, train_bpe_tokenizer
from flint_jax.chat.tokenizer import CONTROL, NORMAL, UNUSED, USER_DEFINED

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024; they'll say 12345 things!",
    "def add(a, b):\n    return a + b  # 加法\n\n\tprint(add(1, 2))\n",
    "北京欢迎你。日本語のテキスト。한국어 텍스트. Ünïcödé façade naïve café.",
    "Emoji: 😀 👩‍💻 🇳🇴 ✨ and symbols ≤ ≥ → ∑ ∞ …",
    '{"city": "Paris", "days": [1, 2, 3], "ok": true, "nested": {"k": null}}',
] * 20

SAMPLES = [
    "",
    "Hello, world!",
    "北京 and Paris 😀👩‍💻 naïve",
    "   leading and trailing   \n\n",
    "[gMASK]<sop><|user|>Hi<|assistant|><think>Hmm</think>Yes<tool_call>f<arg_key>k</arg_key>"
    "<arg_value>v</arg_value></tool_call><|observation|><tool_response>r</tool_response><|endoftext|>",
    "<think><think></think>x<|user|><|system|>[gMASK]<sop>",
    "unseen: ქართული ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x7f",
]


@pytest.fixture(scope="module")
def tok() -> FlintTokenizer:
    return train_bpe_tokenizer(CORPUS, vocab_size=600)


def test_special_tokens_are_single_ids(tok):
    ids = [tok.encode(t) for t in FLINT_SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(FLINT_SPECIAL_TOKENS)
    assert tok.special_token_ids == {t: i[0] for t, i in zip(FLINT_SPECIAL_TOKENS, ids)}
    # ...also inside text, with no space around them.
    text = "a<|user|>b<think>c</think>d"
    ids = tok.encode(text)
    for t in ("<|user|>", "<think>", "</think>"):
        assert tok.special_token_ids[t] in ids
    assert tok.decode(ids) == text


def test_stop_eos_pad_and_vocab(tok):
    ids = tok.special_token_ids
    assert tok.stop_token_ids == (ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"])
    assert tok.eos_token_id == tok.pad_token_id == ids["<|endoftext|>"]
    assert 256 + len(FLINT_SPECIAL_TOKENS) <= tok.vocab_size <= 600
    assert tok.id_to_token(ids["<sop>"]) == "<sop>" and tok.token_to_id("<sop>") == ids["<sop>"]


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_rendered_prompt_encodes_markers_as_ids(tok):
    prompt = render([{"role": "user", "content": "北京?"}])
    ids = tok.encode(prompt)
    assert ids[:3] == [tok.special_token_ids[t] for t in ("[gMASK]", "<sop>", "<|user|>")]
    assert ids[-2:] == [tok.special_token_ids["<|assistant|>"], tok.special_token_ids["<think>"]]


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_decoder_matches_decode(tok, text):
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    deltas = [dec.feed(i) for i in ids]
    assert "".join(deltas) + dec.flush() == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_incremental_decoder_holds_partial_characters(tok):
    # 𝔘 never occurs in the corpus, so its 4 UTF-8 bytes are 4 byte-level tokens.
    ids = tok.encode("x𝔘y")
    assert len(ids) == 6
    dec = IncrementalDecoder(tok)
    assert [dec.feed(i) for i in ids] == ["x", "", "", "", "𝔘", "y"]
    assert dec.flush() == ""
    cut = IncrementalDecoder(tok)
    assert [cut.feed(i) for i in ids[:3]] == ["x", "", ""]
    assert cut.flush() == "\ufffd"  # generation stopped mid-character: the loss is visible, not silent
    assert cut.feed(ids[0]) == "x"  # flush resets the decoder


def test_incremental_decoder_skip_special(tok):
    ids = tok.encode("<|assistant|>hi<|endoftext|>")
    dec = IncrementalDecoder(tok, skip_special_tokens=True)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == "hi" == tok.decode(ids, skip_special_tokens=True)


def test_gguf_metadata_round_trip(tok):
    meta = tok.to_gguf_metadata()
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "glm4"
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == tok.vocab_size
    assert all(isinstance(m, str) and len(m.split(" ")) == 2 for m in meta["tokenizer.ggml.merges"])
    ids = tok.special_token_ids
    for t in FLINT_SPECIAL_TOKENS:
        assert meta["tokenizer.ggml.tokens"][ids[t]] == t
        assert meta["tokenizer.ggml.token_type"][ids[t]] == CONTROL
    assert meta["tokenizer.ggml.eos_token_id"] == ids["<|endoftext|>"]
    assert meta["tokenizer.ggml.eot_token_id"] == ids["<|user|>"]
    assert meta["tokenizer.ggml.eom_token_id"] == ids["<|observation|>"]
    assert meta["tokenizer.ggml.padding_token_id"] == ids["<|endoftext|>"]
    assert meta["tokenizer.chat_template"] == FLINT_CHAT_TEMPLATE
    json.dumps(meta)  # plain Python values, ready for a GGUF writer

    back = FlintTokenizer.from_gguf_metadata(meta)
    for text in SAMPLES + CORPUS[:5]:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert back.to_gguf_metadata() == meta
    assert back.stop_token_ids == tok.stop_token_ids
    assert back.chat_template == FLINT_CHAT_TEMPLATE and tok.chat_template is None

    custom = FlintTokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": "{{ messages[0].content }}"})
    assert render([{"role": "user", "content": "hi"}], chat_template=custom.chat_template) == "hi"
    assert custom.to_gguf_metadata()["tokenizer.chat_template"] == "{{ messages[0].content }}"


def test_gguf_padding_and_reader_types(tok):
    meta = tok.to_gguf_metadata(pad_to=tok.vocab_size + 5)
    assert meta["tokenizer.ggml.tokens"][-1] == f"[PAD{tok.vocab_size + 4}]"
    assert meta["tokenizer.ggml.token_type"][-5:] == [UNUSED] * 5
    # The gguf reader hands back bytes and numpy arrays; accept them.
    as_read = dict(meta)
    as_read["tokenizer.ggml.tokens"] = [t.encode() for t in meta["tokenizer.ggml.tokens"]]
    as_read["tokenizer.ggml.token_type"] = np.array(meta["tokenizer.ggml.token_type"], dtype=np.int32)
    as_read["tokenizer.ggml.pre"] = b"glm4"
    back = FlintTokenizer.from_gguf_metadata(as_read)
    assert back.vocab_size == tok.vocab_size + 5
    assert back.to_gguf_metadata() == meta
    assert back.encode(SAMPLES[2]) == tok.encode(SAMPLES[2])


def test_user_defined_tokens_and_other_pre_tokenizers(tok):
    meta = tok.to_gguf_metadata()
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<custom>"]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [USER_DEFINED]
    back = FlintTokenizer.from_gguf_metadata(meta)
    assert back.encode("a<custom>b")[1:2] == [tok.vocab_size]
    assert back.to_gguf_metadata()["tokenizer.ggml.token_type"][-1] == USER_DEFINED
    for pre in ("gpt-2", "qwen2", "llama-bpe"):
        other = FlintTokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre})
        assert other.decode(other.encode(SAMPLES[1])) == SAMPLES[1]
        assert other.to_gguf_metadata()["tokenizer.ggml.pre"] == pre
        # Recognized again from the tokenizer.json alone.
        expected = "glm4" if pre == "llama-bpe" else pre
        assert FlintTokenizer.from_tokenizer_json(other.to_json_str()).gguf_pre == expected
    assert NORMAL in meta["tokenizer.ggml.token_type"]


def test_from_tokenizer_json_path_and_text(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    for loaded in (FlintTokenizer.from_tokenizer_json(path), FlintTokenizer.from_tokenizer_json(str(path)),
                   FlintTokenizer.from_tokenizer_json(path.read_text())):
        assert loaded.encode(SAMPLES[4]) == tok.encode(SAMPLES[4])
        assert loaded.to_gguf_metadata() == tok.to_gguf_metadata()


def test_markers_that_are_plain_vocab_entries_become_special(tok):
    # Like a tokenizer.json whose markers sit in the BPE vocab without being registered as added tokens.
    state = json.loads(tok.to_json_str())
    state["added_tokens"] = []
    plain = Tokenizer.from_str(json.dumps(state))
    before = plain.to_str()
    wrapped = FlintTokenizer(plain)
    assert plain.to_str() == before  # the caller's tokenizer is untouched
    assert wrapped.encode("x<tool_call>y")[1:2] == [tok.special_token_ids["<tool_call>"]]


def test_missing_markers_and_non_byte_level_are_rejected():
    bare = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    bare.pre_tokenizer = pre_tokenizers.ByteLevel()
    bare.decoder = decoders.ByteLevel()
    with pytest.raises(ValueError, match=r"lacks Flint special tokens: \[gMASK\], <sop>"):
        FlintTokenizer(bare)
    bare.decoder = decoders.BPEDecoder()
    with pytest.raises(ValueError, match="byte-level BPE"):
        FlintTokenizer(bare)


def _meta(tok, **changes):
    meta = tok.to_gguf_metadata()
    for key, value in changes.items():
        key = "tokenizer.ggml." + key
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    return meta


@pytest.mark.parametrize("changes,error", [
    ({"model": None}, r"tokenizer\.ggml\.model: missing"),
    ({"model": "llama"}, r"tokenizer\.ggml\.model: unsupported 'llama'"),
    ({"pre": None}, r"tokenizer\.ggml\.pre: missing"),
    ({"pre": "tekken"}, r"tokenizer\.ggml\.pre: 'tekken'; supported: glm4"),
    ({"tokens": None}, r"tokenizer\.ggml\.tokens: missing"),
    ({"tokens": "abc"}, r"tokenizer\.ggml\.tokens: must be a list"),
    ({"merges": None}, r"tokenizer\.ggml\.merges: missing"),
    ({"merges": ["a"]}, r"tokenizer\.ggml\.merges\[0\]: expected 'left right'"),
    ({"merges": ["zzzz qqqq"]}, r"tokenizer\.ggml\.merges: "),
    ({"token_type": [1, 1]}, r"tokenizer\.ggml\.token_type: 2 entries"),
])
def test_bad_gguf_metadata_names_the_key(tok, changes, error):
    with pytest.raises(ValueError, match=error):
        FlintTokenizer.from_gguf_metadata(_meta(tok, **changes))


def test_duplicate_and_missing_marker_tokens(tok):
    meta = tok.to_gguf_metadata()
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[-1] = tokens[-2]
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.tokens: .* appears at ids"):
        FlintTokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.tokens": tokens})
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[tok.special_token_ids["<arg_key>"]] = "<renamed>"
    with pytest.raises(ValueError, match="lacks Flint special tokens: <arg_key>"):
        FlintTokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.tokens": tokens})


def test_train_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size must be at least 273"):
        train_bpe_tokenizer(["abc"], vocab_size=100)
