"""Participants whose groups failed a check, and those suspended for it (docs/trust.md). A rule of the book
(book.py): the live proxy applies the journal's `checked`, `failed` and `reinstate` records as it writes
them, replay as it reads them, so a restart suspends exactly whom its predecessor had.

Checks fail in two places: the proxy's own on arrival (`unleased`, `reused`, `replayed`: receipts.py) and the
trainer's audit of what it leased (`reward`, `prompt`, `logprobs`: lib/train/audit.py, reported through
`POST /v1/batches/{batch_id}/audit`). Each failed group is one `failed` record naming the participant, the
group, the check and why, and the limit (the proxy's --quarantine-after) in force when it was written: the
failure that reaches the limit suspends the participant, in the record itself, so replay needs no option of
today's proxy to decide what yesterday's did. A suspended participant's token is refused on every route
(403, with the reason: access.py), its buffered groups are held out (and so are those of its leases that come
back), until the run's owner reinstates it (`POST /v1/participants/{name}/reinstate`, or
`bash launch_jobs.sh --token-reinstate NAME`), which also clears its count. The admin token is never audited.

Bounded: one entry per participant that was ever checked (tokens are the admin's to create), the last RECENT
failures each.
"""
from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

RECENT = 8  # failures kept per participant for /v1/stats (every one is in the journal)


class Quarantine:
    def __init__(self):
        self.people: dict[str, dict] = {}

    def _of(self, who: str) -> dict:
        return self.people.setdefault(who, {"checked": 0, "failed": 0, "by_check": {}, "recent": [], "quarantined": None})

    # ---- the rules ---------------------------------------------------------------------------------
    def checked(self, counts: dict[str, int]) -> None:
        """The trainer audited counts[who] more groups of each participant (passed or not)."""
        for who, n in counts.items():
            self._of(who)["checked"] += n

    def fail(self, who: str, gid: str, check: str, detail: str, limit: int, at: float) -> bool:
        """Group `gid` of `who` failed `check`; True when that suspends `who` (its failures reached `limit`)."""
        p = self._of(who)
        p["failed"] += 1
        p["by_check"][check] = p["by_check"].get(check, 0) + 1
        p["recent"] = [*p["recent"], {"group_id": gid, "check": check, "detail": detail, "at": at}][-RECENT:]
        if p["quarantined"] is None and p["failed"] >= limit:
            p["quarantined"] = {"since": at, "check": check,
                                "reason": f"{p['failed']} failed checks (limit {limit}); the last: {check}: {detail}"}
            return True
        return False

    def reinstate(self, who: str, at: float) -> None:
        """The run's owner lets `who` back in: suspension lifted, its count of failures back to 0."""
        p = self._of(who)
        p.update(failed=0, by_check={}, quarantined=None, reinstated_at=at)

    def held(self, who: str | None) -> bool:
        return who is not None and who in self.people and self.people[who]["quarantined"] is not None

    def reason(self, who: str) -> str | None:
        p = self.people.get(who)
        return p["quarantined"]["reason"] if p and p["quarantined"] else None

    # ---- what the owner sees -----------------------------------------------------------------------
    def public(self, who: str) -> dict:
        p = self.people.get(who) or {"checked": 0, "failed": 0, "by_check": {}, "recent": [], "quarantined": None}
        return {k: v for k, v in p.items()}

    def collect(self):
        """Prometheus gauges per participant: groups the trainer checked, failed checks by kind, quarantined."""
        checked = GaugeMetricFamily("proxy_participant_checked", "groups of a participant the trainer audited",
                                    labels=["participant"])
        failed = GaugeMetricFamily("proxy_participant_checks_failed", "a participant's groups that failed a check "
                                   "(since it was last reinstated)", labels=["participant", "check"])
        held = GaugeMetricFamily("proxy_participant_quarantined", "1 while a participant is quarantined (check: the "
                                 "failure that suspended it; the reason is in /v1/stats)", labels=["participant", "check"])
        for who, p in self.people.items():
            checked.add_metric([who], p["checked"])
            for check, n in p["by_check"].items():
                failed.add_metric([who, check], n)
            if p["quarantined"]:
                held.add_metric([who, p["quarantined"]["check"]], 1)
        yield from (checked, failed, held)

    # ---- state ---------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {who: {**p, "by_check": dict(p["by_check"]), "recent": [dict(r) for r in p["recent"]],
                      "quarantined": dict(p["quarantined"]) if p["quarantined"] else None}
                for who, p in sorted(self.people.items())}

    @classmethod
    def from_state(cls, d: dict) -> Quarantine:
        q = cls()
        q.people = {who: {**p, "by_check": dict(p["by_check"]), "recent": [dict(r) for r in p["recent"]],
                          "quarantined": dict(p["quarantined"]) if p["quarantined"] else None}
                    for who, p in d.items()}
        return q
