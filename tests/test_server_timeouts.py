"""Connections that hold the server without finishing: a request head that never ends (slowloris) is closed after
--header-read-timeout, and a stream whose client stopped reading is dropped after --send-timeout, its engine
requests aborted and their KV blocks freed. Against a real `pagoda serve` on loopback, with raw sockets."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from tests.test_server import FRANCE, MODEL, scrape, start_server, wait_for_metric

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("timeouts"),
        "--max-model-len",
        "2048",
        "--num-gpu-blocks-override",
        "512",
        "--header-read-timeout",
        str(TIMEOUT_S),
        "--send-timeout",
        str(TIMEOUT_S),
        "--disable-uvicorn-access-log",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def connect(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect(): it sets the window the client offers
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    return sock


def seconds_until_closed(sock: socket.socket, since: float) -> float:
    """Reads (and drops) what the server sends until it closes the connection; the time that took from `since`."""
    while sock.recv(65536):
        pass
    return time.monotonic() - since


def test_an_unfinished_request_head_is_closed_after_the_header_timeout(server):
    opened = time.monotonic()
    silent = connect(server)  # sends nothing at all
    slow = connect(server)  # a header line now and then, never the blank line that ends the head
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    time.sleep(TIMEOUT_S / 2)
    slow.sendall(b"Content-Type: application/json\r\n")
    # Meanwhile the server answers everyone else.
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    for sock in (silent, slow):
        assert TIMEOUT_S * 0.9 <= seconds_until_closed(sock, opened) < TIMEOUT_S + 3
        sock.close()
    # A kept-alive connection: its first request is answered; the half head after it gets the same time.
    kept = connect(server)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    time.sleep(TIMEOUT_S / 2)  # past half the timeout: had the timer run since the connection opened, it would end
    started = time.monotonic()
    kept.sendall(b"GET /health HTTP/1.1\r\n")
    assert TIMEOUT_S * 0.9 <= seconds_until_closed(kept, started) < TIMEOUT_S + 3
    kept.close()


def test_a_request_that_takes_longer_than_the_header_timeout_is_not_cut(server):
    # The timeout bounds the head only: a stream that runs for several timeouts goes on to the end.
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 60, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 61
    assert time.monotonic() - started > TIMEOUT_S


def test_a_stream_nobody_reads_is_aborted_and_its_blocks_freed(server):
    max_tokens, n = 1500, 4
    # Each step writes n chunks with 20 top logprobs each (a few kilobytes), so the buffers between server and
    # client (a few hundred kilobytes) fill in some tens of steps, far before max_tokens.
    body = {
        "model": MODEL,
        "messages": FRANCE,
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
    payload = json.dumps(body).encode()
    sock = connect(server, rcvbuf=4096)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")  # then it reads no more
    started = time.monotonic()
    wait_for_metric(server.url, "pagoda:num_requests_running", lambda v: v > 0)  # its n sequences
    # Others are served while it hangs.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    metrics = wait_for_metric(server.url, "pagoda:num_requests_running", lambda v: v == 0, timeout=120)
    assert metrics[("pagoda:kv_cache_usage_perc", ())] == 0
    assert time.monotonic() - started < 120
    log = server.log()
    assert re.search(rf"127\.0\.0\.1:\d+ has read nothing for {TIMEOUT_S:g} s: dropping its connection", log)
    (generated,) = (
        int(m) for m in re.findall(r"request \S+ finished \(abort\): prompt \d+ tokens, generated (\d+) tokens", log)
    )
    assert 0 < generated < n * max_tokens / 2  # aborted long before max_tokens
    after = scrape(server.url)
    assert after[("pagoda:request_success_total", (("finished_reason", "abort"),))] >= n
    sock.close()
