"""``TokenIds``: list semantics, and no turn ever sees a later turn's ids."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prompt.token_ids import TokenIds

ids = st.lists(st.integers(0, 1000), max_size=20)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 100), ids, ids), max_size=12))
def test_turns_built_from_any_earlier_turn_keep_their_ids(
    steps: list[tuple[int, int, list[int], list[int]]],
) -> None:
    # Each step continues one earlier turn (chosen by ``pick``) from any point of its ids,
    # as the next turn, an edited or a regenerated conversation does; every turn must
    # still read as the list it was built as.
    turns = [TokenIds.of([])]
    models: list[list[int]] = [[]]
    for pick, keep_at, stem_ids, tail in steps:
        i = pick % len(turns)
        keep = keep_at % (len(models[i]) + 1)
        turns.append(turns[i].extend(keep, stem_ids, tail))
        models.append(models[i][:keep] + stem_ids + tail)
        for turn, model in zip(turns, models, strict=True):
            assert turn == model and model == turn
            assert len(turn) == len(model) and list(turn) == model
            assert turn.tolist() == model and turn.to_array().tolist() == model
            assert turn.to_bytes() == array("I", model).tobytes()
    last, model = turns[-1], models[-1]
    n = len(model)
    for start in range(-n - 1, n + 2):
        for stop in range(-n - 1, n + 2):
            assert last[start:stop] == model[start:stop]
    assert last[::2] == model[::2]
    for i in range(-n, n):
        assert last[i] == model[i]


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 100), ids, ids, st.booleans()),
                max_size=12))
def test_packed_ids_stay_true_whichever_turns_were_packed_before(
    steps: list[tuple[int, int, list[int], list[int], bool]],
) -> None:
    # ``to_bytes`` reads the shared stem: packing some turns and not others, in any
    # order, must never change what any turn packs to.
    turns = [TokenIds.of([])]
    models: list[list[int]] = [[]]
    for pick, keep_at, stem_ids, tail, pack in steps:
        i = pick % len(turns)
        keep = keep_at % (len(models[i]) + 1)
        turns.append(turns[i].extend(keep, stem_ids, tail))
        models.append(models[i][:keep] + stem_ids + tail)
        if pack:
            assert turns[i].to_bytes() == array("I", models[i]).tobytes()
    for turn, model in reversed(list(zip(turns, models, strict=True))):
        assert turn.to_bytes() == array("I", model).tobytes()


def test_a_continuation_from_the_stem_end_shares_the_list() -> None:
    first = TokenIds.of([1, 2, 3])
    second = first.extend(3, [4, 5], [9])
    third = second.extend(5, [6], [])
    assert first == [1, 2, 3] and second == [1, 2, 3, 4, 5, 9] and third == [1, 2, 3, 4, 5, 6]
    assert third.stem_length == 6
    fourth = third.extend(6, [], [7])
    fifth = fourth.extend(7, [8], [])  # keeps the tail too: appended after it
    assert fourth == [1, 2, 3, 4, 5, 6, 7] and fifth == [1, 2, 3, 4, 5, 6, 7, 8]
    regenerated = second.extend(4, [7], [8])  # from inside the stem: copied, others unchanged
    assert regenerated == [1, 2, 3, 4, 7, 8] and third == [1, 2, 3, 4, 5, 6]


def test_bad_indices_and_lengths_are_refused() -> None:
    turn = TokenIds.of([1, 2])
    with pytest.raises(IndexError):
        turn[2]
    with pytest.raises(ValueError):
        turn.extend(3, [], [])
    with pytest.raises(ValueError):
        turn.extend(-1, [], [])
    with pytest.raises(ValueError):
        TokenIds([1], 2, [])
    assert turn != [1, 2, 3] and turn != (1, 2) and turn == TokenIds([1, 2, 5], 2, [])
