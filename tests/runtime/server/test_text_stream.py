"""Incremental detokenization and stop strings: whatever way tokens and text are cut into pieces,
the streamed result equals the offline one."""
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.runtime.server.text_stream import IncrementalDetokenizer, StopStringFilter
from k3compile.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def chunked(seq, cuts):
    """seq split at the (sorted, deduplicated) cut points."""
    bounds = [0] + sorted({c % (len(seq) + 1) for c in cuts}) + [len(seq)]
    return [seq[a:b] for a, b in zip(bounds, bounds[1:])]


# ids: bytes (ASCII and multi-byte UTF-8 pieces, also invalid ones) and specials >= 256
token_ids = st.lists(st.one_of(st.integers(0, 127), st.integers(128, 255), st.integers(256, 300)), max_size=60)
utf8_text_ids = st.text(max_size=20).map(lambda s: list(s.encode("utf-8")))


@settings(max_examples=300, deadline=None)
@given(ids=st.one_of(token_ids, utf8_text_ids), cuts=st.lists(st.integers(0, 100), max_size=10),
       context=st.text(max_size=6))
def test_detokenizer_pieces_join_to_the_offline_text(ids, cuts, context):
    detok = IncrementalDetokenizer(TOK, TOK.encode(context)[-4:])
    pieces = [detok.push(c) for c in chunked(ids, cuts)]
    pieces.append(detok.flush())
    assert "".join(pieces) == TOK.decode(ids)


def test_detokenizer_waits_for_a_whole_character():
    euro = list("€".encode())   # 3 bytes, one token each
    detok = IncrementalDetokenizer(TOK)
    assert detok.push(euro[:1]) == ""
    assert detok.push(euro[1:2]) == ""
    assert detok.push(euro[2:] + [ord("!")]) == "€!"
    assert detok.flush() == ""


def test_detokenizer_flush_renders_an_unfinished_character():
    detok = IncrementalDetokenizer(TOK)
    assert detok.push([ord("a"), 0xE2]) == ""
    assert detok.flush() == "a\ufffd"


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Character by character: stop at the first position where any stop string is complete, cut
    at the start of the longest one complete there."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[:min(starts)], True
    return text, False


stop_lists = st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="abcd", max_size=40), stops=stop_lists, cuts=st.lists(st.integers(0, 100), max_size=12))
def test_stop_filter_matches_the_reference_for_any_chunking(text, stops, cuts):
    f = StopStringFilter(stops)
    sent, stopped = [], False
    for piece in chunked(text, cuts):
        out, stopped = f.feed(piece)
        sent.append(out)
        # nothing sent may be part of a stop string: what went out is a prefix of the final answer
        assert reference_cut(text, stops)[0].startswith("".join(sent))
        if stopped:
            break
    if not stopped:
        sent.append(f.finish())
    assert ("".join(sent), stopped) == reference_cut(text, stops)


def test_stop_string_spanning_pieces_is_cut_and_never_sent():
    f = StopStringFilter(["</s>"])
    assert f.feed("hello <") == ("hello ", False)   # "<" might begin the stop string: held back
    assert f.feed("/") == ("", False)
    assert f.feed("s> tail") == ("", True)          # the stop string and what follows are dropped


def test_held_back_text_is_released_when_it_cannot_be_a_stop():
    f = StopStringFilter(["STOP"])
    assert f.feed("ST") == ("", False)
    assert f.feed("x") == ("STx", False)
    assert f.feed("ST") == ("", False)
    assert f.finish() == "ST"


def test_empty_stop_string_is_rejected():
    import pytest
    with pytest.raises(ValueError, match="non-empty"):
        StopStringFilter(["a", ""])
