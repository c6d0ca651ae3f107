"""RolloutServerClient against stub servers: each failure is a clear ServerError naming the URL, never a hang."""

from __future__ import annotations

import time

import pytest

from coordexp.runtime.rollout.client import (
    RolloutServerClient,
    ServerResponseError,
    ServerTimeoutError,
    ServerUnreachableError,
    is_not_found,
)

from testkit import free_port


def test_health_world_size_and_engine_type(stub):
    stub.world_size = 3
    client = RolloutServerClient(stub.base_url + "/", timeout_s=5)
    assert client.base_url == stub.base_url
    assert client.wait_until_healthy() < 5
    assert client.world_size() == 3
    assert client.world_size() == 3
    assert [c[1] for c in stub.calls].count("/get_world_size/") == 1  # cached
    assert client.engine_type()["enable_lora"] is False
    assert ("POST", "/get_engine_type/", None) in stub.calls  # POST, as ms-swift expects


@pytest.mark.parametrize("body", [7, "4"])
def test_world_size_accepts_bare_int_and_digit_string(stub, body):
    stub.behaviour["/get_world_size/"] = lambda h, b: (200, body)
    assert RolloutServerClient(stub.base_url, timeout_s=5).world_size() == int(body)


def test_world_size_rejects_nonsense(stub):
    stub.behaviour["/get_world_size/"] = lambda h, b: (200, {"world_size": 0})
    with pytest.raises(ServerResponseError, match="get_world_size"):
        RolloutServerClient(stub.base_url, timeout_s=5).world_size()


def test_server_down_at_start_fails_within_timeout_naming_url_and_alternatives():
    url = f"http://127.0.0.1:{free_port()}"
    client = RolloutServerClient(url, timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(ServerUnreachableError) as info:
        client.wait_until_healthy()
    elapsed = time.monotonic() - start
    assert 1.4 <= elapsed < 3.0
    message = str(info.value)
    assert f"{url}/health/" in message
    assert "vllm.mode: colocate" in message and "rollout_backend: hf" in message


def test_health_that_only_comes_up_late_is_waited_for(stub):
    started = time.monotonic()
    stub.behaviour["/health/"] = lambda h, b: (503, {"detail": "loading"}) if time.monotonic() - started < 0.8 \
        else (200, {"status": "ok"})
    waited = RolloutServerClient(stub.base_url, timeout_s=5).wait_until_healthy()
    assert 0.7 <= waited < 3


def test_infer_returns_outputs_in_order(stub):
    client = RolloutServerClient(stub.base_url, timeout_s=5)
    outputs = client.infer([{"messages": [], "data_dict": {"tag": t}} for t in (4, 9)], {"seed": 11})
    assert [o["response"]["choices"][0]["token_ids"] for o in outputs] == [[4, 11, 2], [9, 12, 2]]


def test_hung_infer_times_out_with_infer_timeout(stub):
    stub.behaviour["/infer/"] = stub.hang
    client = RolloutServerClient(stub.base_url, timeout_s=5, infer_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(ServerTimeoutError, match=r"/infer/.*0.5 s"):
        client.infer([{"messages": []}], {"seed": 1})
    assert time.monotonic() - start < 3


def test_http_500_is_a_clear_error_with_the_server_detail(stub):
    stub.behaviour["/infer/"] = lambda h, b: (500, {"detail": "worker crashed: CUDA OOM"})
    with pytest.raises(ServerResponseError, match=r"HTTP 500.*CUDA OOM"):
        RolloutServerClient(stub.base_url, timeout_s=5).infer([{"messages": []}], {"seed": 1})


def test_http_status_is_typed_and_only_a_404_is_not_found(stub):
    """Callers (the weight-sync wire choice, the repeat-guard probe) branch on the status, never on message text."""
    client = RolloutServerClient(stub.base_url, timeout_s=5)
    for status, missing in ((404, True), (500, False), (403, False)):
        stub.behaviour["/coordexp/sync_status/"] = lambda h, b, s=status: (s, {"detail": "answered HTTP 404"})
        with pytest.raises(ServerResponseError) as caught:
            client.request("GET", "coordexp/sync_status", timeout=5)
        assert caught.value.status == status and is_not_found(caught.value) is missing
    stub.behaviour["/coordexp/sync_status/"] = lambda h, b: (200, b"[{not json")
    with pytest.raises(ServerResponseError) as caught:
        client.request("GET", "coordexp/sync_status", timeout=5)
    assert caught.value.status is None and not is_not_found(caught.value)


def test_malformed_json_is_a_clear_error(stub):
    stub.behaviour["/infer/"] = lambda h, b: (200, b"[{not json")
    with pytest.raises(ServerResponseError, match=r"malformed JSON.*not json"):
        RolloutServerClient(stub.base_url, timeout_s=5).infer([{"messages": []}], {"seed": 1})


def test_wrong_number_of_outputs_is_rejected(stub):
    stub.behaviour["/infer/"] = lambda h, b: (200, [])
    with pytest.raises(ServerResponseError, match="a list of 0 for 2 requests"):
        RolloutServerClient(stub.base_url, timeout_s=5).infer([{"messages": []}] * 2, {"seed": 1})


def test_connection_dropped_mid_response_is_unreachable(stub):
    def drop(handler, body):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        handler.wfile.write(b"[{")
        handler.wfile.flush()
        handler.connection.shutdown(2)
        return None

    stub.behaviour["/infer/"] = drop
    with pytest.raises((ServerUnreachableError, ServerResponseError), match="/infer/"):
        RolloutServerClient(stub.base_url, timeout_s=5).infer([{"messages": []}], {"seed": 1})


def test_weight_sync_control_calls_use_the_ms_swift_shapes(stub):
    client = RolloutServerClient(stub.base_url, group_port=51216, timeout_s=5)
    client.init_communicator("127.0.0.1", 51216, 2)
    client.update_flattened_params([{"name": "w", "shape": [2], "dtype": "torch.float32", "start_idx": 0,
                                     "end_idx": 2, "numel": 2}])
    client.reset_prefix_cache()
    client.close_communicator()
    assert stub.calls[0] == ("POST", "/init_communicator/",
                             {"host": "127.0.0.1", "port": 51216, "world_size": 2, "client_device_uuid": None})
    assert stub.calls[1][2]["metadatas"][0]["end_idx"] == 2
    assert [c[1] for c in stub.calls[2:]] == ["/reset_prefix_cache/", "/close_communicator/"]
