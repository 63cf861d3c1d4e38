"""The SQuAD / HotpotQA answer metrics (ragkv.answers), on the official scripts' known cases."""

import pytest

from ragkv.answers import answer_text, best, exact_match, normalize_answer, token_f1


def test_normalisation_is_squads():
    assert normalize_answer("The Denver Broncos!") == "denver broncos"
    assert normalize_answer("  An apple a day,\tthe  doctor ") == "apple day doctor"
    assert normalize_answer("Levi's Stadium") == "levis stadium"  # punctuation inside words goes too
    assert normalize_answer("9,984") == "9984"
    assert normalize_answer("theatre anthem") == "theatre anthem"  # articles only as whole words


def test_exact_match_and_f1_on_squad_examples():
    assert exact_match("Denver Broncos", "The Denver Broncos") == 1.0
    assert exact_match("Denver Broncos win", "Denver Broncos") == 0.0
    assert token_f1("Denver Broncos win", "Denver Broncos") == pytest.approx(0.8)  # P 2/3, R 1
    assert token_f1("Broncos", "Denver Broncos") == pytest.approx(2 / 3)  # P 1, R 1/2
    assert token_f1("it is 22 nautical miles", "22 nautical miles") == pytest.approx(0.75)
    assert token_f1("Paris", "London") == 0.0
    assert token_f1("the the", "The") == 1.0 and token_f1("", "Paris") == 0.0  # empty after normalising: SQuAD v2


def test_best_takes_the_closest_gold_answer():
    golds = ["Santa Clara", "Levi's Stadium in the San Francisco Bay Area at Santa Clara, California", "Levi's Stadium"]
    assert best(token_f1, "Santa Clara, California", golds) == pytest.approx(0.8)
    assert best(exact_match, "levis stadium", golds) == 1.0
    with pytest.raises(ValueError, match="no gold answer"):
        best(token_f1, "x", [])


def test_yes_no_answers_score_only_when_they_match_hotpotqas_rule():
    assert token_f1("Yes.", "yes") == 1.0 and exact_match("Yes.", "yes") == 1.0
    assert token_f1("yes it is", "yes") == 0.0  # plain token F1 would give 0.5
    assert token_f1("no", "no answer at all") == 0.0 and token_f1("no", "yes") == 0.0
    assert token_f1("no answer", "noanswer") == 0.0


def test_the_scored_answer_is_the_first_line_without_a_label():
    assert answer_text("Answer: Paris.\n\nParis is the capital of France.") == "Paris."
    assert answer_text("\n  \n  Agnes Tolland  \nShe built it in 1871.") == "Agnes Tolland"
    assert answer_text("Answer:\nYes") == "Yes"
    assert answer_text("") == "" and answer_text(" \n ") == ""
