"""Schedule maths: when does a task run next.

Pure functions, no I/O. Times go in and come out as timezone-aware UTC datetimes; cron
expressions are evaluated in the task's own timezone so "0 8 * * *" means 08:00 where the
person lives, across daylight-saving changes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from mdclaw.errors import ConfigProblem

ScheduleType = Literal["cron", "interval", "once"]
SCHEDULE_TYPES: tuple[str, ...] = ("cron", "interval", "once")

UTC = UTC
MISSED_COUNT_LIMIT = 1000  # bounds the work of counting a long outage's cron slots


class ScheduleError(ConfigProblem, ValueError):
    """A schedule value that cannot be used; the message says why, for a person."""


def get_zone(name: str) -> ZoneInfo:
    """Return the IANA zone `name`; raise ScheduleError if there is no such zone."""
    try:
        if not name or name.startswith(("/", ".")) or ".." in name:
            raise ZoneInfoNotFoundError(name)
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(
            f"unknown timezone {name!r}: use an IANA name such as 'Europe/Berlin' or 'UTC'"
        ) from None


def utc_now() -> datetime:
    return datetime.now(UTC)


# The last second iso_now formatted, and its text: (seconds since the epoch, text).
_second: tuple[int, str] = (-1, "")


def iso_now() -> str:
    """The current time as `to_iso(utc_now())` gives it (ISO-8601 UTC, milliseconds, Z),
    without an aware datetime; the text of the second is kept, so the calls within one
    second (every round of a burst, the `sent` marks) format only their milliseconds."""
    global _second
    s, ns = divmod(time.time_ns(), 1_000_000_000)
    second = _second
    if second[0] != s:
        second = _second = (s, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s)))
    return f"{second[1]}.{ns // 1_000_000:03d}Z"


def to_iso(dt: datetime) -> str:
    """ISO-8601 UTC with millisecond precision and a trailing Z (the database's format)."""
    dt = dt.astimezone(UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def from_iso(text: str) -> datetime:
    """Parse a stored ISO timestamp (with Z or offset) into an aware UTC datetime."""
    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC)


_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,\-?LW#]+\Z")


def validate_cron(expr: str) -> str:
    """Return the normalised five-field expression; raise ScheduleError naming the problem."""
    fields = expr.split()
    if len(fields) != 5:
        raise ScheduleError(
            f"cron expression {expr!r} has {len(fields)} field(s); five are needed: "
            "minute hour day-of-month month day-of-week, e.g. '0 8 * * *'"
        )
    if not all(_CRON_FIELD.match(f) for f in fields):
        raise ScheduleError(f"cron expression {expr!r} contains characters cron does not accept")
    normalised = " ".join(fields)
    if not croniter.is_valid(normalised):
        raise ScheduleError(f"cron expression {expr!r} is not valid (a value out of range?)")
    return normalised


def parse_interval_ms(value: str | int) -> int:
    """Return a positive interval in milliseconds; raise ScheduleError otherwise."""
    text = str(value).strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise ScheduleError(
            f"interval {value!r} is not a whole number of milliseconds (e.g. 3600000 for an hour)"
        )
    ms = int(text)
    if ms < 1000:
        raise ScheduleError(f"interval {value!r} ms is too short: at least 1000 ms (one second)")
    return ms


def parse_once(value: str, tz: str) -> datetime:
    """Return the UTC instant of an ISO-8601 time; a time without offset is read in `tz`."""
    text = value.strip()
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise ScheduleError(
            f"once value {value!r} is not an ISO-8601 time such as '2026-02-06T17:00:00'"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=get_zone(tz))
    return dt.astimezone(UTC)


def repeats_wall_clock(expr: str) -> bool:
    """True if `expr` runs in every hour, and so follows real time across DST changes.

    Like classic cron: a job that runs every hour (`*`, `*/1`, `0-23` in the hour field) also
    fires in the repeated fall-back hour, and has no slot in the skipped spring-forward hour;
    a job with fixed hours (`0 2 * * *`, `0 */2 * * *`) fires only at the first occurrence of
    a repeated wall-clock time, and at the end of the gap for a skipped one.
    """
    try:
        return croniter(expr).expanded[1] == ["*"]
    except (ValueError, KeyError):
        return False


def _is_second_occurrence(local: datetime) -> bool:
    """`local` is the later of two instants that share the same wall-clock time."""
    if not local.fold:
        return False
    return local.replace(fold=0).utcoffset() != local.utcoffset()


def _cron_times(expr: str, tz: str, after: datetime) -> Iterator[datetime]:
    """The firing times of `expr` in zone `tz` strictly after `after`, as UTC, in order."""
    zone = get_zone(tz)
    both_folds = repeats_wall_clock(expr)
    it = croniter(expr, after.astimezone(zone))
    skipped = 0
    prev = after.astimezone(UTC)
    while True:
        local = it.get_next(datetime).astimezone(zone)
        if both_folds or not _is_second_occurrence(local):
            skipped = 0
            at = local.astimezone(UTC)
            if both_folds:
                # croniter steps over a repeated hour that ends its day (a fall-back at
                # midnight, as in Chile): those wall times are yielded here, in order.
                yield from _repeated_slots(expr, zone, prev, at)
            if at > prev:
                prev = at
                yield at
        else:
            skipped += 1
            if skipped > 1000:
                raise ScheduleError(f"cron expression {expr!r} never fires in {tz}")


def _fall_backs(zone: ZoneInfo, start: datetime, end: datetime) -> Iterator[datetime]:
    """The instants (UTC, to the second) in (start, end) where `zone`'s offset goes down."""
    step = timedelta(days=1)
    lo = start
    while lo < end:
        hi = min(lo + step, end)
        if hi.astimezone(zone).utcoffset() < lo.astimezone(zone).utcoffset():  # type: ignore[operator]
            a, b = lo, hi  # the offset changes once within a day: find the second
            while b - a > timedelta(seconds=1):
                mid = a + (b - a) / 2
                if mid.astimezone(zone).utcoffset() == a.astimezone(zone).utcoffset():
                    a = mid
                else:
                    b = mid
            yield b.replace(microsecond=0)
        lo = hi


def _repeated_slots(expr: str, zone: ZoneInfo, start: datetime,
                    end: datetime) -> Iterator[datetime]:
    """Firing times of `expr` (UTC) strictly between `start` and `end` that lie in the second
    occurrence of a repeated wall-clock hour. A repeated half hour (Lord Howe Island) keeps
    croniter's rule: no slot in it, so no wall-clock time fires twice there."""
    for t in _fall_backs(zone, start, end):
        before = (t - timedelta(seconds=1)).astimezone(zone).utcoffset()
        after = t.astimezone(zone).utcoffset()
        assert before is not None and after is not None
        if before - after != timedelta(hours=1):
            continue
        u = t
        while u < t + (before - after) and u < end:
            local = u.astimezone(zone)
            if u > start and croniter.match(expr, local.replace(tzinfo=None)):
                yield u
            u += timedelta(minutes=1)


def next_cron(expr: str, tz: str, after: datetime) -> datetime:
    """The first time strictly after `after` that matches `expr` in zone `tz`, as UTC.

    croniter walks the zone-aware local clock: a wall-clock time skipped by the spring-forward
    gap fires once, at the end of the gap (an every-hour job simply has no slot there). On
    the fall-back day croniter would return a repeated wall-clock time twice; unless the job
    runs every hour (see repeats_wall_clock) the second occurrence is skipped, so
    `0 2 * * *` fires once. Raises ScheduleError for an unknown zone.
    """
    return next(_cron_times(expr, tz, after))


def count_cron_slots(expr: str, tz: str, start: datetime, end: datetime,
                     limit: int = MISSED_COUNT_LIMIT) -> int:
    """How many times `expr` fires in the half-open span (start, end], capped at `limit`."""
    n = 0
    for t in _cron_times(expr, tz, start):
        if t > end or n >= limit:
            break
        n += 1
    return n


def next_interval(anchor: datetime, interval_ms: int, now: datetime) -> tuple[datetime, int]:
    """Next slot of a fixed grid anchored at `anchor`, strictly after `now`.

    Returns (next_time, missed) where `missed` counts the grid slots in (anchor, now] that
    were skipped: after downtime the task runs once, not once per missed slot.
    """
    step = timedelta(milliseconds=interval_ms)
    if now < anchor:
        return anchor, 0
    passed = (now - anchor) // step  # whole steps since the anchor
    return anchor + (passed + 1) * step, int(passed)


def validate(schedule_type: str, value: str, tz: str, now: datetime | None = None) -> str:
    """Check a schedule when a task is created; return the normalised value.

    Raises ScheduleError with the reason for an unknown type, bad cron, bad interval, a `once`
    time in the past, or an unknown timezone.
    """
    get_zone(tz)
    now = now or utc_now()
    if schedule_type == "cron":
        return validate_cron(value)
    if schedule_type == "interval":
        return str(parse_interval_ms(value))
    if schedule_type == "once":
        at = parse_once(value, tz)
        if at <= now:
            raise ScheduleError(f"once time {value!r} is in the past ({to_iso(at)} UTC): give "
                                "a future time, or remove the task if it has already run")
        return value.strip()
    raise ScheduleError(
        f"unknown schedule_type {schedule_type!r}: use one of {', '.join(SCHEDULE_TYPES)}"
    )


def first_run(schedule_type: str, value: str, tz: str, now: datetime | None = None) -> datetime:
    """The first run time of a new (or rescheduled) task, as UTC. Assumes validate() passed."""
    now = now or utc_now()
    if schedule_type == "cron":
        return next_cron(value, tz, now)
    if schedule_type == "interval":
        return now + timedelta(milliseconds=parse_interval_ms(value))
    if schedule_type == "once":
        return parse_once(value, tz)
    raise ScheduleError(f"unknown schedule_type {schedule_type!r}")



def advance(schedule_type: str, value: str, tz: str, scheduled: datetime,
            now: datetime) -> tuple[datetime | None, int]:
    """When a run due at `scheduled` is started at `now`: the next run time and missed slots.

    Returns (next_run, missed). `next_run` is the first slot strictly after `now` (None for a
    one-shot task), so a backlog collapses into the one run being started; `missed` counts
    the further slots in (scheduled, now] that will not run (capped at MISSED_COUNT_LIMIT).
    Interval slots stay on the grid anchored at `scheduled`, so runs do not drift.
    """
    if schedule_type == "once":
        return None, 0
    if schedule_type == "interval":
        nxt, missed = next_interval(scheduled, parse_interval_ms(value), max(now, scheduled))
        return nxt, min(missed, MISSED_COUNT_LIMIT)
    if schedule_type == "cron":
        missed = count_cron_slots(value, tz, scheduled, now, MISSED_COUNT_LIMIT)
        return next_cron(value, tz, max(now, scheduled)), missed
    raise ScheduleError(f"unknown schedule_type {schedule_type!r}")
