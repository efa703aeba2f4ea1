"""A process reward model's step map (megarl/data/step_map.py): steps through characters, from
the PRM's own tokens to the actor's."""

import pytest

from megarl.data.step_map import prm_read_positions, step_char_ends, token_at_char


def test_steps_end_after_each_separator_and_at_the_end():
    text = "a 3 + 0 = 3 , b 5 + 3 = 8 , so 8"
    assert step_char_ends(text, ",") == [text.index(",") + 1, text.rindex(",") + 1, len(text)]
    assert step_char_ends("a 1 , b 2 ,  ", ",") == [5, 11]  # nothing after the last separator: no extra step
    # whitespace as the separator: each step ends on its last visible character
    assert step_char_ends("9 0", " ") == [1, 3]
    assert step_char_ends("", ",") == [] and step_char_ends(", ,", ",") == [1, 3]
    with pytest.raises(ValueError, match="non-empty step separator"):
        step_char_ends("x", "")


def test_positions_go_through_the_rendered_texts_offsets():
    rendered = "<u> q <a> 1 2 , 3 <e>"
    #            0   4 6   10  14 16 18
    offsets = [(0, 3), (4, 5), (6, 9), (10, 11), (12, 13), (14, 15), (16, 17), (18, 21)]
    response = "1 2 , 3"
    ends = step_char_ends(response, ",")  # [5, 7]
    assert prm_read_positions(rendered, offsets, response, ends) == [5, 6]  # the ',' token, then the '3'
    # a character no token holds (a space) reads the last token before it
    assert token_at_char(offsets, 11) == 3 and token_at_char(offsets, 3) == 0
    with pytest.raises(ValueError, match="does not appear in the PRM's rendering"):
        prm_read_positions(rendered.replace("1 2", "1  2"), offsets, response, ends)
