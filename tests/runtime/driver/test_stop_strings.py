"""Stop strings on decoded text: the earliest match, the held-back tail, and the cut at the
fewest tokens, checked against a brute-force search over every prefix."""

from __future__ import annotations

import random

from specray.runtime.driver.stop_strings import find_stop, held_back, stop_cut

# A toy detokenizer whose tokens are strings of one to three characters.
VOCAB = ["a", "b", "ab", "ba", "c", "abc", " ", "\n", "b\n"]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def brute_cut(tokens: list[int], stops: list[str]):
    for n in range(1, len(tokens) + 1):
        text = decode(tokens[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return n, min(hits)
    return None


def test_find_stop_takes_the_earliest_match_ending_after_start():
    assert find_stop("xxabcab", ["ab"]) == (2, 4)
    assert find_stop("xxabcab", ["ab"], start=5) == (5, 7)
    assert find_stop("xxabcab", ["cab", "xa"]) == (1, 3)
    assert find_stop("xxabcab", ["zz"]) is None


def test_held_back_is_the_longest_tail_that_begins_a_stop_string():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello w", ["world", "\n\n"]) == 1
    assert held_back("line\n", ["\n\nUser:"]) == 1
    assert held_back("done", ["world"]) == 0
    assert held_back("xwo", ["wor"]) == 2
    assert held_back("wor", ["wor"]) == 0          # a whole match is found, never held


def test_stop_cut_equals_a_brute_force_search_step_by_step():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(len(VOCAB)) for _ in range(rng.randint(1, 14))]
        stops = [rng.choice(["ab", "ba", "b\nc", "cc", "a a", "abcab"]) for _ in range(rng.randint(1, 2))]
        want = brute_cut(tokens, stops)
        # Searched incrementally, as steps of 1-4 tokens arrive.
        checked, got = 0, None
        while checked < len(tokens) and got is None:
            upto = min(len(tokens), checked + rng.randint(1, 4))
            got = stop_cut(decode, tokens[:upto], checked, stops)
            checked = upto
        assert got == want, (tokens, stops)


def brute_held_back(text: str, stops: list[str]) -> int:
    """Every proper prefix of every stop string, tried against the end of the text."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_held_back_equals_a_brute_force_search():
    rng = random.Random(1)
    for _ in range(3000):
        text = "".join(rng.choice("aab\n") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("ab\nc") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3))]
        assert held_back(text, stops) == brute_held_back(text, stops), (text, stops)

