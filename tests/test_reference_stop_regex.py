"""The reference engine's bound on how many tokens a `stop_regex` match spans, which sets how far back it
looks for stops: SGLang 0.5.17's `get_max_seq_length` (sampling_params.py), one token per character."""

from __future__ import annotations

import pytest

from art_sglang_reference.sampling import UNBOUNDED, StopRegexError, stop_regex_bound


@pytest.mark.parametrize(
    ("pattern", "bound"),
    [
        ("</tool_call>", 12),
        (r"\d{2,4}-[a-z]", 6),  # a repeat counts its most, a class one character
        ("(ab|cde)f", 4),  # a branch counts its longest arm
        (r"\bend$", 3),  # anchors match no character
        ("a+", UNBOUNDED),
        ("(?=a)b", UNBOUNDED + 1),  # a lookahead is not measured
        ("[^a]", UNBOUNDED),  # nor a negated single character
    ],
)
def test_a_stop_regex_is_bounded_as_sglang_bounds_it(pattern: str, bound: int) -> None:
    assert stop_regex_bound([pattern]) == bound


def test_the_bound_of_several_is_the_longest_and_none_is_zero() -> None:
    assert stop_regex_bound(["ab", "abcd", "a"]) == 4
    assert stop_regex_bound([]) == 0


def test_a_pattern_that_does_not_parse_or_compile_is_refused() -> None:
    with pytest.raises(StopRegexError, match="missing \\), unterminated subpattern at position 0"):
        stop_regex_bound(["("])
    # Parses, but a look-behind must have a fixed width: SGLang fails the request with a 400 saying this.
    with pytest.raises(ValueError, match=r"^invalid stop_regex '\(\?<=a\+\)b': look-behind"):
        stop_regex_bound(["(?<=a+)b"])
