"""The stop checker alone: stop strings across tokens (cut where they start, or kept), stop
token ids, EOS, ``min_tokens`` (with the sequence's sampling ban), ``max_tokens`` and the context
limit, and the cost bound of the per-token search."""

from __future__ import annotations

import pytest

from cb_serve import SamplingParams
from cb_serve.engine.stop_checker import StopChecker
from cb_serve.sequence import Sequence


class _Text:
    """A detokenizer stand-in that appends given text pieces and counts characters searched."""

    def __init__(self) -> None:
        self.text = ""
        self.pieces: list[str] = []

    def append(self, token_id: int) -> int:
        self.text += self.pieces[token_id]
        return len(self.pieces[token_id])

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]


def test_stop_strings_are_found_across_tokens_and_cut_where_they_start():
    checker = StopChecker(SamplingParams(stop=["END", "xyz"], max_tokens=100))
    detok = _Text()
    detok.pieces = ["hello ", "wor", "ld E", "N", "D tail"]
    decisions = [checker.update(i, i + 1, False, detok) for i in range(5)]
    assert decisions[:4] == [None] * 4 and decisions[4] == ("stop", "END")
    assert detok.text == "hello world "
    assert checker.holdback == 2


def test_stop_string_search_looks_only_at_the_new_text(monkeypatch):
    """The per-token search covers the new characters plus the longest stop string - 1,
    whatever the output length: every ``str.find`` starts that close to the end."""
    stops = [f"stop-{i:03d}" for i in range(64)]
    checker = StopChecker(SamplingParams(stop=stops, max_tokens=10_000))
    starts: list[int] = []

    class Spy(str):
        def find(self, sub, start=0, *args):  # noqa: D102
            starts.append(len(self) - start)
            return str.find(self, sub, start, *args)

    detok = _Text()
    detok.pieces = ["word "]
    for _ in range(2000):
        detok.text = Spy(detok.text + "word ")
        assert checker._find_stop_string(detok, 5) is None
    assert max(starts) <= 5 + max(map(len, stops)) - 1
    assert len(starts) == 2000 * 64


def test_min_tokens_bans_stop_tokens_then_lets_them_stop():
    p = SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=10)
    p.eos_token_ids = frozenset({2})
    checker = StopChecker(p)
    seq = Sequence("s", "s", 0, [1, 1], p, max_tokens=10, min_tokens_banned=checker.stop_ids)
    assert seq.banned_token_ids() == [2, 7]
    seq.num_computed_tokens = 2
    for _ in range(3):
        seq.append_token(5, 0.0)
        seq.num_computed_tokens += 1
    assert seq.banned_token_ids() == []
    assert checker.update(7, 2, False, None) is None
    assert checker.update(7, 3, False, None) == ("stop", 7)
    assert checker.update(2, 3, False, None) == ("stop", None)
    assert checker.update(5, 10, True, None) == ("length", None)


def test_include_stop_str_keeps_the_stop_string():
    checker = StopChecker(SamplingParams(stop=["END"], include_stop_str_in_output=True, max_tokens=100))
    detok = _Text()
    detok.pieces = ["a E", "ND b"]
    assert checker.update(0, 1, False, detok) is None
    assert checker.update(1, 2, False, detok) == ("stop", "END")
    assert detok.text == "a END"


def test_the_earliest_ending_stop_string_wins():
    checker = StopChecker(SamplingParams(stop=["cdef", "de"], max_tokens=100))
    detok = _Text()
    detok.pieces = ["abcdefg"]
    assert checker.update(0, 1, False, detok) == ("stop", "de")
    assert detok.text == "abc"


def test_a_stop_string_ending_exactly_at_the_new_text_is_found():
    checker = StopChecker(SamplingParams(stop=["xy"], max_tokens=100))
    detok = _Text()
    detok.pieces = ["ab x", "y"]
    assert checker.update(0, 1, False, detok) is None
    assert checker.update(1, 2, False, detok) == ("stop", "xy") and detok.text == "ab "


def test_a_stop_token_is_not_shown_unless_asked():
    detok = _Text()
    detok.pieces = ["a", "<stop>"]
    checker = StopChecker(SamplingParams(stop_token_ids=[1], max_tokens=100))
    assert checker.update(0, 1, False, detok) is None
    assert checker.update(1, 2, False, detok) == ("stop", 1) and detok.text == "a"
    shown = StopChecker(SamplingParams(stop_token_ids=[1], include_stop_str_in_output=True, max_tokens=100))
    detok.text = ""
    shown.update(0, 1, False, detok)
    assert shown.update(1, 2, False, detok) == ("stop", 1) and detok.text == "a<stop>"


def test_eos_stops_unless_ignored():
    p = SamplingParams(max_tokens=10)
    p.eos_token_ids = frozenset({2})
    assert StopChecker(p).update(2, 1, False, None) == ("stop", None)
    ignored = SamplingParams(max_tokens=10, ignore_eos=True)
    ignored.eos_token_ids = frozenset({2})
    assert StopChecker(ignored).update(2, 1, False, None) is None
    assert StopChecker(ignored).stop_ids == frozenset()


def test_stop_strings_wait_for_min_tokens():
    checker = StopChecker(SamplingParams(stop=["x"], min_tokens=2, max_tokens=10))
    detok = _Text()
    detok.pieces = ["x", "x"]
    assert checker.update(0, 1, False, detok) is None  # the first x is text: min_tokens not reached
    assert checker.update(1, 2, False, detok) == ("stop", "x") and detok.text == "x"


def test_length_only_at_the_limit_and_after_a_stop():
    checker = StopChecker(SamplingParams(stop_token_ids=[3], max_tokens=10))
    assert checker.update(5, 3, False, None) is None
    assert checker.update(5, 10, True, None) == ("length", None)
    assert checker.update(3, 10, True, None) == ("stop", 3), "a stop token at the limit is a stop"


@pytest.mark.parametrize("stops, holdback", [([], 0), (["a"], 0), (["abc", "de"], 2)])
def test_holdback_is_the_longest_stop_string_minus_one(stops, holdback):
    assert StopChecker(SamplingParams(stop=stops, max_tokens=5)).holdback == holdback


def test_later_listed_stop_string_that_ends_first_wins_and_ties_keep_list_order():
    detok = _Text()
    detok.pieces = ["abcdefg"]
    assert StopChecker(SamplingParams(stop=["de", "cdef"], max_tokens=9)).update(0, 1, False, detok) == ("stop", "de")
    assert detok.text == "abc"
    detok.text = ""
    assert StopChecker(SamplingParams(stop=["ef", "def"], max_tokens=9)).update(0, 1, False, detok) == ("stop", "ef")
    assert detok.text == "abcd", "both end at the same character: the first listed wins"


def test_a_stop_string_at_the_very_start_of_the_text():
    detok = _Text()
    detok.pieces = ["END of it"]
    assert StopChecker(SamplingParams(stop=["END"], max_tokens=9)).update(0, 1, False, detok) == ("stop", "END")
    assert detok.text == ""
