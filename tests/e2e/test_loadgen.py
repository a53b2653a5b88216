"""`kvgrid bench serve` (router/sim/loadgen.py): its pure parts, then the load generator against a real
`kvgrid serve`."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from harness import ACME_KEY, free_port
from router import cli
from router.sim import loadgen, replay
from router.sim.loadgen import (
    Prompt,
    Result,
    TokenSource,
    percentile,
    poisson_offsets,
    random_prompts,
    summarise,
    words,
)
from router.sim.trace import TraceEntry, read_mooncake

TRACE = Path(__file__).parents[1] / "data" / "mooncake_conversation_1500.jsonl"


# -- traces ------------------------------------------------------------------------------------------------------


def test_read_mooncake_reads_records_in_seconds_and_stops_at_the_limit():
    entries = read_mooncake(TRACE, limit=5)
    first = json.loads(TRACE.read_text().splitlines()[0])
    assert len(entries) == 5
    assert entries[0] == TraceEntry(
        first["timestamp"] / 1e3, first["input_length"], first["output_length"], tuple(first["hash_ids"])
    )
    assert len(read_mooncake(TRACE)) == 1500


@pytest.mark.parametrize(
    "line, words_in_error",
    [
        ('{"timestamp": 0, "input_length": 10}', ":2: not a trace record"),
        ("not json", ":2: not a trace record"),
        ('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1]}', ":2: input_length 1100"),
        ('{"timestamp": 0, "input_length": 100, "output_length": 0, "hash_ids": [0]}', ":2: output_length"),
    ],
)
def test_read_mooncake_names_the_bad_line(tmp_path, line, words_in_error):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=words_in_error):
        read_mooncake(path)
    with pytest.raises(ValueError, match=words_in_error):  # kvgrid replay reads traces the same way
        replay.load_trace(path)


def test_trace_prompts_equal_hash_ids_give_equal_blocks():
    src = TokenSource(vocab_size=4096, seed=3)
    a = TraceEntry(0.0, 1500, 10, (0, 1, 2))
    b = TraceEntry(0.0, 1100, 10, (0, 1, 7))
    pa, pb = src.trace_prompt(a, 16), src.trace_prompt(b, 16)
    # Lengths scale from 512 tokens per hash id to 16; the last block is cut to the length.
    assert len(pa) == math.ceil(1500 * 16 / 512) and len(pb) == math.ceil(1100 * 16 / 512)
    assert pa[:32] == pb[:32]  # hash ids 0 and 1
    assert pa[32:35] != pb[32:35]  # 2 vs 7
    assert pa[32:] == src.block(2, 16)[: len(pa) - 32]
    assert all(0 <= t < 4096 for t in pa + pb)
    # The same ids give the same tokens in a fresh source (another run); another seed gives others.
    assert TokenSource(4096, 3).trace_prompt(a, 16) == pa
    assert TokenSource(4096, 4).trace_prompt(a, 16) != pa
    # In a trace that reuses ids, the blocks are the same wherever they appear.
    pc = src.trace_prompt(TraceEntry(0.0, 600, 10, (2, 0)), 16)
    assert pc[:16] == src.block(2, 16) and pc[:15] == pa[32:47] and pc[16:] == pa[: len(pc) - 16]


def test_trace_jobs_keep_the_trace_pace_scaled_from_its_first_request(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": ms, "input_length": 600, "output_length": out, "hash_ids": [0, i + 1]}) + "\n"
            for i, (ms, out) in enumerate([(4000, 7), (7000, 9), (10000, 11)])
        )
    )

    def jobs(*flags: str):
        args = cli.build_parser().parse_args(["bench", "serve", "--workload", "trace", "--trace", str(path), *flags])
        trace = read_mooncake(args.trace, args.max_requests)
        return loadgen._jobs(args, TokenSource(4096, 0), 128, trace)[1]

    own_pace = jobs()
    assert [j.at for j in own_pace] == [0.0, 3.0, 6.0]  # seconds after the cut's first request
    assert [j.prompt.output_len for j in own_pace] == [7, 9, 11]  # the trace's own lengths
    assert all(len(j.prompt.ids) == 600 for j in own_pace)
    faster = jobs("--time-scale", "0.1", "--max-requests", "2", "--output-len", "3", "--trace-block-size", "64")
    assert [j.at for j in faster] == pytest.approx([0.0, 0.3])
    assert [j.prompt.output_len for j in faster] == [3, 3]
    assert [len(j.prompt.ids) for j in faster] == [math.ceil(600 * 64 / 512)] * 2


# -- prompts -----------------------------------------------------------------------------------------------------


def test_random_prompts_share_exactly_the_prefix():
    src = TokenSource(vocab_size=50, seed=0)
    prompts = random_prompts(src, 4, 256, 0.75, 8, "tokens")
    assert all(len(p.ids) == 256 and p.output_len == 8 for p in prompts)
    assert len({tuple(p.ids[:192]) for p in prompts}) == 1
    assert len({tuple(p.ids[192:]) for p in prompts}) == 4
    assert all(0 <= t < 50 for p in prompts for t in p.ids)
    assert len({tuple(p.ids[:8]) for p in random_prompts(src, 4, 256, 0.0, 8, "tokens")}) == 4


def test_prompt_bodies_per_format():
    ids = [1, 2, 3]
    tokens = Prompt(ids, 5, "tokens").body("m")
    assert tokens["prompt"] == ids and tokens["max_tokens"] == 5 and tokens["stream"] is True
    assert tokens["stream_options"] == {"include_usage": True}
    assert Prompt(ids, 5, "text").body("m")["prompt"] == words(ids)
    assert Prompt(ids, 5, "chat").body("m")["messages"] == [{"role": "user", "content": words(ids)}]
    # Shared ids are shared text: a prompt's text starts with its prefix's text.
    assert words([7, 8, 9, 10]).startswith(words([7, 8])) and words([7]) != words([8])


def test_follow_up_turns_extend_the_previous_prompt():
    first = Prompt([1, 2, 3], 4, "tokens")
    second = first.follow_up("ignored", 2, user_ids=[9, 9], answer_ids=[5, 6, 7, 8])
    assert second.ids == [1, 2, 3, 5, 6, 9, 9]  # prompt + as many stand-in ids as the answer had tokens + user
    chat = Prompt([1, 2, 3], 4, "chat")
    nxt = chat.follow_up("the answer", 2, user_ids=[9], answer_ids=[5, 6])
    assert nxt.body("m")["messages"] == [
        {"role": "user", "content": words([1, 2, 3])},
        {"role": "assistant", "content": "the answer"},  # the exact answer text
        {"role": "user", "content": words([9])},
    ]
    third = nxt.follow_up("two", 1, user_ids=[4], answer_ids=[0])
    assert [m["role"] for m in third.body("m")["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert third.body("m")["messages"][-1]["content"] == words([4])


def test_poisson_offsets():
    assert poisson_offsets(3, 0.0, 0) == [0.0, 0.0, 0.0]
    at = poisson_offsets(4000, 10.0, 0)
    assert at[0] == 0.0 and all(b > a for a, b in zip(at, at[1:]))
    assert at[-1] / (len(at) - 1) == pytest.approx(0.1, rel=0.1)
    assert poisson_offsets(10, 10.0, 0) == at[:10]


# -- statistics --------------------------------------------------------------------------------------------------


def test_percentile_interpolates_between_order_statistics():
    values = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    assert percentile([5.0], 90) == 5.0
    assert percentile([], 50) is None


def test_summarise_counts_only_completed_requests():
    ok = [
        Result(start=0.0, chunk_times=[0.1, 0.2, 0.4], end=0.5, prompt_tokens=100, cached_tokens=75, output_tokens=3)
        for _ in range(3)
    ]
    failed = Result(start=0.0, error="HTTP 503: busy")
    s = summarise(ok + [failed], duration_s=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["cached_share"] == 0.75 and s["output_tokens"] == 9
    assert s["output_tokens_per_s"] == 4.5 and s["requests_per_s"] == 1.5
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["p50"] == pytest.approx(150.0)  # gaps of 100 and 200 ms
    assert s["e2e_ms"]["p99"] == pytest.approx(500.0)
    assert s["errors"] == ["HTTP 503: busy"]


# -- the command line --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--prefix-ratio", "1.5"], "--prefix-ratio"),
        (["--input-len", "0"], "--input-len"),
        (["--concurrency", "0"], "--concurrency"),
        (["--request-rate", "-1"], "--request-rate"),
        (["--time-scale", "nan"], "--time-scale"),
        (["--vocab-size", "1"], "--vocab-size"),
        (["--workload", "trace"], "--trace"),
        (["--workload", "trace", "--trace", "/does/not/exist"], "--trace"),
        (["--base-url", "127.0.0.1:8000/v1"], "--base-url"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag_before_any_request(capsys, flags, named):
    # The port has no server: a check that came after the first request would fail on the connection instead.
    assert cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}/v1", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "cannot reach" not in err


def test_an_unreachable_server_exits_2_naming_base_url(capsys):
    assert cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}/v1"]) == 2
    assert "--base-url" in capsys.readouterr().err


# -- send: one streamed request over HTTP ------------------------------------------------------------------------


def _send_to(handler) -> Result:
    """``loadgen.send`` against a real HTTP server on 127.0.0.1 whose one route is ``handler``."""
    from aiohttp import ClientSession, web

    async def go() -> Result:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with ClientSession() as session:
                return await loadgen.send(session, f"http://127.0.0.1:{port}/v1/completions", {"prompt": [1]})
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def _sse(*events: dict | str) -> list[bytes]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


def _streaming(pieces: list[bytes]):
    """A handler that answers with ``pieces``, each one write."""
    from aiohttp import web

    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
        await resp.write_eof()
        return resp

    return handler


def test_send_reads_text_chunks_and_usage_however_the_stream_is_cut():
    long = "x" * 3_000_000  # one event longer than aiohttp's own line reader takes (it raises LineTooLong)
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
    body = b"".join(
        _sse({"choices": [{"text": "a"}]}, {"choices": [{"text": long}]}, {"choices": [{"text": "b"}]})
        + _sse({"choices": [], "usage": usage}, "[DONE]")
    )
    # the body cut at odd places: inside "data:", inside the long event, between the two newlines of an event
    cuts = [3, 40, 70_000, 150_000, len(body) - 9, len(body) - 1]
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    res = _send_to(_streaming(pieces))
    assert res.error is None and res.text == "a" + long + "b"
    assert len(res.chunk_times) == 3 and res.start < res.chunk_times[0] <= res.chunk_times[-1] <= res.end
    assert (res.prompt_tokens, res.output_tokens, res.cached_tokens) == (5, 3, 2)
    # a server that puts no usage in its streams: the output tokens are counted as the text chunks
    res = _send_to(_streaming(_sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, "[DONE]")))
    assert res.error is None and res.text == "ab" and res.output_tokens == 2 and res.prompt_tokens == 0


def test_send_records_an_http_error_and_a_stream_error():
    from aiohttp import web

    async def refuse(request):
        return web.json_response({"error": {"message": "slow down"}}, status=429)

    res = _send_to(refuse)
    assert res.error is not None and res.error.startswith("HTTP 429") and "slow down" in res.error

    failing = _sse({"choices": [{"text": "a"}]}, {"error": {"message": "group failed"}})
    res = _send_to(_streaming(failing))
    assert res.error is not None and res.error.startswith("stream error") and "group failed" in res.error

    res = _send_to(_streaming([b"data: {not json\n\n"]))
    assert res.error is not None and res.error.startswith("JSONDecodeError")


# -- against a real kvgrid serve ---------------------------------------------------------------------------------


@pytest.fixture()
def server(shared_server):
    return shared_server  # the server test_serve and test_isolation share too (harness.SHARED_BODY)


def bench(server, capsys, *flags: str) -> dict:
    code = cli.main(["bench", "serve", "--base-url", f"{server.base}/acme/v1", "--api-key", ACME_KEY, "--json", *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_random_workload_reports_cache_hits_for_a_shared_prefix(server, capsys):
    flags = ["--input-len", "256", "--output-len", "8", "--num-requests", "6", "--concurrency", "2"]
    shared = bench(server, capsys, *flags, "--prefix-ratio", "0.75", "--warmup", "1")
    assert shared["model"] == "demo" and shared["vocab_size"] == 4096  # from GET /v1/models and the model
    assert (shared["requests"], shared["completed"], shared["failed"]) == (6, 6, 0)
    assert shared["prompt_tokens"] == 6 * 256
    # The warm-up computed the 192 shared tokens: every measured request can reuse them, never its own suffix.
    assert 0 < shared["cached_share"] <= 0.75
    assert 0 < shared["output_tokens"] <= 6 * 8 and shared["output_tokens_per_s"] > 0
    assert 0 < shared["ttft_ms"]["p50"] <= shared["e2e_ms"]["p99"]
    cold = bench(server, capsys, *flags, "--seed", "1")
    assert cold["completed"] == 6 and cold["cached_share"] == 0.0


def test_multi_turn_chat_reuses_earlier_turns(server, capsys):
    r = bench(
        server,
        capsys,
        "--workload",
        "multi-turn",
        "--prompt-format",
        "chat",
        "--conversations",
        "2",
        "--turns",
        "3",
        "--input-len",
        "48",
        "--turn-len",
        "8",
        "--output-len",
        "4",
        "--concurrency",
        "2",
    )
    assert (r["requests"], r["completed"]) == (6, 6)
    assert r["cached_share"] > 0 and r["output_tokens_per_s"] > 0


def test_trace_replay_sends_the_trace_prompts(server, capsys):
    entries = read_mooncake(TRACE, limit=4)
    r = bench(
        server,
        capsys,
        "--workload",
        "trace",
        "--trace",
        str(TRACE),
        "--max-requests",
        "4",
        "--trace-block-size",
        "64",
        "--time-scale",
        "0",
        "--concurrency",
        "1",
        "--output-len",
        "4",
        "--seed",
        "2",
    )
    assert (r["requests"], r["completed"]) == (4, 4)
    assert r["prompt_tokens"] == sum(math.ceil(e.input_length * 64 / 512) for e in entries)
    # Hash id 0 (the trace's system prompt, 64 tokens here) starts every request: the later ones reuse it.
    assert r["cached_share"] > 0


def test_cpu_per_process_names_the_servers_processes_and_the_load_generator(server, capsys):
    flags = ["--input-len", "64", "--output-len", "16", "--num-requests", "8", "--concurrency", "4", "--seed", "7"]
    r = bench(server, capsys, *flags, "--cpu-per-process")
    cpu = r["cpu_ms_per_1000_tokens"]
    assert r["completed"] == 8 and cpu["load generator"] > 0
    # the group's rank computed every token: it shows under its actor class, with its share of the CPU
    assert cpu.get("ray::RankActor", 0) > 0, cpu
    assert list(cpu.values()) == sorted(cpu.values(), reverse=True)
    assert "cpu_ms_per_1000_tokens" not in bench(server, capsys, *flags)


def test_process_labels_and_the_per_token_table():
    from router.sim import proc_cpu

    assert proc_cpu.label(["ray::RankActor.subscribe"], "ray::RankActor") == "ray::RankActor"
    assert proc_cpu.label(["/usr/bin/python3", "-m", "router.cli", "serve"], "python3") == "python -m router.cli"
    assert proc_cpu.label(["python", "-m", "worker.engine_process", "9"], "python") == "python -m worker.engine_process"
    assert proc_cpu.label(["python", "bench/side_by_side.py"], "python") == "python side_by_side.py"
    assert proc_cpu.label([], "raylet") == "raylet"
    used = {"a": 0.5, "b": 1.0, "tiny": 0.001, "tiny2": 0.001}
    assert proc_cpu.table(used, 0.25, 1000) == {"b": 1000.0, "a": 500.0, "load generator": 250.0, "other": 2.0}
    before = {1: (1.0, "a"), 2: (5.0, "b")}
    after = {1: (1.5, "a"), 2: (5.0, "b"), 3: (0.25, "c"), 4: (9.0, "me")}
    assert proc_cpu.per_process(before, after, skip_pid=4) == {"a": 0.5, "c": 0.25}
