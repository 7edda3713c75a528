"""The gateway's side of a token stream, with no workers: detokenizing, stop strings, deadlines.

The work per token must not grow with the output: the detokenizer is held to a bound on
the token ids it decodes, and the stop matcher to a bound on the automaton steps it takes,
both counted rather than timed. Each is checked against the plain reference (a whole
decode; str.find over the whole text).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from minifaas.gateway.requests import DeadlineExceeded, RequestDeadline
from minifaas.gateway.stop_strings import StopMatcher
from minifaas.gateway.token_stream import OutputText
from minifaas.model.sampling import SamplingParams
from minifaas.model.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDecoder


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the token ids it is asked to decode."""

    decoded = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return super().decode(ids)


def random_ids(n: int, seed: int) -> list[int]:
    """Bytes of mixed text (ASCII, 2-, 3- and 4-byte characters), stray bytes and special tokens."""
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "b", " ", "é", "ж", "€", "中", "😀", "\n"]) for _ in range(n))
    ids = list(text.encode())
    for _ in range(n // 20):
        ids.insert(rng.randrange(len(ids)), rng.choice([0x80, 0xFF, 0xC3, 256, 257, 260]))
    return ids[:n]


@pytest.mark.parametrize("seed", range(6))
def test_pieces_join_to_the_whole_decode_and_never_split_a_character(seed: int) -> None:
    tok = ByteTokenizer()
    ids = random_ids(600, seed)
    detok = IncrementalDecoder(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == tok.decode(ids)
    for piece in pieces:
        assert not piece.endswith("\ufffd") or "\ufffd" in tok.decode(ids)  # only a real stray byte shows as one


def test_detokenizing_costs_the_same_per_token_however_long_the_output() -> None:
    def ids_decoded(n: int) -> int:
        tok = CountingTokenizer()
        detok = IncrementalDecoder(tok)
        for i in random_ids(n, seed=1):
            detok.push(i)
        return tok.decoded

    short, long = ids_decoded(1000), ids_decoded(16000)
    assert long / 16000 < 1.2 * short / 1000  # per token, not per token times the length
    assert long < 16000 * 12  # a few tokens of window per token; a whole decode per token would be 128 M


@pytest.mark.parametrize("kind", ["metaspace", "byte-level"])
def test_a_checkpoint_tokenizer_streams_the_text_its_whole_decode_gives(kind: str, tmp_path: Path) -> None:
    """SentencePiece-like (a token's leading space depends on what comes before it) and GPT-2-like (a
    character's bytes split over tokens) BPE, trained here on the repository's Shakespeare."""
    from transformers import PreTrainedTokenizerFast  # no model code: the kernel choice is not at stake

    shakespeare = (Path(__file__).parent.parent / "data" / "text" / "tinyshakespeare.txt").read_text()[:100_000]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "metaspace":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet: list[str] = []
    else:
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"], initial_alphabet=alphabet)
    tok.train_from_iterator([shakespeare], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(tmp_path)
    hf = HFTokenizer(tmp_path)
    text = "To be, or not to be: that is the question. Whether 'tis nobler in the mind " * 3
    if kind == "byte-level":
        text += "café 中文 😀, señor"
    ids = hf.encode(text)
    detok = IncrementalDecoder(hf)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == hf.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def naive_cut(text: str, stops: list[str]) -> int | None:
    """Where the output ends: the start of the first stop string to complete (the longest of those)."""
    found = [(text.find(s) + len(s), -len(s), text.find(s)) for s in stops if s in text]
    return min(found)[2] if found else None


@pytest.mark.parametrize("seed", range(20))
def test_the_cut_is_where_the_reference_puts_it_however_the_text_is_split(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("abcab ") for _ in range(200))
    stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
    expected = naive_cut(text, stops)
    for _ in range(3):
        matcher, shown, i, stopped = StopMatcher(stops), [], 0, False
        while i < len(text) and not stopped:
            n = rng.randint(1, 5)
            piece, stopped = matcher.feed(text[i : i + n])
            shown.append(piece)
            i += n
        out = "".join(shown) + ("" if stopped else matcher.flush())
        assert out == (text if expected is None else text[:expected]), (stops, expected)


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("the ST") == ("the ", False)  # "ST" may become "STOP": not shown yet
    assert matcher.feed("OVE") == ("STOVE", False)
    assert matcher.feed(" ST") == (" ", False)
    assert matcher.feed("OP now") == ("", True)  # no byte of the stop string reached the client


def test_stop_matching_costs_the_same_per_character_for_one_or_sixty_four_stop_strings() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("ab") for _ in range(20000))
    many = ["".join(rng.choice("ab") for _ in range(40)) + "c" for _ in range(64)]  # never complete

    def lookups(stops: list[str]) -> int:
        """Transition lookups the matcher makes over ``text``: one per step forward or back."""
        matcher = StopMatcher(stops)
        counting = [CountingDict(d) for d in matcher._next]
        matcher._next = counting  # type: ignore[assignment]
        for ch in text:
            matcher.feed(ch)
        return sum(d.lookups for d in counting)

    assert lookups(many) / len(text) < 4  # amortised O(1); a scan of every stop string would be 64 x 41
    assert lookups(many[:1]) / len(text) < 4


class CountingDict(dict):
    lookups = 0

    def __contains__(self, key: object) -> bool:
        self.lookups += 1
        return super().__contains__(key)

    def get(self, key: object, default: object = None) -> object:
        self.lookups += 1
        return super().get(key, default)


def test_min_tokens_passes_stop_strings_over_until_enough_tokens() -> None:
    tok = ByteTokenizer()
    text = OutputText(tok, SamplingParams(max_tokens=20, min_tokens=4, stop=("b",)))
    out = [text.push(t, n) for n, t in enumerate(tok.encode("abab"), start=1)]
    assert out == [("a", False), ("", False), ("ba", False), ("", True)]  # the first "b" came too early


def test_deadlines_bound_silence_and_the_optional_total() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        patient = RequestDeadline(first_token=0.5, between_tokens=0.2, total=None, now=loop.time())
        async with patient.first_token():
            await asyncio.sleep(0.3)
        for _ in range(8):  # 1.2 s in all, never 0.2 s of silence
            async with patient.next_token():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # the client reading: not the server's silence
        with pytest.raises(DeadlineExceeded, match=r"no token for 0\.2 s"):
            async with patient.next_token():
                await asyncio.sleep(1)
        total = RequestDeadline(first_token=5, between_tokens=5, total=0.3, now=loop.time())
        with pytest.raises(DeadlineExceeded, match=r"longer than its limit of 0\.3 s"):
            for _ in range(10):
                async with total.next_token():
                    await asyncio.sleep(0.1)
        with pytest.raises(TimeoutError):  # someone else's timeout inside is not the deadline's
            async with patient.first_token(), asyncio.timeout(0.01):
                await asyncio.sleep(1)

    asyncio.run(main())
