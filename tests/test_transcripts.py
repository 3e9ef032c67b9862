"""Searching past conversations: the transcript index (migration 10), its triggers and
backfill, ranking, hostile queries, and memory_search through the real IPC engine.
Real SQLite (FTS5), real files."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from ipc_helpers import FAMILY_JID, MAIN_JID, WORK_JID, Env
from mdclaw import schedule
from mdclaw.scheduler import Claim, Scheduler
from mdclaw.state import Database
from mdclaw.state.conversations import StoredMessage, settle_files, store_message
from mdclaw.state.outbox import enqueue
from mdclaw.state.tasks import delete_task, insert_task
from mdclaw.state.transcripts import group_token, match_expression, query_terms, search
from schema_at import database_at

# Four conversations of the family group, oldest first; each its own words.
CONVERSATIONS = [
    ("Should we rent a kayak for the lake trip?", "A kayak rental costs 40 euros a day."),
    ("What is the wifi password again?", "It is on the fridge, next to the calendar."),
    ("Remind me to water the tomatoes.", "Done: every morning at eight."),
    ("Which movie tonight?", "How about the documentary about penguins?"),
]


@pytest.fixture
def env(tmp_path: Path):  # noqa: ANN201
    e = Env(tmp_path)
    yield e
    e.close()


_n = iter(range(1, 10_000))


def say(db: Database, jid: str, text: str, sender: str = "Alice") -> str:
    """Store an inbound message the way the orchestrator does; returns its timestamp."""
    i = next(_n)
    ts = f"2026-01-01T{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}.000Z"
    assert store_message(db, StoredMessage(f"{jid}:{i}", jid, "u1", sender, text, ts,
                                           False, False), channel="tg", is_group=True)
    return ts


def reply(db: Database, jid: str, folder: str, text: str) -> None:
    """What the orchestrator does with an agent's answer: an outbox row."""
    with db.transaction() as c:
        enqueue(c, chat_jid=jid, kind="text", text=text, source_group=folder)


def converse(db: Database, jid: str, folder: str) -> None:
    for question, answer in CONVERSATIONS:
        say(db, jid, question)
        reply(db, jid, folder, answer)


def integrity(db: Database) -> None:
    """FTS5's own check that the index matches the transcript table row for row."""
    db.conn.execute("INSERT INTO transcript_fts(transcript_fts, rank) "
                    "VALUES ('integrity-check', 1)")


# --------------------------------------------------------------------------- state layer

def test_files_are_found_by_name_caption_and_transcript_once_settled(env: Env) -> None:
    """A message's files (their own column) are in its transcript row: the saved name, a
    caption that is not the text, a voice note's transcript. A message whose files are
    still downloading gets its row when they are settled."""
    ts = "2026-01-02T10:00:00.000Z"
    assert store_message(env.db, StoredMessage(
        "f1", FAMILY_JID, "u1", "Alice", "", ts, False, False,
        attachments=({"kind": "document", "name": "quarterly-budget.xlsx"},),
        files_pending=True), channel="tg", is_group=True)
    assert search(env.db.conn, "family", "quarterly", 5) == []
    settle_files(env.db, "f1", [
        {"kind": "document", "name": "quarterly-budget.xlsx", "caption": "numbers for March",
         "path": "/workspace/group/inbox/2026-01-02/quarterly-budget.xlsx"},
        {"kind": "voice", "name": "voice.oga", "transcript": "remember the plumber"}])
    assert store_message(env.db, StoredMessage(
        "f2", FAMILY_JID, "u1", "Alice", "the garden", "2026-01-02T10:00:01.000Z", False,
        False, attachments=({"kind": "image", "name": "photo.jpg", "caption": "the garden"},)),
        channel="tg", is_group=True)
    (hit,) = search(env.db.conn, "family", "quarterly", 5)
    assert hit.sender == "Alice" and hit.kind == "message"
    assert [len(search(env.db.conn, "family", q, 5)) for q in ("march", "plumber", "photo")] \
        == [1, 1, 1]
    body = env.db.query_one("SELECT body FROM transcript WHERE source_id = 'f2'")[0]
    assert body == "the garden\n[image photo.jpg]"  # the caption is the text: once
    integrity(env.db)


def test_a_word_said_three_conversations_ago_is_found(env: Env) -> None:
    converse(env.db, FAMILY_JID, "family")
    hits = search(env.db.conn, "family", "kayak", 5)
    assert [(h.kind, h.direction) for h in hits] == [("message", "in"), ("reply", "out")] or \
        [(h.kind, h.direction) for h in hits] == [("reply", "out"), ("message", "in")]
    msg = next(h for h in hits if h.kind == "message")
    assert (msg.group, msg.chat, msg.sender) == ("family", FAMILY_JID, "Alice")
    assert msg.timestamp.startswith("2026-01-01T")
    assert msg.snippet == "Should we rent a **kayak** for the lake trip?"
    # Inflected forms meet (porter): "penguin" finds "penguins", "rented" finds "rent".
    assert [h.snippet for h in search(env.db.conn, "family", "penguin", 5)] == [
        "How about the documentary about **penguins**?"]
    assert "**rent**" in search(env.db.conn, "family", "rented", 5)[0].snippet
    # Accents do not matter either way.
    say(env.db, FAMILY_JID, "Meet at the café on Tuesday")
    assert search(env.db.conn, "family", "CAFE", 5)[0].snippet.startswith("Meet at the **café**")
    integrity(env.db)


def test_another_groups_words_are_not_found(env: Env) -> None:
    converse(env.db, FAMILY_JID, "family")
    say(env.db, WORK_JID, "The quarterly kayak budget is confidential")
    assert search(env.db.conn, "work", "penguins", 5) == []
    (w,) = search(env.db.conn, "work", "kayak", 5)
    assert w.group == "work" and "confidential" in w.snippet
    assert all(h.group == "family" for h in search(env.db.conn, "family", "kayak budget", 50))
    # Naming work's index token in the query is only text: it finds nothing of work's.
    token = group_token("work")
    for q in (token, f"grp:{token}", f'grp : "{token}" OR kayak', f"{{grp}}: {token}"):
        assert all(h.group == "family" for h in search(env.db.conn, "family", q, 50)), q


def test_messages_of_a_chat_that_is_no_group_are_not_indexed(env: Env) -> None:
    say(env.db, "tg:stranger", "kayak talk from a chat nobody registered")
    assert env.db.scalar("SELECT COUNT(*) FROM transcript") == 0


def test_what_main_sends_into_a_groups_chat_is_that_groups_conversation(env: Env) -> None:
    reply(env.db, FAMILY_JID, "main", "Announcement: the kayak is booked")
    with env.db.transaction() as c:
        enqueue(c, chat_jid=FAMILY_JID, kind="file", file_name="kayak-receipt.pdf",
                source_path="/workspace/group/r.pdf", source_group="main")
        enqueue(c, chat_jid=FAMILY_JID, kind="reaction", message_id="x", emoji="👍",
                source_group="main")
    hits = search(env.db.conn, "family", "kayak", 5)
    assert sorted(h.snippet for h in hits) == [
        "Announcement: the **kayak** is booked", "[file **kayak**-receipt.pdf]"]
    assert search(env.db.conn, "main", "kayak", 5) == []


def _run_task(db: Database, task_id: str, replies: list[str], result: str | None) -> Claim:
    """Claim `task_id`, send `replies` to its chat as the run does, finish with `result`."""
    sched = Scheduler(db, execute=None)  # type: ignore[arg-type]  # runs are driven here
    claim = sched.claim(task_id)
    assert isinstance(claim, Claim)
    for text in replies:
        reply(db, claim.task.chat_jid, claim.task.group_folder, text)
    sched.finish(claim, "success" if result is not None else "error", result=result,
                 error=None if result is not None else "model unavailable")
    return claim


def _due_task(db: Database, task_id: str, folder: str, jid: str) -> None:
    with db.transaction() as c:
        insert_task(c, group_folder=folder, chat_jid=jid, prompt="weather report",
                    schedule_type="interval", schedule_value="3600000", timezone="UTC",
                    task_id=task_id)
        c.execute("UPDATE scheduled_tasks SET next_run = ? WHERE id = ?",
                  (schedule.to_iso(schedule.utc_now() - timedelta(seconds=1)), task_id))


def test_task_output_is_found_once_and_labelled_as_the_tasks(env: Env) -> None:
    _due_task(env.db, "t-weather", "family", FAMILY_JID)
    claim = _run_task(env.db, "t-weather", ["Morning forecast: drizzle, then sunshine."],
                      "Morning forecast: drizzle, then sunshine.")
    (h,) = search(env.db.conn, "family", "drizzle", 5)
    assert (h.kind, h.task_id, h.direction) == ("task", "t-weather", "out")
    # A run whose output reached no chat reply still gets its row.
    _due_task(env.db, "t-quiet", "family", FAMILY_JID)
    _run_task(env.db, "t-quiet", [], "Silent summary: hailstorm expected")
    (q,) = search(env.db.conn, "family", "hailstorm", 5)
    assert (q.kind, q.task_id) == ("task", "t-quiet")
    # A failed run's error is not conversation.
    _due_task(env.db, "t-bad", "family", FAMILY_JID)
    _run_task(env.db, "t-bad", [], None)
    assert search(env.db.conn, "family", "unavailable", 5) == []
    # Deleting a task and its runs: its own rows go, the replies the chat saw stay (as replies).
    with env.db.transaction() as c:
        delete_task(c, "t-weather")
        delete_task(c, "t-quiet")
    (h2,) = search(env.db.conn, "family", "drizzle", 5)
    assert (h2.kind, h2.task_id, h2.id) == ("reply", None, h.id)
    assert search(env.db.conn, "family", "hailstorm", 5) == []
    assert claim.run_id
    integrity(env.db)


def test_ranking_puts_the_closest_match_first(env: Env) -> None:
    db = env.db
    for i in range(30):
        say(db, FAMILY_JID, f"ordinary chatter number {i} about dinner and the children")
    for i in range(3):
        say(db, FAMILY_JID, f"the weather is nice today, day {i}")
    say(db, FAMILY_JID, "a glacier trip, weather permitting")
    say(db, FAMILY_JID, "glacier photos from the old album")
    hits = search(db.conn, "family", "glacier weather", 10)
    # Both words beat one word; the rarer word beats the common one.
    assert [h.snippet for h in hits[:2]] == ["a **glacier** trip, **weather** permitting",
                                             "**glacier** photos from the old album"]
    assert len(hits) == 5 and all("**weather**" in h.snippet for h in hits[2:])
    assert all(h.score >= n.score for h, n in zip(hits, hits[1:], strict=False))
    assert hits[0].score > hits[1].score > hits[2].score > 0
    assert len(search(db.conn, "family", "dinner", 50)) == 30


HOSTILE = ['"', '""', '"kayak', 'kayak"', "*", "kayak*", "NEAR(kayak paddle)",
           "kayak NEAR paddle", "NEAR", "-kayak", "kayak -paddle", "(kayak", "kayak)",
           "((((", ")(", "AND", "OR kayak", "kayak AND", "NOT kayak", "^kayak", "+kayak",
           "body:kayak", "grp:kayak", "{body grp}: kayak", "kayak:", ":", "'", "a'b",
           "kayak\x00", "\x00", "\\", "Kajak über die Brücke", "каяк", "カヤック", "🛶 kayak",
           "x" * 5000, " ".join(["kayak"] * 500), "kayak " * 40 + "paddle",
           "\u202ekayak", "e-mail", "kayak.", "kayak,paddle", "_kayak_"]


@pytest.mark.parametrize("query", HOSTILE, ids=[f"q{i}" for i in range(len(HOSTILE))])
def test_hostile_queries_never_break_the_search(env: Env, query: str) -> None:
    say(env.db, FAMILY_JID, "we paddle the kayak across the lake")
    say(env.db, FAMILY_JID, "Die Brücke über den Fluss")
    say(env.db, WORK_JID, "work kayak paddle secret")
    hits = search(env.db.conn, "family", query, 50)
    assert all(h.group == "family" for h in hits)
    words = set(query_terms(query.casefold()))
    if words & {"kayak", "kayak*", "-kayak", "(kayak", "kayak)", "^kayak", "+kayak",
                "kayak:", "kayak.", "kayak,paddle"}:
        assert hits and "**kayak**" in hits[0].snippet, (query, hits)
    expr = match_expression("family", query)
    assert expr is None or len(expr) < 8000


def test_query_terms_are_bounded_and_quoted() -> None:
    assert query_terms('NEAR(a b) "c* -d') == ["NEAR", "a", "b", "c", "-d"]
    assert len(query_terms(" ".join(f"w{i}" for i in range(100)))) == 32
    assert query_terms("*** --- ((( )))") == []
    expr = match_expression("fam", 'say "hi"')
    assert expr == f'grp : "{group_token("fam")}" AND body : ("say" OR "hi")'


# --------------------------------------------------------------------------- migration


def test_migration_backfills_the_transcript(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    conn = database_at(path, 8)
    conn.executescript("""
        INSERT INTO registered_groups (folder, name, jid, trigger, added_at)
            VALUES ('fam', 'Family', 'tg:1', '@Andy', '2024-01-01T00:00:00.000Z'),
                   ('work', 'Work', 'tg:2', '@Andy', '2024-01-01T00:00:00.000Z');
        INSERT INTO chats (jid, last_activity) VALUES ('tg:1', 'x'), ('tg:2', 'x'), ('tg:9', 'x');
        INSERT INTO messages (id, chat_jid, sender, sender_name, content, timestamp)
            VALUES ('m1', 'tg:1', 'u', 'Ann', 'the canoe is in the garage',
                    '2024-01-01T10:00:00.000Z'),
                   ('m2', 'tg:2', 'u', 'Bo', 'canoe budget', '2024-01-01T10:00:01.000Z'),
                   ('m3', 'tg:9', 'u', 'X', 'canoe from nowhere', '2024-01-01T10:00:02.000Z'),
                   ('m4', 'tg:1', 'u', 'Ann', '', '2024-01-01T10:00:03.000Z');
        INSERT INTO outbox (chat_jid, kind, text, file_name, emoji, source_group, created_at,
                            updated_at)
            VALUES ('tg:1', 'text', 'I found the canoe paddles', NULL, NULL, 'fam',
                    '2024-01-01T10:01:00.000Z', 'x'),
                   ('tg:1', 'reaction', NULL, NULL, 'ok', 'fam', '2024-01-01T10:01:01.000Z', 'x'),
                   ('tg:1', 'file', NULL, 'canoe.jpg', NULL, 'fam', '2024-01-01T10:01:02.000Z',
                    'x'),
                   ('tg:1', 'text', 'Forecast: canoe weather', NULL, NULL, 'fam',
                    '2024-01-02T08:00:05.000Z', 'x');
        INSERT INTO scheduled_tasks (id, group_folder, chat_jid, prompt, schedule_type,
            schedule_value, context_mode, next_run, status, created_at)
            VALUES ('t1', 'fam', 'tg:1', 'forecast', 'cron', '0 8 * * *', 'isolated',
                    '2024-01-03T08:00:00.000Z', 'active', '2024-01-01T00:00:00.000Z');
        INSERT INTO task_run_logs (task_id, run_at, duration_ms, status, result, error,
                                   finished_at)
            VALUES ('t1', '2024-01-02T08:00:00.000Z', 9000, 'success',
                    'Forecast: canoe weather', NULL, '2024-01-02T08:00:09.000Z'),
                   ('t1', '2024-01-03T08:00:00.000Z', 9000, 'success',
                    'Unsent canoe summary', NULL, '2024-01-03T08:00:09.000Z'),
                   ('t1', '2024-01-04T08:00:00.000Z', 9000, 'error', NULL, 'canoe crash',
                    '2024-01-04T08:00:09.000Z');
    """)
    conn.close()
    db = Database(path)
    try:
        rows = [tuple(r) for r in db.query(
            "SELECT source, kind, direction, group_folder, sender, task_id, body "
            "FROM transcript ORDER BY id")]
        assert rows == [
            ("messages", "message", "in", "fam", "Ann", None, "the canoe is in the garage"),
            ("messages", "message", "in", "work", "Bo", None, "canoe budget"),
            ("outbox", "reply", "out", "fam", None, None, "I found the canoe paddles"),
            ("outbox", "reply", "out", "fam", None, None, "[file canoe.jpg]"),
            ("outbox", "task", "out", "fam", None, "t1", "Forecast: canoe weather"),
            ("task_run_logs", "task", "out", "fam", None, "t1", "Unsent canoe summary"),
        ]
        assert len(search(db.conn, "fam", "canoe", 50)) == 5
        assert [h.group for h in search(db.conn, "work", "canoe", 50)] == ["work"]
        integrity(db)
        # And from now on the triggers carry on where the backfill stopped.
        store_message(db, StoredMessage("m5", "tg:1", "u", "Ann", "canoe again",
                                        "2024-01-05T00:00:00.000Z", False, False))
        assert len(search(db.conn, "fam", "canoe", 50)) == 6
    finally:
        db.close()


# --------------------------------------------------------------------------- through IPC

def _ask(env: Env, group: str, rid: str, params: dict) -> dict:
    name = env.write(group, {"type": "memory_action", "requestId": rid,
                             "action": "memory_search", "params": params}, sub="actions")
    env.drain_and_run()  # memory_search runs off the loop, on the action worker
    assert not (env.ipc / group / "actions" / name).exists()
    result = env.ipc / group / "action_results" / f"{rid}.json"
    if not result.exists():
        err = env.errors_for(group, name)
        return {"status": "quarantined", "error": err and err.get("reason")}
    return json.loads(result.read_text())


def test_memory_search_of_sessions_through_the_ipc_engine(env: Env) -> None:
    converse(env.db, FAMILY_JID, "family")
    # The agent's own message, sent through IPC, is part of the conversation too.
    env.write("family", {"type": "message", "chatJid": FAMILY_JID,
                         "text": "Reminder: return the kayak by Sunday"}, sub="messages")
    env.drain()
    say(env.db, WORK_JID, "kayak secrets of work")
    say(env.db, MAIN_JID, "main talks about kayaks too")
    r = _ask(env, "family", "s1", {"query": "kayak", "sources": "sessions", "topK": 10})
    assert r["status"] == "success", r
    hits = r["result"]["hits"]
    assert len(hits) == 3 and {h["group"] for h in hits} == {"family"}
    assert {h["kind"] for h in hits} == {"message", "reply"}
    for h in hits:
        assert h["source"] == "sessions" and "**kayak**" in h["snippet"]
        assert h["chat"] == FAMILY_JID and h["timestamp"] and h["direction"] in ("in", "out")
    # Non-main: another group's transcript is refused (quarantined, as for memory files).
    r = _ask(env, "family", "s2", {"query": "kayak", "sources": "sessions",
                                   "groupFolder": "work"})
    assert r["status"] == "quarantined"
    # Main: any group, by groupFolder; its own by default.
    r = _ask(env, "main", "s3", {"query": "kayak", "sources": "sessions",
                                 "groupFolder": "work"})
    assert [h["snippet"] for h in r["result"]["hits"]] == ["**kayak** secrets of work"]
    r = _ask(env, "main", "s4", {"query": "kayak", "sources": "sessions"})
    assert [h["group"] for h in r["result"]["hits"]] == ["main"]
    # topK is bounded as before, and the default stays memory files only.
    assert _ask(env, "family", "s5", {"query": "kayak", "sources": "sessions",
                                      "topK": 51})["status"] == "error"
    r = _ask(env, "family", "s6", {"query": "kayak", "sources": "sessions", "topK": 1})
    assert len(r["result"]["hits"]) == 1
    assert _ask(env, "family", "s7", {"query": "kayak"})["result"]["hits"] == []
    # Hostile text through the whole path.
    r = _ask(env, "family", "s8", {"query": 'NEAR("kayak" -* (', "sources": "sessions"})
    assert r["status"] == "success" and r["result"]["hits"]


def test_memory_search_all_merges_memory_files_and_sessions(env: Env) -> None:
    g = env.data / "groups" / "family"
    (g / "MEMORY.md").write_text("# Memory\nThe kayak lives in the garage.\n")
    converse(env.db, FAMILY_JID, "family")
    r = _ask(env, "family", "a1", {"query": "kayak", "sources": "all", "topK": 3})
    hits = r["result"]["hits"]
    assert [h["source"] for h in hits] == ["memory", "sessions", "sessions"]
    assert hits[0]["path"] == "MEMORY.md" and hits[0]["line"] == 2
    r = _ask(env, "family", "a2", {"query": "kayak", "sources": "memory"})
    assert [h["source"] for h in r["result"]["hits"]] == ["memory"]


def test_memory_search_is_queued_for_the_worker_and_checked_on_the_loop(env: Env) -> None:
    """The search itself runs on the action worker's thread (its own connection),
    never on the IPC loop; what the loop does is the quick check: a foreign groupFolder is
    quarantined and bad parameters get their error result at once, with no job queued."""
    converse(env.db, FAMILY_JID, "family")

    def write(rid: str, params: dict) -> str:
        return env.write("family", {"type": "memory_action", "requestId": rid,
                                    "action": "memory_search", "params": params}, sub="actions")

    def jobs() -> list[str]:
        return [r["request_id"] for r in env.db.query(
            "SELECT request_id FROM action_jobs ORDER BY id")]

    results = env.ipc / "family" / "action_results"
    write("q1", {"query": "kayak", "sources": "sessions"})
    foreign = write("q2", {"query": "kayak", "sources": "sessions", "groupFolder": "work"})
    write("q3", {"query": "kayak", "topK": 0})
    env.drain()
    assert jobs() == ["q1"]
    assert not (results / "q1.json").exists()  # not answered on the loop
    quarantined = env.errors_for("family", foreign)
    assert quarantined is not None
    assert "only the main group may read another group's data" in json.dumps(quarantined)
    assert not (results / "q2.json").exists()
    bad = json.loads((results / "q3.json").read_text())
    assert bad["status"] == "error" and "topK must be a whole number" in bad["error"]
    assert env.run_jobs() == 1
    found = json.loads((results / "q1.json").read_text())
    assert found["status"] == "success" and len(found["result"]["hits"]) == 2
