"""A bounded load test of the server on loopback: 16 concurrent clients x 3 requests, two
pause/continue interruptions, a weight update from disk mid-flight and one client that
disconnects mid-request. Bounded in count and time (every call has a timeout; the test
stops by itself), 127.0.0.1 only. Checked: every request answered exactly once with its
own prompt and the full token budget, per-token versions in {0, 1} and never going
back, the server's version 1 at the end, and RSS flat (under RSS_BOUND_MIB)."""
from __future__ import annotations

import socket
import threading
import time

import requests

from areal_tik.adapter.server import TikServer

from .test_areal_server import TIMEOUT, _checkpoint, make_llm, post

CLIENTS, PER_CLIENT, NEW_TOKENS = 16, 3, 4
RSS_BOUND_MIB = 64


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import resource

    return pages * resource.getpagesize() / 2 ** 20


def client(url: str, index: int, results: dict, errors: list, updated: threading.Event) -> None:
    for k in range(PER_CLIENT):
        if k == PER_CLIENT - 1:  # the last request of each client goes after the weight update
            updated.wait(timeout=120)  # (so some tokens carry version 1 however the threads are scheduled)
        prompt = [3 + index, 40 + k, 7]
        try:
            r = post(url, "/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "seed": index * 10 + k}})
            r.raise_for_status()
            results.setdefault((index, k), []).append((prompt, r.json()))
        except Exception as exc:  # counted: a lost request fails the test
            errors.append(f"client {index} request {k}: {exc!r}")


def disconnect_mid_request(address: str) -> None:
    """Send a whole /generate request and close the socket without reading the answer."""
    host, port = address.split(":")
    body = b'{"input_ids": [9, 9, 9], "sampling_params": {"max_new_tokens": 32, "ignore_eos": true}}'
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.2)


def test_concurrent_clients_interruptions_and_a_weight_update(tmp_path):
    new_weights = _checkpoint(tmp_path / "v1", seed=1)
    llm = make_llm()
    server = TikServer(llm).start()
    url = f"http://{server.address}"
    results: dict = {}
    errors: list = []
    updated = threading.Event()
    try:
        post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})  # warm-up
        rss_before, start = rss_mib(), time.monotonic()
        threads = [threading.Thread(target=client, args=(url, i, results, errors, updated), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        disconnect_mid_request(server.address)
        deadline = time.monotonic() + 60
        while len(results) < CLIENTS and time.monotonic() < deadline:  # a third answered: mid-flight
            time.sleep(0.01)
        for _ in range(2):  # interruptions: requests in flight wait, then continue
            post(url, "/pause_generation", {})
            time.sleep(0.1)
            post(url, "/continue_generation", {})
        assert post(url, "/update_weights_from_disk", {"model_path": new_weights, "weight_version": 1}).ok
        updated.set()
        for t in threads:
            t.join(timeout=120)
        wall = time.monotonic() - start
        rss_after = rss_mib()
        version = requests.get(url + "/get_weight_version", timeout=TIMEOUT).json()["weight_version"]
    finally:
        server.stop(close_llm=True)
    print(f"load: {CLIENTS} clients x {PER_CLIENT} requests in {wall:.1f} s, answered {len(results)}, "
          f"errors {len(errors)}, RSS {rss_before:.0f} -> {rss_after:.0f} MiB "
          f"(delta {rss_after - rss_before:+.1f} MiB), final weight version {version}")
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads)
    assert sorted(results) == [(i, k) for i in range(CLIENTS) for k in range(PER_CLIENT)]
    seen_versions = set()
    for (i, k), answers in results.items():
        assert len(answers) == 1, (i, k)  # never duplicated
        prompt, body = answers[0]
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and len(body["output_ids"]) == NEW_TOKENS
        versions = meta["output_token_versions"]
        assert len(versions) == NEW_TOKENS and set(versions) <= {0, 1} and versions == sorted(versions)
        seen_versions |= set(versions)
    assert version == 1 and 1 in seen_versions
    assert rss_after - rss_before < RSS_BOUND_MIB
