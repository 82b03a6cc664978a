"""The append-only checker: a clean transcript passes; each kind of break is detected,
located and attributed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.chat_tokenizers import ChatTokenizer
from bench.check_prompts import (
    Cause,
    Checker,
    Turn,
    common_prefix,
    format_table,
    load_transcripts,
    reusable_blocks,
    to_json,
)

SYSTEM = "You are a careful assistant. " + "Answer the question about the cache. " * 20
USERS = [f"question {i}: how does the router keep block {i} warm for user {i}?" for i in range(6)]
REPLIES = [f"reply {i}: it keeps the prefix of turn {i} on one replica " * 4 for i in range(6)]


def msgs(n: int, replies: list[str] | None = None, system: str = SYSTEM) -> list[dict[str, Any]]:
    """The message list of turn ``n`` (1-based) of a clean conversation."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}]
    replies = replies or REPLIES
    for i in range(n):
        out.append({"role": "user", "content": USERS[i]})
        if i < n - 1:
            out.append({"role": "assistant", "content": replies[i]})
    return out


def turns(lists: list[list[dict[str, Any]]], **kw: Any) -> list[Turn]:
    return [Turn(messages=tuple(m), **kw) for m in lists]


@pytest.fixture
def checker(chat_tokenizer: ChatTokenizer) -> Checker:
    return Checker(chat_tokenizer, block_size=16)


def test_helpers() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix(list(range(1000)), list(range(1000))) == 1000
    assert common_prefix([], [1]) == 0
    assert reusable_blocks(shared=64, tokens=64, block_size=16) == 3  # last token recomputed
    assert reusable_blocks(shared=64, tokens=65, block_size=16) == 4


def test_clean_append_only_transcript_passes(checker: Checker) -> None:
    report = checker.check_session(turns([msgs(n) for n in range(1, 6)]))
    assert [t.turn for t in report.turns] == [1, 2, 3, 4, 5]
    assert report.flagged == []
    for prev, t in zip(report.turns, report.turns[1:], strict=False):
        assert t.share == 1.0 and t.shared == prev.tokens
        assert t.reusable_blocks == prev.tokens // 16


def check_one(checker: Checker, seq: list[Turn]) -> Any:
    report = checker.check_session(seq)
    flagged = report.flagged
    assert len(flagged) == 1, format_table([report], 16)
    return flagged[0]


def test_dynamic_content_at_the_top(checker: Checker) -> None:
    seq = turns([msgs(n, system=f"Now: 2026-11-29 21:0{n}:00. " + SYSTEM) for n in (1, 2)])
    t = check_one(checker, seq)
    assert t.divergence.cause is Cause.DYNAMIC_PREFIX
    assert t.divergence.message_index == 0 and t.divergence.message_role == "system"
    assert t.share < 0.1
    assert "21:01" in t.divergence.previous_text and "21:02" in t.divergence.current_text


def test_reasoning_stripped_from_history(checker: Checker) -> None:
    with_thinking = ["<think>let me think about blocks</think>" + r for r in REPLIES]
    seq = turns([msgs(1), msgs(2, with_thinking), msgs(3, REPLIES)])
    report = checker.check_session(seq)
    assert [t.turn for t in report.flagged] == [3]
    d = report.flagged[0].divergence
    assert d is not None
    assert d.cause is Cause.REASONING_STRIPPED
    assert d.message_index == 2 and d.message_role == "assistant"


def test_truncation_sliding_window(checker: Checker) -> None:
    full = msgs(4)
    window = [full[0], *full[3:], {"role": "assistant", "content": REPLIES[3]},
              {"role": "user", "content": USERS[4]}]
    t = check_one(checker, turns([full, window]))
    assert t.divergence.cause is Cause.TRUNCATION
    assert t.divergence.message_index == 1


def test_summary_replacement(checker: Checker) -> None:
    full = msgs(4)
    summary = {"role": "user", "content": "Summary of the earlier conversation: blocks."}
    replaced = [full[0], summary, *full[5:], {"role": "assistant", "content": REPLIES[3]},
                {"role": "user", "content": USERS[4]}]
    t = check_one(checker, turns([full, replaced]))
    assert t.divergence.cause is Cause.SUMMARY_REPLACEMENT
    assert t.divergence.message_index == 1


def test_history_edited(checker: Checker) -> None:
    edited = msgs(3)
    edited[2] = {"role": "assistant", "content": "a completely different answer"}
    t = check_one(checker, turns([msgs(2), edited]))
    assert t.divergence.cause is Cause.HISTORY_EDITED


def test_tools_changed(checker: Checker) -> None:
    tool_a = {"type": "function", "function": {"name": "a", "parameters": {}}}
    tool_b = {"type": "function", "function": {"name": "b", "parameters": {}}}
    seq = [Turn(tuple(msgs(1)), tools=(tool_a, tool_b)),
           Turn(tuple(msgs(2)), tools=(tool_b, tool_a))]
    t = check_one(checker, seq)
    assert t.divergence.cause is Cause.TOOLS_CHANGED


def test_engine_ids_catch_stripped_reasoning(
    checker: Checker, chat_tokenizer: ChatTokenizer
) -> None:
    eot = chat_tokenizer.encode_text("<|eot_id|>")
    gen = chat_tokenizer.encode_text("<think>first the blocks</think>" + REPLIES[0]) + eot
    plain = checker.check_session(turns([msgs(1), msgs(2)]))
    assert plain.flagged == []  # re-rendering alone cannot see it
    seq = [Turn(tuple(msgs(1)), generated_token_ids=tuple(gen)), Turn(tuple(msgs(2)))]
    report = checker.check_session(seq)
    t = report.flagged[0]
    assert t.share == 1.0 and t.reply_share is not None and t.reply_share < 0.1
    assert t.divergence is not None
    assert t.divergence.cause is Cause.REASONING_STRIPPED
    assert t.divergence.message_index == 2


def test_engine_ids_catch_retokenization_drift(
    checker: Checker, chat_tokenizer: ChatTokenizer
) -> None:
    eot = chat_tokenizer.encode_text("<|eot_id|>")
    canonical = chat_tokenizer.encode_text(REPLIES[0])
    # the engine sampled the same text through other (longer) token paths
    odd = [i for ch in REPLIES[0][:40] for i in chat_tokenizer.encode_text(ch)]
    odd += chat_tokenizer.encode_text(REPLIES[0][40:])
    assert chat_tokenizer.decode(odd) == REPLIES[0] and odd != canonical
    seq = [Turn(tuple(msgs(1)), generated_token_ids=tuple(odd + eot)), Turn(tuple(msgs(2)))]
    t = check_one(checker, seq)
    assert t.divergence.cause is Cause.RETOKENIZATION_DRIFT
    # with the canonical ids the reply survives whole
    ok = [Turn(tuple(msgs(1)), generated_token_ids=tuple(canonical + eot)), Turn(tuple(msgs(2)))]
    good = checker.check_session(ok).turns[1]
    assert not good.flagged and good.reply_share == 1.0


def test_transcript_file_json_and_table(tmp_path: Path, checker: Checker) -> None:
    path = tmp_path / "t.jsonl"
    lines = [msgs(1), msgs(2)]
    dyn = [{"session": "dyn", "messages": msgs(n, system=f"id {n * 7919} " + SYSTEM)}
           for n in (1, 2)]
    path.write_text("\n".join(json.dumps(x) for x in [*lines, *dyn]) + "\n")
    gen = tmp_path / "gen.jsonl"
    gen.write_text(json.dumps({"session": "dyn", "turn": 1, "token_ids": [1, 2, 3]}) + "\n")
    sessions = load_transcripts(path, gen)
    assert set(sessions) == {"", "dyn"} and sessions["dyn"][0].generated_token_ids == (1, 2, 3)
    reports = [checker.check_session(t, s) for s, t in sessions.items()]
    doc = to_json(reports)
    assert doc["summary"]["flagged"] == 1
    assert doc["summary"]["causes"] == {"dynamic_prefix": 1}
    json.dumps(doc)
    table = format_table(reports, 16)
    assert "dynamic_prefix" in table and "1 of 4 turns" in table


def test_command_line(tmp_path: Path, llama3_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvroute.cli import main

    path = tmp_path / "t.jsonl"
    rows = [msgs(1), msgs(2), msgs(3, system="Session id 4242. " + SYSTEM)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "report.json"
    assert main(["check-prompts", str(path), "--tokenizer", str(llama3_dir),
                 "--out", str(out)]) == 1  # a turn is flagged
    printed = capsys.readouterr().out
    assert "dynamic_prefix" in printed and "1 of 3 turns" in printed
    doc = json.loads(out.read_text())
    turns = doc["sessions"][0]["turns"]
    assert [t["flagged"] for t in turns] == [False, False, True]
    assert turns[2]["divergence"]["message_index"] == 0


@pytest.mark.slow
async def test_a_replica_tokenize_endpoint_renders_the_same(
    llama3_dir: Path, chat_tokenizer: ChatTokenizer
) -> None:
    import asyncio

    from bench.chat_tokenizers import HttpChatTokenizer
    from bench.fleet import Fleet, FleetSpec

    spec = FleetSpec(tokenizer=llama3_dir, replicas=1, router=False, num_blocks=256)
    async with Fleet(spec) as fleet:
        remote = HttpChatTokenizer(fleet.url, spec.model)
        seq = turns([msgs(1), msgs(2), msgs(3, system="Now 12:00. " + SYSTEM)])
        local_report = Checker(chat_tokenizer).check_session(seq)
        remote_report = await asyncio.to_thread(Checker(remote).check_session, seq)
        ids = await asyncio.to_thread(remote.render, msgs(2))
    assert ids == chat_tokenizer.render(msgs(2))

    def essentials(report: Any) -> list[Any]:
        # decoded snippets may differ (a replica's /detokenize may skip special tokens)
        return [(t.tokens, t.shared, t.reusable_blocks, t.share, t.flagged,
                 t.divergence and (t.divergence.position, t.divergence.cause,
                                   t.divergence.message_index)) for t in report.turns]

    assert essentials(local_report) == essentials(remote_report)
    third = remote_report.turns[2].divergence
    assert third is not None and third.cause is Cause.DYNAMIC_PREFIX
