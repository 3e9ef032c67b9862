"""Schedule maths: bad input, DST days in several zones, interval grid, one-shot parsing."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from mdclaw import schedule
from mdclaw.config import ConfigError, load_config
from mdclaw.schedule import ScheduleError

UTC = UTC
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("stype,value,tz,reason", [
    ("cron", "61 * * * *", "UTC", "not valid"),
    ("cron", "0 8 * *", "UTC", "has 4 field(s); five are needed"),
    ("cron", "0 8 * * * *", "UTC", "has 6 field(s)"),
    ("cron", "abc", "UTC", "five are needed"),
    ("cron", "a b c d e", "UTC", "not valid"),
    ("cron", "0 25 * * *", "UTC", "not valid"),
    ("interval", "0", "UTC", "too short"),
    ("interval", "-5", "UTC", "not a whole number"),
    ("interval", "abc", "UTC", "not a whole number"),
    ("interval", "1.5", "UTC", "not a whole number"),
    ("interval", "", "UTC", "not a whole number"),
    ("once", "2020-01-01T00:00:00Z", "UTC", "in the past"),
    ("once", "2026-06-01T13:59:00", "Europe/Berlin", "in the past"),  # 11:59 UTC
    ("once", "abc", "UTC", "not an ISO-8601 time"),
    ("cron", "0 8 * * *", "Mars/Olympus", "unknown timezone 'Mars/Olympus'"),
    ("cron", "0 8 * * *", "../etc/passwd", "unknown timezone"),
    ("weekly", "0 8 * * *", "UTC", "unknown schedule_type"),
])
def test_bad_input_is_rejected_with_reason(stype, value, tz, reason) -> None:
    with pytest.raises(ScheduleError) as ei:
        schedule.validate(stype, value, tz, NOW)
    assert reason in str(ei.value)


def test_good_input_is_normalised() -> None:
    assert schedule.validate("cron", " 0  8 * * 1-5 ", "UTC", NOW) == "0 8 * * 1-5"
    assert schedule.validate("interval", "3600000", "UTC", NOW) == "3600000"
    assert schedule.validate("once", "2026-06-01T14:01:00", "Europe/Berlin", NOW)


CONFIG_HEAD = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: Europe/Berlin}
groups:
  main: {name: Admin, jid: "tg:1", main: true}
tasks:
  - id: t1
    group: main
    prompt: hello
"""


@pytest.mark.parametrize("line,needle", [
    ('cron: "61 * * * *"', "'61 * * * *' is not valid"),
    ('cron: "0 8 * *"', "five are needed"),
    ("interval: 0", "duration must be positive"),
    ("interval: -5", "duration must be positive, got -5"),
    ("interval: abc", "invalid duration"),
    ('once: "tomorrow at 8"', "not an ISO-8601 time"),
    ('cron: "0 8 * * *"\n    timezone: Mars/Olympus', "unknown timezone 'Mars/Olympus'"),
])
def test_bad_task_in_config_is_a_config_error(write_config, line, needle) -> None:
    p = write_config(CONFIG_HEAD + f"    {line}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    text = str(ei.value)
    assert needle in text, text
    assert "tasks" in text or "t1" in text


# ------------------------------------------------------------------ daylight saving

def fires_on(expr: str, tz: str, day: date) -> list[datetime]:
    """Every firing whose local date is `day`, as local times."""
    zone = ZoneInfo(tz)
    t = datetime(day.year, day.month, day.day, tzinfo=zone).astimezone(UTC) - timedelta(hours=1)
    out = []
    while True:
        t = schedule.next_cron(expr, tz, t)
        local = t.astimezone(zone)
        if local.date() > day:
            return out
        if local.date() == day:
            out.append(local)


# (zone, spring-forward day, fall-back day) in 2026
DST_DAYS = [
    ("Europe/Berlin", date(2026, 3, 29), date(2026, 10, 25)),
    ("America/New_York", date(2026, 3, 8), date(2026, 11, 1)),
    ("Australia/Sydney", date(2026, 10, 4), date(2026, 4, 5)),
    ("Australia/Lord_Howe", date(2026, 10, 4), date(2026, 4, 5)),  # 30-minute shift
]


@pytest.mark.parametrize("tz,spring,fall", DST_DAYS)
@pytest.mark.parametrize("expr", ["0 2 * * *", "30 2 * * *", "0 1 * * *", "30 1 * * *",
                                  "15 3 * * *"])
def test_fixed_time_fires_once_on_dst_days(tz, spring, fall, expr) -> None:
    for day in (spring, fall, spring - timedelta(days=1), fall + timedelta(days=1)):
        got = fires_on(expr, tz, day)
        assert len(got) == 1, (tz, day, expr, got)


@pytest.mark.parametrize("tz,spring,fall", DST_DAYS[:3])
def test_two_am_exact_times(tz, spring, fall) -> None:
    (s,) = fires_on("0 2 * * *", tz, spring)
    assert (s.hour, s.minute) == (3, 0)  # 02:00 does not exist: fires when the gap ends
    (f,) = fires_on("0 2 * * *", tz, fall)
    assert (f.hour, f.minute) == (2, 0)
    assert f.fold == 0 or f.replace(fold=0).utcoffset() == f.utcoffset()  # first occurrence
    # Exactly 23 / 25 hours between the firings around each change where 02:00 repeats.
    before = fires_on("0 2 * * *", tz, fall - timedelta(days=1))[0]
    after = fires_on("0 2 * * *", tz, fall + timedelta(days=1))[0]
    assert after.astimezone(UTC) - before.astimezone(UTC) == timedelta(hours=49)


def test_berlin_fall_back_stored_utc() -> None:
    t = schedule.next_cron("0 2 * * *", "Europe/Berlin", datetime(2026, 10, 24, 12, tzinfo=UTC))
    assert schedule.to_iso(t) == "2026-10-25T00:00:00.000Z"  # 02:00 CEST
    t = schedule.next_cron("0 2 * * *", "Europe/Berlin", t)
    assert schedule.to_iso(t) == "2026-10-26T01:00:00.000Z"  # 02:00 CET next day, not 01:00Z


def test_wildcard_hour_follows_real_time_through_repeated_hour() -> None:
    # Hourly jobs run every real hour: 25 times on the fall-back day, 23 on spring-forward.
    assert len(fires_on("0 * * * *", "Europe/Berlin", date(2026, 10, 25))) == 25
    assert len(fires_on("0 * * * *", "Europe/Berlin", date(2026, 3, 29))) == 23
    assert len(fires_on("*/30 * * * *", "America/New_York", date(2026, 11, 1))) == 50
    assert len(fires_on("0 */1 * * *", "Europe/Berlin", date(2026, 10, 25))) == 25
    # Every second hour is a fixed-hours job: 02:00 repeats but fires once (12 on the day).
    fall = fires_on("0 */2 * * *", "Europe/Berlin", date(2026, 10, 25))
    assert len(fall) == 12 and [t.hour for t in fall][:3] == [0, 2, 4]


def test_half_hour_fall_back() -> None:
    # Lord Howe Island goes from +11:00 back to +10:30 at 02:00. croniter (and so mdclaw)
    # gives a job that runs every hour no slots in the repeated half hour: nothing fires
    # twice, and the longest pause is that half hour plus one step.
    zone = ZoneInfo("Australia/Lord_Howe")
    t = datetime(2026, 4, 4, 14, 0, tzinfo=UTC)  # 01:00 local, +11:00
    times = []
    while t < datetime(2026, 4, 4, 16, 30, tzinfo=UTC):
        t = schedule.next_cron("*/4 * * * *", "Australia/Lord_Howe", t)
        times.append(t)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) == timedelta(minutes=4)
    assert max(gaps) <= timedelta(minutes=34)
    walls = [x.astimezone(zone).replace(tzinfo=None) for x in times]
    assert len(walls) == len(set(walls))  # no wall-clock time fired twice
    assert len(fires_on("30 1 * * *", "Australia/Lord_Howe", date(2026, 4, 5))) == 1


def test_cron_evaluated_in_task_timezone() -> None:
    after = datetime(2026, 1, 10, 0, 0, tzinfo=UTC)
    assert schedule.to_iso(schedule.next_cron("0 8 * * *", "Europe/Berlin", after)) == \
        "2026-01-10T07:00:00.000Z"
    assert schedule.to_iso(schedule.next_cron("0 8 * * *", "America/New_York", after)) == \
        "2026-01-10T13:00:00.000Z"
    assert schedule.to_iso(schedule.next_cron("0 8 * * *", "UTC", after)) == \
        "2026-01-10T08:00:00.000Z"


# ------------------------------------------------------------------ interval and missed slots

def test_interval_grid_does_not_drift() -> None:
    anchor = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
    step = 60_000
    slot = anchor
    for late_ms in (5, 900, 42_000, 1):  # each run starts a little late
        now = slot + timedelta(milliseconds=late_ms)
        nxt, missed = schedule.advance("interval", str(step), "UTC", slot, now)
        assert missed == 0
        assert nxt == slot + timedelta(milliseconds=step)
        slot = nxt
    assert slot == anchor + timedelta(minutes=4)


def test_interval_skips_missed_slots_and_counts_them() -> None:
    anchor = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
    now = anchor + timedelta(minutes=10, seconds=30)
    nxt, missed = schedule.advance("interval", "60000", "UTC", anchor, now)
    assert nxt == anchor + timedelta(minutes=11)  # still on the grid
    assert missed == 10


def test_cron_missed_count_and_next() -> None:
    slot = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
    nxt, missed = schedule.advance("cron", "*/5 * * * *", "UTC", slot,
                                   slot + timedelta(hours=1, minutes=2))
    assert nxt == slot + timedelta(hours=1, minutes=5)
    assert missed == 12
    nxt, missed = schedule.advance("cron", "0 8 * * *", "UTC", slot + timedelta(hours=8),
                                   slot + timedelta(days=3, hours=9))
    assert missed == 3 and nxt == datetime(2026, 1, 5, 8, 0, tzinfo=UTC)


def test_missed_count_is_capped() -> None:
    slot = datetime(2020, 1, 1, tzinfo=UTC)
    _, missed = schedule.advance("cron", "* * * * *", "UTC", slot, slot + timedelta(days=400))
    assert missed == schedule.MISSED_COUNT_LIMIT


def test_once_advance_has_no_next() -> None:
    assert schedule.advance("once", "2026-01-01T00:00:00Z", "UTC", NOW, NOW) == (None, 0)


# ------------------------------------------------------------------ once

def test_once_without_offset_is_read_in_task_timezone() -> None:
    assert schedule.to_iso(schedule.parse_once("2026-07-01T17:00:00", "Europe/Berlin")) == \
        "2026-07-01T15:00:00.000Z"
    assert schedule.to_iso(schedule.parse_once("2026-01-01T17:00:00", "America/New_York")) == \
        "2026-01-01T22:00:00.000Z"
    assert schedule.to_iso(schedule.parse_once("2026-07-01T17:00:00Z", "Europe/Berlin")) == \
        "2026-07-01T17:00:00.000Z"
    assert schedule.to_iso(schedule.parse_once("2026-07-01T17:00:00+05:30", "Europe/Berlin")) \
        == "2026-07-01T11:30:00.000Z"


def test_first_run_is_in_the_future() -> None:
    for stype, value in (("cron", "0 8 * * *"), ("interval", "1000"),
                         ("once", "2026-06-01T12:00:01Z")):
        assert schedule.first_run(stype, value, "Europe/Berlin", NOW) > NOW


def test_a_repeated_hour_at_the_end_of_the_day_fires() -> None:
    # Chile goes from -03:00 back to -04:00 at midnight: 23:00-23:59 of April 1, 2023 comes
    # twice, the second time on the same date. An every-minute job of that date fires in it
    # (a job that runs every hour follows real time); croniter alone jumped to next year.
    after = datetime(2023, 4, 2, 2, 59, tzinfo=UTC)  # 23:59 local, the first time (-03:00)
    got = schedule.next_cron("* * 1 4 *", "America/Santiago", after)
    assert got == datetime(2023, 4, 2, 3, 0, tzinfo=UTC)  # 23:00 local again (-04:00)
    n = schedule.count_cron_slots("* * 1 4 *", "America/Santiago", after,
                                  datetime(2023, 4, 2, 4, 0, tzinfo=UTC))
    assert n == 60  # the whole repeated hour, each minute once
    # A job with a fixed hour still fires once: the repeated 23:30 is skipped.
    got = schedule.next_cron("30 23 * * *", "America/Santiago",
                             datetime(2023, 4, 2, 2, 35, tzinfo=UTC))
    assert got == datetime(2023, 4, 3, 3, 30, tzinfo=UTC)


def test_iso_now_is_the_time_to_iso_gives_and_moves_on_with_the_second() -> None:
    """iso_now keeps the text of the second it last formatted: a call in a later second
    must not reuse it (here the kept second is made stale on purpose), and every call reads
    the same clock, in the same format, as to_iso(utc_now())."""
    for _ in range(2000):
        before = schedule.to_iso(schedule.utc_now())
        now = schedule.iso_now()
        after = schedule.to_iso(schedule.utc_now())
        assert before <= now <= after and len(now) == len(before)
    schedule._second = (schedule._second[0] - 1, "1999-01-01T00:00:00")  # noqa: SLF001
    assert schedule.iso_now() >= before
    assert schedule.to_iso(schedule.from_iso(schedule.iso_now())) <= schedule.iso_now()
