"""The server backend's pure pieces, without a server (the real vLLM server is in the vLLM lane,
tests/test_vllm_server.py; SGLang in bench/sglang_check.sh): the start commands carry what the
backend relies on, and a server's answer is checked before it can become a trajectory group."""
import math

import pytest

import hf_engine
import server_engine
from runlib import hf_adapter


def test_server_commands_ask_for_runtime_lora_and_processed_logprobs():
    cmd, env = server_engine.server_command("vllm", "Qwen/Qwen2.5-0.5B-Instruct", 8123, lora_rank=24, python="py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--model"] == "Qwen/Qwen2.5-0.5B-Instruct" and flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["--max-lora-rank"] == "32"          # the smallest size vLLM accepts that holds rank 24
    assert flags["--logprobs-mode"] == "processed_logprobs" and "--enable-lora" in cmd
    assert flags["--dtype"] == "float32"             # on CPU: logprobs must match the trainer's float32
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--api-key" not in cmd                    # the key goes through the environment (ManagedServer)
    cmd, env = server_engine.server_command("sglang", "Qwen/Qwen2.5-0.5B-Instruct", 8123, lora_rank=24, python="py")
    flags = dict(zip(cmd, cmd[1:]))
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"] and flags["--model-path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert flags["--max-lora-rank"] == "24" and flags["--lora-target-modules"] == "all" and "--enable-lora" in cmd
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env
    with pytest.raises(ValueError, match="unknown server kind 'tgi'"):
        server_engine.server_command("tgi", "m", 1)


def test_a_server_answer_is_checked_before_it_becomes_a_group():
    good = [([5, 6, 2], [-0.5, -1e-7, -2.0], "stop"), ([7], [0.0], "length")]
    assert server_engine.checked(good, 2) == good
    bad = [
        (good[:1], "1 completions, expected 2"),
        ([([5, 6], [-0.5], "stop"), good[1]], "2 token ids, 1 logprobs"),
        ([([5], [-0.5], "abort"), good[1]], "finish_reason 'abort'"),
        ([([], [], "stop"), good[1]], "0 token ids"),
        ([([5], [math.nan], "stop"), good[1]], "missing, not finite or > 0"),
        ([([5], [None], "stop"), good[1]], "missing, not finite or > 0"),
        ([([5], [0.3], "stop"), good[1]], "missing, not finite or > 0"),
    ]
    for samples, says in bad:
        with pytest.raises(RuntimeError, match=r"the inference server returned .*" + says):
            server_engine.checked(samples, 2)


# ---- the server backend against a recording stand-in of an OpenAI-compatible server (the platform boundary) ----

import json  # noqa: E402
import threading  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

LOGITS = [3.0 - 0.37 * i for i in range(24)]  # the next-token logits of the stand-in's model: token i has logit LOGITS[i]


def log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    z = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - z for x in xs]


class FakeServer:
    """Answers like vLLM's OpenAI server: GET /v1/models, POST /v1/completions (one next token; `logprobs: k`
    gives the top k plus the sampled token when it is not among them, as vLLM does: up to k+1 entries) and
    POST /v1/chat/completions. `processed`: logprobs of logits / T (what --logprobs-mode processed_logprobs
    reports), else of the raw logits (pre-temperature). At T=1 it samples token 9 (outside any top 5), at any
    other temperature token 0. Every request body is kept in `bodies`."""

    def __init__(self, model: str, processed: bool = True):
        self.model, self.processed, self.bodies = model, processed, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"data": [{"id": fake.model, "root": fake.model, "parent": None}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append((self.path, body))
                self._send({"/v1/completions": fake.completion, "/generate": fake.generate}.get(self.path, fake.chat)(body))

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def completion(self, body: dict) -> dict:
        t = body["temperature"]
        lps = log_softmax([x / t for x in LOGITS] if self.processed else LOGITS)
        sampled = 9 if abs(t - 1.0) < 1e-9 else 0
        name = (lambda i: f"token_id:{i}") if body.get("return_tokens_as_token_ids") else (lambda i: f"w{i}")
        top = {i: lps[i] for i in sorted(range(len(LOGITS)), key=lambda i: -lps[i])[:body.get("logprobs") or 0]}
        top[sampled] = lps[sampled]
        return {"choices": [{"index": i, "text": "x", "finish_reason": "length", "token_ids": [sampled],
                             "logprobs": {"tokens": [name(sampled)], "token_logprobs": [lps[sampled]],
                                          "top_logprobs": [{name(i): lp for i, lp in top.items()}]}}
                            for i in range(len(body["prompt"]) * body.get("n", 1))]}

    def generate(self, body: dict) -> list:  # SGLang's native route
        return [{"meta_info": {"output_token_logprobs": [[-0.5, 0, None]], "finish_reason": {"type": "length"}}}
                for _ in body["input_ids"]]

    def chat(self, body: dict) -> dict:
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1}}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def fake_server(tiny_model):
    servers = []

    def start(**kw) -> FakeServer:
        servers.append(FakeServer(tiny_model, **kw))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def test_the_processed_logprobs_check_compares_token_by_token(tiny_model, fake_server):
    """vLLM answers `logprobs: 5` with six entries when the sampled token is not in the top 5. The check must
    pair the two temperatures' logprobs by token id: a server that reports pre-temperature logprobs is refused
    even when one answer carries that extra entry (pairing sorted values shifted every pair by one, so
    such a server passed), and one that reports processed logprobs passes."""
    raw = fake_server(processed=False)
    engine = server_engine.ServerSampler(raw.url, "vllm", model=tiny_model)
    with pytest.raises(RuntimeError, match="same logprobs at temperature 1 and 0.7"):
        engine.check_processed_logprobs([1, 2, 3], 0.7)
    assert [b["logprobs"] for p, b in raw.bodies] == [5, 5]
    processed = fake_server(processed=True)
    server_engine.ServerSampler(processed.url, "vllm", model=tiny_model).check_processed_logprobs([1, 2, 3], 0.7)


NEUTRAL = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_server_backend_asks_for_neutral_sampling_in_chat_and_rollouts(kind, tiny_model, fake_server):
    """A parameter left out of a request is taken from the model's generation_config.json by vLLM (its default
    --generation-config auto) and by SGLang: a routed chat request would decode with the model's top-k, min-p or
    repetition penalty on the server backend but not on the hf one. Every request says the neutral value
    (top_k -1: SGLang's "off", which vLLM takes as its 0), and the client's own top_p."""
    srv = fake_server()
    engine = server_engine.ServerSampler(srv.url, kind, model=tiny_model)
    engine.chat([{"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 4, "temperature": 0.8,
                  "top_p": 0.9, "seed": 1, "stop": []}])
    engine.sample([[1, 2, 3], [4, 5]], 2, 3, 0.7)
    (_, chat), = [(p, b) for p, b in srv.bodies if p == "/v1/chat/completions"]
    assert {k: chat.get(k) for k in NEUTRAL} == NEUTRAL, chat
    assert chat["top_p"] == 0.9 and chat["temperature"] == 0.8
    (_, rollout), = [(p, b) for p, b in srv.bodies if p in ("/v1/completions", "/generate")]
    params = rollout["sampling_params"] if kind == "sglang" else rollout
    assert {k: params.get(k) for k in NEUTRAL} == NEUTRAL and params["top_p"] == 1.0, params


def test_the_hf_backend_ignores_the_models_sampling_defaults_too(tiny_model):
    """The same routed request decodes the same whatever the model's generation_config says about top-k,
    min-p or repetition penalty (generate() applies them unless told otherwise), greedy and sampled."""
    import models
    model, tok = models.load_base(tiny_model)
    req = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 12, "temperature": 0.0,
           "top_p": 1.0, "seed": 5, "stop": []}
    plain = [hf_engine.hf_chat(model, tok, {**req, "temperature": t}) for t in (0.0, 1.0)]
    model.generation_config.update(repetition_penalty=3.0, top_k=2, min_p=0.5)
    assert [hf_engine.hf_chat(model, tok, {**req, "temperature": t}) for t in (0.0, 1.0)] == plain


# ---- the hf backend's hot-swap: an adapter of another shape is refused, the loaded one stays ----------------


def test_hf_swap_in_refuses_an_adapter_of_another_shape_and_keeps_serving_the_old_one(tiny_model, tmp_path):
    import torch

    import models
    from common import AdapterError
    base, _ = models.load_base(tiny_model)
    ids = torch.tensor([[1, 2, 3, 4, 5]])

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids).logits
    plain = logits(base)
    served = hf_engine.swap_in(base, hf_adapter(tiny_model, tmp_path / "v1", 1, r=4))
    v1 = logits(served)
    assert not torch.allclose(v1, plain)
    for v, r, alpha, says in ((2, 8, None, r"rank 8"), (3, 4, 32, r"lora_alpha 32")):
        with pytest.raises(AdapterError, match=rf"version {v}\b.*{says}") as e:
            hf_engine.swap_in(served, hf_adapter(tiny_model, tmp_path / f"v{v}", v, r=r, alpha=alpha))
        assert "rank 4" in str(e.value)             # what is loaded now, named too
        assert torch.equal(logits(served), v1)     # not one tensor of it copied in
    # the same shape still swaps in place, to exactly what the version loaded afresh computes
    v4 = hf_adapter(tiny_model, tmp_path / "v4", 4, r=4)
    served = hf_engine.swap_in(served, v4)
    assert not torch.allclose(logits(served), v1)
    assert torch.equal(logits(served), logits(hf_engine.swap_in(models.load_base(tiny_model)[0], v4)))


# ---- a mid-round swap (hf): the next token on is the new version's, exactly --------------------------------


def test_a_mid_round_swap_records_each_tokens_version_and_keeps_the_ratio_exact(tiny_model, tmp_path):
    """hf_engine.sample with a swap between decode steps, as rollout.py does it: tokens before the swap carry
    version 1's logprobs, tokens from it on version 2's, each exactly (within the engine's numerical floor)
    what completion_logprobs (the trainer's and the audit's forward) computes under that version given the
    same context, so the importance ratio under version 2 is 1 on its tokens. Without recomputing the KV cache
    (the new weights on the old version's cache) the tokens after the swap would not be version 2's."""
    import torch

    import models
    import rollout
    from common import TrajectoryGroup
    base, tok = models.load_base(tiny_model)
    v1, v2 = (hf_adapter(tiny_model, tmp_path / f"v{v}", v, r=4) for v in (1, 2))
    prompts = [tok.encode("Once upon a time"), tok.encode("What is 12 + 30? Answer:")]
    G, n, at = 2, 12, 5

    def run(rebuild: bool):
        model = hf_engine.swap_in(models.load_base(tiny_model)[0], v1)
        swaps = []

        def swap(i: int) -> bool:
            if i != at:
                return False
            hf_engine.swap_in(model, v2)          # in place, as between two decode steps of a real round
            swaps.append((i, 2))
            return rebuild                      # False: pretend the cache need not be recomputed
        torch.manual_seed(0)
        out = hf_engine.sample(model, prompts, G, n, 1.0, set(), tok.pad_token_id, swap=swap)
        return model, out, swaps

    def logprobs(version: dict, out) -> torch.Tensor:
        m = hf_engine.swap_in(models.load_base(tiny_model)[0], version)
        with torch.no_grad():
            return models.completion_logprobs(m, prompts, [ids for ids, _, _ in out], 1.0, pad=tok.pad_token_id)[0]

    _, out, swaps = run(rebuild=True)
    assert swaps == [(at, 2)] and all(len(ids) == n for ids, _, _ in out)
    behaviour = torch.tensor([lps for _, lps, _ in out])
    under1, under2 = logprobs(v1, out), logprobs(v2, out)
    floor = 1e-4  # float32 on CPU: incremental decode vs one full forward (measured ~1e-6)
    assert (behaviour[:, :at] - under1[:, :at]).abs().max() < floor         # version 1 sampled these
    assert (behaviour[:, at:] - under2[:, at:]).abs().max() < floor         # version 2 sampled these: ratio 1
    assert (torch.exp(under2[:, at:] - behaviour[:, at:]) - 1).abs().max() < 1e-3
    assert (behaviour[:, at:] - under1[:, at:]).abs().max() > 100 * floor   # the two versions do differ
    # each completion says so, and the group it makes passes the schema (policy_version: the oldest token's)
    comps, _, _ = rollout.single_turn(rollout.load_task("addition"), tok, 0, out[:G], 1, swaps)
    assert all(c["versions"] == [[0, 1], [at, 2]] for c in comps)
    TrajectoryGroup(group_id="g" * 8, worker_id="w", policy_version=1, prompt_ids=prompts[0], completions=comps)
    assert rollout.version_runs(1, swaps, at) is None                       # one that ended before the swap
    # completions that ended before the swap leave the batch at the swap; those still running go on exact.
    # Make the token row 0 sampled at index 2 an end-of-sequence token: the same seed samples the same tokens
    # up to the swap, so row 0 now ends at its index 2 (or before) and the others run on
    eos = {out[0][0][2]}
    model = hf_engine.swap_in(models.load_base(tiny_model)[0], v1)
    calls = []
    torch.manual_seed(0)
    ended = hf_engine.sample(model, prompts, G, n, 1.0, eos, tok.pad_token_id,
                           swap=lambda i: i == at and (calls.append(hf_engine.swap_in(model, v2)) or True))
    assert calls and ended[0][2] == "stop" and len(ended[0][0]) <= 3 and ended[0][0] == out[0][0][:len(ended[0][0])]
    running = [k for k, (ids, _, _) in enumerate(ended) if len(ids) > at]
    assert running, "some completion ran past the swap"
    lp1 = logprobs(v1, ended)
    lp2 = logprobs(v2, ended)
    for k in running:
        ids, lps, _ = ended[k]
        assert (torch.tensor(lps[:at]) - lp1[k, :at]).abs().max() < floor
        assert (torch.tensor(lps[at:]) - lp2[k, at:len(ids)]).abs().max() < floor
    # the new weights on the old cache: tokens after the swap are not version 2's
    _, stale, _ = run(rebuild=False)
    drift = (torch.tensor([lps for _, lps, _ in stale])[:, at + 1:] - logprobs(v2, stale)[:, at + 1:]).abs().max()
    assert drift > 10 * floor, drift


def test_a_version_that_arrives_during_the_prefill_samples_every_token(tiny_model, tmp_path):
    """hf_engine.sample asks swap(0) between chunks of the prefill (PREFILL_CHUNK prompt tokens each): a version
    swapped in after the first chunk starts the prefill again under it, so every token is that version's
    (its logprobs what completion_logprobs computes under it, not under the version loaded at the start), and
    the chunked prefill samples exactly what one forward of the prompt does when nothing arrives."""
    import torch

    import models
    tok = models.load_base(tiny_model)[1]
    v1, v2 = (hf_adapter(tiny_model, tmp_path / f"v{v}", v, r=4) for v in (1, 2))
    prompts = [tok.encode("Once upon a time there was a tiny model that learned to add numbers " * 3),
               tok.encode("What is 12 + 30? Answer:")]
    assert len(prompts[0]) > 2 * hf_engine.PREFILL_CHUNK  # three chunks or more: swap(0) asked between them
    G, n = 2, 6

    def run(swap_at_chunk: int | None):
        model = hf_engine.swap_in(models.load_base(tiny_model)[0], v1)
        asked = []

        def swap(i: int) -> bool:
            asked.append(i)
            if i == 0 and asked.count(0) == swap_at_chunk:
                hf_engine.swap_in(model, v2)
                return True
            return False
        torch.manual_seed(0)
        return hf_engine.sample(model, prompts, G, n, 1.0, set(), tok.pad_token_id, swap=swap), asked

    def logprobs(version: dict, out) -> torch.Tensor:
        m = hf_engine.swap_in(models.load_base(tiny_model)[0], version)
        with torch.no_grad():
            return models.completion_logprobs(m, prompts, [ids for ids, _, _ in out], 1.0, pad=tok.pad_token_id)[0]

    out, asked = run(swap_at_chunk=1)
    chunks = -(-len(prompts[0]) // hf_engine.PREFILL_CHUNK)
    assert asked[:1 + chunks] == [0] * (1 + chunks) and asked[1 + chunks] == 1, asked  # 1 chunk, then all again
    behaviour = torch.tensor([lps for _, lps, _ in out])
    floor = 1e-4  # float32 on CPU, as in the mid-round test above
    assert (behaviour - logprobs(v2, out)).abs().max() < floor
    assert (behaviour - logprobs(v1, out)).abs().max() > 100 * floor
    # nothing arrives: the chunked prefill samples what the one-forward prefill (no swap callback) samples
    quiet, _ = run(swap_at_chunk=None)
    model = hf_engine.swap_in(models.load_base(tiny_model)[0], v1)
    torch.manual_seed(0)
    whole = hf_engine.sample(model, prompts, G, n, 1.0, set(), tok.pad_token_id)
    assert [ids for ids, _, _ in quiet] == [ids for ids, _, _ in whole]
    assert (torch.tensor([lps for _, lps, _ in quiet]) - torch.tensor([lps for _, lps, _ in whole])).abs().max() < floor

