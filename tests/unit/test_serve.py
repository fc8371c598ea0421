"""kvcoll serve (read-only: --poll-ms 0) on a model trained here with kv.callbacks.Publish:

- a TensorFlow Serving gRPC client (PredictionServiceStub) and a REST client (the
  "instances" and the "inputs" forms) get what model.predict gives in the training
  process at the same version (1e-5): raw string ids hashed as training did, multi-hot
  ids as 2-D arrays and as flat ids with row_splits, ids never seen;
- GetModelMetadata, GET /v1/models/<name> and /metrics answer; what the server loaded
  at start is frozen out of Python's cycle collector;
- bad requests (an unknown or missing input, a wrong dtype or shape, a batch over the
  limit, malformed JSON, an unknown model) get TF Serving's error shape (HTTP 400 /
  gRPC INVALID_ARGUMENT, 404 / NOT_FOUND) with a message naming the problem, and the
  server keeps serving.
Every server is started on ports it picks and stopped by the test, pass or fail.
"""

import json
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow_serving.apis import (get_model_metadata_pb2, predict_pb2,  # noqa: E402
                                     prediction_service_pb2_grpc)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_process import serving  # noqa: E402
from test_publish_keras import data, trained  # noqa: E402


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("serve") / "pub")
    model, cb = trained(d, every_n_steps=2, base_every=3)
    feeds, _ = data(24, 7)
    feeds["user"][:2] = ["never-seen", "neither-this"]
    feeds["tags"][2] = [999, 998, -1]
    want = model.predict(feeds, verbose=0)
    return d, cb.published[-1].version, feeds, want


def rest(url, path, body=None):
    data = None if body is None else (body if isinstance(body, bytes) else
                                      json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def grpc_request(feeds, name="model"):
    req = predict_pb2.PredictRequest()
    req.model_spec.name = name
    for k, v in feeds.items():
        v = np.asarray(v)
        if v.dtype == object:
            v = v.astype(bytes)
        req.inputs[k].CopyFrom(tf.make_tensor_proto(v))
    return req


def test_same_predictions_over_grpc_rest_and_predict(published):
    d, version, feeds, want = published
    with serving(d, "--poll-ms", "0") as srv:
        assert srv.version == version
        stub = prediction_service_pb2_grpc.PredictionServiceStub(
            grpc.insecure_channel(srv.grpc))
        resp = stub.Predict(grpc_request(feeds), timeout=30)
        assert resp.model_spec.version.value == version
        np.testing.assert_allclose(tf.make_ndarray(resp.outputs["prediction"]), want,
                                   rtol=0, atol=1e-5)
        # multi-hot as flat ids with row_splits (kv.export's form), the padding dropped
        tags = feeds["tags"]
        keep = tags != -1
        flat = dict(feeds, tags=tags[keep])
        flat["tags_row_splits"] = np.concatenate([[0], np.cumsum(keep.sum(1))])
        resp = stub.Predict(grpc_request(flat), timeout=30)
        np.testing.assert_allclose(tf.make_ndarray(resp.outputs["prediction"]), want,
                                   rtol=0, atol=1e-5)
        rows = [{"user": u, "tags": t.tolist(), "x": x.tolist()}
                for u, t, x in zip(feeds["user"], feeds["tags"], feeds["x"])]
        code, body = rest(srv.rest, "/v1/models/model:predict", {"instances": rows})
        assert code == 200, body
        np.testing.assert_allclose(np.array(body["predictions"]), want, rtol=0, atol=1e-5)
        cols = {"user": feeds["user"].tolist(), "tags": feeds["tags"].tolist(),
                "x": feeds["x"].tolist()}
        code, body = rest(srv.rest, f"/v1/models/model/versions/{version}:predict",
                          {"inputs": cols})
        assert code == 200, body
        np.testing.assert_allclose(np.array(body["outputs"]), want, rtol=0, atol=1e-5)
        # metadata, status, metrics
        meta = get_model_metadata_pb2.GetModelMetadataRequest()
        meta.model_spec.name = "model"
        meta.metadata_field.append("signature_def")
        got = stub.GetModelMetadata(meta, timeout=30)
        sigs = get_model_metadata_pb2.SignatureDefMap()
        got.metadata["signature_def"].Unpack(sigs)
        sd = sigs.signature_def["serving_default"]
        assert sorted(sd.inputs) == ["tags", "user", "x"] and list(sd.outputs) == ["prediction"]
        assert sd.inputs["user"].dtype == tf.string.as_datatype_enum
        code, st = rest(srv.rest, "/v1/models/model")
        assert code == 200
        assert st["model_version_status"][0] == {
            "version": str(version), "state": "AVAILABLE",
            "status": {"error_code": "OK", "error_message": ""}}
        assert st["kvcoll"]["rows"]["user"] > 0 and st["kvcoll"]["freshness_s"] >= 0
        with urllib.request.urlopen(srv.rest + "/metrics", timeout=30) as r:
            text = r.read().decode()
        assert f"kvcoll_serve_version {float(version)}" in text
        assert 'kvcoll_serve_requests_total{api="grpc",code="OK"} 2.0' in text
        assert 'kvcoll_serve_request_seconds_count{api="rest"} 2.0' in text
        stages = dict(re.findall(r'^kvcoll_serve_stage_seconds_count\{stage="(\w+)"\} (\S+)$',
                                 text, re.M))
        assert float(stages["queue"]) >= 4 and 1 <= float(stages["predict"]) <= \
            float(stages["queue"]) and stages["dispatch"] == stages["predict"] == \
            stages["lookup"] == stages["graph"], stages
        # what was loaded at start is out of the cycle collector's reach (a full
        # collection walking TensorFlow's objects stalled every request for 0.15 s)
        frozen = float(re.search(r"^kvcoll_serve_gc_frozen_objects (\S+)$", text, re.M)[1])
        assert frozen > 10_000 and st["kvcoll"]["gc_frozen_objects"] == frozen
        assert "kvcoll_serve_gc_pause_seconds_count" in text and \
            st["kvcoll"]["gc_pause_ms_max"] >= 0


def test_bad_requests_are_refused_and_the_server_keeps_serving(published):
    d, version, feeds, want = published
    with serving(d, "--poll-ms", "0", "--max-batch", "16") as srv:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(
            grpc.insecure_channel(srv.grpc))
        small = {k: v[:8] for k, v in feeds.items()}
        bad = {
            "unknown": (dict(small, age=np.ones(8, np.float32)), "unknown \\['age'\\]"),
            "missing": ({k: v for k, v in small.items() if k != "x"}, "missing \\['x'\\]"),
            "dtype": (dict(small, x=np.array([["a", "b"]] * 8)), "'x' takes float32"),
            "shape": (dict(small, x=np.ones((8, 3), np.float32)), "'x' takes shape"),
            "float ids": (dict(small, user=np.ones(8)), "'user': ids must be integers"),
            "sizes": (dict(small, x=np.ones((7, 2), np.float32)), "different batch sizes"),
            "too big": ({k: np.concatenate([v, v, v]) for k, v in small.items()},
                        "24 samples is over this server's limit of 16"),
        }
        for what, (f, msg) in bad.items():
            with pytest.raises(grpc.RpcError) as e:
                stub.Predict(grpc_request(f), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert __import__("re").search(msg, e.value.details()), (what, e.value.details())
            cols = {k: np.asarray(v).astype(str).tolist() if np.asarray(v).dtype == object
                    else np.asarray(v).tolist() for k, v in f.items()}
            code, body = rest(srv.rest, "/v1/models/model:predict", {"inputs": cols})
            assert code == 400 and __import__("re").search(msg, body["error"]), (what, body)
        with pytest.raises(grpc.RpcError) as e:
            stub.Predict(grpc_request(small, name="other"), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        for body, msg in ((b'{"inputs": ', "not valid JSON"),
                          (b'{"instances": [], "inputs": {}}', "exactly one of"),
                          (b'{"instances": [{"user": "a"}, {"x": 1}]}', "same inputs"),
                          (b'{"inputs": {"user": ["a"], "tags": [[1], [2, 3]], "x": [[1, 2]]}}',
                           "ragged")):
            code, got = rest(srv.rest, "/v1/models/model:predict", body)
            assert code == 400 and msg in got["error"], got
        code, got = rest(srv.rest, "/v1/models/nope:predict", {"inputs": {}})
        assert code == 404 and "Servable not found" in got["error"]
        # still serving, the same answers
        resp = stub.Predict(grpc_request(small), timeout=30)
        np.testing.assert_allclose(tf.make_ndarray(resp.outputs["prediction"]), want[:8],
                                   rtol=0, atol=1e-5)
        assert srv.proc.poll() is None
