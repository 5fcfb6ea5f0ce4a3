"""SGLang's native /generate and the header rid override, as sglang.bench_serving and RL
frameworks use them."""

import json

import httpx

from gateway.sim.faults import Faults
from gateway.sim.server import SimOptions, start_sim_pair
from tests.sim.conftest import wait_until

GENERATE = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}


def chunks_of(raw: str) -> list:
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(block[6:]) for block in raw.split("\n\n")[:-2]]


async def test_generate_stream_and_non_stream(pair):
    url = pair.urls["mtp"] + "/generate"
    async with httpx.AsyncClient() as http:
        whole = (await http.post(url, json={**GENERATE, "rid": "g1"})).json()
        raw = (await http.post(url, json={**GENERATE, "rid": "g2", "stream": True})).text
    assert set(whole) == {"text", "output_ids", "meta_info"}
    assert whole["meta_info"]["id"] == "g1" and whole["meta_info"]["completion_tokens"] == 40
    assert whole["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert len(whole["output_ids"]) == 40 and len(whole["text"].split()) == 40
    chunks = chunks_of(raw)
    # cumulative text and ids (bench_serving reads data["text"] as the text so far)
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    texts = [chunk["text"] for chunk in chunks]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    # MTP: per-request acceptance, which bench_serving reports as the accept length
    assert 1.0 <= chunks[-1]["meta_info"]["spec_accept_length"] <= 4.0


async def test_generate_in_200_abort_and_errors(pair):
    url = pair.urls["plain"] + "/generate"
    await pair.servers["plain"].set_faults(Faults(abort_status=503))
    async with httpx.AsyncClient() as http:
        streamed = await http.post(url, json={**GENERATE, "stream": True, "rid": "g3"})
        whole = await http.post(url, json=GENERATE)
        await pair.servers["plain"].clear_faults()
        empty = await http.post(url, json={"sampling_params": {}})
    assert streamed.status_code == 200
    meta = chunks_of(streamed.text)[0]["meta_info"]
    abort = {"type": "abort", "status_code": 503, "message": "Simulated abort (sim fault)."}
    assert meta["finish_reason"] == abort
    assert (whole.status_code, whole.json()["type"]) == (503, "503")
    assert empty.status_code == 400
    missing = "Either text, input_ids or input_embeds should be provided."
    assert empty.json() == {"error": {"message": missing}}


async def test_header_rid_override_only_when_enabled():
    body = {"model": "m", "max_tokens": 100_000, "messages": [{"role": "user", "content": "go"}],
            "stream": True, "ignore_eos": True}  # fmt: skip
    headers = {"x-override-rid": "claude-1"}
    for enabled in (False, True):
        async with start_sim_pair(SimOptions(speed=50, request_header_overrides=enabled)) as pair:
            engine = pair.servers["plain"].live.engine
            async with httpx.AsyncClient() as http:
                url = pair.urls["plain"]
                async with http.stream("POST", url + "/v1/messages", json=body, headers=headers) as response:
                    lines = response.aiter_lines()
                    await anext(lines)
                    assert ("claude-1" in engine) is enabled
                    await http.post(url + "/abort_request", json={"rid": "claude-1"})
                    if enabled:
                        await wait_until(lambda e=engine: e.num_running == 0)
                    else:
                        assert engine.num_running == 1


async def test_tokenize_counts_what_usage_counts_and_detokenize_inverts(pair):
    url = pair.urls["plain"]
    messages = [{"role": "user", "content": "count these words"}]
    async with httpx.AsyncClient() as http:
        tokens = (await http.post(url + "/v1/tokenize", json={"model": "m", "prompt": "a b c a"})).json()
        ids = {"model": "m", "tokens": tokens["tokens"]}
        text = (await http.post(url + "/v1/detokenize", json=ids)).json()
        chat = (await http.post(url + "/v1/tokenize", json={"model": "m", "messages": messages})).json()
        answer = (await http.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages,
                                                                      "max_tokens": 5})).json()  # fmt: skip
        embeddings = await http.post(url + "/v1/embeddings", json={"model": "m", "input": "x"})
    assert tokens["count"] == 4 and tokens["tokens"][0] == tokens["tokens"][3]
    assert tokens["max_model_len"] > 0 and text == {"text": "a b c a"}
    assert chat["count"] == answer["usage"]["prompt_tokens"]
    assert embeddings.status_code == 400
    assert "not appear to be an embedding model" in embeddings.json()["message"]
