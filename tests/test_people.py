"""People and who may drive a group: `people:`, `members:`, `unknown_senders:` from the config
to the orchestrator and the CLI; triggers as an address (a passing mention wakes nothing, a
main group that requires a trigger ignores what does not address it).

The orchestrator runs in-process with the real database and reconciler; the fake runner of
tests/test_senders.py stands in at the container boundary."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest

from mdclaw.channels.base import InboundMessage
from mdclaw.config import ConfigError, load_config
from mdclaw.people import People, channel_of, decide, verdict
from mdclaw.reconcile import reconcile
from mdclaw.state import Database
from mdclaw.state.people import admit, is_admitted, list_admitted
from test_senders import Agent, orchestrator, queued

ALEX, BOB, SAM, STRANGER = "111", "222", "333", "999"

PEOPLE = """\
people:
  alex: {name: Alex, role: owner, identities: {telegram: ["111"], http: [alex]}}
  bob: {name: Bob, role: admin, identities: {telegram: [222]}}
  sam: {name: Sam, identities: {telegram: ["333"]}}
"""


def config(tmp_path: Path, groups: str, extra: str = PEOPLE) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(f"data_dir: {tmp_path / 'data'}\nassistant: {{name: Andy, timezone: UTC}}\n"
                 f"groups:\n{textwrap.indent(textwrap.dedent(groups), '  ')}" + extra)
    return p


def problems(tmp_path: Path, groups: str, extra: str = PEOPLE) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(config(tmp_path, groups, extra))
    return [f"{i.path}: {i.message}" for i in e.value.issues]


MAIN = 'main: {name: Admin, jid: "tg:111", main: true}\n'


# --------------------------------------------------------------------------- the config


def test_a_member_that_is_no_person_is_named_with_the_known_ones(tmp_path: Path) -> None:
    (p,) = problems(tmp_path, MAIN + 'family: {name: F, jid: "tg:-5", members: [alex, tom]}\n')
    assert p.startswith("groups.family.members.1:") and "'tom'" in p and "alex, bob, sam" in p


def test_an_identity_is_one_persons(tmp_path: Path) -> None:
    extra = PEOPLE + '  tom: {name: Tom, identities: {telegram: ["222"]}}\n'
    (p,) = problems(tmp_path, MAIN, extra)
    assert p.startswith("people.tom.identities.telegram.0:") and "'bob'" in p


def test_members_and_allow_senders_together_name_the_new_keys(tmp_path: Path) -> None:
    (p,) = problems(tmp_path, MAIN + 'family: {name: F, jid: "tg:-5", members: [alex], '
                    'allow_senders: {ids: ["111"]}}\n')
    assert p.startswith("groups.family.allow_senders:")
    assert "members" in p and "unknown_senders" in p and "remove allow_senders" in p


def test_approvals_and_admit_cards_need_an_owner(tmp_path: Path) -> None:
    no_owner = PEOPLE.replace("role: owner", "role: member")
    got = problems(tmp_path, MAIN + 'family: {name: F, jid: "tg:-5", members: [alex], '
                   'unknown_senders: ask_owner}\n', no_owner)
    assert any(p.startswith("people:") and "approvals.defaults: false" in p for p in got)
    assert any(p.startswith("groups.family.unknown_senders:") and "role: owner" in p
               for p in got)
    # Without any people, the defaults do not apply and nothing asks for an owner.
    load_config(config(tmp_path, MAIN, ""))


def test_unknown_senders_needs_members_and_telegram_ids_are_numbers(tmp_path: Path) -> None:
    got = problems(tmp_path, MAIN + 'family: {name: F, jid: "tg:-5", unknown_senders: allow}\n',
                   PEOPLE + '  tom: {name: Tom, identities: {telegram: ["tg:444"]}}\n')
    assert any(p.startswith("groups.family.unknown_senders:") and "add members" in p
               for p in got)
    assert any(p.startswith("people.tom.identities.telegram.0:") and "/chatid" in p
               for p in got)


def test_a_persons_cards_go_to_the_direct_chat_of_their_first_identity(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, MAIN, PEOPLE + '  kim: {name: Kim, direct_chat: '
                             '"wa:49151@s.whatsapp.net", identities: {telegram: ["444"]}}\n'))
    people = People.of(cfg)
    assert people.card_chat("alex") == "tg:111" and people.card_chat("kim").startswith("wa:")
    assert people.approvers("owner") == ["alex"]
    assert sorted(people.approvers("admin")) == ["alex", "bob"]
    assert people.approvers("sam") == ["sam"] and people.approvers("none") == []
    assert people.label("alex") == "Alex (owner)"
    assert channel_of("tg:-5") == "telegram" and channel_of("hl:x", "http") == "http"
    assert channel_of("mail:a@b.org") == "email"


def test_an_email_identity_is_one_address_whatever_its_case(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, MAIN, PEOPLE + '  erin: {name: Erin, identities: '
                             '{email: ["Erin@Example.ORG"]}}\n'))
    people = People.of(cfg)
    assert people.card_chat("erin") == "mail:erin@example.org"  # the email channel's chat
    assert people.person_for("email", "erin@example.org") == "erin"
    assert people.person_for("email", "ERIN@example.org") == "erin"
    assert people.person_for("telegram", "erin@example.org") is None


# --------------------------------------------------------------------------- the rule


def test_members_roles_admitted_and_strangers(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, MAIN + 'family: {name: F, jid: "tg:-5", members: '
                             '[sam, "role:admin"], unknown_senders: ask_owner}\n'
                             'open: {name: O, jid: "tg:-6", members: [sam], '
                             'unknown_senders: allow}\n'))
    nobody = lambda c, s, f: False  # noqa: E731
    assert verdict(cfg, "main", "telegram", STRANGER, nobody) is None  # no members: old rule
    assert verdict(cfg, "family", "telegram", SAM, nobody) == "member"
    assert verdict(cfg, "family", "telegram", BOB, nobody) == "member"  # by role
    assert verdict(cfg, "family", "telegram", ALEX, nobody) == "known"  # owner, not listed
    assert verdict(cfg, "family", "telegram", STRANGER, nobody) == "unknown"
    assert verdict(cfg, "family", "whatsapp", SAM, nobody) == "unknown"  # another channel
    assert verdict(cfg, "family", "telegram", STRANGER,
                   lambda c, s, f: (c, s, f) == ("telegram", STRANGER, "family")) == "admitted"
    run = decide(cfg, "family", "member", triggered=True)
    assert run.run and run.store and not run.refused
    assert decide(cfg, "family", "known", triggered=True) == \
        type(run)(store=True, direct=False, run=False, refused=True)
    ignored = decide(cfg, "family", "unknown", triggered=True)
    assert not ignored.store and not ignored.run and ignored.refused
    assert decide(cfg, "open", "unknown", triggered=True).run


# --------------------------------------------------------------------------- orchestrator

_ids = iter(range(1, 10_000))


def msg(sender: str, text: str, jid: str, channel: str = "telegram") -> InboundMessage:
    i = next(_ids)
    return InboundMessage(id=f"{jid}:{i}", chat_jid=jid, sender=sender,
                          sender_name=f"user {sender}", content=text,
                          timestamp=f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}.000Z",
                          is_group=True, channel=channel)


def stored(db: Database) -> list[str]:
    return [r[0] for r in db.query("SELECT content FROM messages ORDER BY timestamp, id")]


def test_only_members_drive_a_group_and_strangers_are_not_even_stored(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, MAIN + 'family: {name: F, jid: "tg:-5", members: '
                             '[sam, bob]}\n'))
    db = Database(cfg.db_path)
    reconcile(cfg, db)

    async def main() -> Agent:
        agent = Agent()
        agent.release.set()
        orch = orchestrator(cfg, db, agent)
        await orch.on_inbound(msg(STRANGER, "@Andy send me the door code", "tg:-5"))
        await orch.on_inbound(msg(ALEX, "@Andy alex is no member here", "tg:-5"))
        assert queued(orch) == []
        assert orch.recover_pending() == 0
        await orch.on_inbound(msg(SAM, "@Andy hello from sam", "tg:-5"))
        assert queued(orch) == ["family"]
        await asyncio.wait_for(orch.queue.join(), 10)
        return agent

    agent = asyncio.run(main())
    assert stored(db) == ["@Andy alex is no member here", "@Andy hello from sam"]
    (run,) = agent.inputs
    assert "door code" not in run["prompt"] and "alex is no member here" in run["prompt"]


def test_an_admitted_identity_talks_until_it_is_revoked(tmp_path: Path, cli) -> None:
    path = config(tmp_path, MAIN + 'family: {name: F, jid: "tg:-5", members: [sam], '
                  'unknown_senders: ask_owner}\n')
    cfg = load_config(path)
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    with db.transaction() as c:
        admit(c, channel="telegram", sender=STRANGER, folder="family", sender_name="Grandma",
              by="alex")
    assert is_admitted(db, "telegram", STRANGER, "family")
    assert not is_admitted(db, "telegram", STRANGER, "main")

    async def talk(text: str) -> list[str]:
        orch = orchestrator(cfg, db, Agent())
        await orch.on_inbound(msg(STRANGER, text, "tg:-5"))
        return queued(orch)

    assert asyncio.run(talk("@Andy hi, it's grandma")) == ["family"]
    listing = json.loads(cli("people", "list", "--json", "--config", str(path)).stdout)
    assert [p["key"] for p in listing["people"]] == ["alex", "bob", "sam"]
    assert listing["people"][0]["card_chat"] == "tg:111"
    (row,) = listing["admitted"]
    assert (row["channel"], row["sender"], row["group_folder"], row["admitted_by"]) == \
        ("telegram", STRANGER, "family", "alex")
    r = cli("people", "revoke", "telegram", STRANGER, "--config", str(path))
    assert r.returncode == 0 and "revoked 1" in r.stdout, r.stderr
    assert list_admitted(db) == []
    assert asyncio.run(talk("@Andy hello again?")) == []
    again = cli("people", "revoke", "telegram", STRANGER, "--config", str(path))
    assert again.returncode == 1 and "not admitted" in again.stderr


# --------------------------------------------------------------------------- triggers


def test_a_main_group_that_requires_a_trigger_ignores_what_does_not_address_it(
        tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, 'main: {name: Admin, jid: "tg:111", main: true, '
                             'requires_trigger: true}\n', ""))
    db = Database(cfg.db_path)
    reconcile(cfg, db)

    async def main() -> list[list[str]]:
        orch = orchestrator(cfg, db, Agent())
        seen = []
        for text in ("good morning everyone", "I told andy yesterday", "Andy, lights off"):
            await orch.on_inbound(msg(ALEX, text, "tg:111"))
            seen.append(queued(orch))
        return seen

    assert asyncio.run(main()) == [[], [], ["main"]]


def test_a_passing_mention_does_not_wake_a_group_that_requires_the_trigger(
        tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, MAIN + 'family: {name: F, jid: "tg:-5"}\n', ""))
    db = Database(cfg.db_path)
    reconcile(cfg, db)

    async def main() -> list[list[str]]:
        orch = orchestrator(cfg, db, Agent())
        seen = []
        for text, addressed in (("I told andy yesterday", False), ("andy's bike is fixed", False),
                                ("ask Andy, he knows", False), ("thanks", True),
                                ("hey Andy: dinner?", False)):
            m = msg(BOB, text, "tg:-5")
            if addressed:  # a reply to the assistant, as the channel reports it
                m = InboundMessage(**{**m.__dict__, "addressed": True})
            await orch.on_inbound(m)
            seen.append(queued(orch))
        return seen

    assert asyncio.run(main()) == [[], [], [], ["family"], ["family"]]


def test_check_config_warns_when_a_persons_cards_cannot_be_delivered(tmp_path: Path,
                                                                      cli) -> None:
    path = config(tmp_path, MAIN, PEOPLE + "channels: {http: {enabled: false}}\n")
    r = cli("check-config", "--config", str(path))
    assert r.returncode == 0, r.stderr
    assert "people.alex: cards go to tg:111, but channels.telegram is not enabled" in r.stderr
    assert "people.bob: cards go to tg:222" in r.stderr  # any person may be asked
    assert "people.sam: cards go to tg:333" in r.stderr
    # Slack and Discord: a user id is no chat, so cards need direct_chat (a DM's id)
    path = config(tmp_path, MAIN, PEOPLE + "  sl: {name: Sl, identities: {slack: [U1]}}\n"
                  "  dc: {name: Dc, identities: {discord: ['42']}, direct_chat: 'dc:77'}\n")
    r = cli("check-config", "--config", str(path))
    assert r.returncode == 0, r.stderr
    assert "people.sl: no identity of a channel with chats" in r.stderr
    assert "Slack and Discord need direct_chat" in r.stderr
    assert "people.dc: cards go to dc:77, but channels.discord is not enabled" in r.stderr
