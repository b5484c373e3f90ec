"""Hostile and malformed requests against the real proxy process (with the real local S3 server):
each gets its documented 4xx naming the problem, never a 5xx, and /v1/stats does not move.
Then schemathesis fuzzes every operation of /openapi.json: no 5xx."""
import subprocess
import sys
import uuid

import httpx
import hypothesis
import schemathesis
from hypothesis import HealthCheck, given, settings

from conftest import ROOT
from proxyproc import wait_for
from test_proxy import group, publish


def raw_group(completion: str, G: int = 4) -> bytes:
    """A group as raw JSON text, for what json.dumps will not write (NaN, Infinity)."""
    return ('{"group_id":"%s","worker_id":"w","policy_version":0,"prompt_ids":[1],"completions":[%s],"meta":{}}'
            % (uuid.uuid4().hex, ",".join([completion] * G))).encode()


def comp(**over):
    return [{"token_ids": [1, 2], "logprobs": [-1.0, -2.0], "reward": 0.0, "finish_reason": "stop", **over}] * 4


class chunked:
    """n MB sent chunked (no Content-Length); iterable afresh each time it is sent (a generator would be spent
    after the first send, and a second run of the cases would send nothing)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return (b"x" * (1 << 20) for _ in range(self.n))


# (what, method, path, request kwargs, expected status, text the answer must contain)
CASES = [
    ("no token", "POST", "/v1/groups", {"json": group(), "headers": {}}, 401, "token"),
    ("wrong token", "POST", "/v1/groups", {"json": group(), "headers": {"Authorization": "Bearer nope"}}, 401, "token"),
    ("token with the wrong scheme", "GET", "/v1/stats", {"headers": {"Authorization": "Basic {token}"}}, 401, "token"),
    ("not JSON", "POST", "/v1/groups", {"content": b"{", "headers": {"Content-Type": "application/json", "X-Proxy-Token": "{token}"}}, 422, "json"),
    ("a JSON array", "POST", "/v1/groups", {"json": [group()]}, 422, "object"),
    ("empty object", "POST", "/v1/groups", {"json": {}}, 422, "group_id"),
    ("version of the wrong type", "POST", "/v1/groups", {"json": group(policy_version="one")}, 422, "policy_version"),
    ("negative version", "POST", "/v1/groups", {"json": group(version=-1)}, 422, "policy_version"),
    ("version from the future", "POST", "/v1/groups", {"json": group(version=99)}, 409, "newer than the latest"),
    ("wrong G", "POST", "/v1/groups", {"json": group(G=3)}, 422, "group_size"),
    ("mismatched lengths", "POST", "/v1/groups", {"json": group(completions=comp(logprobs=[-1.0]))}, 422, "logprobs"),
    ("NaN logprob", "POST", "/v1/groups", {"content": raw_group('{"token_ids":[1],"logprobs":[NaN],"reward":0,"finish_reason":"stop"}')}, 422, "logprobs"),
    ("Infinity reward", "POST", "/v1/groups", {"content": raw_group('{"token_ids":[1],"logprobs":[-1],"reward":Infinity,"finish_reason":"stop"}')}, 422, "reward"),
    ("huge reward", "POST", "/v1/groups", {"json": group(completions=comp(reward=1e300))}, 422, "reward"),
    ("positive logprob", "POST", "/v1/groups", {"json": group(completions=comp(logprobs=[0.5, -1.0]))}, 422, "logprobs"),
    ("negative token id", "POST", "/v1/groups", {"json": group(prompt_ids=[1, -2])}, 422, "prompt_ids"),
    ("token id beyond any vocabulary", "POST", "/v1/groups", {"json": group(completions=comp(token_ids=[1, 2**40]))}, 422, "token_ids"),
    ("unknown top-level field", "POST", "/v1/groups", {"json": group(admin=True)}, 422, "admin"),
    ("unknown completion field", "POST", "/v1/groups", {"json": group(completions=comp(text="hi"))}, 422, "text"),
    ("bad finish_reason", "POST", "/v1/groups", {"json": group(completions=comp(finish_reason="eos"))}, 422, "finish_reason"),
    ("empty prompt", "POST", "/v1/groups", {"json": group(prompt_ids=[])}, 422, "prompt_ids"),
    ("path in group_id", "POST", "/v1/groups", {"json": group(gid="../../etc/passwd")}, 422, "group_id"),
    ("group_id too long", "POST", "/v1/groups", {"json": group(gid="a" * 65)}, 422, "group_id"),
    ("meta too large", "POST", "/v1/groups", {"json": group(meta={"x": "y" * 20000})}, 422, "meta"),
    ("meta nested 5000 deep", "POST", "/v1/groups", {"content": raw_group('{"token_ids":[1],"logprobs":[-1],"reward":0,"finish_reason":"stop"}').replace(b'"meta":{}', b'"meta":{"a":' + b"[" * 5000 + b"]" * 5000 + b"}")}, 422, "recursion limit"),
    ("completion over max_completion_tokens", "POST", "/v1/groups", {"json": group(completions=comp(token_ids=[1] * 5000, logprobs=[-1.0] * 5000))}, 422, "max_completion"),
    ("10 MB body", "POST", "/v1/groups", {"content": b"x" * (10 << 20), "headers": {"X-Proxy-Token": "{token}"}}, 413, "body"),
    ("10 MB chunked body", "POST", "/v1/batches/lease", {"content": chunked(10)}, 413, "body"),
    ("lease of 0 groups", "POST", "/v1/batches/lease", {"json": {"num_groups": 0}}, 422, "num_groups"),
    ("lease of a billion groups", "POST", "/v1/batches/lease", {"json": {"num_groups": 10**9}}, 422, "num_groups"),
    ("negative lease wait", "POST", "/v1/batches/lease", {"json": {"num_groups": 1, "wait_s": -1}}, 422, "wait_s"),
    ("unknown lease field", "POST", "/v1/batches/lease", {"json": {"num_groups": 1, "all": True}}, 422, "all"),
    ("ack of an unknown batch", "POST", "/v1/batches/0123456789abcdef/ack", {}, 404, "no open lease"),
    ("ack with a hostile batch id", "POST", "/v1/batches/bad!id;drop/ack", {}, 422, "batch_id"),
    ("ack with a 100-char batch id", "POST", "/v1/batches/" + "a" * 100 + "/ack", {}, 422, "batch_id"),
    ("double ack", "POST", "/v1/batches/{acked}/ack", {}, 409, "already acked"),
    ("ack of an expired lease", "POST", "/v1/batches/{expired}/ack", {}, 410, "expired"),
    ("register version 0", "POST", "/v1/adapters", {"json": {"version": 0, "step": 0, "published_at": 1}}, 422, "version"),
    ("register without published_at", "POST", "/v1/adapters", {"json": {"version": 2, "step": 0}}, 422, "published_at"),
    ("register an unpublished version", "POST", "/v1/adapters", {"json": {"version": 7, "step": 7, "published_at": 1}}, 422, "meta.json"),
    ("register a version that is not newer", "POST", "/v1/adapters", {"json": {"version": 1, "step": 9, "published_at": 1}}, 409, "not newer"),
    ("latest with after=-5", "GET", "/v1/adapters/latest", {"params": {"after": -5}}, 422, "after"),
    ("latest with a huge wait", "GET", "/v1/adapters/latest", {"params": {"wait_s": 1e9}}, 422, "wait_s"),
    ("prompts of another dataset size", "POST", "/v1/prompts/lease", {"json": {"dataset": "d", "size": 11, "n": 1}}, 409, "size"),
    ("prompts n=0", "POST", "/v1/prompts/lease", {"json": {"dataset": "d", "size": 10, "n": 0}}, 422, "n"),
    ("prompts of a hostile dataset name", "POST", "/v1/prompts/lease", {"json": {"dataset": "d\n$(rm -rf /)", "size": 10, "n": 1}}, 422, "dataset"),
    ("prompts of a huge dataset", "POST", "/v1/prompts/lease", {"json": {"dataset": "e", "size": 10**12, "n": 1}}, 422, "size"),
    ("GET on a POST endpoint", "GET", "/v1/groups", {}, 405, "method"),
    # numbers are parsed strictly everywhere, as in groups: no "3" for 3, no 2.0 for an int, no true for 1
    ("lease of num_groups as a string", "POST", "/v1/batches/lease", {"json": {"num_groups": "3"}}, 422, "num_groups"),
    ("lease of num_groups as a float", "POST", "/v1/batches/lease", {"json": {"num_groups": 2.0}}, 422, "num_groups"),
    ("lease of num_groups as a bool", "POST", "/v1/batches/lease", {"json": {"num_groups": True}}, 422, "num_groups"),
    ("lease wait as a string", "POST", "/v1/batches/lease", {"json": {"num_groups": 1, "wait_s": "1"}}, 422, "wait_s"),
    ("prompts n as a string", "POST", "/v1/prompts/lease", {"json": {"dataset": "d", "size": 10, "n": "3"}}, 422, "n"),
    ("prompts size as a float", "POST", "/v1/prompts/lease", {"json": {"dataset": "d", "size": 10.0, "n": 1}}, 422, "size"),
    ("register a version as a float", "POST", "/v1/adapters", {"json": {"version": 2.0, "step": 0, "published_at": 1}}, 422, "version"),
    ("register final as a string", "POST", "/v1/adapters", {"json": {"version": 2, "step": 0, "published_at": 1, "final": "yes"}}, 422, "final"),
    # leases: renew like ack
    ("renew of an unknown batch", "POST", "/v1/batches/0123456789abcdef/renew", {}, 404, "no open lease"),
    ("renew of an acked batch", "POST", "/v1/batches/{acked}/renew", {}, 409, "already acked"),
    ("renew of an expired lease", "POST", "/v1/batches/{expired}/renew", {}, 410, "expired"),
    ("renew with a hostile batch id", "POST", "/v1/batches/a;b/renew", {}, 422, "batch_id"),
    ("release of an unknown batch", "POST", "/v1/batches/0123456789abcdef/release", {}, 404, "no open lease"),
    ("release of an acked batch", "POST", "/v1/batches/{acked}/release", {}, 409, "already acked"),
    ("release of an expired lease", "POST", "/v1/batches/{expired}/release", {}, 410, "expired"),
    ("release with a hostile batch id", "POST", "/v1/batches/a;b/release", {}, 422, "batch_id"),
    # a group cannot say who sent it
    ("a group naming its participant", "POST", "/v1/groups", {"json": group(participant="bob")}, 422, "participant"),
    # the open paths take no body at all, without reading it
    ("a body to /health", "POST", "/health", {"content": b"x" * 100, "headers": {}}, 413, "no request body"),
    ("a chunked body to the docs", "POST", "/docs", {"content": chunked(8), "headers": {}}, 413, "no request body"),
    ("a big body to a small route", "POST", "/v1/batches/lease", {"content": b"{" + b" " * 100_000 + b"}"}, 413, "body over"),
    # participants (admin token)
    ("a token with a bad name", "POST", "/v1/tokens", {"json": {"name": "Bob Smith"}}, 422, "name"),
    ("a token named admin", "POST", "/v1/tokens", {"json": {"name": "admin"}}, 422, "admin"),
    ("a token of an unknown role", "POST", "/v1/tokens", {"json": {"name": "x", "role": "root"}}, 422, "role"),
    ("a negative rate limit", "POST", "/v1/tokens", {"json": {"name": "x", "max_rps": -1}}, 422, "max_rps"),
    ("revoke of nobody", "DELETE", "/v1/tokens/nobody", {}, 404, "no participant"),
    ("limit of nobody", "PATCH", "/v1/tokens/nobody", {"json": {"max_rps": 1}}, 404, "no participant"),
    ("limit without a rate", "PATCH", "/v1/tokens/nobody", {"json": {}}, 422, "max_rps, workers or both"),
    ("a token of no workers", "POST", "/v1/tokens", {"json": {"name": "x", "workers": 0}}, 422, "workers"),
    ("a token of workers as a string", "POST", "/v1/tokens", {"json": {"name": "x", "workers": "4"}}, 422, "workers"),
    ("a limit of too many workers", "PATCH", "/v1/tokens/nobody", {"json": {"workers": 10**6}}, 422, "workers"),
    # adapter files
    ("files of an unregistered version", "GET", "/v1/adapters/7/files", {}, 404, "not registered"),
    ("a file that is not an adapter's", "GET", "/v1/adapters/1/files/secrets.txt", {}, 422, "name"),
    ("a file of version 0", "GET", "/v1/adapters/0/files/meta.json", {}, 422, "version"),
]


def comparable(stats: dict) -> dict:
    out = {k: v for k, v in stats.items() if k not in ("peak_rss_mb", "workers", "participants")}
    for table in ("workers", "participants"):  # last_seen_s_ago moves with the clock
        out[table] = {w: d["groups"] for w, d in stats[table].items()}
    out["fleet"] = {k: v for k, v in stats["fleet"].items() if k != "clock_s"}   # so does the proxy's age
    return out


def requests_seen(p) -> int:
    """Requests the proxy has finished, over all routes and answers (401s, 413s and 404s included):
    /metrics' latency histogram observes each one as it ends."""
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in p.http.get("/metrics").text.splitlines()
                   if line.startswith("proxy_request_seconds_count{")))


def advertised() -> int:
    """How many hostile requests the docs say this suite sends (docs/proxy.md and docs/DESIGN.md, which must agree)."""
    import re
    said = {int(m) for doc, pattern in [("proxy.md", r"\((\d+) malformed or hostile requests"),
                                        ("DESIGN.md", r"(\d+) hostile requests")]
            for m in re.findall(pattern, (ROOT / "docs" / doc).read_text())}
    assert len(said) == 1, f"docs/proxy.md and docs/DESIGN.md give {sorted(said)} hostile requests"
    return said.pop()


def test_the_advertised_cases_are_all_there():
    """The docs advertise a number of hostile requests: exactly that many cases here, each with its own name."""
    n = advertised()
    assert len(CASES) == n and len({c[0] for c in CASES}) == n, (len(CASES), n)


def test_bad_inputs_get_their_4xx_and_change_nothing(bucket, start_proxy):
    p = start_proxy("--group-size", "4", "--lease-s", "1", "--max-body-mb", "8")
    # setup: a version, an acked batch, an expired lease, a prompt cursor (the hostile requests need them)
    publish(bucket, p, 1)
    for _ in range(2):
        assert p.http.post("/v1/groups", json=group(version=1)).status_code == 200
    acked = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()["batch_id"]
    assert p.http.post(f"/v1/batches/{acked}/ack").status_code == 200
    expired = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()["batch_id"]
    wait_for(lambda: p.stats()["leases_expired"] == 1, 60, msg="the 1 s lease to run out")  # housekeeping: every 1 s
    assert p.http.post("/v1/prompts/lease", json={"dataset": "d", "size": 10, "n": 3}).status_code == 200
    before = comparable(p.stats())
    seen = requests_seen(p)

    wrong, checked = [], []
    for what, method, path, kw, status, needle in CASES:
        kw = {"headers": {"X-Proxy-Token": p.token}, **kw}  # cases with their own headers replace the token
        kw["headers"] = {k: v.format(token=p.token) for k, v in kw["headers"].items()}
        r = httpx.request(method, p.url + path.format(acked=acked, expired=expired), **kw, timeout=30)
        if r.status_code != status or needle.lower() not in r.text.lower():
            wrong.append(f"{what}: {r.status_code} {r.text[:200]}")
        checked.append(what)
    assert not wrong, "\n".join(wrong)
    assert checked == [c[0] for c in CASES] and len(checked) == advertised()
    # and the proxy saw every one of them (plus the /metrics call above, which it observes once it has answered)
    assert requests_seen(p) - seen == len(CASES) + 1
    assert comparable(p.stats()) == before
    # and the proxy still works
    assert p.http.post("/v1/groups", json=group(version=1)).json()["status"] == "accepted"


# ---------------------------------------------------------------------------------------------
# schemathesis: property-based requests from /openapi.json against the live proxy, no 5xx


def test_openapi_fuzz_no_5xx(bucket, start_proxy, seed):
    """Every operation of /openapi.json, 25 generated requests each (schemathesis' strategies driven by
    hypothesis here, not its pytest plugin; hypothesis draws from `seed`: TEST_SEED replays the examples).
    Routed chat requests answer 503 (no worker serving) or 504 (nobody answered within --route.timeout-s) by
    design: those two, with their messages, are not errors."""
    p = start_proxy("--group-size", "4", "--lease-s", "2", "--route.timeout-s", "1")
    publish(bucket, p, 1)
    schema = schemathesis.openapi.from_url(f"{p.url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/groups", "/v1/batches/lease", "/v1/batches/{batch_id}/ack", "/v1/adapters",
                                       "/v1/adapters/latest", "/v1/prompts/lease", "/v1/stats", "/metrics",
                                       "/v1/batches/{batch_id}/renew", "/v1/whoami", "/v1/tokens", "/v1/tokens/{name}",
                                       "/v1/adapters/{version}/files", "/v1/adapters/{version}/files/{name}"}
    calls = []
    for op in ops:
        @hypothesis.seed(seed)
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            # long-poll waits are valid up to 300 s; cap them so that fuzzing takes a minute, not hours
            for part in (case.query, case.body):
                if isinstance(part, dict) and isinstance(part.get("wait_s"), (int, float)) and part["wait_s"] > 0.2:
                    part["wait_s"] = 0.2
            r = case.call(headers={"X-Proxy-Token": p.token}, timeout=30)
            calls.append(r.status_code)
            designed = case.path == "/v1/chat/completions" and (
                (r.status_code == 503 and "no worker is serving" in r.text)
                or (r.status_code == 504 and "no worker answered within" in r.text))
            assert r.status_code < 500 or designed, f"{case.method} {case.path}: {r.status_code} {r.text[:300]}"
        run()
    assert len(calls) >= 5 * len(ops) and any(c == 200 for c in calls)
    assert p.http.get("/health").status_code == 200


def test_settings_that_cannot_work_are_refused_at_the_start_each_named():
    """A negative staleness, a margin of NaN, a grace of 0, a port past 65535: the proxy does not start, and says
    which options and why, all at once (each was taken before, and a proxy started that could not work)."""
    bad = subprocess.run([sys.executable, str(ROOT / "proxy.py"), "--max-staleness", "-1", "--pace-jitter", "nan",
                          "--poll-grace-s", "0", "--port", "70000", "--temperatures", "1.0", "1e-39", "--no-use-bucket"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0
    for problem in ("--max-staleness -1: must be at least 0", "--pace-jitter nan: must be at least 0",
                    "--poll-grace-s 0.0: must be above 0", "--port 70000: must be at most 65535",
                    "--temperatures 1e-39: 1e-39 is not a number in [0.05, 10.0]"):
        assert problem in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
