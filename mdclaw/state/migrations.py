"""Numbered schema migrations, tracked with `PRAGMA user_version`.

Migration 1 is the original schema (mdclaw's first tables, columns, CHECK constraints and
indexes). Later migrations add what mdclaw's invariants need. A migration never edits an
earlier one: a database made by any earlier version is carried forward step by step.
"""

from __future__ import annotations

# Each entry: (version, description, SQL script). Scripts run inside one transaction.
# The transcript row of a message whose files are settled (migration 11's two triggers, one
# for a message stored settled, one for a message whose files settle later).
_MESSAGE_TRANSCRIPT_ROW = """\
  INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder,
      chat_jid, sender, ts, body)
    SELECT 'messages', NEW.id, 'message', 'in', g.folder, NEW.chat_jid,
           COALESCE(NULLIF(NEW.sender_name, ''), NEW.sender), NEW.timestamp, b
    FROM registered_groups g,
         (SELECT trim(NEW.content || COALESCE(char(10) || (
             SELECT group_concat('[' || json_extract(j.value, '$.kind') || ' ' ||
                 json_extract(j.value, '$.name') ||
                 COALESCE(': ' || NULLIF(json_extract(j.value, '$.caption'), NEW.content), '')
                 || ']' || COALESCE(char(10) || json_extract(j.value, '$.transcript'), ''),
                 char(10))
             FROM json_each(NEW.attachments) j), ''), char(10) || ' ') AS b)
    WHERE g.jid = NEW.chat_jid AND b != '';
"""

# The same row from migration 14 on: the group of any of its chats (group_chats).
_MESSAGE_TRANSCRIPT_ROW_CHATS = _MESSAGE_TRANSCRIPT_ROW.replace(
    "FROM registered_groups g,", "FROM group_chats g,")
assert _MESSAGE_TRANSCRIPT_ROW_CHATS != _MESSAGE_TRANSCRIPT_ROW

# The IPC ledger's columns and key (migration 2's table, rebuilt WITHOUT ROWID by 22).
_LEDGER_COLUMNS = """\
  group_folder TEXT NOT NULL,
  file_name TEXT NOT NULL,
  content_hash TEXT NOT NULL,
  command_type TEXT,
  outcome TEXT NOT NULL CHECK(outcome IN ('applied', 'rejected')),
  detail TEXT,
  processed_at TEXT NOT NULL,
  PRIMARY KEY (group_folder, file_name, content_hash)
"""

# A successful task run's transcript rows (migration 10's trigger, restated by migration 21
# after it writes the queued replies' rows): the replies sent during the run relabelled as
# the task's, and a row of its own for a result that reached no reply.
_TASK_RUN_ROWS = """\
  UPDATE transcript SET kind = 'task', task_id = NEW.task_id, task_run = NEW.id
    WHERE group_folder = (SELECT group_folder FROM scheduled_tasks WHERE id = NEW.task_id)
      AND ts >= NEW.run_at AND source = 'outbox' AND kind = 'reply'
      AND chat_jid = (SELECT chat_jid FROM scheduled_tasks WHERE id = NEW.task_id)
      AND instr(NEW.result, body) > 0;
  INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder,
      chat_jid, sender, task_id, task_run, ts, body)
    SELECT 'task_run_logs', CAST(NEW.id AS TEXT), 'task', 'out', t.group_folder, t.chat_jid,
           NULL, NEW.task_id, NEW.id, COALESCE(NEW.finished_at, NEW.run_at), NEW.result
    FROM scheduled_tasks t WHERE t.id = NEW.task_id
      AND NOT EXISTS (SELECT 1 FROM transcript WHERE task_run = NEW.id);
"""

MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "original schema", """
CREATE TABLE IF NOT EXISTS chats (
  jid TEXT PRIMARY KEY,
  name TEXT,
  last_activity TEXT NOT NULL,
  channel TEXT DEFAULT 'whatsapp',
  is_group INTEGER DEFAULT 0
);
CREATE INDEX IF NOT EXISTS idx_chats_last_activity ON chats(last_activity);

CREATE TABLE IF NOT EXISTS messages (
  id TEXT PRIMARY KEY,
  chat_jid TEXT NOT NULL,
  sender TEXT NOT NULL,
  sender_name TEXT NOT NULL,
  content TEXT NOT NULL,
  timestamp TEXT NOT NULL,
  is_from_me INTEGER DEFAULT 0,
  is_bot_message INTEGER DEFAULT 0,
  FOREIGN KEY (chat_jid) REFERENCES chats(jid)
);
CREATE INDEX IF NOT EXISTS idx_messages_chat_jid ON messages(chat_jid);
CREATE INDEX IF NOT EXISTS idx_messages_timestamp ON messages(timestamp);

CREATE TABLE IF NOT EXISTS registered_groups (
  folder TEXT PRIMARY KEY,
  name TEXT NOT NULL,
  jid TEXT,
  trigger TEXT NOT NULL DEFAULT '@Andy',
  added_at TEXT NOT NULL,
  container_config TEXT,
  requires_trigger INTEGER DEFAULT 1
);

CREATE TABLE IF NOT EXISTS router_state (
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS sessions (
  group_folder TEXT PRIMARY KEY,
  session_id TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS scheduled_tasks (
  id TEXT PRIMARY KEY,
  group_folder TEXT NOT NULL,
  chat_jid TEXT NOT NULL,
  prompt TEXT NOT NULL,
  schedule_type TEXT NOT NULL CHECK(schedule_type IN ('cron', 'interval', 'once')),
  schedule_value TEXT NOT NULL,
  context_mode TEXT NOT NULL DEFAULT 'group' CHECK(context_mode IN ('group', 'isolated')),
  next_run TEXT,
  last_run TEXT,
  last_result TEXT,
  status TEXT NOT NULL DEFAULT 'active' CHECK(status IN ('active', 'paused', 'completed')),
  created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_scheduled_tasks_status ON scheduled_tasks(status);
CREATE INDEX IF NOT EXISTS idx_scheduled_tasks_next_run ON scheduled_tasks(next_run);

CREATE TABLE IF NOT EXISTS task_run_logs (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  task_id TEXT NOT NULL,
  run_at TEXT NOT NULL,
  duration_ms INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('success', 'error')),
  result TEXT,
  error TEXT,
  FOREIGN KEY (task_id) REFERENCES scheduled_tasks(id)
);
CREATE INDEX IF NOT EXISTS idx_task_run_logs_task_id ON task_run_logs(task_id);
"""),
    (2, "provenance, main flag, task scheduling state, IPC ledger, outbox", """
-- Groups: where each came from, and which one is main.
ALTER TABLE registered_groups ADD COLUMN is_main INTEGER NOT NULL DEFAULT 0
  CHECK(is_main IN (0, 1));
ALTER TABLE registered_groups ADD COLUMN source TEXT NOT NULL DEFAULT 'ipc'
  CHECK(source IN ('config', 'ipc'));
ALTER TABLE registered_groups ADD COLUMN updated_at TEXT;
CREATE UNIQUE INDEX IF NOT EXISTS idx_registered_groups_jid
  ON registered_groups(jid) WHERE jid IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS idx_registered_groups_one_main
  ON registered_groups(is_main) WHERE is_main = 1;

-- Tasks: SQLite cannot widen a CHECK in place, so the table is rebuilt. 'running' marks a
-- claimed one-shot task; provenance, timezone and catch-up policy are new columns.
CREATE TABLE scheduled_tasks_v2 (
  id TEXT PRIMARY KEY,
  group_folder TEXT NOT NULL,
  chat_jid TEXT NOT NULL,
  prompt TEXT NOT NULL,
  schedule_type TEXT NOT NULL CHECK(schedule_type IN ('cron', 'interval', 'once')),
  schedule_value TEXT NOT NULL,
  context_mode TEXT NOT NULL DEFAULT 'group' CHECK(context_mode IN ('group', 'isolated')),
  next_run TEXT,
  last_run TEXT,
  last_result TEXT,
  status TEXT NOT NULL DEFAULT 'active'
    CHECK(status IN ('active', 'paused', 'completed', 'running')),
  created_at TEXT NOT NULL,
  source TEXT NOT NULL DEFAULT 'ipc' CHECK(source IN ('config', 'ipc')),
  timezone TEXT,
  catch_up INTEGER NOT NULL DEFAULT 1 CHECK(catch_up IN (0, 1)),
  updated_at TEXT
);
INSERT INTO scheduled_tasks_v2 (id, group_folder, chat_jid, prompt, schedule_type,
  schedule_value, context_mode, next_run, last_run, last_result, status, created_at)
  SELECT id, group_folder, chat_jid, prompt, schedule_type, schedule_value, context_mode,
         next_run, last_run, last_result, status, created_at FROM scheduled_tasks;

CREATE TABLE task_run_logs_v2 (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  task_id TEXT NOT NULL,
  run_at TEXT NOT NULL,
  duration_ms INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('success', 'error', 'running', 'interrupted')),
  result TEXT,
  error TEXT,
  missed INTEGER NOT NULL DEFAULT 0,
  finished_at TEXT,
  FOREIGN KEY (task_id) REFERENCES scheduled_tasks(id)
);
INSERT INTO task_run_logs_v2 (id, task_id, run_at, duration_ms, status, result, error)
  SELECT id, task_id, run_at, duration_ms, status, result, error FROM task_run_logs;

DROP TABLE task_run_logs;
DROP TABLE scheduled_tasks;
ALTER TABLE scheduled_tasks_v2 RENAME TO scheduled_tasks;
ALTER TABLE task_run_logs_v2 RENAME TO task_run_logs;
CREATE INDEX idx_scheduled_tasks_status ON scheduled_tasks(status);
CREATE INDEX idx_scheduled_tasks_next_run ON scheduled_tasks(next_run);
CREATE INDEX idx_scheduled_tasks_due ON scheduled_tasks(status, next_run);
CREATE INDEX idx_scheduled_tasks_group ON scheduled_tasks(group_folder);
CREATE INDEX idx_task_run_logs_task_id ON task_run_logs(task_id);
CREATE INDEX idx_task_run_logs_task_run_at ON task_run_logs(task_id, run_at);

-- Every IPC command file that reached a final state, so a restart after a crash between
-- "applied" and "file removed" neither re-applies nor loses it.
CREATE TABLE ipc_ledger (
""" + _LEDGER_COLUMNS + """);
CREATE INDEX idx_ipc_ledger_processed_at ON ipc_ledger(processed_at);

-- Durable outbox: channels deliver from here with retries and record the outcome.
CREATE TABLE outbox (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  chat_jid TEXT NOT NULL,
  kind TEXT NOT NULL CHECK(kind IN ('text', 'file', 'reaction')),
  text TEXT,
  file_path TEXT,
  file_name TEXT,
  message_id TEXT,
  emoji TEXT,
  reply_to TEXT,
  sender TEXT,
  source_group TEXT,
  status TEXT NOT NULL DEFAULT 'pending'
    CHECK(status IN ('pending', 'sending', 'sent', 'failed')),
  attempts INTEGER NOT NULL DEFAULT 0,
  next_attempt_at TEXT,
  last_error TEXT,
  created_at TEXT NOT NULL,
  updated_at TEXT NOT NULL,
  sent_at TEXT
);
CREATE INDEX idx_outbox_status_next ON outbox(status, next_attempt_at);
CREATE INDEX idx_outbox_chat ON outbox(chat_jid);
"""),  # noqa: S608 - fixed text: the ledger's columns, no value from outside
    (3, "local HTTP channel transcript, outbox delivery progress", """
-- The local HTTP channel's chats as its readers see them: what was posted to it and what
-- the assistant sent back. `seq` is the cursor of GET /messages?after=.
CREATE TABLE http_messages (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  chat_jid TEXT NOT NULL,
  direction TEXT NOT NULL CHECK(direction IN ('in', 'out')),
  kind TEXT NOT NULL DEFAULT 'text' CHECK(kind IN ('text', 'file', 'reaction')),
  message_id TEXT NOT NULL,
  sender TEXT,
  sender_name TEXT,
  content TEXT NOT NULL DEFAULT '',
  file_name TEXT,
  reply_to TEXT,
  created_at TEXT NOT NULL
);
CREATE INDEX idx_http_messages_chat_seq ON http_messages(chat_jid, seq);

-- How many pieces of a split text row were already delivered, so a retry after a failure
-- (or a crash) half-way resumes instead of repeating the pieces the chat already shows.
CREATE TABLE outbox_progress (
  outbox_id INTEGER PRIMARY KEY REFERENCES outbox(id) ON DELETE CASCADE,
  parts_sent INTEGER NOT NULL DEFAULT 0
);
"""),
    (4, "model usage per group through the credential proxy", """
-- One row per group, model and UTC day: requests the credential proxy forwarded, how many
-- failed (upstream status >= 400 or a broken connection), and the tokens the API reported.
CREATE TABLE model_usage (
  group_folder TEXT NOT NULL,
  day TEXT NOT NULL,
  model TEXT NOT NULL DEFAULT '',
  requests INTEGER NOT NULL DEFAULT 0,
  errors INTEGER NOT NULL DEFAULT 0,
  input_tokens INTEGER NOT NULL DEFAULT 0,
  output_tokens INTEGER NOT NULL DEFAULT 0,
  updated_at TEXT NOT NULL,
  PRIMARY KEY (group_folder, day, model)
);
"""),
    (5, "files agents send are copied off the IPC loop", """
-- A file row whose host copy is still to be made names the file as the agent's container
-- sees it; the copy clears it (and sets file_path). The outbox holds the chat's later rows
-- behind such a row, so messages keep their order.
ALTER TABLE outbox ADD COLUMN source_path TEXT;
"""),
    (6, "sender allow-lists per group, refused message counts", """
-- The group's allow_senders policy as JSON {"mode", "ids"}; NULL: everyone may drive it.
ALTER TABLE registered_groups ADD COLUMN allow_senders TEXT;

-- Messages refused by a group's allow_senders, per group: how many, and the latest when.
CREATE TABLE sender_refusals (
  group_folder TEXT PRIMARY KEY,
  refused INTEGER NOT NULL DEFAULT 0,
  last_refused_at TEXT NOT NULL
);
"""),
    (7, "failed turns: messages set aside by a failed turn, and the record of each failure", """
-- A message whose turn failed for good keeps its place in the history but is marked with
-- the cause; the group's cursor moves past it so it does not ride along in later prompts.
ALTER TABLE messages ADD COLUMN failed_cause TEXT;

-- Every failed agent turn (each failed try of a retried one too): why, what happened next,
-- and which messages it was about. `mdclaw status`, `mdclaw failures` and `doctor` read it.
CREATE TABLE failed_turns (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  group_folder TEXT NOT NULL,
  chat_jid TEXT,
  cause TEXT NOT NULL,
  policy TEXT NOT NULL,
  outcome TEXT NOT NULL CHECK(outcome IN ('retry', 'gave_up', 'dropped', 'config', 'resend',
                                          'task')),
  attempts INTEGER NOT NULL DEFAULT 1,
  detail TEXT,
  first_message_at TEXT,
  last_message_at TEXT,
  messages INTEGER NOT NULL DEFAULT 0,
  told TEXT,
  created_at TEXT NOT NULL
);
CREATE INDEX idx_failed_turns_group_created ON failed_turns(group_folder, created_at);
CREATE INDEX idx_failed_turns_created ON failed_turns(created_at);
"""),
    (8, "task runs: when each was due, when it started, and why it started late", """
-- due_at: the slot the run is for (a task claimed late after downtime keeps its slot's time);
-- started_at: when the task was handed to the container runner; start_note: what it waited
-- for first, if anything (an idle conversation closed for it, a turn it let finish...).
ALTER TABLE task_run_logs ADD COLUMN due_at TEXT;
ALTER TABLE task_run_logs ADD COLUMN started_at TEXT;
ALTER TABLE task_run_logs ADD COLUMN start_note TEXT;
"""),
    (9, "off-loop action jobs", """
-- Action requests whose handler runs off the IPC loop (network, slow work). The row is
-- inserted in the same transaction as the request's ledger row; the action worker claims it
-- (status running, attempts + 1), stores the result body with status done/failed, then writes
-- action_results/<request_id>.json and sets written_at. A restart finishes what a crash left.
CREATE TABLE action_jobs (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  group_folder TEXT NOT NULL,
  request_id TEXT NOT NULL,
  action TEXT NOT NULL,
  params TEXT NOT NULL,
  is_main INTEGER NOT NULL DEFAULT 0 CHECK(is_main IN (0, 1)),
  status TEXT NOT NULL DEFAULT 'queued'
    CHECK(status IN ('queued', 'running', 'done', 'failed')),
  attempts INTEGER NOT NULL DEFAULT 0,
  max_attempts INTEGER NOT NULL DEFAULT 1,
  result TEXT,
  error TEXT,
  created_at TEXT NOT NULL,
  started_at TEXT,
  finished_at TEXT,
  written_at TEXT,
  UNIQUE (group_folder, request_id)
);
CREATE INDEX idx_action_jobs_status ON action_jobs(status, id);
CREATE INDEX idx_action_jobs_finished ON action_jobs(finished_at);
"""),
    (10, "searchable transcript of every group's conversations (FTS5)", """
-- One row per thing said in a group's conversation: an inbound message (kind 'message',
-- direction 'in'), a text or file the host sent to the chat (kind 'reply', direction 'out'),
-- or the output of a scheduled task run (kind 'task'). Rows are written by the triggers
-- below, in the transaction that stores the source row, so every write path is covered.
-- `source`/`source_id` name the row it copies (messages.id, outbox.id, task_run_logs.id).
-- A group's rows belong to its folder (the chat's group when the row was written).
-- `grp` is the folder as one index token, so a search is confined to one group inside the
-- full-text index itself (hex keeps any folder one token; the trailing 0 keeps the porter
-- stemmer off it). See mdclaw/state/transcripts.py.
CREATE TABLE transcript (
  id INTEGER PRIMARY KEY,
  source TEXT NOT NULL CHECK(source IN ('messages', 'outbox', 'task_run_logs')),
  source_id TEXT NOT NULL,
  kind TEXT NOT NULL CHECK(kind IN ('message', 'reply', 'task')),
  direction TEXT NOT NULL CHECK(direction IN ('in', 'out')),
  group_folder TEXT NOT NULL,
  chat_jid TEXT,
  sender TEXT,
  task_id TEXT,
  task_run INTEGER,
  ts TEXT NOT NULL,
  body TEXT NOT NULL,
  grp TEXT GENERATED ALWAYS AS ('g' || lower(hex(group_folder)) || '0') VIRTUAL,
  UNIQUE (source, source_id)
);
CREATE INDEX idx_transcript_group_ts ON transcript(group_folder, ts);
CREATE INDEX idx_transcript_task_run ON transcript(task_run) WHERE task_run IS NOT NULL;

-- The index reads its text from `transcript` (external content: stored once more, not twice).
CREATE VIRTUAL TABLE transcript_fts USING fts5(
  body, grp, content='transcript', content_rowid='id',
  tokenize='porter unicode61 remove_diacritics 2'
);

CREATE TRIGGER transcript_fts_ai AFTER INSERT ON transcript BEGIN
  INSERT INTO transcript_fts(rowid, body, grp) VALUES (NEW.id, NEW.body, NEW.grp);
END;
CREATE TRIGGER transcript_fts_ad AFTER DELETE ON transcript BEGIN
  INSERT INTO transcript_fts(transcript_fts, rowid, body, grp)
    VALUES ('delete', OLD.id, OLD.body, OLD.grp);
END;
CREATE TRIGGER transcript_fts_au AFTER UPDATE OF body, group_folder ON transcript BEGIN
  INSERT INTO transcript_fts(transcript_fts, rowid, body, grp)
    VALUES ('delete', OLD.id, OLD.body, OLD.grp);
  INSERT INTO transcript_fts(rowid, body, grp) VALUES (NEW.id, NEW.body, NEW.grp);
END;

-- Inbound messages of a chat that is a group's.
CREATE TRIGGER transcript_messages_ai AFTER INSERT ON messages WHEN NEW.content != '' BEGIN
  INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder,
      chat_jid, sender, ts, body)
    SELECT 'messages', NEW.id, 'message', 'in', g.folder, NEW.chat_jid,
           COALESCE(NULLIF(NEW.sender_name, ''), NEW.sender), NEW.timestamp, NEW.content
    FROM registered_groups g WHERE g.jid = NEW.chat_jid;
END;
CREATE TRIGGER transcript_messages_ad AFTER DELETE ON messages BEGIN
  DELETE FROM transcript WHERE source = 'messages' AND source_id = OLD.id;
END;

-- What the host sends to a chat (texts, files with their caption and name): the chat's
-- group's conversation, or the sending group's when the chat is no group's.
CREATE TRIGGER transcript_outbox_ai AFTER INSERT ON outbox
WHEN NEW.kind IN ('text', 'file') BEGIN
  INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder,
      chat_jid, sender, ts, body)
    SELECT 'outbox', CAST(NEW.id AS TEXT), 'reply', 'out', f, NEW.chat_jid, NEW.sender,
           NEW.created_at, b
    FROM (SELECT COALESCE((SELECT folder FROM registered_groups WHERE jid = NEW.chat_jid),
                          NEW.source_group) AS f,
                 CASE WHEN NEW.kind = 'file' AND NEW.file_name IS NOT NULL
                      THEN COALESCE(NULLIF(NEW.text, '') || char(10), '') || '[file ' ||
                           NEW.file_name || ']'
                      ELSE COALESCE(NEW.text, '') END AS b)
    WHERE f IS NOT NULL AND b != '';
END;
CREATE TRIGGER transcript_outbox_ad AFTER DELETE ON outbox BEGIN
  DELETE FROM transcript WHERE source = 'outbox' AND source_id = CAST(OLD.id AS TEXT);
END;

-- A task run that succeeded: its output was sent to the chat during the run, so those
-- replies (sent since the run began, to the task's chat, text contained in the result)
-- are relabelled as the task's; only a result that reached no reply gets a row of its own.
CREATE TRIGGER transcript_task_runs_au AFTER UPDATE OF status ON task_run_logs
WHEN OLD.status = 'running' AND NEW.status = 'success' AND COALESCE(NEW.result, '') != ''
BEGIN
""" + _TASK_RUN_ROWS + """END;
CREATE TRIGGER transcript_task_runs_ad AFTER DELETE ON task_run_logs BEGIN
  DELETE FROM transcript WHERE source = 'task_run_logs' AND source_id = CAST(OLD.id AS TEXT);
  UPDATE transcript SET kind = 'reply', task_id = NULL, task_run = NULL
    WHERE task_run = OLD.id;
END;

-- Backfill what was stored before this migration, in the same order.
INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder, chat_jid,
    sender, ts, body)
  SELECT 'messages', m.id, 'message', 'in', g.folder, m.chat_jid,
         COALESCE(NULLIF(m.sender_name, ''), m.sender), m.timestamp, m.content
  FROM messages m JOIN registered_groups g ON g.jid = m.chat_jid
  WHERE m.content != '' ORDER BY m.rowid;
INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder, chat_jid,
    sender, ts, body)
  SELECT 'outbox', CAST(o.id AS TEXT), 'reply', 'out', f, o.chat_jid, o.sender, o.created_at, b
  FROM (SELECT o.*, COALESCE((SELECT folder FROM registered_groups WHERE jid = o.chat_jid),
                             o.source_group) AS f,
               CASE WHEN o.kind = 'file' AND o.file_name IS NOT NULL
                    THEN COALESCE(NULLIF(o.text, '') || char(10), '') || '[file ' ||
                         o.file_name || ']'
                    ELSE COALESCE(o.text, '') END AS b
        FROM outbox o WHERE o.kind IN ('text', 'file')) o
  WHERE f IS NOT NULL AND b != '' ORDER BY o.id;
UPDATE transcript SET kind = 'task', task_run = r.id, task_id = r.task_id
  FROM (SELECT r.id, r.task_id, r.run_at, COALESCE(r.finished_at, r.run_at) AS till,
               r.result, t.group_folder, t.chat_jid
        FROM task_run_logs r JOIN scheduled_tasks t ON t.id = r.task_id
        WHERE r.status = 'success' AND COALESCE(r.result, '') != '') AS r
  WHERE transcript.source = 'outbox' AND transcript.kind = 'reply'
    AND transcript.group_folder = r.group_folder AND transcript.chat_jid = r.chat_jid
    AND transcript.ts >= r.run_at AND transcript.ts <= r.till
    AND instr(r.result, transcript.body) > 0;
INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder, chat_jid,
    sender, task_id, task_run, ts, body)
  SELECT 'task_run_logs', CAST(r.id AS TEXT), 'task', 'out', t.group_folder, t.chat_jid, NULL,
         r.task_id, r.id, COALESCE(r.finished_at, r.run_at), r.result
  FROM task_run_logs r JOIN scheduled_tasks t ON t.id = r.task_id
  WHERE r.status = 'success' AND COALESCE(r.result, '') != ''
    AND NOT EXISTS (SELECT 1 FROM transcript x WHERE x.task_run = r.id)
  ORDER BY r.id;
"""),  # noqa: S608 - fixed text: the task run's transcript rows, no value from outside
    (11, "files that came with a message: their own column, saved off the channel's loop", """
-- What the host made of each file that came with a message (JSON list of objects: kind,
-- name, mime, size, caption, path, error, transcript, transcript_note), NULL when none.
-- Kept apart from `content` (the person's words) so the prompt can show files in a form a
-- person's text cannot imitate (mdclaw/formatting.py).
ALTER TABLE messages ADD COLUMN attachments TEXT;
-- 1 while the message's files are being downloaded: the message and every later one of its
-- chat are held back from the agent until it is 0 (mdclaw/state/conversations.py).
ALTER TABLE messages ADD COLUMN files_pending INTEGER NOT NULL DEFAULT 0;
CREATE INDEX idx_messages_files_pending ON messages(chat_jid, timestamp)
  WHERE files_pending = 1;

-- The transcript row of a message: its text, then a line per file (kind, name, a caption
-- that is not the text, the transcript), written once its files are settled.
DROP TRIGGER transcript_messages_ai;
CREATE TRIGGER transcript_messages_ai AFTER INSERT ON messages WHEN NEW.files_pending = 0
BEGIN
""" + _MESSAGE_TRANSCRIPT_ROW + """END;
CREATE TRIGGER transcript_messages_files_au AFTER UPDATE OF files_pending ON messages
WHEN OLD.files_pending = 1 AND NEW.files_pending = 0 BEGIN
""" + _MESSAGE_TRANSCRIPT_ROW + """END;
"""),
    (12, "messages ordered by the host's sequence; indexes for the cursor and open outbox rows",
     """
-- A message's place in its chat is a sequence the host assigns when it stores the message
-- (`seq`), never the chat service's clock: Telegram's and WhatsApp's timestamps are whole
-- seconds, and a cursor that is a timestamp skips a message stored after it moved to that
-- same second. AUTOINCREMENT: a seq is never given twice (not even after the newest message
-- is deleted), and as the rowid it survives VACUUM. `id` (the channel's id) stays unique.
-- SQLite cannot add a primary key in place, so the table is rebuilt; its triggers and
-- indexes go with the old table and are made again below.
CREATE TABLE messages_v12 (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  chat_jid TEXT NOT NULL,
  sender TEXT NOT NULL,
  sender_name TEXT NOT NULL,
  content TEXT NOT NULL,
  timestamp TEXT NOT NULL,
  is_from_me INTEGER DEFAULT 0,
  is_bot_message INTEGER DEFAULT 0,
  failed_cause TEXT,
  attachments TEXT,
  files_pending INTEGER NOT NULL DEFAULT 0,
  FOREIGN KEY (chat_jid) REFERENCES chats(jid)
);
-- Stored messages are numbered in the order the cursor read them until now (timestamp,
-- then the order they were stored in), so "after the cursor" keeps its meaning for them.
INSERT INTO messages_v12 (id, chat_jid, sender, sender_name, content, timestamp, is_from_me,
    is_bot_message, failed_cause, attachments, files_pending)
  SELECT id, chat_jid, sender, sender_name, content, timestamp, is_from_me, is_bot_message,
         failed_cause, attachments, files_pending
  FROM messages ORDER BY timestamp, rowid;
DROP TABLE messages;
ALTER TABLE messages_v12 RENAME TO messages;
-- A chat's messages in the host's order: the cursor's range seek (chat, seq > cursor).
CREATE INDEX idx_messages_chat_jid ON messages(chat_jid, seq);
CREATE INDEX idx_messages_timestamp ON messages(timestamp);
CREATE INDEX idx_messages_files_pending ON messages(chat_jid, seq) WHERE files_pending = 1;
CREATE TRIGGER transcript_messages_ai AFTER INSERT ON messages WHEN NEW.files_pending = 0
BEGIN
""" + _MESSAGE_TRANSCRIPT_ROW + """END;
CREATE TRIGGER transcript_messages_files_au AFTER UPDATE OF files_pending ON messages
WHEN OLD.files_pending = 1 AND NEW.files_pending = 0 BEGIN
""" + _MESSAGE_TRANSCRIPT_ROW + """END;
CREATE TRIGGER transcript_messages_ad AFTER DELETE ON messages BEGIN
  DELETE FROM transcript WHERE source = 'messages' AND source_id = OLD.id;
END;

-- Each group's cursor becomes the seq of the last message at or before its timestamp (in
-- the group's chat; for a group without a chat, in any chat: seqs were given in timestamp
-- order above, so both name the same place), under a key of its own. A cursor of '' (the
-- start) becomes 0. Old keys are removed, so running this again changes nothing.
INSERT OR REPLACE INTO router_state (key, value)
  SELECT 'agent_cursor:' || substr(r.key, 22), CAST(COALESCE(
           (SELECT MAX(m.seq) FROM messages m
              WHERE m.chat_jid = (SELECT g.jid FROM registered_groups g
                                  WHERE g.folder = substr(r.key, 22))
                AND m.timestamp <= r.value),
           (SELECT MAX(m.seq) FROM messages m WHERE m.timestamp <= r.value),
           0) AS TEXT)
  FROM router_state r WHERE substr(r.key, 1, 21) = 'last_agent_timestamp:';
DELETE FROM router_state WHERE substr(key, 1, 21) = 'last_agent_timestamp:';

-- A failed turn's messages by their place too (the *_message_at columns keep their times,
-- for people to read).
ALTER TABLE failed_turns ADD COLUMN first_message_seq INTEGER;
ALTER TABLE failed_turns ADD COLUMN last_message_seq INTEGER;

-- The outbox's look for a chat's next open row seeks the chat's open rows alone, never the
-- rows already sent (a chat's whole history).
CREATE INDEX idx_outbox_open ON outbox(chat_jid, id) WHERE status IN ('pending', 'sending');
"""),  # noqa: S608 - fixed text: the message's transcript row, no value from outside
    (13, "people and approvals: admitted senders, approvals awaiting a person, cards", """
-- Identities the owner admitted to a group through an admit card (groups with members and
-- unknown_senders: ask_owner). mdclaw/state/people.py.
CREATE TABLE admitted_senders (
  channel TEXT NOT NULL,
  sender TEXT NOT NULL,
  group_folder TEXT NOT NULL,
  sender_name TEXT,
  admitted_by TEXT NOT NULL,
  admitted_at TEXT NOT NULL,
  approval_id INTEGER,
  PRIMARY KEY (channel, sender, group_folder)
);

-- What waits for a person: an IPC command or an action a rule holds (kind command, action),
-- an unknown sender asking to talk to a group (admission), an agent's ask_person question.
-- `request` is the request as stored when it was made (the canonical command, the action's
-- request, the held message): what the card shows and what runs, never read again from an
-- agent's folder. A decision is a conditional UPDATE from 'pending' (one decision wins);
-- `settled_at` is set in the transaction that carried out what the decision asks for.
-- mdclaw/approvals/store.py.
CREATE TABLE approvals (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  kind TEXT NOT NULL CHECK(kind IN ('command', 'action', 'admission', 'question')),
  group_folder TEXT NOT NULL,
  subject TEXT NOT NULL,
  summary TEXT NOT NULL,
  request TEXT NOT NULL,
  rule TEXT,
  approver TEXT NOT NULL,
  approvers TEXT NOT NULL,
  request_id TEXT,
  status TEXT NOT NULL DEFAULT 'pending'
    CHECK(status IN ('pending', 'approved', 'denied', 'expired', 'answered')),
  choice TEXT,
  decided_by TEXT,
  decided_label TEXT,
  decided_via TEXT,
  created_at TEXT NOT NULL,
  expires_at TEXT NOT NULL,
  decided_at TEXT,
  settled_at TEXT,
  outcome TEXT,
  wrong_codes INTEGER NOT NULL DEFAULT 0,
  codes_locked INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX idx_approvals_pending ON approvals(expires_at) WHERE status = 'pending';
CREATE INDEX idx_approvals_pending_group ON approvals(group_folder) WHERE status = 'pending';
CREATE INDEX idx_approvals_unsettled ON approvals(id) WHERE settled_at IS NULL;
CREATE INDEX idx_approvals_created ON approvals(created_at);
CREATE INDEX idx_approvals_group ON approvals(group_folder, id);
-- One admit card per (identity, group) while it waits.
CREATE UNIQUE INDEX idx_approvals_one_admission ON approvals(group_folder, subject)
  WHERE kind = 'admission' AND status = 'pending';

-- The code each approver may answer with on a channel without buttons ("approve 7KQ2"):
-- random, one per approver and approval, looked up by the approver's person key.
CREATE TABLE approval_codes (
  approval_id INTEGER NOT NULL REFERENCES approvals(id) ON DELETE CASCADE,
  person TEXT NOT NULL,
  code TEXT NOT NULL,
  PRIMARY KEY (approval_id, person)
);
CREATE INDEX idx_approval_codes_person ON approval_codes(person, code);

-- The cards sent for an approval (one per approver's chat): the outbox row of each, whose
-- card keeps the message it became (`sent`), so a decision can edit every card to show the
-- outcome.
CREATE TABLE approval_cards (
  approval_id INTEGER NOT NULL REFERENCES approvals(id) ON DELETE CASCADE,
  chat_jid TEXT NOT NULL,
  outbox_id INTEGER NOT NULL,
  PRIMARY KEY (approval_id, chat_jid)
);
CREATE INDEX idx_approval_cards_outbox ON approval_cards(outbox_id);

-- An outbox row with a card: `card` is JSON {text, choices: [{label, data}], ...}; such a
-- row's `text` is NULL (cards stay out of every group's transcript). `message_id` set on a
-- card row: edit that message to the card instead of sending a new one.
ALTER TABLE outbox ADD COLUMN card TEXT;

-- A card in the local web chat's transcript (JSON {choices, state}), on a 'text' row.
ALTER TABLE http_messages ADD COLUMN card TEXT;

-- Off-loop actions a rule holds wait in 'awaiting_approval' (the worker does not claim
-- them); a decision sets them 'queued', and the worker writes what the approval says (the
-- result, or "denied by ..."). SQLite cannot widen a CHECK in place: the table is rebuilt.
CREATE TABLE action_jobs_v2 (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  group_folder TEXT NOT NULL,
  request_id TEXT NOT NULL,
  action TEXT NOT NULL,
  params TEXT NOT NULL,
  is_main INTEGER NOT NULL DEFAULT 0 CHECK(is_main IN (0, 1)),
  status TEXT NOT NULL DEFAULT 'queued'
    CHECK(status IN ('awaiting_approval', 'queued', 'running', 'done', 'failed')),
  attempts INTEGER NOT NULL DEFAULT 0,
  max_attempts INTEGER NOT NULL DEFAULT 1,
  result TEXT,
  error TEXT,
  created_at TEXT NOT NULL,
  started_at TEXT,
  finished_at TEXT,
  written_at TEXT,
  approval_id INTEGER,
  UNIQUE (group_folder, request_id)
);
INSERT INTO action_jobs_v2 (id, group_folder, request_id, action, params, is_main, status,
    attempts, max_attempts, result, error, created_at, started_at, finished_at, written_at)
  SELECT id, group_folder, request_id, action, params, is_main, status, attempts,
         max_attempts, result, error, created_at, started_at, finished_at, written_at
  FROM action_jobs;
DROP TABLE action_jobs;
ALTER TABLE action_jobs_v2 RENAME TO action_jobs;
CREATE INDEX idx_action_jobs_status ON action_jobs(status, id);
CREATE INDEX idx_action_jobs_finished ON action_jobs(finished_at);
CREATE INDEX idx_action_jobs_approval ON action_jobs(approval_id) WHERE approval_id IS NOT NULL;
"""),
    (14, "a group answers in several chats: every chat of a group, by jid", """
-- Every chat a group answers in (registered_groups.jid stays its first). A chat belongs to
-- one group: inbound routing looks the group of a chat up here. mdclaw/state/groups.py.
CREATE TABLE group_chats (
  jid TEXT PRIMARY KEY,
  folder TEXT NOT NULL,
  ord INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX idx_group_chats_folder ON group_chats(folder, ord);
INSERT OR IGNORE INTO group_chats (jid, folder, ord)
  SELECT jid, folder, 0 FROM registered_groups WHERE jid IS NOT NULL AND jid != '';

-- The transcript (a group's searchable memory) takes the messages of each of its chats.
DROP TRIGGER transcript_messages_ai;
DROP TRIGGER transcript_messages_files_au;
CREATE TRIGGER transcript_messages_ai AFTER INSERT ON messages WHEN NEW.files_pending = 0
BEGIN
""" + _MESSAGE_TRANSCRIPT_ROW_CHATS + """END;
CREATE TRIGGER transcript_messages_files_au AFTER UPDATE OF files_pending ON messages
WHEN OLD.files_pending = 1 AND NEW.files_pending = 0 BEGIN
""" + _MESSAGE_TRANSCRIPT_ROW_CHATS + """END;
DROP TRIGGER transcript_outbox_ai;
CREATE TRIGGER transcript_outbox_ai AFTER INSERT ON outbox
WHEN NEW.kind IN ('text', 'file') BEGIN
  INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder,
      chat_jid, sender, ts, body)
    SELECT 'outbox', CAST(NEW.id AS TEXT), 'reply', 'out', f, NEW.chat_jid, NEW.sender,
           NEW.created_at, b
    FROM (SELECT COALESCE((SELECT folder FROM group_chats WHERE jid = NEW.chat_jid),
                          NEW.source_group) AS f,
                 CASE WHEN NEW.kind = 'file' AND NEW.file_name IS NOT NULL
                      THEN COALESCE(NULLIF(NEW.text, '') || char(10), '') || '[file ' ||
                           NEW.file_name || ']'
                      ELSE COALESCE(NEW.text, '') END AS b)
    WHERE f IS NOT NULL AND b != '';
END;
"""),  # noqa: S608 - fixed text: the message's transcript row, no value from outside
    (15, "indexes for the rows a command, a turn or a delivery looks for among the history", """
-- Each of these seeks the few rows it wants instead of walking rows that only grow with the
-- install's age (tests/test_history_paths.py reads the plans of every statement a command,
-- a turn and a delivery run).
-- File rows whose host copy is still to be made (the spooler's look at start and on wake).
CREATE INDEX idx_outbox_waiting_copy ON outbox(id) WHERE source_path IS NOT NULL;
-- What did not arrive since a group's last run (told to its next run): failed rows only.
CREATE INDEX idx_outbox_failed ON outbox(source_group, updated_at) WHERE status = 'failed';
-- Finished off-loop jobs past the ledger's keep (pruned at start), and those whose result
-- is still to be written (finished at start).
CREATE INDEX idx_action_jobs_written ON action_jobs(written_at) WHERE written_at IS NOT NULL;
CREATE INDEX idx_action_jobs_unwritten ON action_jobs(id) WHERE written_at IS NULL;
"""),
    (16, "the chat an approval's request came from: its outcome note goes there", """
-- The chat of the message the agent was answering when it made the request (one of its
-- group's chats; NULL: unknown, the note goes to the group's first chat).
ALTER TABLE approvals ADD COLUMN chat_jid TEXT;
"""),
    (17, "the transcript's full-text index is written in batches, off the storing transaction",
     """
-- Transcript rows not in the full-text index yet. Storing a message or a reply only queues
-- its transcript row's id here (a row in a small table); the indexer moves queued rows into
-- `transcript_fts` in batches, each batch one transaction that inserts the rows into the
-- index and removes them from the queue, so a crash at any point leaves every row either
-- queued or indexed, never both, never neither. A search first indexes what is queued, in its
-- own transaction (mdclaw/state/transcripts.py). Not a high-water mark of ids: transcript
-- ids are reused once the newest row is deleted.
CREATE TABLE transcript_unindexed (id INTEGER PRIMARY KEY);

DROP TRIGGER transcript_fts_ai;
CREATE TRIGGER transcript_fts_ai AFTER INSERT ON transcript BEGIN
  INSERT INTO transcript_unindexed (id) VALUES (NEW.id);
END;
-- A row leaves the index only if it is in it: the index's 'delete' of a row it does not hold
-- would corrupt it (the row's words are taken out of the index as given). A queued row only
-- leaves the queue.
DROP TRIGGER transcript_fts_ad;
CREATE TRIGGER transcript_fts_ad AFTER DELETE ON transcript BEGIN
  INSERT INTO transcript_fts (transcript_fts, rowid, body, grp)
    SELECT 'delete', OLD.id, OLD.body, OLD.grp
    WHERE NOT EXISTS (SELECT 1 FROM transcript_unindexed WHERE id = OLD.id);
  DELETE FROM transcript_unindexed WHERE id = OLD.id;
END;
-- A queued row is indexed as it is when its batch comes: its change needs nothing now.
DROP TRIGGER transcript_fts_au;
CREATE TRIGGER transcript_fts_au AFTER UPDATE OF body, group_folder ON transcript
WHEN NOT EXISTS (SELECT 1 FROM transcript_unindexed WHERE id = OLD.id) BEGIN
  INSERT INTO transcript_fts (transcript_fts, rowid, body, grp)
    VALUES ('delete', OLD.id, OLD.body, OLD.grp);
  INSERT INTO transcript_fts (rowid, body, grp) VALUES (NEW.id, NEW.body, NEW.grp);
END;
"""),
    (18, "the outbox's rows by state and time of their last change", """
-- The daemon's status (every 5 s: the rows of each state, those sent in the last day) and the
-- health rule of a channel whose deliveries fail (the last row sent in the last hour, the
-- rows that failed since) read a window of recent rows: a range of this index. The index it
-- replaces, (status, next_attempt_at), had every row ever sent under one key (a sent row has
-- no next attempt), so each of those reads walked them all: 0.3 s a look at a million rows.
-- The writes are the same: a row's status and its updated_at change together.
DROP INDEX idx_outbox_status_next;
CREATE INDEX idx_outbox_status_time ON outbox(status, updated_at);
"""),
    (19, "no index of every outbox row by chat: a reply is one index entry fewer", """
-- Its one reader, the web chat's replies not delivered yet (every long poll of an open
-- page), walked every row ever sent to the chat through it; they are now a range of
-- idx_outbox_status_time (the rows waiting and failed), and a chat's open rows are in
-- idx_outbox_open. A group's export reads the table in order anyway.
DROP INDEX idx_outbox_chat;
"""),
    (20, "a count of the changes to the scheduled tasks, kept by triggers", """
-- The IPC loop's poll tick asks whether the tasks changed since its last look (every group's
-- task snapshot is then written again): one read of this count, instead of counting every
-- task and finding the newest change, a walk of a table that keeps every completed one-shot
-- task (16 ms at 100,000 tasks). Any connection's change counts (the CLI's, the scheduler's).
CREATE TABLE change_counts (name TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO change_counts (name, n) VALUES ('scheduled_tasks', 0);
CREATE TRIGGER scheduled_tasks_counted_ai AFTER INSERT ON scheduled_tasks BEGIN
  UPDATE change_counts SET n = n + 1 WHERE name = 'scheduled_tasks';
END;
CREATE TRIGGER scheduled_tasks_counted_au AFTER UPDATE ON scheduled_tasks BEGIN
  UPDATE change_counts SET n = n + 1 WHERE name = 'scheduled_tasks';
END;
CREATE TRIGGER scheduled_tasks_counted_ad AFTER DELETE ON scheduled_tasks BEGIN
  UPDATE change_counts SET n = n + 1 WHERE name = 'scheduled_tasks';
END;
"""),
    (21, "a reply's transcript row is written by the indexer, off the storing transaction", """
-- Replies (outbox 'text' and 'file' rows) whose transcript row is not written yet. Storing a
-- reply only queues its outbox id here; the indexer writes the transcript rows of queued
-- replies in batches, each batch one transaction that inserts the rows and removes them from
-- the queue (then indexes them as any row), so after a crash every reply is queued or has
-- its row, exactly one of the two. A reply's row used to be written by the trigger in the
-- command's own transaction: a row, two index entries and a queue entry, where a queue entry
-- alone is about 30 us less of the command's transaction (mdclaw/state/transcripts.py).
CREATE TABLE transcript_replies_queued (id INTEGER PRIMARY KEY);

-- The transcript row of each queued reply, as the trigger of migration 14 wrote it: the
-- chat's group's conversation, or the sending group's when the chat is no group's. The one
-- definition of that row: the indexer writes it from here, and a reader that may not write
-- (a read-only export) reads queued replies from here. The queue first (CROSS JOIN keeps
-- that order), each reply a seek: never a walk of the outbox, which keeps every row sent.
CREATE VIEW transcript_queued_reply_rows AS
SELECT id, group_folder, chat_jid, sender, ts, body FROM (
  SELECT q.id AS id, o.chat_jid AS chat_jid, o.sender AS sender, o.created_at AS ts,
         COALESCE((SELECT folder FROM group_chats WHERE jid = o.chat_jid),
                  o.source_group) AS group_folder,
         CASE WHEN o.kind = 'file' AND o.file_name IS NOT NULL
              THEN COALESCE(NULLIF(o.text, '') || char(10), '') || '[file ' || o.file_name ||
                   ']'
              ELSE COALESCE(o.text, '') END AS body
  FROM transcript_replies_queued q CROSS JOIN outbox o ON o.id = q.id)
WHERE group_folder IS NOT NULL AND body != '';

DROP TRIGGER transcript_outbox_ai;
CREATE TRIGGER transcript_outbox_ai AFTER INSERT ON outbox
WHEN NEW.kind IN ('text', 'file') BEGIN
  INSERT OR IGNORE INTO transcript_replies_queued (id) VALUES (NEW.id);
END;
DROP TRIGGER transcript_outbox_ad;
CREATE TRIGGER transcript_outbox_ad AFTER DELETE ON outbox BEGIN
  DELETE FROM transcript_replies_queued WHERE id = OLD.id;
  DELETE FROM transcript WHERE source = 'outbox' AND source_id = CAST(OLD.id AS TEXT);
END;

-- A task run that succeeded relabels the replies sent during the run as the task's: the
-- queued ones get their rows first, in the same transaction.
DROP TRIGGER transcript_task_runs_au;
CREATE TRIGGER transcript_task_runs_au AFTER UPDATE OF status ON task_run_logs
WHEN OLD.status = 'running' AND NEW.status = 'success' AND COALESCE(NEW.result, '') != ''
BEGIN
  INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, group_folder,
      chat_jid, sender, ts, body)
    SELECT 'outbox', CAST(id AS TEXT), 'reply', 'out', group_folder, chat_jid, sender, ts,
           body
    FROM transcript_queued_reply_rows ORDER BY id;
  DELETE FROM transcript_replies_queued;
""" + _TASK_RUN_ROWS + """END;
"""),  # noqa: S608 - fixed text: the task run's transcript rows, no value from outside
    (22, "the IPC ledger is one B-tree keyed by its primary key (WITHOUT ROWID)", """
-- A command's ledger row was written to the table and to the index of its primary key,
-- and its lookup read both: now the key's B-tree holds the row, one page fewer a command.
-- The rows are the same; the index by time (pruning) stays.
CREATE TABLE ipc_ledger_keyed (
""" + _LEDGER_COLUMNS + """) WITHOUT ROWID;
INSERT INTO ipc_ledger_keyed (group_folder, file_name, content_hash, command_type, outcome,
    detail, processed_at)
  SELECT group_folder, file_name, content_hash, command_type, outcome, detail, processed_at
  FROM ipc_ledger;
DROP TABLE ipc_ledger;
ALTER TABLE ipc_ledger_keyed RENAME TO ipc_ledger;
CREATE INDEX idx_ipc_ledger_processed_at ON ipc_ledger(processed_at);
"""),  # noqa: S608 - fixed text: the ledger's columns, no value from outside
]

LATEST_VERSION = MIGRATIONS[-1][0]
